"""Tool-ReRL's comparison (Tool-ReRL, Table 1) on the embedded default, several seeds each.

    .venv/bin/python scripts/paper_table.py [--variants grpo,ppo,ref,cot_is,tool_rerl] [--seeds 3]
        [--faults rate_limit=0.1] [--budget-minutes M] [--rl-minutes M [--max-steps N]]
        [--set key=value ...] [--out runs/paper_table]
        [--json FILE]

Each (variant, seed) runs `reflrl train --config configs/<variant>.yaml` in its own process (exactly
what a user runs: model loading, warm-up and both evaluations included), one after the other, and the
run's summary.json is read back. Printed per variant: held-out accuracy after training (mean ± std over
seeds) and its gain over the start; under faults, the accuracy on the held-out episodes that met no fault
and the recovery under faults (of the episodes that met one, the share that still ended right), each
with its gain (with API-change faults also adaptation, overall and per kind: of the episodes whose call
at the change was right apart from it, the share that ended right); the recovered-trajectory ratio (failed rollouts recovered by
reflection / failed rollouts, over all seeds), tool calls per trajectory with a learning signal, RL
steps and wall time; then whether the paper's ordering holds (tool_rerl > cot_is > grpo, on accuracy and
on recovery under faults; ref not better than cot when both ran).

With the real model each run takes the recipe's 14-minute budget (5 variants x 3 seeds: about 3.5 hours
on 2 cores); --budget-minutes shortens every run (train.time_budget_min), and --warm-start pays the warm-up once
per seed instead of once per run (every variant of a seed then starts RL from the same checkpoint,
which is also the fairer comparison). With a run-folder pattern and `--set train.eval_before=false`,
each run skips its evaluation before RL and takes the warm-up run's own held-out evaluation as its
start (refused if that was made on another number of tasks or another evaluation fault seed).

Equal steps (the default: every run does the recipe's train.steps) or equal time: --rl-minutes M gives
every run M minutes of RL steps (train.rl_minutes; train.steps = --max-steps, default 1000, is only a
ceiling), so a variant whose steps cost more (reflection retries, thought tokens) does fewer of them.
An equal-time table depends on the machine and its load, and says so; run it on an idle machine. A smoke
test with the tiny
random model:

    .venv/bin/python scripts/paper_table.py --seeds 1 --set model.name=tiny-random --set model.dtype=float32 \\
        --set model.trainable=all --set warmup.enabled=false --set data.n_train=8 --set data.n_test=4 \\
        --set data.n_val=0 --set rollout.max_new_tokens=16 --set train.steps=2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = "grpo,ppo,ref,cot_is,tool_rerl"


from reflrl.experiment.runner import fmt_mean_std as mean_std, run_train, train_command, WARM_START_HELP, warm_starts


def run_one(variant: str, seed: int, args: argparse.Namespace, stamp: str) -> dict:
    """One `reflrl train` subprocess; returns the row read from its summary.json."""
    name = f"{variant}-{stamp}-s{seed}"
    cfg = ROOT / "configs" / f"{variant}.yaml"
    if not cfg.is_file():
        raise SystemExit(f"paper_table: no config {cfg} for variant {variant!r}")
    over = ([f"train.time_budget_min={args.budget_minutes}"] if args.budget_minutes is not None else []) + list(args.overrides)
    if args.rl_minutes is not None:  # equal time: the minutes are the rule, train.steps only a ceiling
        over += [f"train.rl_minutes={args.rl_minutes:g}", f"train.steps={args.max_steps}"]
    over = args.warm_overrides.get(seed, []) + over
    cmd = train_command(seed=seed, name=name, out_dir=args.out, config=cfg, faults=args.faults, overrides=over)
    print(f"{variant} seed {seed}: {' '.join(cmd[2:])}", flush=True)
    try:
        s, wall = run_train(cmd, Path(args.out) / name, cwd=ROOT)
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        raise RuntimeError(f"{variant} seed {seed}: reflrl train failed") from None
    rec = s.get("recovery") or {}
    held = s.get("heldout") or {}
    before, held_before = s["accuracy_before"], held.get("before")
    if before is None and seed in args.warm_dirs:  # train.eval_before=false: the warm-up run's own evaluation
        before, held_before = warmup_evaluation(args.warm_dirs[seed], held.get("after"))
    row = {"variant": variant, "seed": seed, "before": before, "after": s["accuracy_after"],
           "heldout_before": held_before, "heldout_after": held.get("after"),
           "steps": s["steps"], "stop_reason": s.get("stop_reason"), "rl_s": s.get("rl_seconds"), "wall_s": wall, "failed": rec.get("failed", 0.0),
           "recovered": rec.get("recovered_by_reflection", 0.0), "recovered_ratio": rec.get("recovered_ratio"),
           "tool_calls": rec.get("tool_calls"), "signal_trajectories": rec.get("signal_trajectories"),
           "tool_calls_per_signal": rec.get("tool_calls_per_signal"),
           "weight_mean_last": (rec.get("weight_mean_per_step") or [None])[-1], "run_dir": s["run_dir"]}
    start = "n/a" if row["before"] is None else f"{row['before']:.1%}"
    print(f"  accuracy {start} -> {row['after']:.1%}, {row['steps']} steps, {wall / 60:.1f} min, "
          f"recovered {row['recovered']:.0f}/{row['failed']:.0f}, tool calls/signal "
          f"{'n/a' if row['tool_calls_per_signal'] is None else format(row['tool_calls_per_signal'], '.2f')}",
          flush=True)
    return row


def warmup_evaluation(run_dir: str | Path, after: dict | None) -> tuple[float | None, dict | None]:
    """The held-out evaluation right after the warm-up, read from the warm-up's run folder, for a run
    that skipped its own (``train.eval_before=false``): (accuracy, held-out numbers), or (None, None)
    when that run has none. ValueError when it was made on other tasks or faults than ``after`` (the
    RL run's final evaluation: its number of tasks and evaluation fault seed must match)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None, None
    s = json.loads(path.read_text())
    h = (s.get("heldout") or {}).get("after_warmup")
    if not h:
        return s.get("accuracy_after_warmup"), None
    if after and (h.get("n"), h.get("eval_fault_seed")) != (after.get("n"), after.get("eval_fault_seed")):
        raise ValueError(f"the warm-up evaluation in {path} ({h.get('n')} tasks, fault seed {h.get('eval_fault_seed')}) "
                         f"is not the RL run's ({after.get('n')} tasks, fault seed {after.get('eval_fault_seed')}): "
                         "run with train.eval_before=true or the warm-up's data.n_test")
    return h.get("accuracy"), h


# adaptation to API changes (summary heldout): overall and per kind, columns only when some run met a change
ADAPTATION_KEYS = ("adaptation", "adaptation_param_renamed", "adaptation_tool_moved")
ADAPTATION_LABELS = {"adaptation": "adaptation", "adaptation_param_renamed": "adaptation, param renamed",
                     "adaptation_tool_moved": "adaptation, tool moved"}


def _held(r: dict, stage: str, key: str) -> float | None:
    return (r.get(f"heldout_{stage}") or {}).get(key)


def _gains(rs: list[dict], key: str | None = None) -> list[float]:
    """Per-run after minus before of the accuracy (key None) or of a held-out number."""
    pairs = ([(r["after"], r["before"]) for r in rs] if key is None
             else [(_held(r, "after", key), _held(r, "before", key)) for r in rs])
    return [a - b for a, b in pairs if a is not None and b is not None]


def table(rows: list[dict], variants: list[str]) -> tuple[str, dict[str, float], dict[str, float]]:
    """The markdown table, each variant's mean accuracy after training and its mean recovery under
    faults after training (runs with faults only: of the held-out episodes that met a fault, the share
    that still ended right). When some run's held-out episodes met API changes (param_renamed,
    tool_moved), a column per kind of adaptation after training (gain): of the episodes whose call at the
    change was right apart from it, the share that ended right."""
    adapt = [k for k in ADAPTATION_KEYS if any(_held(r, st, k) is not None for r in rows for st in ("before", "after"))]
    out = ["| variant | seeds | held-out acc. after | gain | no fault met, after (gain) | recovery under faults, "
           "after (gain) | " + "".join(f"{ADAPTATION_LABELS[k]}, after (gain) | " for k in adapt)
           + "recovered ratio | tool calls / signal | RL steps | RL min | wall min |",
           "|---|---|---|---|---|---|" + "---|" * len(adapt) + "---|---|---|---|---|"]
    means: dict[str, float] = {}
    recovery: dict[str, float] = {}
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        after = [r["after"] for r in rs]
        means[v] = statistics.mean(after)
        rec = [x for x in (_held(r, "after", "recovery_under_faults") for r in rs) if x is not None]
        if rec:
            recovery[v] = statistics.mean(rec)
        held = {k: (f"{mean_std([_held(r, 'after', k) for r in rs])} ({mean_std(_gains(rs, k))})")
                for k in ("clean_accuracy", "recovery_under_faults", *adapt)}
        failed = sum(r["failed"] for r in rs)
        ratio = f"{sum(r['recovered'] for r in rs) / failed:.1%}" if failed else "n/a"
        sig = sum(r["signal_trajectories"] or 0 for r in rs)
        calls = sum(r["tool_calls"] or 0 for r in rs)
        tps = f"{calls / sig:.2f}" if sig else "n/a"
        out.append(f"| {v} | {len(rs)} | {mean_std(after)} | {mean_std(_gains(rs))} | {held['clean_accuracy']} | "
                   f"{held['recovery_under_faults']} | " + "".join(f"{held[k]} | " for k in adapt)
                   + f"{ratio} | {tps} | {mean_std([float(r['steps']) for r in rs], '.1f')} | "
                   f"{mean_std([(r.get('rl_s') or 0.0) / 60 for r in rs], '.1f')} | "
                   f"{mean_std([r['wall_s'] / 60 for r in rs], '.1f')} |")
    return "\n".join(out), means, recovery


def ordering(means: dict[str, float], recovery: dict[str, float] | None = None) -> list[str]:
    """Whether the paper's ordering holds on these means (sec. 4.2: tool_rerl > cot_is > grpo; +Ref not
    better than +CoT), on held-out accuracy and, where the runs met faults, on recovery under faults."""
    lines = []
    for label, vals in (("accuracy", means), ("recovery under faults", recovery or {})):
        chain = [v for v in ("tool_rerl", "cot_is", "grpo") if v in vals]
        if len(chain) >= 2:
            ok = all(vals[a] > vals[b] for a, b in zip(chain, chain[1:]))
            lines.append(f"{' > '.join(chain)} on {label}: {'holds' if ok else 'does NOT hold'} "
                         f"({', '.join(f'{v} {vals[v]:.3f}' for v in chain)})")
    if "ref" in means and "cot" in means:
        ok = means["ref"] <= means["cot"]
        lines.append(f"ref not better than cot: {'holds' if ok else 'does NOT hold'} "
                     f"(ref {means['ref']:.3f}, cot {means['cot']:.3f})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated configs/<variant>.yaml names")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (train.seed 0..N-1)")
    p.add_argument("--faults", default="rate_limit=0.1", help="fault spec passed to reflrl train")
    p.add_argument("--budget-minutes", type=float, help="train.time_budget_min of every run (default: the recipe's)")
    p.add_argument("--rl-minutes", type=float,
                   help="equal wall time: every run gets this many minutes of RL steps (train.rl_minutes) instead of "
                        "the recipe's step count")
    p.add_argument("--max-steps", type=int, default=1000, help="with --rl-minutes: train.steps, only a ceiling")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (repeatable)")
    p.add_argument("--out", default=str(ROOT / "runs" / "paper_table"), help="parent folder of the runs")
    p.add_argument("--json", help="write the per-run rows to this JSON file")
    p.add_argument("--warm-start", nargs="?", const="auto", metavar="RUN_PATTERN", help=WARM_START_HELP)
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.rl_minutes is not None and not (args.rl_minutes > 0 and args.max_steps >= 1):
        p.error(f"--rl-minutes must be > 0 and --max-steps >= 1 (got {args.rl_minutes}, {args.max_steps})")
    if args.seeds < 1 or not variants:
        p.error(f"--seeds must be >= 1 (got {args.seeds}) and --variants must name at least one config")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    rows = []
    try:
        args.warm_dirs = {}
        args.warm_overrides = warm_starts(args.warm_start, range(args.seeds), out_dir=args.out,
                                          faults=args.faults, overrides=args.overrides, cwd=ROOT,
                                          run_dirs=args.warm_dirs)
        for v in variants:
            for seed in range(args.seeds):
                rows.append(run_one(v, seed, args, stamp))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"paper_table: {e}", file=sys.stderr)
        return 1
    text, means, recovery = table(rows, variants)
    print(f"\nfaults {args.faults!r}, {args.seeds} seed(s) per variant"
          + (f", {args.budget_minutes} min per run" if args.budget_minutes is not None else "")
          + (f", EQUAL TIME: {args.rl_minutes:g} min of RL steps per run (step counts depend on this machine)"
             if args.rl_minutes is not None else ", equal steps")
          + (f", every variant from the seed's shared warm-up ({args.warm_start}; 'gain' is RL's alone)"
             if args.warm_start else ""))
    print(text)
    for line in ordering(means, recovery):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "faults": args.faults, "variants": variants,
                                               "budget_minutes": args.budget_minutes, "rl_minutes": args.rl_minutes,
                                               "warm_start": args.warm_start,
                                               "overrides": args.overrides}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
