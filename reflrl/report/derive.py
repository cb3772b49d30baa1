"""Numbers the report plots, derived from a run's metrics rows and summary (pure functions).

Metric keys written by different parts of the trainer are looked up through the candidate lists
below, so a run that lacks a key (an older run, a method without reflection) gives ``None`` and the
report says "not recorded in this run" instead of failing.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .data import RunData

# Tool-ReRL importance weights of repaired trajectories (reflrl.algos.importance: "rerl/weight_*")
IW_MEAN_KEYS = ("rerl/weight_mean", "importance_weight_mean", "is_weight_mean", "iw_mean")
IW_STD_KEYS = ("rerl/weight_std", "importance_weight_std", "is_weight_std", "iw_std")
# summary entries shown in the report's reflection table (reflrl.recovery's accounting)
REFLECTION_KEY_RE = re.compile(r"reflect|rerl|critic|repair|importance|recover|variant|signal|weight", re.I)


def find_key(rows: Sequence[dict[str, Any]], candidates: Iterable[str]) -> str | None:
    """The first candidate key that has a number in some row."""
    for k in candidates:
        if any(_num(r.get(k)) is not None for r in rows):
            return k
    return None


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)) and math.isfinite(float(x)):
        return float(x)
    return None


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where ``key`` is a finite number."""
    xs, ys = [], []
    for r in rows:
        v = _num(r.get(key))
        if v is not None:
            xs.append(int(r["step"]))
            ys.append(v)
    return xs, ys


