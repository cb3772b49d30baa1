"""Run `reflrl train` in a child process and read its summary: what the benchmark and table scripts
(scripts/bench_recipe.py, paper_table.py, sampling_table.py) share. A run that fails raises with the
tail of its output, so a table never silently misses a row."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from reflrl.budget import EXIT_BUDGET_CUT
from reflrl.report.derive import mean_std as _mean_std


def train_command(*, seed: int, name: str, out_dir: str | Path, config: str | Path | None = None,
                  faults: str | None = None, overrides: Sequence[str] = ()) -> list[str]:
    """The command line of one quiet `reflrl train` run writing ``out_dir/name``."""
    cmd = [sys.executable, "-m", "reflrl", "train", "--seed", str(seed), "--name", name, "--no-progress",
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
    RuntimeError with the output's tail when it fails or leaves no summary. A run the time budget cut
    (exit status 3) is returned: its summary's ``budget_cuts`` says so, and tables show it."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = Path(run_dir) / "summary.json"
    if proc.returncode not in (0, EXIT_BUDGET_CUT) or not summary.is_file():
        raise RuntimeError(f"reflrl train exited with status {proc.returncode} ({' '.join(cmd[1:])}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(summary.read_text()), wall


def warm_start(spec: str, seed: int, *, out_dir: str | Path, faults: str | None = None,
               overrides: Sequence[str] = (), cwd: str | Path | None = None) -> tuple[list[str], dict[str, Any]]:
    """Overrides that start a run from seed ``seed``'s shared warm-up, and that warm-up's summary.

    Comparisons of RL variants (paper_table, sampling_table) differ only after the warm-up, so every
    variant of a seed can start from ONE warm-up checkpoint (``model.init_from``, ``warmup.enabled=
    false``): the RL part is compared from the same point, and the warm-up is paid once per seed.

    ``spec``: ``"auto"`` = the run folder ``out_dir/warmup-s<seed>``, made by a warm-up-only
    ``reflrl train --set train.steps=0`` (default recipe, same ``faults``/``overrides``) unless it
    already has its summary; otherwise a run-folder pattern with ``{seed}``, e.g.
    ``runs/bench_recipe/recipe-X-s{seed}`` (any run of the default recipe: its step-0 checkpoint is
    the state right after the warm-up). Raises FileNotFoundError naming a missing checkpoint.
    """
    if spec == "auto":
        run_dir = Path(out_dir) / f"warmup-s{seed}"
        if not (run_dir / "summary.json").is_file():
            if run_dir.exists():
                shutil.rmtree(run_dir)  # an interrupted warm-up: start it again
            cmd = train_command(seed=seed, name=run_dir.name, out_dir=out_dir, faults=faults,
                                overrides=[*overrides, "train.steps=0"])
            print(f"warm-up seed {seed}: {' '.join(cmd[2:])}", flush=True)
            run_train(cmd, run_dir, cwd=cwd)
    else:
        if "{seed}" not in spec:
            raise ValueError(f"warm start {spec!r}: expected 'auto' or a run-folder pattern with {{seed}}")
        run_dir = Path(spec.format(seed=seed))
    ck = run_dir / "checkpoints" / "step_000000"
    if not (ck / "trainable.pt").is_file():
        raise FileNotFoundError(f"warm start for seed {seed}: {ck} has no trainable.pt (the step-0 checkpoint, "
                                "written right after the warm-up, is missing)")
    state = json.loads((ck / "state.json").read_text())
    info = {"run_dir": str(run_dir), "checkpoint": str(ck), "warmup": state.get("warmup", {}),
            "accuracy_base": (state.get("eval_before") or {}).get("accuracy")}
    return [f"model.init_from={ck.resolve()}", "warmup.enabled=false"], info


WARM_START_HELP = ("start every method of a seed from ONE shared warm-up (model.init_from): alone, a "
                   "warm-up-only run per seed under --out; or existing default-recipe run folders, e.g. "
                   "'runs/bench_recipe/recipe-X-s{seed}'. 'before' is then the warmed-up accuracy")


def warm_starts(spec: str | None, seeds: Sequence[int], *, out_dir: str | Path, faults: str | None = None,
                overrides: Sequence[str] = (), cwd: str | Path | None = None,
                run_dirs: dict[int, str] | None = None) -> dict[int, list[str]]:
    """:func:`warm_start` for every seed (``{}`` when ``spec`` is None), printing where each starts;
    ``run_dirs``, when given, receives each seed's warm-up run folder."""
    out: dict[int, list[str]] = {}
    if spec:
        for seed in seeds:
            out[seed], info = warm_start(spec, seed, out_dir=out_dir, faults=faults, overrides=overrides, cwd=cwd)
            if run_dirs is not None:
                run_dirs[seed] = info["run_dir"]
            print(f"seed {seed} starts from {info['checkpoint']}", flush=True)
    return out


def fmt_mean_std(xs: Sequence[float | None], fmt: str = ".3f") -> str:
    """'mean ± std' of the non-None values (sample std; 0 for one value), 'n/a' when there are none."""
    vals = [float(x) for x in xs if x is not None]
    if not vals:
        return "n/a"
    m, s, _ = _mean_std(vals)
    return f"{m:{fmt}} ± {s:{fmt}}"
