"""What a run reports at its end: the summary (``summary.json``) and the short human summary printed."""
from __future__ import annotations

from typing import Any, Sequence

from reflrl import config as C
from reflrl.budget import EXIT_BUDGET_CUT, budget_cut_text
from reflrl.precision import DtypeChoice
from reflrl.recovery import RecoveryLedger, format_recovery
from reflrl.rollout import API_CHANGE_KINDS
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


STAGES = (("before", "eval_before"), ("after_warmup", "eval_after_warmup"), ("after", "eval_after"))
# the API-change numbers of a held-out evaluation (reflrl.rollout.adaptation_outcomes)
ADAPTATION_KEYS = ("adaptation", *(f"adaptation_{k}" for k in API_CHANGE_KINDS), "n_changed", "n_change_recoverable",
                   *(f"n_change_recoverable_{k}" for k in API_CHANGE_KINDS))


def heldout_numbers(ev: dict[str, Any] | None, faults: bool) -> dict[str, Any] | None:
    """The held-out numbers of one evaluation (base, after the warm-up, after RL): ``accuracy`` (overall:
    the share of episodes that ended right under the run's faults, or the greedy first answer's exact
    match without faults), ``clean_accuracy`` (episodes that met no fault), ``recovery_under_faults`` (of
    the episodes that met at least one fault, the share that still ended right; None without faults),
    reflection's repair rate on the failed episodes by cause (``reflection_ratio_env_fault`` /
    ``_policy_error``, None when the variant does not reflect), adaptation to API changes (``adaptation``
    and ``adaptation_<kind>``: of the episodes whose call at the change was right apart from it, the share
    that ended right; None when no episode met one) and the counts behind them."""
    if not ev:
        return None
    if not faults or "clean_accuracy" not in ev:
        return {"accuracy": ev.get("accuracy"), "clean_accuracy": ev.get("accuracy"), "recovery_under_faults": None,
                "n": ev.get("n"), "n_clean": ev.get("n"), "n_faulted": 0,
                "reflection_ratio_env_fault": None, "reflection_ratio_policy_error": None}
    return {"accuracy": ev.get("episode_accuracy", ev.get("accuracy")),
            "first_answer_accuracy": ev.get("first_answer_accuracy"),
            "clean_accuracy": ev.get("clean_accuracy"), "recovery_under_faults": ev.get("recovery_under_faults"),
            "recoverable_under_faults": ev.get("recoverable_under_faults"),
            **{k: ev.get(k) for k in ADAPTATION_KEYS},
            "n": ev.get("n_episodes", ev.get("n")), "n_clean": ev.get("n_clean"), "n_faulted": ev.get("n_faulted"),
            "recovered_by_policy": ev.get("recovered_by_policy"),
            "masked": ev.get("masked"), "eval_fault_seed": ev.get("eval_fault_seed"),
            **{k: ev.get(k) for k in ("reflection_ratio_env_fault", "reflection_ratio_policy_error",
                                      "reflected_env_fault", "recovered_env_fault", "reflected_policy_error",
                                      "recovered_policy_error")}}


def time_split(st: dict[str, Any], *, load_s: float, elapsed_s: float) -> dict[str, Any]:
    """Where the run's wall time went: loading the model, the held-out evaluations (with the warm-up's
    format probes and validation), the warm-up, the RL steps, and the rest (run folder, checkpoints,
    report); each in seconds and as a share of the total. ``rl_share``: the RL steps' share."""
    t = st.get("timers", {})
    parts = {"load_s": float(load_s), "eval_s": float(t.get("eval_s", 0.0)),
             "warmup_s": float(t.get("warmup_s", 0.0)), "rl_s": float(st.get("rl_seconds", 0.0))}
    total = max(float(elapsed_s), 1e-9)
    parts["other_s"] = max(0.0, float(elapsed_s) - sum(parts.values()))
    out: dict[str, Any] = {k: round(v, 1) for k, v in parts.items()}
    out["total_s"] = round(float(elapsed_s), 1)
    out.update({f"{k[:-2]}_share": round(v / total, 4) for k, v in parts.items()})
    return out


