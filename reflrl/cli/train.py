"""``reflrl train``: its arguments, how they resolve to a config and a run folder, and the handler."""
from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from reflrl import config as C
from reflrl.errors import IncompleteRun

DEFAULT_CONFIG = C.default_recipe()  # configs/default.yaml, shipped as package data (same in a wheel)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``reflrl train`` under the ``reflrl`` command's subparsers."""
    p = sub.add_parser("train", help="train a tool-calling policy with RL (SFT warm-up, GRPO, Tool-ReRL)",
                       description="Train a tool-calling policy with GRPO on the CPU, through fault-injecting "
                                   "tools. Writes a run folder.")
    p.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.name}, the default recipe)")
    p.add_argument("--faults", help="fault spec, e.g. rate_limit=0.1,timeout=0.05 (sets env.faults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set algo.lr=2e-5 (repeatable)")
    p.add_argument("--seed", type=int, help="sets train.seed")
    p.add_argument("--name", help="run folder name (sets train.run_name)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--no-report", action="store_true",
                   help="do not write the run report (report.html, report.md, plots/) at the end")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the recipe, --config, --faults and --set applied) as YAML and exit")
    p.add_argument("--backend", choices=("cpu", "verl"), default="cpu",
                   help="cpu: this process's trainer (default); verl: build a verl config from --config "
                        "(a configs/verl/*.yaml recipe) and launch verl's trainer on Ray (docs/scale-out.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --backend verl: build and validate the verl config, print it, don't train (without verl "
                        "installed: on reflrl's copy of verl's defaults, without verl's own checks)")
    p.set_defaults(func=run)
    return p


def resolve_config(args: argparse.Namespace) -> tuple[C.Config, Path, bool]:
    """(config, run folder, resume?) from the parsed command line."""
    from reflrl.runlog import refuse_existing_run, refuse_slimmed_resume

    overrides = list(args.overrides)
    if args.faults is not None:
        from reflrl.faults.spec import FaultPlan

        overrides.append(f"env.faults={'' if args.faults in ('', 'none') else str(FaultPlan.parse(args.faults))}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise C.ConfigError(f"--resume {run_dir}: no config.yaml there (not a reflrl run folder)")
        try:
            refuse_slimmed_resume(run_dir)
        except FileNotFoundError as e:
            raise C.ConfigError(f"--resume: {e}") from None
        cfg = C.load_config(run_dir / "config.yaml", overrides)
        return cfg, run_dir, True
    if args.name:
        overrides.append(f"train.run_name={args.name}")
    path = args.config if args.config else DEFAULT_CONFIG
    if not Path(path).is_file():
        raise C.ConfigError(f"config file {str(path)!r} does not exist"
                            + ("" if args.config else " (the default recipe is missing from this installation)"))
    cfg = C.load_config(path, overrides)
    name = cfg.train.run_name or (datetime.now().strftime("%Y%m%d-%H%M%S") + f"-s{cfg.train.seed}")
    run_dir = Path(cfg.train.out_dir) / name
    try:
        refuse_existing_run(run_dir)
    except FileExistsError as e:
        raise C.ConfigError(str(e)) from None
    return cfg, run_dir, False


def _run_verl(args: argparse.Namespace) -> int:
    """``reflrl train --backend verl --config configs/verl/X.yaml``: hand over to verl (GPU; not run
    here, see docs/scale-out.md). Configuration errors are ConfigErrors (exit 2)."""
    if not args.config:
        raise C.ConfigError("--backend verl needs --config configs/verl/<recipe>.yaml")
    from reflrl.verl_backend import require_verl

    if not args.dry_run:
        require_verl()  # before anything else: one line naming what to install (exit 2)
    from reflrl.verl_backend.launch import launch

    overrides = list(args.overrides) + ([f"env.faults={args.faults}"] if args.faults else [])
    out = launch(args.config, overrides, dry_run=args.dry_run, write_data=not args.dry_run)
    if args.dry_run:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(out))
    return 0


def run(args: argparse.Namespace) -> int:
    """The handler: exit status 0, or an error of reflrl.errors for the command's one handler (2: a
    configuration error, 3: the time budget cut a phase, 4: not enough disk space for the checkpoints)."""
    if args.help_config:
        print(C.config_help())
        return 0
    if args.backend == "verl":
        return _run_verl(args)
    cfg, run_dir, resume = resolve_config(args)
    C.check_trainer(cfg)  # e.g. reflection.variant='ppo': exit 2 with the reason, before loading anything
    from reflrl.device import resolve_device

    resolve_device(cfg.train.device)  # train.device=cuda without a GPU: exit 2
    if args.print_config:
        src = args.resume or args.config or str(DEFAULT_CONFIG)
        print(C.dump_config(cfg, header=f"resolved config: {src}"), end="")
        return 0
    from reflrl.train import format_summary, train

    summary = train(cfg, run_dir, resume=resume, progress=not args.no_progress, quiet=args.quiet,
                    report=not args.no_report)  # DiskSpaceError before the run or at a checkpoint: exit 4
    print(format_summary(summary), flush=True)
    if summary.get("budget_cuts"):
        raise IncompleteRun("a time budget cut a phase of this run (train.time_budget_min): its result is not "
                            "the recipe's (summary above)")
    return 0
