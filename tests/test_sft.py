"""reflrl.sft: the warm-up's learning-rate schedule is defined by step counts; a guard can cut it."""
from __future__ import annotations

import pytest
import torch

from reflrl import sft
from reflrl.models import load_model


def _examples(tok, k=4):
    ids = tok.encode("hello there")
    return [sft.SFTExample(ids, tok.encode(" ok") + [tok.eos_token_id], f"t{i}") for i in range(k)]


def test_schedule_depends_on_steps_only_and_anneals_to_ten_percent():
    lrs = [sft.lr_schedule(s, steps=20, lr=1e-3, warmup_steps=2) for s in range(20)]
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)  # linear warm-up
    assert lrs[2:] == sorted(lrs[2:], reverse=True)  # cosine decay after it
    assert sft.lr_schedule(20, steps=20, lr=1e-3, warmup_steps=2) == pytest.approx(1e-4)


def test_same_seed_same_weights_whatever_the_clock(monkeypatch):
    """Two warm-ups with the same seed end with identical weights even when one machine is 'slower'
    (a clock that runs 1000x faster): the schedule no longer reads the time."""
    def run(speed: float) -> dict[str, torch.Tensor]:
        model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
        t = [0.0]

        def clock():
            t[0] += speed
            return t[0]

        monkeypatch.setattr(sft.time, "perf_counter", clock)
        out = sft.train_sft(model, tok, _examples(tok), steps=6, batch_size=2, lr=1e-3, seed=3)
        assert out["steps"] == 6 and out["cut"] is False and out["planned"] == 6
        return {k: v.clone() for k, v in model.state_dict().items()}

    a, b = run(1.0), run(1000.0)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_guard_cuts_the_warm_up_and_the_result_says_so():
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    asked = []

    def should_stop(done, sps):
        asked.append((done, sps))
        return done >= 3

    out = sft.train_sft(model, tok, _examples(tok), steps=50, batch_size=2, lr=1e-3, should_stop=should_stop)
    assert out["steps"] == 3 and out["cut"] is True and out["planned"] == 50
    assert asked[0] == (0, None) and asked[-1][0] == 3 and asked[-1][1] > 0  # seconds per step once measured
