"""The default recipe over several seeds: held-out accuracy of the base model, after the warm-up and after
RL, the paired RL gain (after RL - after warm-up, same run) and wall time, mean ± std; under faults also
accuracy on the episodes that met no fault, recovery under faults, adaptation to API changes (runs with
param_renamed / tool_moved faults) and reflection's repair rates, with the paired RL gains, and an
equal-time control: the RL phase's minutes spent on more supervised steps on the clean demonstrations
instead, from the same warm-up checkpoint; with --arms, other RL variants (such as `grpo`, RL without
reflection, and `cot_is`) from that same checkpoint, each compared with the recipe's own RL.

    .venv/bin/python scripts/bench_recipe.py --seeds 0,1,2 [--faults rate_limit=0.1] [--test-size 240]
                                             [--no-control] [--arms grpo,cot_is] [--config FILE]
                                             [--set key=value ...] [--out runs/bench_recipe] [--name NAME]

For the API-change recipe, every arm on 3 seeds:

    .venv/bin/python scripts/bench_recipe.py --config configs/api_changes.yaml --arms grpo,cot_is --test-size 240

The base model's evaluation is the same for every seed (greedy, the same held-out tasks, the same fixed
evaluation faults), so only the first seed runs it; the later seeds skip it (`train.eval_before=false`,
the warm-up on or off as the first seed's was) and report the first seed's numbers as their base.

Each seed runs `reflrl train` in its own process (exactly what a user runs, model loading and the
evaluations included) one after the other; wall time is measured around the whole process. The control
is a second `reflrl train` from the seed's warm-up checkpoint (`model.init_from`), its warm-up as many
supervised steps as the RL phase's seconds buy at the warm-up's measured rate, no RL step; it is scored
by the same evaluation (same tasks, same fixed fault seed). An arm is a `reflrl train` from the seed's
warm-up checkpoint with `reflection.variant` set to the arm, every other key as the recipe's, scored by the
same evaluation.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


from reflrl.experiment.runner import fmt_mean_std as mean_std, run_train, train_command


FAULT_KEYS = ("accuracy", "clean_accuracy", "recovery_under_faults", "recoverable_under_faults",
              "adaptation", "adaptation_param_renamed", "adaptation_tool_moved",
              "reflection_ratio_env_fault", "reflection_ratio_policy_error")
COUNT_KEYS = ("n_faulted", "n_clean", "n_changed", "n_change_recoverable")


def heldout_row(s: dict) -> dict:
    """A run summary's held-out numbers after the warm-up and after RL (fault runs: ``summary['heldout']``)."""
    h = s.get("heldout") or {}
    return {stage: {k: (h.get(stage) or {}).get(k) for k in FAULT_KEYS + COUNT_KEYS}
            for stage in ("after_warmup", "after")}


def control_steps(s: dict) -> int:
    """Supervised steps the RL phase's seconds buy at the warm-up's measured rate (at least 1)."""
    w = s.get("warmup") or {}
    per_step = (w.get("sft_seconds") or 0.0) / max(1, w.get("sft_steps") or 0)
    return max(1, round((s.get("rl_seconds") or 0.0) / per_step)) if per_step > 0 else 1


def fault_lines(rows: list[dict]) -> list[str]:
    """Per metric: after warm-up, after RL, the paired RL gain, and RL minus the equal-time control."""
    out = []
    for k in FAULT_KEYS:
        w = [(r["heldout"]["after_warmup"] or {}).get(k) for r in rows if r.get("heldout")]
        a = [(r["heldout"]["after"] or {}).get(k) for r in rows if r.get("heldout")]
        if not any(x is not None for x in w + a):
            continue
        gains = [x - y for x, y in zip(a, w) if x is not None and y is not None]
        line = f"{k}: after warm-up {mean_std(w)}, after RL {mean_std(a)}, RL gain (paired) {mean_std(gains)}"
        if gains:
            line += f" (per seed {', '.join(f'{100 * g:+.1f}' for g in gains)} points)"
        ctl = [((r["heldout"]["after"] or {}).get(k), r["control"].get(k)) for r in rows if r.get("control")]
        diffs = [x - c for x, c in ctl if x is not None and c is not None]
        if diffs:
            line += (f"; RL - equal-time SFT {mean_std(diffs)} (per seed "
                     f"{', '.join(f'{100 * d:+.1f}' for d in diffs)}; RL above in {sum(d > 0 for d in diffs)} of {len(diffs)})")
        out.append(line)
    return out


