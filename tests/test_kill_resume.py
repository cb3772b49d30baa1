"""kill -9 at random moments of a tiny run that really updates its weights (issue 18, acceptance).

Run A goes uninterrupted. Run B is killed with SIGKILL at 10 random moments (uniform over A's
wall time, seeded) and resumed each time (``tests/kill_resume_driver.py``: resume when the folder
holds a run, start it otherwise, as a user would), then finishes. Every step is checkpointed and
kept, so B must match A at every step: the same prompts (task ids) and rewards in each step's
record, bit-identical trainable parameters and optimizer state in each step's checkpoint, and
metrics.jsonl / TensorBoard holding each (phase, step) once.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from test_run_folder import tb_scalars

DRIVER = Path(__file__).resolve().parent / "kill_resume_driver.py"
STEPS = 6
KILLS = 10


def _start(run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(DRIVER), str(run), "--steps", str(STEPS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(p: subprocess.Popen, timeout: float = 600) -> None:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode()[-3000:]


def _train_records(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["phase"] == "train":
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("time")}
    return out


def _same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_bit_identically(tmp_path):
    t0 = time.monotonic()
    _finish(_start(tmp_path / "a"))
    t_full = time.monotonic() - t0
    rng = random.Random(18)
    moments = [rng.uniform(0.5, t_full) for _ in range(KILLS)]
    b = tmp_path / "b"
    killed_at = []
    for delay in moments:
        p = _start(b)
        try:
            p.wait(timeout=delay)  # finished before the kill moment: nothing left to kill
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            killed_at.append(round(delay, 1))
        p.stderr.close()
    _finish(_start(b))
    assert len(killed_at) >= KILLS - 2, killed_at  # (a late moment may find the run finished)

    rec_a, rec_b = _train_records(tmp_path / "a"), _train_records(b)
    assert sorted(rec_a) == list(range(1, STEPS + 1))
    assert rec_b == rec_a  # same prompts, rewards, losses, grad norms ... in every step
    assert all(r["update_skipped"] == 0.0 for r in rec_a.values())
    for step in range(STEPS + 1):
        ca = tmp_path / "a" / "checkpoints" / f"step_{step:06d}"
        cb = b / "checkpoints" / f"step_{step:06d}"
        for f in ("trainable.pt", "optimizer.pt"):
            ta = torch.load(ca / f, weights_only=False)
            tb = torch.load(cb / f, weights_only=False)
            assert _same_tensors(ta, tb), f"step {step} {f} differs (kills at {killed_at})"
    first = torch.load(tmp_path / "a" / "checkpoints" / "step_000000" / "trainable.pt")
    last = torch.load(tmp_path / "a" / "checkpoints" / f"step_{STEPS:06d}" / "trainable.pt")
    assert any(not torch.equal(first[k], last[k]) for k in first), "the weights never changed"
    keys = [(json.loads(x)["phase"], json.loads(x)["step"])
            for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [k for k, n in Counter(keys).items() if n > 1] == []
    assert [k for k, n in tb_scalars(b).items() if n > 1] == []
