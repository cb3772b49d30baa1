"""Peak resident memory of one held-out evaluation after RL, with the optimiser's state moved to disk for
it (what the trainer does) or kept in memory (``--keep-optimizer-state``). Run each in its own process
and compare the two peaks.

    .venv/bin/python scripts/bench_eval_memory.py --checkpoint RUN/checkpoints/step_N [--keep-optimizer-state]
        [--faults rate_limit=0.1] [--set KEY=VALUE ...]

The checkpoint is loaded as ``reflrl train --resume`` loads it (weights and AdamW state); then one greedy
evaluation of the test split runs while resident memory (``VmRSS``) is sampled every 50 ms. Printed: the
resident memory and the AdamW state's size after loading, the evaluation's seconds, accuracy and peak
resident memory, and the resident memory after it. Linux only (reads /proc/self/status).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1e6
    return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run's checkpoint folder (RUN/checkpoints/step_N)")
    ap.add_argument("--keep-optimizer-state", action="store_true",
                    help="keep AdamW's state in memory during the evaluation (the comparison)")
    ap.add_argument("--faults", default="rate_limit=0.1", help="env.faults of the evaluation (the main job's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import reflrl.train.loop as L
    from reflrl import config as C

    real = L.offload_optimizer_state
    if args.keep_optimizer_state:  # restored below: the script may run inside another program (the tests)
        L.offload_optimizer_state = lambda *a, **k: False
    try:
        cfg = C.load_config(None, ["warmup.enabled=false", f"env.faults={args.faults}", *args.set])
        with tempfile.TemporaryDirectory() as tmp:
            tr = L.Trainer(cfg, Path(tmp) / "run", progress=False, quiet=True)
            tr._load(Path(args.checkpoint))
            opt = sum(v.numel() * v.element_size() for s in tr.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
            print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; loaded: resident {rss_gb():.2f} GB, "
                  f"AdamW state {opt / 1e6:.1f} MB", flush=True)
            peak = [0.0]

            def sample() -> None:
                while True:
                    peak[0] = max(peak[0], rss_gb())
                    time.sleep(0.05)

            threading.Thread(target=sample, daemon=True).start()
            t0 = time.perf_counter()
            res = tr.evaluate()
            mode = "kept in memory" if args.keep_optimizer_state else "on disk"
            print(f"evaluation with the optimiser state {mode}: {time.perf_counter() - t0:.0f} s, accuracy "
                  f"{res['accuracy']:.3f}, peak resident {max(peak[0], rss_gb()):.2f} GB, after {rss_gb():.2f} GB")
    finally:
        L.offload_optimizer_state = real
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
