"""Noise control for an RL update: copy a reflrl checkpoint with a random +-EPS sign perturbation added to
every trainable weight, so its held-out accuracy can be compared with the unperturbed checkpoint's.

Fresh Adam moves each weight by about lr per step whatever its gradient, so 8 steps at lr 5e-5 move a
weight by at most 4e-4. If a checkpoint perturbed that much at random keeps its accuracy, an RL phase that
loses accuracy lost it to the direction of its updates, not to their size.

    .venv/bin/python scripts/noise_control.py RUN/checkpoints/step_000000 /tmp/noisy --eps 4e-4 --seed 1
    .venv/bin/reflrl train --set model.init_from=/tmp/noisy --set warmup.enabled=false --set train.steps=0

Measured (README, "What was tried"): the bfloat16 seed-0 warm-up stayed at 50.0% with eps 4e-4 and 1.4e-4.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def perturb(src: Path, dst: Path, eps: float, seed: int) -> int:
    """Copy checkpoint ``src`` to ``dst`` with +-eps added to each element of its float trainable tensors;
    returns how many weights were perturbed."""
    import torch

    if not (src / "trainable.pt").is_file():
        raise SystemExit(f"{src}: not a reflrl checkpoint (no trainable.pt)")
    if dst.exists():
        raise SystemExit(f"{dst} exists: give a new folder")
    shutil.copytree(src, dst)
    sd = torch.load(dst / "trainable.pt", map_location="cpu", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    n = 0
    for k, v in sd.items():
        if torch.is_tensor(v) and v.is_floating_point():
            sign = torch.randint(0, 2, v.shape, generator=g).to(v.dtype) * 2 - 1
            sd[k] = v + eps * sign
            n += v.numel()
    torch.save(sd, dst / "trainable.pt")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a reflrl checkpoint folder (RUN/checkpoints/step_N)")
    p.add_argument("out", type=Path, help="the perturbed copy (a new folder)")
    p.add_argument("--eps", type=float, default=4e-4, help="size of the +-eps perturbation of each weight")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    n = perturb(a.checkpoint, a.out, a.eps, a.seed)
    print(f"{a.out}: {n} trainable weights perturbed by +-{a.eps:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
