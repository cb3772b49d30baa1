"""What a run reports at its end: the summary (``summary.json``) and the short human summary printed."""
from __future__ import annotations

from typing import Any, Sequence

from reflrl import config as C
from reflrl.budget import EXIT_BUDGET_CUT, budget_cut_text
from reflrl.precision import DtypeChoice
from reflrl.recovery import RecoveryLedger, format_recovery
from reflrl.threads import describe as threads_summary


def ledger_totals(envs: Sequence[Any]) -> dict[str, Any]:
    """Fault and triage counts summed over the envs' ledgers (this process's episodes)."""
    tot: dict[str, Any] = {"calls": 0, "attempts": 0, "retries": 0, "recovered": 0, "given_up": 0,
                           "policy_errors": 0, "tool_bugs": 0, "faults_by_kind": {}, "injected_by_kind": {}}
    for env in envs:
        led = getattr(env, "ledger", None)
        if led is None:
            continue
        t = led.totals()
        for k in ("calls", "attempts", "retries", "recovered", "given_up", "policy_errors", "tool_bugs"):
            tot[k] += int(getattr(t, k))
        for key in ("faults_by_kind", "injected_by_kind"):
            for kind, c in getattr(t, key).items():
                tot[key][kind] = tot[key].get(kind, 0) + int(c)
    return tot