def arm_lines(rows: list[dict]) -> list[str]:
    """Per arm and metric: its value after RL and the recipe's RL minus the arm's (paired per seed)."""
    out = []
    arms = sorted({a for r in rows for a in (r.get("arms") or {})})
    for arm in arms:
        for k in ("accuracy", *FAULT_KEYS[1:]):
            pairs = [((r["heldout"]["after"] or {}).get(k), r["arms"][arm].get(k))
                     for r in rows if arm in (r.get("arms") or {})]
            vals = [v for _, v in pairs]
            if not any(v is not None for v in vals):
                continue
            diffs = [x - v for x, v in pairs if x is not None and v is not None]
            out.append(f"{arm} {k}: {mean_std(vals)}; the recipe's RL - {arm} {mean_std(diffs)} (per seed "
                       f"{', '.join(f'{100 * d:+.1f}' for d in diffs)}; above in {sum(d > 0 for d in diffs)} of {len(diffs)})")
    return out


def aggregate_lines(rows: list[dict]) -> list[str]:
    """The seeds' aggregate: accuracy at the three points and the paired RL gain (mean ± std over
    seeds; the RL gain is after RL minus after warm-up of the SAME run), reflection's recovery, wall time."""
    before = [r["before"] for r in rows]
    after = [r["after"] for r in rows]
    gain = [a - b for a, b in zip(after, before) if a is not None and b is not None]
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
    p.add_argument("--faults", help="fault spec passed to reflrl train (default: rate_limit=0.1 for the default "
                                    "recipe, the config's own env.faults with --config)")
    p.add_argument("--config", help="config file (default: the default recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_recipe"), help="parent folder of the runs")
    p.add_argument("--json", help="write the per-seed results and aggregates to this JSON file")
    p.add_argument("--test-size", type=int, help="held-out tasks of every evaluation (sets data.n_test)")
    p.add_argument("--no-control", action="store_true", help="skip the equal-time supervised control")
    p.add_argument("--arms", default="", help="comma-separated reflection variants (such as grpo,cot_is) run "
                                              "from each seed's warm-up checkpoint beside the recipe's RL")
    p.add_argument("--name", help="name of this bench (run folders NAME-s<seed>); run again with the same name and "
                                  "--out, it reuses every seed already finished (its row file NAME-s<seed>.json) "
                                  "and runs the others; default recipe-<date-time>")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    prefix = args.name or f"recipe-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if args.test_size:
        args.overrides = [*args.overrides, f"data.n_test={args.test_size}"]
    if args.faults is None and args.config is None:
        args.faults = "rate_limit=0.1"
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    settings = {"faults": args.faults, "config": args.config, "overrides": list(args.overrides),
                "control": not args.no_control, **({"arms": arms} if arms else {})}
    rows = []
    base: dict | None = None  # the first seed's base-model evaluation, shared by the later seeds
    for seed in seeds:
        name = f"{prefix}-s{seed}"
        done = Path(args.out) / f"{name}.json"
        if done.is_file():  # finished by an earlier run of this bench (same --name)
            row = json.loads(done.read_text())
            if row.get("settings") != settings:
                print(f"seed {seed}: {done} was run with other settings ({row.get('settings')}; now {settings}): "
                      "use another --name", file=sys.stderr)
                return 2
            rows.append(row)
            base = base or row.get("base")
            print(f"seed {seed}: finished earlier ({done}): after warm-up {row['after_warmup']}, after RL {row['after']}",
                  flush=True)
            continue
        later = [] if base is None else ["train.eval_before=false", f"warmup.enabled={str(base['warmup_ran']).lower()}"]
        cmd = train_command(seed=seed, name=name, out_dir=args.out, config=args.config, faults=args.faults,
                            overrides=[*args.overrides, *later])
        print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
        try:
            s, wall = run_train(cmd, Path(args.out) / name, cwd=ROOT)
        except RuntimeError as e:
            print(f"seed {seed}: {e}", file=sys.stderr)
            return 1
        if base is None:
            base = {"accuracy": s["accuracy_before"], "format": s.get("format_rate_before"),
                    "warmup_ran": bool((s.get("warmup") or {}).get("ran")), "heldout": (s.get("heldout") or {}).get("before")}
        else:
            s["accuracy_before"], s["format_rate_before"] = base["accuracy"], base["format"]
        row = {"seed": seed, "before": s["accuracy_before"], "after": s["accuracy_after"],
               "after_warmup": s.get("accuracy_after_warmup"), "rl_gain": s.get("rl_gain"),
               "recipe_complete": s.get("recipe_complete", True),
               "format_before": s.get("format_rate_before"), "format_after": s.get("format_rate_after"),
               "steps": s["steps"], "wall_s": wall, "masked": s["masked_trajectories"],
               "faults": s["faults"]["faults_by_kind"], "run_dir": s["run_dir"],
               "warmup_steps": (s.get("warmup") or {}).get("sft_steps"), "recovery": s.get("recovery") or {}}
        row["heldout"] = heldout_row(s)
        ck = Path(s["run_dir"]) / "checkpoints" / "step_000000"  # the state right after the warm-up
        if s.get("heldout") and not args.no_control:  # the RL phase's seconds on more SFT, same warm-up checkpoint
            steps = control_steps(s)
            ccmd = train_command(seed=seed, name=name + "-sft", out_dir=args.out, config=args.config,
                                 faults=args.faults, overrides=[*args.overrides, f"model.init_from={ck}",
                                                                "train.eval_before=false",
                                                                "warmup.enabled=true", f"warmup.steps={steps}",
                                                                "warmup.eval_after=false", "train.steps=0"])
            print(f"seed {seed} control: {steps} more SFT steps ({' '.join(ccmd[1:])})", flush=True)
            try:
                cs, _cwall = run_train(ccmd, Path(args.out) / (name + "-sft"), cwd=ROOT)
            except RuntimeError as e:
                print(f"seed {seed} control: {e}", file=sys.stderr)
                return 1
            row["control"] = {k: (cs.get("heldout") or {}).get("after", {}).get(k) for k in FAULT_KEYS}
            row["control_steps"] = steps
        for arm in arms:  # other RL variants from the same warm-up checkpoint
            acmd = train_command(seed=seed, name=f"{name}-{arm}", out_dir=args.out, config=args.config,
                                 faults=args.faults, overrides=[*args.overrides, f"model.init_from={ck}",
                                                                "warmup.enabled=false", "train.eval_before=false",
                                                                f"reflection.variant={arm}"])
            print(f"seed {seed} arm {arm}: {' '.join(acmd[1:])}", flush=True)
            try:
                a_s, _awall = run_train(acmd, Path(args.out) / f"{name}-{arm}", cwd=ROOT)
            except RuntimeError as e:
                print(f"seed {seed} arm {arm}: {e}", file=sys.stderr)
                return 1
            after = (a_s.get("heldout") or {}).get("after") or {}
            row.setdefault("arms", {})[arm] = {"accuracy": a_s["accuracy_after"],
                                               **{k: after.get(k) for k in FAULT_KEYS[1:] + COUNT_KEYS}}
        row["base"], row["settings"] = base, settings
        done.write_text(json.dumps(row, indent=2))
        rows.append(row)
        warm = "n/a" if row["after_warmup"] is None else f"{row['after_warmup']:.1%}"
        gain = "n/a" if row["rl_gain"] is None else f"{100 * row['rl_gain']:+.1f} points"
        base_s = "n/a" if row["before"] is None else f"{row['before']:.1%}"
        print(f"seed {seed}: base {base_s} -> after warm-up {warm} -> after RL {row['after']:.1%} "
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
    print(f"\n{len(rows)} seeds, faults {args.faults or 'of ' + str(args.config)}, {n_test} held-out tasks each")
    print("\n".join(aggregate_lines(rows)))
    if any(r.get("control") or (r["heldout"]["after"] or {}).get("n_faulted") for r in rows):
        print("\n".join(fault_lines(rows)))
    print("\n".join(arm_lines(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "faults": args.faults}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