def build_summary(st: dict[str, Any], *, cfg: C.Config, run_dir: str, step: int, precision: DtypeChoice,
                  load_s: float, decode_weights: Any = None, decode_attention: Any = None, decode_matmul: Any = None, elapsed_s: float, prefilter_skipped: dict[int, int], sampling: Any,
                  faults: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a run from its state (``st``: the trainer's checkpointed state)."""
    before, after = st.get("eval_before") or {}, st.get("eval_after") or {}
    wu = st.get("warmup") or {}
    mid = st.get("eval_after_warmup") or {}
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
        "decode_weights": None if decode_weights is None else decode_weights.to_dict(),
        "decode_attention": None if decode_attention is None else decode_attention.to_dict(),
        "decode_matmul": None if decode_matmul is None else decode_matmul.to_dict(),
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
        # per evaluation: overall accuracy, accuracy with no fault met, recovery under faults, reflection's
        # repair rate by cause (env.fault_exposure says who met the faults)
        "heldout": {name: heldout_numbers(st.get(key), bool(cfg.env.faults)) for name, key in STAGES},
        "fault_exposure": cfg.env.fault_exposure,
        "train_faults": C.train_faults(cfg.env),
        # the wall time by phase: load, evaluations, warm-up, RL steps (rl_share: RL's part of the run)
        "time_split": time_split(st, load_s=load_s, elapsed_s=elapsed_s),
        # peak resident memory (MB) by phase and of the run (reflrl.memory.PeakMemory)
        "peak_rss_mb": peak_memory(st),
    }


MEMORY_PHASES = (("load", "load"), ("evaluations", "eval"), ("warm-up", "warmup"), ("RL", "rl"))


def peak_memory(st: dict[str, Any]) -> dict[str, Any] | None:
    """``{"load": MB, "eval": MB, "warmup": MB, "rl": MB, "run": MB}`` of the phases that ran (``run``: the
    largest), or None where none was measured."""
    p = {k: v for k, v in (st.get("peak_rss_mb") or {}).items() if isinstance(v, (int, float))}
    return {**p, "run": max(p.values())} if p else None


def format_peak_memory(s: dict[str, Any]) -> str | None:
    """``peak memory (resident): load 0.9 GB, evaluations 3.1 GB, warm-up 2.6 GB, RL 3.4 GB; the run 3.4 GB``;
    None for a summary without it."""
    p = s.get("peak_rss_mb")
    if not p:
        return None
    parts = [f"{name} {p[k] / 1000:.2f} GB" for name, k in MEMORY_PHASES if k in p]
    return "peak memory (resident): " + ", ".join(parts) + f"; the run {p['run'] / 1000:.2f} GB"


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


HELDOUT_LINES = (("no fault met", "clean_accuracy"),
                 ("recovery under faults", "recovery_under_faults"),
                 ("recoverable (answer at the fault right)", "recoverable_under_faults"),
                 ("adaptation to API changes", "adaptation"),
                 *((f"adaptation, {k.replace('_', ' ')}", f"adaptation_{k}") for k in API_CHANGE_KINDS),
                 ("reflection repaired, fault-caused failures", "reflection_ratio_env_fault"),
                 ("reflection repaired, policy errors", "reflection_ratio_policy_error"))


def format_heldout(s: dict[str, Any]) -> list[str]:
    """Lines: one per held-out metric, its three points base -> after warm-up -> after RL (the stages the
    run evaluated) and RL's gain over the warm-up: no fault met, recovery under faults, adaptation to API
    changes (overall and per kind, only where an evaluation's episodes met one), reflection's repair rate
    by cause (the overall accuracy has its own line); none when the run had no faults."""
    h = {k: v for k, v in (s.get("heldout") or {}).items() if v}
    if not h or not any("first_answer_accuracy" in v for v in h.values()):
        return []

    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    names = {"before": "base", "after_warmup": "after warm-up", "after": "after RL"}
    seed = next((v.get("eval_fault_seed") for v in h.values() if v.get("eval_fault_seed") is not None), None)
    out = [f"  under the run's faults ({s.get('fault_exposure', 'client')} sees them; evaluation fault seed {seed}):"]
    for label, key in HELDOUT_LINES:
        vals = [(names[k], h[k].get(key), h[k]) for k in ("before", "after_warmup", "after") if k in h]
        if all(v is None for _n, v, _h in vals):
            continue
        line = f"    {label}: " + " -> ".join(f"{n} {pct(v)}" + _count(key, e) for n, v, e in vals)
        w, a = (h.get("after_warmup") or {}).get(key), (h.get("after") or {}).get(key)
        if w is not None and a is not None:
            line += f"  (RL {(a - w) * 100:+.1f} points)"
        out.append(line)
    return out


def _count(key: str, e: dict[str, Any]) -> str:
    """`` (n of m)``: the episodes behind a held-out number (none for the overall accuracy)."""
    of = {"clean_accuracy": "n_clean", "recovery_under_faults": "n_faulted",
          "adaptation": "n_change_recoverable",
          **{f"adaptation_{k}": f"n_change_recoverable_{k}" for k in API_CHANGE_KINDS},
          "reflection_ratio_env_fault": "reflected_env_fault",
          "reflection_ratio_policy_error": "reflected_policy_error"}.get(key)
    return f" (of {e[of]:.0f})" if of and isinstance(e.get(of), (int, float)) else ""


def format_warmup_examples(wu: dict[str, Any]) -> str:
    """``warm-up demonstrations: 512 gold answers of fault-free episodes and 512 critique-following
    examples (...; trained on 118 and 122); 0 showed a fault or a recovery``: the warm-up's examples of
    each kind (warmup.critique_share), how many of each its steps drew, and how many showed a tool fault."""
    crit = wu.get("critique_examples") or 0
    line = f"warm-up demonstrations: {wu['demonstrations']} gold answers of fault-free episodes"
    if crit:
        trained = wu.get("sft_trained_by_kind") or {}
        line += (f" and {crit} critique-following examples (the retry prompt of a policy error, its critique "
                 f"naming the fix -> the gold call)")
        if trained:
            line += f"; trained on {trained.get('demonstration', 0)} and {trained.get('critique', 0)}"
    if wu.get("renamed_examples"):
        line += f"; {wu['renamed_examples']} gold answers on a catalogue with one name renamed"
    return line + f"; {wu.get('demonstrations_with_fault', 0)} showed a fault or a recovery from one"


def format_time_split(s: dict[str, Any]) -> str | None:
    """``time split: load 20s (4%), evaluations 60s (12%), warm-up 100s (20%), RL 300s (60%), other 20s
    (4%) of 500s; RL 60% of the run``; None for a summary without it."""
    t = s.get("time_split")
    if not t:
        return None
    parts = [("load", "load"), ("evaluations", "eval"), ("warm-up", "warmup"), ("RL", "rl"), ("other", "other")]
    return ("time split: " + ", ".join(f"{name} {t[k + '_s']:.0f}s ({t[k + '_share']:.0%})" for name, k in parts
                                       if k + "_s" in t)
            + f" of {t['total_s']:.0f}s; RL {t['rl_share']:.0%} of the run")


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
        f"  ({s['eval_after'].get('n', 0)} test tasks, greedy exact match"
        + (", episodes under the run's faults)" if (s.get("config") or {}).get("faults") else ")"),
    ]
    if s.get("accuracy_after_warmup") is not None:
        gain = s.get("rl_gain")
        lines.append(f"  base model {pct(s['accuracy_before'])} -> after warm-up {pct(s['accuracy_after_warmup'])} "
                     f"-> after RL {pct(s['accuracy_after'])}"
                     + (f"  (RL gain {gain * 100:+.1f} points)" if gain is not None else ""))
    lines += format_heldout(s)
    by_calls = format_by_gold_calls(s)
    if by_calls:
        lines.append(by_calls)
    if s.get("precision"):
        lines.append(f"{s['precision']['dtype']} on {s['precision']['cpu']}, {s.get('threads', '?')} threads "
                     f"(OpenMP wait policy {s.get('omp_wait_policy', '?')}) "
                     f"({s['precision']['reason']})")
    wu = s.get("warmup") or {}
    if wu.get("demonstrations") is not None:
        lines.append(format_warmup_examples(wu))
    if s.get("format_rate_before") is not None:
        lines.append(f"format rate (sampled): {pct(s['format_rate_before'])} -> {pct(s.get('format_rate_after'))}"
                     f"  (warm-up {'ran' if s['warmup'].get('ran') else 'skipped'})")
    zv = [float(v) for v in (s.get("zero_var_ratio_per_step") or [])]
    lines += [
        f"RL steps: {s['steps']} ({s['stop_reason']}); last rewards: "
        + ", ".join(f"{r:.2f}" for r in s["reward_per_step"][-5:])
        + (f"; steps without signal (every group's rewards equal): {sum(v >= 1.0 for v in zv)} of {len(zv)}"
           if zv else ""),
        f"tool calls: {f['calls']} ({f['attempts']} billed attempts, {f['retries']} retries); env faults seen: {fk}; "
        f"recovered {f['recovered']}, given up {f['given_up']} -> {s['masked_trajectories']} of "
        f"{s['trajectories']} rollouts masked (not penalised)",
    ]
    if s.get("recovery"):
        lines += format_recovery(s["recovery"], s["recovery"].get("variant", "grpo"))
    ev = s.get("eval_seconds") or {}
    split = format_time_split(s)
    if split:
        lines.append(split)
    mem = format_peak_memory(s)
    if mem:
        lines.append(mem)
    lines += [
        "time: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in s["time_s"].items())
        + ("; evaluations: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in ev.items()) if ev else ""),
        f"run folder: {s['run_dir']}  (summary.json, metrics.jsonl, TensorBoard events, checkpoints/)",
    ]
    if s.get("report"):
        lines.append(f"report: {s['report']}  (plots: reward, accuracy, learning curves, zero-variance prompts, faults and "
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
