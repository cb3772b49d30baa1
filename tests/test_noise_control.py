"""scripts/noise_control.py: a perturbed copy of a checkpoint, every trainable weight moved by exactly +-eps."""
from __future__ import annotations

import pytest
import torch

from script_loader import load_script


def test_every_float_weight_moves_by_eps_and_the_rest_of_the_checkpoint_is_copied(tmp_path):
    nc = load_script("noise_control")
    src = tmp_path / "step_000000"
    src.mkdir()
    torch.save({"w": torch.zeros(4, 5), "b": torch.ones(3), "step": torch.tensor([7])}, src / "trainable.pt")
    (src / "state.json").write_text("{}")
    assert nc.perturb(src, tmp_path / "noisy", 4e-4, seed=1) == 23
    sd = torch.load(tmp_path / "noisy" / "trainable.pt", weights_only=True)
    assert torch.allclose(sd["w"].abs(), torch.full((4, 5), 4e-4))
    assert torch.allclose((sd["b"] - 1).abs(), torch.full((3,), 4e-4), atol=1e-7)
    assert 0 < int((sd["w"] > 0).sum()) < 20  # both signs
    assert sd["step"].tolist() == [7] and (tmp_path / "noisy" / "state.json").is_file()
    assert torch.load(src / "trainable.pt", weights_only=True)["w"].abs().sum() == 0  # the source is untouched
    with pytest.raises(SystemExit, match="exists"):
        nc.perturb(src, tmp_path / "noisy", 4e-4, seed=1)
    with pytest.raises(SystemExit, match="not a reflrl checkpoint"):
        nc.perturb(tmp_path, tmp_path / "other", 4e-4, seed=1)
