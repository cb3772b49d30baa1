"""argparse wiring of ``reflrl experiment faults`` and ``reflrl report`` (building the parser imports
neither torch nor matplotlib)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_experiment_commands(subparsers: Any) -> None:
    """Add ``experiment`` and ``report`` to the ``reflrl`` subparsers (each sets ``func``)."""
    ex = subparsers.add_parser("experiment", help="sweeps over many training runs (faults)",
                               description="Experiments over many training runs.")
    ex_sub = ex.add_subparsers(dest="experiment_command", metavar="EXPERIMENT")
    ex_sub.required = True
    f = ex_sub.add_parser(
        "faults", help="train every method at every fault setting and seed; resumable; writes a report",
        description="A fault-injection sweep: methods x fault settings x seeds, each cell a normal "
                    "'reflrl train' run in its own folder (its own process: a crash is recorded and the "
                    "sweep goes on). Re-running the same command continues a killed sweep: finished cells "
                    "are skipped, interrupted ones resume from their checkpoint. Ends with the sweep "
                    "report (report.html, report.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    f.add_argument("--methods", default="grpo",
                   help="comma-separated methods: each is the recipe configs/<method>.yaml; 'grpo' without "
                        "such a file is the default recipe")
    f.add_argument("--faults", required=True,
                   help="fault grid: one axis per kind, 'kind=rate,rate;kind=rate,...', e.g. "
                        "'rate_limit=0,0.1,0.3;timeout=0,0.1' (values as in --faults: prob[:param])")
    f.add_argument("--grid", default="per-kind", choices=("per-kind", "product"),
                   help="per-kind: sweep each kind alone, the others off (a shared no-fault baseline); "
                        "product: every combination of the axes")
    f.add_argument("--seeds", default="3", help="number of seeds (3 = seeds 0,1,2) or a list (0,5,7)")
    f.add_argument("--budget-minutes", type=float, default=None,
                   help="time budget of each cell's training run (sets train.time_budget_min; "
                        "default: the recipe's)")
    f.add_argument("--config", default=None,
                   help="base recipe the methods' keys are laid over (default: configs/default.yaml)")
    f.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every cell, e.g. --set train.threads=1 (repeatable)")
    f.add_argument("--out", default=None,
                   help="sweep folder (default: runs/experiments/faults-<methods>-<hash of the arguments>, so "
                        "the same command continues the same sweep)")
    f.add_argument("--jobs", type=int, default=1,
                   help="cells run at the same time (each is a training process; 1 on a small CPU)")
    # the choices of reflrl.runlog.KEEP_CHOICES, written out: building the parser imports no torch
    f.add_argument("--keep-checkpoints", default="model", choices=("all", "model", "none"),
                   help="what a finished cell keeps of its weights: 'model' its final model (CELL/model/, "
                        "0.34 GB with the default recipe in bfloat16; reflrl eval --model CELL_DIR loads it), "
                        "'all' its checkpoints (1.3 GB), 'none' no weights (results, logs and reports are "
                        "always kept)")
    f.add_argument("--no-report", action="store_true", help="do not write the sweep report at the end")
    f.add_argument("--no-cell-reports", action="store_true",
                   help="cells skip their own run report (saves a few seconds per cell; 'reflrl report "
                        "CELL_DIR' writes one later)")
    f.set_defaults(func=cmd_experiment_faults)

    r = subparsers.add_parser(
        "report", help="HTML + markdown report with plots of a run folder or a sweep folder",
        description="Write report.html (self-contained, plots embedded), report.md and plots/*.png into "
                    "RUN_OR_SWEEP_DIR. A run folder with missing files still gets a report saying what is "
                    "missing.")
    r.add_argument("path", metavar="RUN_OR_SWEEP_DIR", help="a run folder (reflrl train) or a sweep folder "
                                                            "(reflrl experiment faults)")
    r.set_defaults(func=cmd_report)


def cmd_experiment_faults(args: argparse.Namespace) -> int:
    from reflrl.experiment.sweep import Sweep, SweepError, SweepSpec, parse_methods, parse_seeds

    config = None
    if args.config:
        cp = Path(args.config)
        if not cp.is_file():
            raise SweepError(f"--config {args.config}: no such file")
        config = str(cp.resolve())
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise SweepError(f"--budget-minutes {args.budget_minutes:g}: must be > 0")
    for o in args.overrides:
        if "=" not in o:
            raise SweepError(f"--set {o!r}: expected key=value, e.g. train.threads=1")
    spec = SweepSpec(methods=parse_methods(args.methods), faults=args.faults, grid=args.grid,
                     seeds=parse_seeds(args.seeds), budget_minutes=args.budget_minutes, config=config,
                     overrides=tuple(args.overrides))
    out = Path(args.out) if args.out else spec.default_out()
    sweep = Sweep(spec, out, jobs=args.jobs, argv=sys.argv[1:], say=lambda m: print(m, flush=True),
                  cell_reports=not args.no_cell_reports, keep_checkpoints=args.keep_checkpoints)
    rc = sweep.run()
    if rc != 130 and not args.no_report:
        _report(sweep.out)
    return rc


def _report(path: Path) -> int:
    from reflrl.report import build_report

    rep = build_report(path)  # ReportError (a UserError) names what is wrong with the folder
    drawn = [p for p in rep.plots if p.path is not None]
    print(f"report: {rep.html}  ({len(drawn)}/{len(rep.plots)} plots; markdown: {rep.markdown})")
    for p in rep.plots:
        if p.path is None:
            print(f"  {p.spec.title}: {p.reason}")
    if rep.missing:
        print(f"  missing: {len(rep.missing)} item(s) (listed in the report)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    return _report(Path(args.path))