def build_summary(st: dict[str, Any], *, cfg: C.Config, run_dir: str, step: int, precision: DtypeChoice,
                  load_s: float, elapsed_s: float, prefilter_skipped: dict[int, int], sampling: Any,
                  faults: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a run from its state (``st``: the trainer's checkpointed state)."""
    before, after = st.get("eval_before", {}), st.get("eval_after", {})
    wu = st.get("warmup", {})
    mid = st.get("eval_after_warmup", {})
    cuts = list(st.get("budget_cuts", []))
    return {
        "run_dir": run_dir,
        "accuracy_before": before.get("accuracy"), "accuracy_after": after.get("accuracy"),
        "accuracy_after_warmup": mid.get("accuracy"),
        "accuracy_gain": (after.get("accuracy", 0) - before.get("accuracy", 0)) if before and after else None,
        # what RL added on top of the warm-up (same run, same test tasks)
        "rl_gain": (after["accuracy"] - mid["accuracy"]) if mid and after else None,
        "eval_before": before, "eval_after_warmup": mid or None, "eval_after": after,
        "eval_seconds": {k: v.get("seconds") for k, v in (("before", before), ("after_warmup", mid),
                                                           ("after", after)) if v},
        # the time guard: empty when the run is the recipe's; otherwise which phase was cut, and where
        "budget_cuts": cuts, "recipe_complete": not cuts,
        "precision": precision.to_dict(), **threads_summary(),
        "format_rate_before": wu.get("format_rate_before"), "format_rate_after": wu.get("format_rate_after"),
        "warmup": wu,
        "steps": step, "stop_reason": st.get("stop_reason"), "rl_seconds": round(st.get("rl_seconds", 0.0), 1),
        "reward_per_step": st["rewards"], "zero_var_ratio_per_step": st["zero_var_ratio"],
        "prefilter_skipped_per_epoch": dict(prefilter_skipped),
        "trajectories": st["trajectories"], "masked_trajectories": st["masked"],
        # RL rollouts sampled (n per prompt, DAPO-style refills included; not reflection re-attempts)
        "rollouts": st.get("episodes", st["trajectories"]),
        "sampling": sampling.summary() if sampling is not None else None,
        "faults": faults,
        "time_s": {**{k: round(v, 1) for k, v in st["timers"].items()}, "load_s": round(load_s, 1),
                   "total_s": round(elapsed_s, 1)},
        "config": {"faults": cfg.env.faults, "model": cfg.model.name, "seed": cfg.train.seed,
                   "variant": cfg.reflection.variant},
        # Tool-ReRL accounting (reflrl.recovery.RecoveryLedger): failures by cause, recovered by the client's
        # retries / by reflection, discarded, tool calls per learning signal, critic calls, importance weights
        "recovery": {"variant": cfg.reflection.variant, **RecoveryLedger(st.setdefault("recovery", {})).summary()},
    }


def format_by_gold_calls(s: dict[str, Any]) -> str | None:
    """One line: right answers per number of gold calls at each evaluation of the run, e.g.
    ``  right by gold calls (1 call / 2 calls / 3 calls): before 0/24, 0/15, 0/9 -> after warm-up 21/24,
    3/15, 1/9 -> after RL 21/24, 2/15, 1/9``; None when no evaluation recorded it."""
    stages = [(name, (s.get(key) or {}).get("by_gold_calls")) for name, key in
              (("before", "eval_before"), ("after warm-up", "eval_after_warmup"), ("after RL", "eval_after"))]
    stages = [(name, b) for name, b in stages if b]
    if not stages:
        return None
    kinds = sorted({k for _, b in stages for k in b}, key=int)
    head = " / ".join(f"{k} call{'' if k == '1' else 's'}" for k in kinds)
    return (f"  right by gold calls ({head}): "
            + " -> ".join(f"{name} " + ", ".join(f"{b[k][0]}/{b[k][1]}" if k in b else "-" for k in kinds)
                          for name, b in stages))


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed at the end of a run (its last line says whether the result is
    the recipe's: a time-budget cut is impossible to miss)."""
    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    f = s["faults"]
    fk = ", ".join(f"{k}={v}" for k, v in sorted(f["faults_by_kind"].items())) or "none"
    lines = [
        "",
        f"held-out accuracy: {pct(s['accuracy_before'])} -> {pct(s['accuracy_after'])}"
        f"  ({s['eval_after'].get('n', 0)} test tasks, greedy exact match)",
    ]
    if s.get("accuracy_after_warmup") is not None:
        gain = s.get("rl_gain")
        lines.append(f"  base model {pct(s['accuracy_before'])} -> after warm-up {pct(s['accuracy_after_warmup'])} "
                     f"-> after RL {pct(s['accuracy_after'])}"
                     + (f"  (RL gain {gain * 100:+.1f} points)" if gain is not None else ""))
    by_calls = format_by_gold_calls(s)
    if by_calls:
        lines.append(by_calls)
    if s.get("precision"):
        lines.append(f"{s['precision']['dtype']} on {s['precision']['cpu']}, {s.get('threads', '?')} threads "
                     f"(OpenMP wait policy {s.get('omp_wait_policy', '?')}) "
                     f"({s['precision']['reason']})")
    if s.get("format_rate_before") is not None:
        lines.append(f"format rate (sampled): {pct(s['format_rate_before'])} -> {pct(s.get('format_rate_after'))}"
                     f"  (warm-up {'ran' if s['warmup'].get('ran') else 'skipped'})")
    lines += [
        f"RL steps: {s['steps']} ({s['stop_reason']}); last rewards: "
        + ", ".join(f"{r:.2f}" for r in s["reward_per_step"][-5:]),
        f"tool calls: {f['calls']} ({f['attempts']} billed attempts, {f['retries']} retries); env faults seen: {fk}; "
        f"recovered {f['recovered']}, given up {f['given_up']} -> {s['masked_trajectories']} of "
        f"{s['trajectories']} rollouts masked (not penalised)",
    ]
    if s.get("recovery"):
        lines += format_recovery(s["recovery"], s["recovery"].get("variant", "grpo"))
    ev = s.get("eval_seconds") or {}
    lines += [
        "time: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in s["time_s"].items())
        + ("; evaluations: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in ev.items()) if ev else ""),
        f"run folder: {s['run_dir']}  (summary.json, metrics.jsonl, TensorBoard events, checkpoints/)",
    ]
    if s.get("report"):
        lines.append(f"report: {s['report']}  (plots: reward, accuracy, zero-variance prompts, faults and "
                     "recovery, time; open it in a browser)")
    cuts = s.get("budget_cuts") or []
    if cuts:
        lines += [f"WARNING: {budget_cut_text(c)}" for c in cuts]
        lines.append(f"RESULT INCOMPLETE: the time budget cut {', '.join(c['phase'] for c in cuts)}; "
                     f"exit status {EXIT_BUDGET_CUT}")
    elif s.get("stop_reason") == "rl_minutes":
        lines.append(f"result: RL stopped by train.rl_minutes after {s['steps']} steps ({s.get('rl_seconds', 0) / 60:.1f} "
                     "min of RL steps): a time-based stop, so the step count depends on this machine's speed and load")
    else:
        lines.append("result: the recipe ran whole (every planned step)")
    return "\n".join(lines)
