"""Sampling strategies side by side (DSCL Table 1 at this scale): ToolRL-style GRPO, DAPO, SMV,
SMR, RDS, TDCL and DSCL on the default recipe, N seeds each, the same wall-clock budget for each.

    .venv/bin/python scripts/sampling_table.py [--seeds 0,1,2] [--budget-minutes 14]
        [--methods toolrl,dapo,smv,smr,rds,tdcl,dscl] [--faults SPEC] [--set key=value ...]
        [--out runs/sampling_table] [--json FILE]

Each (method, seed) is one `reflrl train --config configs/<method>.yaml` process (the recipe files
start from configs/default.yaml: the embedded SmolLM2-135M, its warm-up and its evaluation), run one
after the other, seeds outer and methods inner so that a slow patch of the machine does not fall
on one method only. Every run gets ``train.time_budget_min = --budget-minutes`` (the whole process:
model loading, warm-up, both evaluations) and a step cap high enough that the budget, not the
step count, ends RL (``--steps`` to change it), so a cheaper sampler gets to run more steps.

Printed per method (mean ± std over seeds): held-out accuracy after training (greedy exact match on
the test split; the same split and the same starting model for every method), its gain over the
accuracy before, wall time of the process, RL steps run, rollouts sampled (``rollouts`` in
summary.json: every RL rollout generated, DAPO-style refills included) and the curriculum stage
reached. About ``budget x methods x seeds`` of wall time: 7 x 3 x 14 min ~ 5 hours at the defaults.

``--warm-start`` pays the supervised warm-up once per seed (every method of that seed starts RL from
the same checkpoint; 'before' is then the warmed-up accuracy and 'gain' RL's alone), and
``--merge A.json B.json`` prints one table from the --json files of several partial runs (e.g. the
methods split over two processes).
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

METHODS: dict[str, tuple[str, str]] = {  # key -> (label as in DSCL Table 1, config file)
    "toolrl": ("ToolRL (GRPO)", "configs/toolrl.yaml"),
    "dapo": ("w/ DAPO", "configs/dapo.yaml"),
    "smv": ("w/ SMV", "configs/smv.yaml"),
    "smr": ("w/ SMR", "configs/smr.yaml"),
    "rds": ("w/ RDS", "configs/rds.yaml"),
    "tdcl": ("w/ TDCL", "configs/tdcl.yaml"),
    "dscl": ("DSCL (TDCL + RDS)", "configs/dscl.yaml"),
}


from reflrl.experiment.runner import fmt_mean_std, run_train, WARM_START_HELP, warm_starts  # noqa: E402


def mean_std(xs: list[float], fmt: str = "{:.3f}") -> str:
    return fmt_mean_std(xs, fmt[2:-1])  # "{:.3f}" -> ".3f"


def command(method: str, seed: int, name: str, args: argparse.Namespace) -> list[str]:
    """The `reflrl train` command line of one run."""
    cmd = [sys.executable, "-m", "reflrl", "train", "--config", str(ROOT / METHODS[method][1]),
           "--seed", str(seed), "--name", name, "--no-progress", "--quiet",
           "--set", f"train.out_dir={args.out}", "--set", f"train.time_budget_min={args.budget_minutes}",
           "--set", f"train.steps={args.steps}"]
    if args.faults is not None:
        cmd += ["--faults", args.faults]
    for o in [*getattr(args, "warm_overrides", {}).get(seed, []), *args.overrides]:
        cmd += ["--set", o]
    return cmd


def row_from_summary(method: str, seed: int, s: dict, wall: float) -> dict:
    """One table row from a run's summary.json."""
    sampling = s.get("sampling") or {}
    return {"method": method, "seed": seed, "before": s["accuracy_before"], "after": s["accuracy_after"],
            "gain": s.get("accuracy_gain"), "wall_s": wall, "steps": s["steps"],
            "stop_reason": s.get("stop_reason"), "rollouts": s.get("rollouts", s.get("trajectories")),
            "stage": sampling.get("stage"), "transitions": len(sampling.get("transitions", [])),
            "n_test": s.get("eval_after", {}).get("n"), "run_dir": s["run_dir"]}


