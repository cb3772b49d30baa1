"""Synthetic run and sweep folders for the report tests: every metric the report reads, with
plausible numbers (reward rising, zero-variance share falling, importance weights decaying as in
Tool-ReRL Fig. 3), written the way reflrl.runlog and reflrl.experiment.sweep write them."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import yaml

TASKS = [f"syn-{i:03d}" for i in range(12)]


def make_run(path: Path, *, seed: int = 0, fault_rate: float = 0.1, reflection: bool = True,
             steps: int = 24, acc_after: float = 0.6) -> Path:
    rng = random.Random(seed * 1000 + int(fault_rate * 100) + reflection)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model": {"name": "tiny-random"}, "env": {"faults": f"rate_limit={fault_rate:g}" if fault_rate else "",
                                                    "reward": "binary"},
           "algo": {"advantage": "grpo", "policy_loss": "clipped"}, "train": {"seed": seed, "steps": steps},
           "reflection": {"variant": "tool_rerl" if reflection else "grpo"}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (path / "versions.json").write_text(json.dumps({"python": "3.11.7", "torch": "2.13.0", "reflrl": "0.1.0"}))
    rows = [{"step": 0, "phase": "eval", "test_accuracy": 0.2, "test_stderr": 0.05, "test_n": 40}]
    solved: set[str] = set()
    per_epoch = 4  # prompts per step; 12 tasks -> 3 steps per epoch
    for step in range(1, steps + 1):
        epoch = (step - 1) // 3
        start = ((step - 1) % 3) * per_epoch
        ids = TASKS[start:start + per_epoch]
        flags = []
        for t in ids:
            if t not in solved and rng.random() < 0.25:
                solved.add(t)
            elif t in solved and rng.random() < 0.1:
                solved.discard(t)
            flags.append(t in solved)
        progress = step / steps
        r = {"step": step, "phase": "train", "epoch": epoch, "task_ids": ids, "group_all_correct": flags,
             "reward_mean": 0.2 + 0.5 * progress + rng.uniform(-0.05, 0.05),
             "correct_rate": 0.2 + 0.5 * progress, "zero_var_ratio": max(0.0, 0.8 - 0.5 * progress),
             "masked": rng.randint(0, 2), "groups_trained": rng.randint(1, 4), "time_rollout_s": 2 + rng.random(),
             "time_update_s": 1 + rng.random(), "reflect/failed": 6, "reflect/recovered_by_retry": 2,
             "tool_calls": 20, "signal_trajectories": 8,
             # the held-out numbers on the step's own rollouts (reflrl.rollout.rollout_stats, step_accounting)
             "rollout_accuracy": 0.18 + 0.5 * progress, "rollout_clean_accuracy": 0.25 + 0.5 * progress,
             "rollout_recovery_under_faults": 0.1 + 0.6 * progress if fault_rate else None,
             "reflection_ratio_env_fault": (0.3 + 0.4 * progress) if reflection and fault_rate else None,
             "reflection_ratio_policy_error": 0.1 + 0.05 * rng.random() if reflection else None}
        if reflection:
            r["rerl/weight_mean"] = 0.12 * math.exp(-step / 6) + 0.015
            r["rerl/weight_std"] = 0.3 * r["rerl/weight_mean"]
        rows.append(r)
        if step % 8 == 0:
            rows.append({"step": step, "phase": "eval", "val_accuracy": 0.2 + 0.4 * progress, "val_n": 20,
                         "val_clean_accuracy": 0.25 + 0.4 * progress,
                         "val_recovery_under_faults": 0.1 + 0.5 * progress if fault_rate else None})
    rows.append({"step": steps, "phase": "eval", "test_accuracy": acc_after, "test_stderr": 0.06, "test_n": 40})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refl = 30.0 if reflection else 0.0
    summary = {
        "run_dir": str(path), "accuracy_before": 0.2, "accuracy_after": acc_after, "steps": steps,
        "stop_reason": "steps", "eval_after": {"n": 40}, "trajectories": 24 * 16, "masked_trajectories": 9,
        "faults": {"calls": 400, "attempts": 460, "retries": 60, "recovered": 45, "given_up": 9,
                   "policy_errors": 70, "faults_by_kind": {"rate_limit": 50, "timeout": 4},
                   "injected_by_kind": {"rate_limit": 50, "timeout": 4}},
        "time_s": {"rollout_s": 60.0, "update_s": 30.0, "eval_s": 10.0, "warmup_s": 0.0, "load_s": 4.0,
                   "total_s": 110.0},
        "config": {"faults": cfg["env"]["faults"], "model": "tiny-random", "seed": seed},
        "heldout": {stage: {"accuracy": acc, "clean_accuracy": acc + 0.05,
                            "recovery_under_faults": rec if fault_rate else None, "n": 40, "n_clean": 30,
                            "n_faulted": 10 if fault_rate else 0,
                            "reflection_ratio_env_fault": (rec + 0.1) if reflection and fault_rate else None,
                            "reflection_ratio_policy_error": 0.1 if reflection else None, "eval_fault_seed": 1234}
                    for stage, acc, rec in (("before", 0.2, 0.0), ("after_warmup", 0.45, 0.2),
                                            ("after", acc_after, 0.5))},
        "peak_rss_mb": {"load": 900.0, "eval": 3100.0, "rl": 3400.0, "run": 3400.0},
        "time_split": {"load_s": 4.0, "eval_s": 10.0, "warmup_s": 0.0, "rl_s": 90.0, "other_s": 6.0,
                       "total_s": 110.0, "load_share": 4 / 110, "eval_share": 10 / 110, "warmup_share": 0.0,
                       "rl_share": 90 / 110, "other_share": 6 / 110},
        "recovery": {"variant": cfg["reflection"]["variant"], "rollouts": 384.0, "failed": 140.0,
                     "failed_env_fault": 9.0 + 0.2 * refl, "failed_policy_error": 131.0 - 0.2 * refl,
                     "recovered_by_retry": 40 * (1 + fault_rate), "reflected": refl * 1.5,
                     "recovered_by_reflection": refl, "recovered_env_fault": 0.2 * refl,
                     "recovered_policy_error": 0.8 * refl, "unrecovered": 140 - refl, "discarded": 9.0,
                     "recovered_ratio": refl / 140, "tool_calls": 480.0 + 100 * fault_rate,
                     "signal_trajectories": 64.0 + rng.randint(-5, 5), "tool_calls_per_signal": 7.5,
                     "critic_calls": refl * 1.5},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def make_sweep(path: Path, methods=("grpo", "tool_rerl"), rates=(0.0, 0.1, 0.3), seeds=(0, 1)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cells = []
    for rate in rates:
        spec = f"rate_limit={rate:g}" if rate else "none"
        for m in methods:
            for s in seeds:
                cid = f"{m}__{spec.replace('=', '-')}__s{s}"
                make_run(path / "cells" / cid, seed=s, fault_rate=rate, reflection=m == "tool_rerl",
                         acc_after=0.6 - rate * (0.5 if m == "grpo" else 0.2) + 0.03 * s)
                cells.append({"id": cid, "method": m, "faults": spec, "rates": {"rate_limit": rate}, "seed": s,
                              "run_dir": f"cells/{cid}", "status": "done", "attempts": 1, "wall_s": 100.0})
    manifest = {"version": 1, "kind": "fault_sweep", "created": "2026-01-01T00:00:00", "updated": "2026-01-01T01:00:00",
                "spec": {"methods": list(methods), "faults": "rate_limit=" + ",".join(f"{r:g}" for r in rates),
                         "grid": "per-kind", "seeds": list(seeds), "budget_minutes": 1, "config": None,
                         "overrides": []},
                "cells": cells}
    (path / "sweep.json").write_text(json.dumps(manifest))
    (path / "configs").mkdir(exist_ok=True)
    for m in methods:
        (path / "configs" / f"{m}.yaml").write_text(f"base: /x/configs/{m}.yaml\n")
    return path
