"""scripts/sweep_warmup.py: a setting's overrides reach the run it measures, threads included."""
from __future__ import annotations

import torch

from script_loader import load_script

sweep = load_script("sweep_warmup")


def test_worker_applies_the_settings_threads_and_records_every_point():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = sweep.worker(["model.name=tiny-random", "model.trainable=all", "model.dtype=float32", "train.threads=1", "data.n_test=4", "data.n_train=8",
                            "warmup.batch_size=2"], steps=2, every=1, seed=0)
        assert torch.get_num_threads() == 1  # train.threads=1 pinned, as `reflrl train` does
        assert [p["step"] for p in out["curve"]] == [0, 1, 2]
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in out["curve"]) and out["precision"] == "float32"
    finally:
        torch.set_num_threads(before)