def format_table(rows: list[dict], methods: list[str]) -> str:
    """The comparison table (markdown), one line per method, mean ± std over its seeds."""
    lines = ["| method | seeds | held-out acc. after | gain | wall (min) | RL steps | rollouts | final stage |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        stages = sorted({r["stage"] for r in rs if r["stage"] is not None})
        lines.append(
            f"| {METHODS[m][0]} | {len(rs)} | {mean_std([r['after'] for r in rs])} | "
            f"{mean_std([r['gain'] for r in rs])} | {mean_std([r['wall_s'] / 60 for r in rs], '{:.1f}')} | "
            f"{mean_std([r['steps'] for r in rs], '{:.1f}')} | {mean_std([r['rollouts'] for r in rs], '{:.0f}')} | "
            f"{'/'.join(str(x) for x in stages) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values (default 0,1,2)")
    p.add_argument("--budget-minutes", type=float, default=14.0,
                   help="train.time_budget_min of every run (whole process; default 14, the default recipe's)")
    p.add_argument("--steps", type=int, default=100_000,
                   help="train.steps cap (default: high, so the time budget ends every run)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--faults", default=None, help="fault spec for every run (default: the recipe's, none)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable)")
    p.add_argument("--out", default=str(ROOT / "runs" / "sampling_table"), help="parent folder of the runs")
    p.add_argument("--json", help="write the per-run rows to this JSON file")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from these --json files and exit")
    p.add_argument("--warm-start", nargs="?", const="auto", metavar="RUN_PATTERN", help=WARM_START_HELP)
    args = p.parse_args(argv)
    if args.merge:
        rows = [r for f in args.merge for r in json.loads(Path(f).read_text())["rows"]]
        present = [m for m in METHODS if any(r["method"] == m for r in rows)]
        print(format_table(rows, present))
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods or not seeds:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}" if unknown
                else "need at least one method and one seed")
    if args.budget_minutes <= 0:
        p.error("--budget-minutes must be > 0")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    rows: list[dict] = []
    failed: list[str] = []
    try:
        args.warm_overrides = warm_starts(args.warm_start, seeds, out_dir=args.out, faults=args.faults,
                                          overrides=args.overrides, cwd=ROOT)
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"sampling_table: {e}", file=sys.stderr)
        return 1
    for seed in seeds:
        for m in methods:
            name = f"{m}-{stamp}-s{seed}"
            cmd = command(m, seed, name, args)
            print(f"{m} seed {seed}: {' '.join(cmd[2:])}", flush=True)
            try:
                summary, wall = run_train(cmd, Path(args.out) / name, cwd=ROOT)
            except RuntimeError as e:
                print(f"{m} seed {seed}: {e}", file=sys.stderr)
                failed.append(f"{m}/s{seed}")
                continue
            r = row_from_summary(m, seed, summary, wall)
            rows.append(r)
            print(f"  accuracy {r['before']:.1%} -> {r['after']:.1%}, {r['steps']} RL steps "
                  f"({r['stop_reason']}), {r['rollouts']} rollouts, stage {r['stage']}, wall {wall / 60:.1f} min",
                  flush=True)
    n_test = rows[0]["n_test"] if rows else None
    print(f"\n{len(seeds)} seed(s), budget {args.budget_minutes:g} min per run, faults "
          f"{args.faults or 'none'}, {n_test} held-out tasks (greedy exact match)"
          + (f", every method from the seed's shared warm-up ({args.warm_start}; 'gain' is RL's alone)"
             if args.warm_start else "") + "\n")
    print(format_table(rows, methods), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "budget_minutes": args.budget_minutes,
                                               "seeds": seeds, "faults": args.faults,
                                               "overrides": args.overrides, "warm_start": args.warm_start},
                                              indent=2))
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