def total(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [v for v in (_num(r.get(key)) for r in rows) if v is not None]
    return sum(vals) if vals else None


# ============================================================================ efficiency paper (arXiv:2606.00135) Fig. 4
@dataclass
class ZeroVariance:
    """Per training step: share of prompt groups with zero reward variance (no learning signal),
    and among all groups the share whose live rollouts were all correct (efficiency paper, arXiv:2606.00135, Fig. 4's orange)."""

    steps: list[int]
    zero_var: list[float]
    all_correct_steps: list[int]
    all_correct: list[float]


def zero_variance(rows: Sequence[dict[str, Any]]) -> ZeroVariance | None:
    steps, zv = series(rows, "zero_var_ratio")
    if not steps:
        return None
    ac_s, ac = [], []
    for r in rows:
        flags = [f for f in (r.get("group_all_correct") or []) if f is not None]
        if flags:
            ac_s.append(int(r["step"]))
            ac.append(sum(bool(f) for f in flags) / len(flags))
    return ZeroVariance(steps, zv, ac_s, ac)


# ============================================================================ efficiency paper (arXiv:2606.00135) Fig. 5
@dataclass
class Stability:
    """P(still all-correct | all-correct in the previous k observations) per epoch, with the number
    of prompts conditioned on (efficiency paper, arXiv:2606.00135, sec. 4.1, Fig. 5)."""

    k: int
    epochs: list[int]
    prob: list[float]
    n: list[int]


def temporal_stability(rows: Sequence[dict[str, Any]], ks: Sequence[int] = (1, 2)) -> list[Stability] | None:
    """From each training row's ``task_ids`` and ``group_all_correct`` (aligned lists) and ``epoch``.

    A prompt's observation in an epoch is "all-correct" when every live rollout of every group it
    had that epoch was correct (groups whose rollouts were all masked are no observation). The
    paper conditions on the previous k consecutive epochs; with the pre-rollout filter on, a
    prompt skipped in an epoch has no observation there, so here the condition is its previous k
    *observations* (the question the filter asks: is a prompt that was all-correct still
    all-correct when it is next rolled out?). Returns None when the rows lack the flags.
    """
    per_task: dict[str, dict[int, bool]] = defaultdict(dict)
    seen_flags = False
    for r in rows:
        ids, flags = r.get("task_ids"), r.get("group_all_correct")
        if not isinstance(ids, list) or not isinstance(flags, list) or len(ids) != len(flags):
            continue
        seen_flags = True
        ep = int(r.get("epoch", 0) or 0)
        for tid, f in zip(ids, flags):
            if f is None:
                continue
            obs = per_task[str(tid)]
            obs[ep] = obs.get(ep, True) and bool(f)
    if not seen_flags:
        return None
    out = []
    for k in ks:
        n: dict[int, int] = defaultdict(int)
        stay: dict[int, int] = defaultdict(int)
        for obs in per_task.values():
            eps = sorted(obs)
            for i in range(k, len(eps)):
                if all(obs[eps[j]] for j in range(i - k, i)):
                    n[eps[i]] += 1
                    stay[eps[i]] += int(obs[eps[i]])
        epochs = sorted(n)
        out.append(Stability(k, epochs, [stay[e] / n[e] for e in epochs], [n[e] for e in epochs]))
    return out


# ============================================================================ failures and recovery
ROLLOUT_COUNTS = ("rollouts", "failed", "failed_env_fault", "failed_policy_error", "recovered_by_retry",
                  "recovered_by_policy", "recovered_by_reflection", "recovered_env_fault", "recovered_policy_error", "discarded")


@dataclass
class Recovery:
    """Failures by cause and what became of them, for one run.

    Tool calls (the fault ledger): ``faults_by_kind`` (env faults observed per attempt),
    ``calls_recovered`` (hit a fault, then succeeded within the client's retries), ``calls_given_up``,
    ``calls_policy_errors``. Rollouts (``reflrl.recovery``'s triage, summary ``recovery`` or per-step
    ``reflect/*``; empty when not recorded): ``failed_env_fault`` (unrecovered env fault after the
    retries: masked), ``failed_policy_error`` (wrong, unparseable or no call), ``recovered_by_retry``
    (an env fault the retries recovered, answer right), ``recovered_by_policy`` (faults the policy sees: it
    was shown a fault, called again and ended right), ``recovered_by_reflection`` and its split
    ``recovered_env_fault`` / ``recovered_policy_error`` (Tool-ReRL sec. 3.2).
    """

    faults_by_kind: dict[str, int]
    calls: int | None
    attempts: int | None
    calls_recovered: int | None
    calls_given_up: int | None
    calls_policy_errors: int | None
    masked: int | None
    rollouts: dict[str, float]          # ROLLOUT_COUNTS -> count ({} = not recorded)
    source: str                         # where ``rollouts`` came from

    @property
    def recovered_ratio(self) -> tuple[float | None, str]:
        """(recovered-trajectory ratio, unit). Over rollouts that went wrong at some point (an env
        fault, recovered by the retries, by the policy or not, or a policy error): the share that ended
        usable, recovered by the client's retries, by the policy calling again or by reflection::

            (recovered_by_retry + recovered_by_policy + recovered_by_reflection)
                / (recovered_by_retry + recovered_by_policy + failed)

        Without rollout counts (older runs): tool calls recovered / (recovered + given up)."""
        r = self.rollouts
        if r:
            done = r.get("recovered_by_retry", 0) + r.get("recovered_by_policy", 0)
            den = done + r.get("failed", 0)
            num = done + r.get("recovered_by_reflection", 0)
            return (num / den if den else None), "rollouts"
        if self.calls_recovered is not None and self.calls_given_up is not None:
            d = self.calls_recovered + self.calls_given_up
            return (self.calls_recovered / d if d else None), "tool calls"
        return None, "not recorded"


def recovery(run: RunData) -> Recovery:
    s = run.summary or {}
    f = s.get("faults") or {}
    rows = run.train_rows()
    counts: dict[str, float] = {}
    source = "not recorded"
    rec = s.get("recovery")
    if isinstance(rec, dict) and any(_num(rec.get(k)) is not None for k in ROLLOUT_COUNTS):
        counts = {k: float(rec.get(k) or 0) for k in ROLLOUT_COUNTS}
        source = "summary.json recovery"
    elif any(f"reflect/{k}" in r for r in rows for k in ROLLOUT_COUNTS):
        counts = {k: float(total(rows, f"reflect/{k}") or 0) for k in ROLLOUT_COUNTS}
        source = "metrics.jsonl reflect/*"
    masked = s.get("masked_trajectories")
    if masked is None:
        masked = total(rows, "masked")

    def i(x: Any) -> int | None:
        return None if _num(x) is None else int(x)

    return Recovery(
        faults_by_kind={str(k): int(v) for k, v in (f.get("faults_by_kind") or {}).items()},
        calls=i(f.get("calls")), attempts=i(f.get("attempts")), calls_recovered=i(f.get("recovered")),
        calls_given_up=i(f.get("given_up")), calls_policy_errors=i(f.get("policy_errors")),
        masked=i(masked), rollouts=counts, source=source)


def calls_per_signal(run: RunData) -> tuple[float | None, float | None, float | None]:
    """(tool calls per learning signal, calls, signals).

    From ``reflrl.recovery``'s accounting when recorded: tool calls of the rollouts and of the
    reflection retries per trajectory with a learning signal (a non-zero advantage that was
    trained). Otherwise: billed attempts of the fault ledger (retries included) per prompt group
    that gave a non-zero gradient (``groups_trained``)."""
    rec = (run.summary or {}).get("recovery")
    rows = run.train_rows()
    if isinstance(rec, dict) and _num(rec.get("tool_calls")) is not None:
        calls, sig = float(rec["tool_calls"]), _num(rec.get("signal_trajectories"))
    elif any(_num(r.get("tool_calls")) is not None for r in rows):
        calls, sig = total(rows, "tool_calls"), total(rows, "signal_trajectories")
    else:
        calls = _num((run.summary or {}).get("faults", {}).get("attempts"))
        sig = total(rows, "groups_trained")
    if calls is None or sig is None:
        return None, calls, sig
    return (calls / sig if sig > 0 else None), calls, sig


def reflection_accounting(run: RunData) -> dict[str, Any]:
    """Summary entries about reflection (Tool-ReRL): the scalars of summary ``recovery`` (written by
    ``reflrl.recovery.RecoveryLedger``), else any summary key mentioning reflection, critic, repair,
    importance weights or recovery; flattened (``a.b``)."""
    out: dict[str, Any] = {}

    def walk(d: Any, prefix: str) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(d, (int, float, str, bool)) or d is None:
            out[prefix] = d

    s = run.summary or {}
    if isinstance(s.get("recovery"), dict):  # reflrl.recovery's run-level accounting
        walk(s["recovery"], "")
    else:
        walk(s, "")
        out = {k: v for k, v in out.items() if REFLECTION_KEY_RE.search(k)}
    return out


# ============================================================================ accuracy
@dataclass
class Accuracy:
    """Held-out accuracy: the base model (before any training), the RL curve on the test split (after
    the warm-up at step 0, then after RL; with standard errors) and validation accuracy over RL steps.

    ``test_*`` starts at the warm-up's result when the run evaluated it, so the curve over RL steps
    shows what RL added; ``base`` is the untrained model's accuracy (the warm-up's starting point)."""

    test_steps: list[int]
    test_acc: list[float]
    test_err: list[float]
    val_steps: list[int]
    val_acc: list[float]
    base: float | None = None


def accuracy(run: RunData) -> Accuracy:
    ts, ta, te = [], [], []
    base = warm = None
    for r in run.eval_rows():
        w = _num(r.get("test_after_warmup_accuracy"))
        if w is not None:
            warm = (int(r["step"]), w, _num(r.get("test_after_warmup_stderr")) or 0.0)
        a = _num(r.get("test_accuracy"))
        if a is not None:
            ts.append(int(r["step"]))
            ta.append(a)
            te.append(_num(r.get("test_stderr")) or 0.0)
    vs, va = series(run.eval_rows(), "val_accuracy")
    if not ts and run.summary:  # no metrics: the summary's before/after
        for step, key in ((0, "eval_before"), (run.summary.get("steps", 0), "eval_after")):
            ev = run.summary.get(key) or {}
            if _num(ev.get("accuracy")) is not None:
                ts.append(int(step))
                ta.append(float(ev["accuracy"]))
                te.append(_num(ev.get("stderr")) or 0.0)
        ev = run.summary.get("eval_after_warmup") or {}
        if _num(ev.get("accuracy")) is not None:
            warm = (0, float(ev["accuracy"]), _num(ev.get("stderr")) or 0.0)
    if warm is not None and ts and ts[0] == warm[0]:
        # the test point at step 0 is the base model's: RL starts from the warm-up's result instead
        base = ta[0]
        ts[0], ta[0], te[0] = warm
    return Accuracy(ts, ta, te, vs, va, base)


def mean_std(xs: Sequence[float]) -> tuple[float, float, int]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return math.nan, math.nan, 0
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd, len(xs)


# ============================================================================ held-out stages and learning curves
# (key, label): the held-out numbers a run reports at base / after the warm-up / after RL (summary ``heldout``)
HELDOUT_METRICS = (("accuracy", "overall accuracy"), ("clean_accuracy", "accuracy, no fault met"),
                   ("recovery_under_faults", "recovery under faults"),
                   ("adaptation", "adaptation to API changes"),
                   ("adaptation_param_renamed", "adaptation, param renamed"),
                   ("adaptation_tool_moved", "adaptation, tool moved"),
                   ("reflection_ratio_env_fault", "reflection's repair rate, fault-caused failures"),
                   ("reflection_ratio_policy_error", "reflection's repair rate, policy errors"))
HELDOUT_STAGES = (("before", "base"), ("after_warmup", "after warm-up"), ("after", "after RL"))
# per-step keys of the RL rollouts (metrics.jsonl) for each held-out metric
ROLLOUT_KEYS = {"accuracy": "rollout_accuracy", "clean_accuracy": "rollout_clean_accuracy",
                "recovery_under_faults": "rollout_recovery_under_faults",
                **{k: f"rollout_{k}" for k in ("adaptation", "adaptation_param_renamed", "adaptation_tool_moved")},
                "reflection_ratio_env_fault": "reflection_ratio_env_fault",
                "reflection_ratio_policy_error": "reflection_ratio_policy_error"}


def heldout_stages(run: RunData) -> dict[str, dict[str, float | None]]:
    """stage (``before`` / ``after_warmup`` / ``after``) -> metric (:data:`HELDOUT_METRICS`) -> value, for
    the stages the run evaluated: from summary ``heldout``, else from the eval rows of metrics.jsonl
    (``test_*`` at step 0 and the last step, ``test_after_warmup_*``). A run without faults has its
    accuracy as the no-fault accuracy and no recovery under faults."""
    out: dict[str, dict[str, float | None]] = {}
    h = (run.summary or {}).get("heldout")
    if isinstance(h, dict) and any(isinstance(v, dict) for v in h.values()):
        for stage, _ in HELDOUT_STAGES:
            v = h.get(stage)
            if isinstance(v, dict):
                out[stage] = {k: _num(v.get(k)) for k, _ in HELDOUT_METRICS}
        return out
    rows = run.eval_rows()
    faults = run.faults != "none"

    def pick(r: dict[str, Any], prefix: str) -> dict[str, float | None]:
        d = {k: _num(r.get(prefix + k)) for k, _ in HELDOUT_METRICS}
        if not faults and d["clean_accuracy"] is None:
            d["clean_accuracy"] = d["accuracy"]
        return d

    tests = [r for r in rows if _num(r.get("test_accuracy")) is not None]
    if tests:
        out["before"] = pick(tests[0], "test_")
        if len(tests) > 1:
            out["after"] = pick(tests[-1], "test_")
    warm = [r for r in rows if _num(r.get("test_after_warmup_accuracy")) is not None]
    if warm:
        out["after_warmup"] = pick(warm[-1], "test_after_warmup_")
    return {k: out[k] for k, _ in HELDOUT_STAGES if k in out}


@dataclass
class Curve:
    """One held-out metric over RL steps: the RL rollouts' value per step (``rollout_*``; the policy's own
    samples at the rollout temperature), the held-out points (``points``: (label, step, value) for base,
    after warm-up, after RL, greedy) and validation (``val_*``: the validation split when
    ``train.eval_every`` is set)."""

    key: str
    label: str
    rollout_steps: list[int]
    rollout: list[float]
    points: list[tuple[str, int, float]]
    val_steps: list[int]
    val: list[float]

    @property
    def empty(self) -> bool:
        return not self.rollout_steps and not self.points and not self.val_steps


def learning_curves(run: RunData) -> list[Curve]:
    """One :class:`Curve` per metric of :data:`HELDOUT_METRICS`: per-step values from the training rows,
    held-out points at step 0 (base, after warm-up) and at the last RL step (after RL), validation
    points from the eval rows."""
    rows, evals = run.train_rows(), run.eval_rows()
    stages = heldout_stages(run)
    last = (run.summary or {}).get("steps")
    if last is None:
        steps = [int(r["step"]) for r in rows] + [int(r["step"]) for r in evals]
        last = max(steps) if steps else 0
    where = {"before": 0, "after_warmup": 0, "after": int(last)}
    faults = run.faults != "none"
    out = []
    for key, label in HELDOUT_METRICS:
        rs, rv = series(rows, ROLLOUT_KEYS[key])
        if not rs and key in ("accuracy", "clean_accuracy") and not faults:
            rs, rv = series(rows, "correct_rate")  # a run without faults: every rollout is clean
        pts = [(name, where[stage], stages[stage][key]) for stage, name in HELDOUT_STAGES
               if stage in stages and stages[stage].get(key) is not None]
        vs, vv = series(evals, f"val_{key}")
        if not vs and key == "clean_accuracy" and not faults:
            vs, vv = series(evals, "val_accuracy")
        out.append(Curve(key, label, rs, rv, [(n, s, float(v)) for n, s, v in pts], vs, vv))
    return out
