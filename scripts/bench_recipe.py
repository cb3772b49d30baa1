"""The default recipe over several seeds: held-out accuracy of the base model, after the warm-up and after
RL, the paired RL gain (after RL - after warm-up, same run) and wall time, mean ± std.

    .venv/bin/python scripts/bench_recipe.py --seeds 0,1,2 [--faults rate_limit=0.1] [--config FILE]
                                             [--set key=value ...] [--out runs/bench_recipe]

Each seed runs `reflrl train` in its own process (exactly what a user runs, model loading and both
evaluations included) one after the other; wall time is measured around the whole process. About
12 minutes of CPU per seed on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


from reflrl.experiment.runner import fmt_mean_std as mean_std, run_train, train_command


def aggregate_lines(rows: list[dict]) -> list[str]:
    """The seeds' aggregate: accuracy at the three points and the paired RL gain (mean ± std over
    seeds; the RL gain is after RL minus after warm-up of the SAME run), reflection's recovery, wall time."""
    before = [r["before"] for r in rows]
    after = [r["after"] for r in rows]
    gain = [a - b for a, b in zip(after, before)]
    wall = [r["wall_s"] / 60 for r in rows]
    rl = [r["rl_gain"] for r in rows if r.get("rl_gain") is not None]
    out = [f"accuracy, base model:    {mean_std(before)}",
           f"accuracy after warm-up:  {mean_std([r.get('after_warmup') for r in rows])}",
           f"accuracy after RL:       {mean_std(after)}",
           f"total gain:              {mean_std(gain)}",
           f"RL gain (paired, after RL - after warm-up, same run): {mean_std(rl)}"
           + (f"  (per seed: {', '.join(f'{100 * g:+.1f}' for g in rl)} points; positive in "
              f"{sum(g > 0 for g in rl)} of {len(rl)})" if rl else "")]
    recs = [r["recovery"] for r in rows if r.get("recovery")]
    if recs:
        rf = sum(r.get("reflected", 0) for r in recs)
        rr = sum(r.get("recovered_by_reflection", 0) for r in recs)
        pe = sum(r.get("recovered_policy_error", 0) for r in recs)
        out.append(f"reflection: recovered {rr:.0f} of {rf:.0f} reflected failures "
                   f"({rr / rf if rf else 0:.1%}; {pe:.0f} of them policy errors)")
    cut = [r["seed"] for r in rows if not r.get("recipe_complete", True)]
    out.append(f"wall time (min): {mean_std(wall)}   (max {max(wall) if wall else 0:.1f}; limit 15)"
               + (f"; CUT BY THE TIME GUARD: seed(s) {', '.join(map(str, cut))}" if cut else ""))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    p.add_argument("--faults", default="rate_limit=0.1", help="fault spec passed to reflrl train")
    p.add_argument("--config", help="config file (default: the default recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_recipe"), help="parent folder of the runs")
    p.add_argument("--json", help="write the per-seed results and aggregates to this JSON file")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    rows = []
    for seed in seeds:
        name = f"recipe-{stamp}-s{seed}"
        cmd = train_command(seed=seed, name=name, out_dir=args.out, config=args.config, faults=args.faults,
                            overrides=args.overrides)
        print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
        try:
            s, wall = run_train(cmd, Path(args.out) / name, cwd=ROOT)
        except RuntimeError as e:
            print(f"seed {seed}: {e}", file=sys.stderr)
            return 1
        row = {"seed": seed, "before": s["accuracy_before"], "after": s["accuracy_after"],
               "after_warmup": s.get("accuracy_after_warmup"), "rl_gain": s.get("rl_gain"),
               "recipe_complete": s.get("recipe_complete", True),
               "format_before": s.get("format_rate_before"), "format_after": s.get("format_rate_after"),
               "steps": s["steps"], "wall_s": wall, "masked": s["masked_trajectories"],
               "faults": s["faults"]["faults_by_kind"], "run_dir": s["run_dir"],
               "warmup_steps": (s.get("warmup") or {}).get("sft_steps"), "recovery": s.get("recovery") or {}}
        rows.append(row)
        warm = "n/a" if row["after_warmup"] is None else f"{row['after_warmup']:.1%}"
        gain = "n/a" if row["rl_gain"] is None else f"{100 * row['rl_gain']:+.1f} points"
        print(f"seed {seed}: base {row['before']:.1%} -> after warm-up {warm} -> after RL {row['after']:.1%} "
              f"(RL gain {gain}){'' if row['recipe_complete'] else '  CUT BY THE TIME GUARD'}", flush=True)
        print(f"  {row['steps']} RL steps, "
              f"wall {wall / 60:.1f} min, {row['warmup_steps']} warm-up steps, faults {row['faults']}, "
              f"masked rollouts {row['masked']}", flush=True)
        rec = row["recovery"]
        if rec:
            print(f"  recovery ({rec.get('variant')}): {rec.get('failed', 0):.0f} failed of {rec.get('rollouts', 0):.0f} "
                  f"rollouts, {rec.get('recovered_by_retry', 0):.0f} recovered by retry, "
                  f"{rec.get('recovered_by_reflection', 0):.0f} by reflection ({rec.get('reflected', 0):.0f} reflected), "
                  f"{rec.get('tool_calls_per_signal') or float('nan'):.2f} tool calls per learning signal", flush=True)
    n_test = None
    if rows:
        n_test = json.loads((Path(rows[0]["run_dir"]) / "summary.json").read_text())["eval_after"].get("n")
    print(f"\n{len(rows)} seeds, faults {args.faults!r}, {n_test} held-out tasks each")
    print("\n".join(aggregate_lines(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "faults": args.faults}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
