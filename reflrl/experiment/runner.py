"""Run `reflrl train` in a child process and read its summary: what the benchmark and table scripts
(scripts/bench_recipe.py, paper_table.py, sampling_table.py) share. A run that fails raises with the
tail of its output, so a table never silently misses a row."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from reflrl.report.derive import mean_std as _mean_std


def train_command(*, seed: int, name: str, out_dir: str | Path, config: str | Path | None = None,
                  faults: str | None = None, overrides: Sequence[str] = ()) -> list[str]:
    """The command line of one quiet `reflrl train` run writing ``out_dir/name``."""
    cmd = [sys.executable, "-m", "reflrl.trainer", "--seed", str(seed), "--name", name, "--no-progress",
           "--quiet", "--set", f"train.out_dir={out_dir}"]
    if config is not None:
        cmd += ["--config", str(config)]
    if faults is not None:
        cmd += ["--faults", faults]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def run_train(cmd: list[str], run_dir: str | Path, cwd: str | Path | None = None) -> tuple[dict[str, Any], float]:
    """Run ``cmd`` (from :func:`train_command`); returns (its summary.json, wall seconds).
    RuntimeError with the output's tail when it exits non-zero or leaves no summary."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = Path(run_dir) / "summary.json"
    if proc.returncode != 0 or not summary.is_file():
        raise RuntimeError(f"reflrl train exited with status {proc.returncode} ({' '.join(cmd[1:])}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(summary.read_text()), wall


def fmt_mean_std(xs: Sequence[float | None], fmt: str = ".3f") -> str:
    """'mean ± std' of the non-None values (sample std; 0 for one value), 'n/a' when there are none."""
    vals = [float(x) for x in xs if x is not None]
    if not vals:
        return "n/a"
    m, s, _ = _mean_std(vals)
    return f"{m:{fmt}} ± {s:{fmt}}"
