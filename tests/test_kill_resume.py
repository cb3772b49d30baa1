"""kill -9 at random moments of a tiny run that really updates its weights (issue 18, acceptance).

Run A goes uninterrupted. Run B is killed with SIGKILL at 10 random moments (seeded): 3 while a
process starts (or resumes), 7 at a moment uniform over the step after the process's first new
checkpoint (timed from A's steps), so every phase of a step can be hit; and twice more while a
checkpoint is being written (after its step was logged). It is resumed each
time (``tests/kill_resume_driver.py``: resume when the folder holds a run, start it otherwise, as
a user would), then finishes. Every step is checkpointed and kept, so B must match A at every step: the same prompts (task ids) and rewards in each step's
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

from doubles import tb_scalars

DRIVER = Path(__file__).resolve().parent / "kill_resume_driver.py"
STEPS = 10


def _start(run: Path) -> subprocess.Popen:
    # A process killed with SIGKILL cannot remove its tool server's temporary sandbox folder: give it
    # a TMPDIR inside the test's own folder, so the leftovers go with it instead of piling up in /tmp.
    tmp = run.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, str(DRIVER), str(run), "--steps", str(STEPS)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp)})


def _kill_after(p: subprocess.Popen, delay: float, run: Path, log: list) -> None:
    """SIGKILL ``p`` after ``delay`` seconds (unless it ended before) and note what ``run`` held."""
    try:
        p.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        log.append((round(delay, 2), _state(run)))
    p.stderr.close()


def _finish(p: subprocess.Popen, timeout: float = 600) -> None:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode()[-3000:]


def _state(run: Path) -> str:
    """What a killed run left: its checkpoints, metrics records and half-written folders."""
    cks = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    m = run / "metrics.jsonl"
    n = len(m.read_text().splitlines()) if m.exists() else 0
    done = [c[5:].lstrip("0") or "0" for c in cks if c[5:].isdigit()]
    odd = [c for c in cks if not c[5:].isdigit()]
    return f"ckpts {','.join(done) or '-'} metrics {n}" + (f" {odd}" if odd else "")


def _last_checkpoint(run: Path) -> int:
    from reflrl.runlog import latest_checkpoint

    ck = latest_checkpoint(run)
    return int(ck.name.split("_")[1]) if ck is not None else -1


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
@pytest.mark.timeout(1800)  # a busy shared machine can make the 12 processes slow
def test_kill_9_at_random_moments_resumes_bit_identically(tmp_path):
    t0 = time.time()
    _finish(_start(tmp_path / "a"))
    t_full = time.time() - t0
    # A's timeline: seconds to its first checkpoint (start-up, evaluation), then per step
    ck_a = [(tmp_path / "a" / "checkpoints" / f"step_{s:06d}" / "state.json").stat().st_mtime
            for s in (0, STEPS)]
    t_first, t_step = ck_a[0] - t0, (ck_a[1] - ck_a[0]) / STEPS
    rng = random.Random(18)
    kinds = ["start"] * 3 + ["step"] * 7 + ["save"] * 2
    rng.shuffle(kinds)
    b = tmp_path / "b"
    killed_at = []
    for kind in kinds:
        before = _last_checkpoint(b)
        p = _start(b)
        if kind == "start":  # imports, model load, reading the checkpoint back
            _kill_after(p, rng.uniform(0.3, 0.5 * t_first), b, killed_at)
            continue
        if kind == "save":  # not random: while a checkpoint is being written (after its step's log)
            while not list((b / "checkpoints").glob("step_*.tmp")) and p.poll() is None:
                time.sleep(0.005)
            _kill_after(p, 0.0, b, killed_at)
            continue
        # a random moment of the step after this process's first new checkpoint: any phase of a
        # step (rollout, update, logging, saving the next checkpoint, pruning) can be hit
        while _last_checkpoint(b) <= before and p.poll() is None:
            time.sleep(0.02)
        _kill_after(p, rng.uniform(0.0, 1.2 * t_step), b, killed_at)
    _finish(_start(b))
    print(f"run A took {t_full:.1f}s ({t_first:.1f}s to its first checkpoint, {t_step:.2f}s a "
          f"step); kill -9 (seconds after start or after a new checkpoint, what the folder held): "
          f"{killed_at}")
    assert len(killed_at) == len(kinds), killed_at

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
