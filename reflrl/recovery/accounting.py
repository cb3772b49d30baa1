"""Tool-ReRL's accounting: failures by cause, recovered by the client's retries and by reflection,
discarded, tool calls per trajectory with a learning signal, critic calls, importance weights."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from reflrl import rollout as R
from reflrl.critic.base import CriticStats

from .reflection import RepairRecord


def triage(t: R.Trajectory) -> str:
    """"ok" | "recovered_by_retry" (env faults the client's retries recovered, answer right) |
    "recovered_by_policy" (faults the policy sees: a fault came back as the tool's answer and the policy
    itself ended right, by calling again) | "env_fault" (an unrecovered env fault: masked; or, with faults
    the policy sees, a wrong answer that would have been right had the policy called its faulted calls
    again: ``fault_caused``) | "policy_error" (wrong, unparseable or no call)."""
    if t.masked:
        return "env_fault"
    if not t.correct:
        return "env_fault" if t.last is not None and t.last.info.get("fault_caused") else "policy_error"
    if t.recovered_by_policy:
        return "recovered_by_policy"
    last = t.last
    return "recovered_by_retry" if last is not None and last.env_fault_treatment == "retried-recovered" else "ok"


COUNT_KEYS = ("rollouts", "failed", "failed_env_fault", "failed_policy_error", "recovered_by_retry",
              "recovered_by_policy",
              "reflected", "reflected_env_fault", "reflected_policy_error",
              "recovered_by_reflection", "recovered_env_fault", "recovered_policy_error",
              "unrecovered", "discarded", "retries", "generate_calls", "reflection_errors",
              "rollout_tool_calls", "reflection_tool_calls")


@dataclass
class RecoveryResult:
    """What :func:`arecover` did in one round: the repaired rollouts (already swapped into the list
    given), the records, the counts of :data:`COUNT_KEYS`, critic stats and timings."""

    records: list[RepairRecord]
    counts: dict[str, float]
    critic: CriticStats
    seconds: float = 0.0
    generate_s: float = 0.0
    errors: list[str] | None = None

    def metrics(self) -> dict[str, float]:
        m = {f"reflect/{k}": float(v) for k, v in self.counts.items()}
        m.update(self.critic.as_metrics("critic/"))
        m["reflect/time_s"] = self.seconds
        m["reflect/time_generate_s"] = self.generate_s
        return m


def own_rollouts(trajs: Sequence[R.Trajectory]) -> list[R.Trajectory]:
    """The policy's own samples among ``trajs``: a repair that replaced a failure stands for that
    failure, a repair added beside it is left out (for the pre-rollout filter and reward metrics)."""
    out = []
    for t in trajs:
        if t.original is None:
            out.append(t)
        elif not t.added:
            out.append(t.original)
    return out


def count_rollouts(trajs: Sequence[R.Trajectory]) -> dict[str, float]:
    """The counts of :data:`COUNT_KEYS` for rollouts with no reflection (variants without it)."""
    c = {k: 0.0 for k in COUNT_KEYS}
    for t in trajs:
        c["rollouts"] += 1
        c["rollout_tool_calls"] += float(t.last.billed_calls if t.last else 0)
        tri = triage(t)
        if tri in ("recovered_by_retry", "recovered_by_policy"):
            c[tri] += 1
        elif tri != "ok":
            c["failed"] += 1
            c[f"failed_{tri}"] += 1
            c["unrecovered"] += 1
            c["discarded"] += tri == "env_fault"
    return c


def step_accounting(recoveries: Sequence[RecoveryResult], rollouts: Sequence[R.Trajectory], signal: int
                    ) -> tuple[dict[str, float], dict[str, Any]]:
    """(counts, metrics) of one training step: the rounds' :class:`RecoveryResult` summed (or, with no
    reflection, :func:`count_rollouts` of the step's own rollouts), plus tool calls per trajectory with
    a learning signal (``signal``: rollouts with a non-zero advantage that were trained, or 2 per DPO
    pair) and critic calls/latency (``critic/*``)."""
    if recoveries:
        counts = {k: sum(float(r.counts[k]) for r in recoveries) for k in COUNT_KEYS}
    else:
        counts = count_rollouts(own_rollouts(rollouts))
    m = {f"reflect/{k}": v for k, v in counts.items()}
    tool_calls = counts["rollout_tool_calls"] + counts["reflection_tool_calls"]
    m["tool_calls"] = tool_calls
    m["signal_trajectories"] = float(signal)
    m["tool_calls_per_signal"] = tool_calls / signal if signal else None
    for cause in ("env_fault", "policy_error"):  # reflection's repair rate this step, by cause
        of = counts[f"reflected_{cause}"]
        m[f"reflection_ratio_{cause}"] = counts[f"recovered_{cause}"] / of if of else None
    if recoveries:
        cs = CriticStats()
        for r in recoveries:
            for k in ("calls", "positive", "negative", "unparseable", "errors"):
                setattr(cs, k, getattr(cs, k) + getattr(r.critic, k))
            cs.latency_s += r.critic.latency_s
            cs.max_latency_s = max(cs.max_latency_s, r.critic.max_latency_s)
        m.update(cs.as_metrics("critic/"))
        m["reflect/time_s"] = sum(r.seconds for r in recoveries)
        m["reflect/time_generate_s"] = sum(r.generate_s for r in recoveries)
    return counts, m


class RecoveryLedger:
    """Sums the per-step accounting into the run's (JSON state kept in checkpoints)."""

    def __init__(self, state: dict[str, Any]):
        self.s = state
        self.s.setdefault("counts", {k: 0.0 for k in COUNT_KEYS})
        for k in COUNT_KEYS:
            self.s["counts"].setdefault(k, 0.0)
        for k in ("signal_trajectories", "tool_calls", "critic_calls", "critic_latency_s", "critic_unparseable",
                  "critic_errors"):
            self.s.setdefault(k, 0.0)
        self.s.setdefault("weight_mean_per_step", [])
        self.s.setdefault("weight_std_per_step", [])

    def add_step(self, counts: dict[str, float], critics: Sequence[CriticStats], signal: int,
                 metrics: dict[str, Any]) -> None:
        """Add one step: its counts (:func:`step_accounting`), critic stats, trajectories with a
        learning signal and the update's ``rerl/*`` weight metrics."""
        for k, v in counts.items():
            self.s["counts"][k] += float(v)
        for cs in critics:
            self.s["critic_calls"] += cs.calls
            self.s["critic_latency_s"] += cs.latency_s
            self.s["critic_unparseable"] += cs.unparseable
            self.s["critic_errors"] += cs.errors
        self.add_update(signal, metrics)

    def add_update(self, signal: int, metrics: dict[str, Any]) -> None:
        self.s["signal_trajectories"] += float(signal)
        if metrics.get("rerl/count"):
            self.s["weight_mean_per_step"].append(float(metrics["rerl/weight_mean"]))
            self.s["weight_std_per_step"].append(float(metrics["rerl/weight_std"]))

    def summary(self) -> dict[str, Any]:
        c = self.s["counts"]
        tool_calls = c["rollout_tool_calls"] + c["reflection_tool_calls"]
        sig = self.s["signal_trajectories"]
        return {
            **{k: c[k] for k in COUNT_KEYS},
            "recovered_ratio": (c["recovered_by_reflection"] / c["failed"]) if c["failed"] else None,
            # reflection's repair rate by cause: repaired / reflected on (a fault-caused failure: the policy
            # did not act on a fault it was shown, or the client's retries gave up; a policy error)
            **{f"recovered_ratio_{cause}": (c[f"recovered_{cause}"] / c[f"reflected_{cause}"])
               if c[f"reflected_{cause}"] else None for cause in ("env_fault", "policy_error")},
            "tool_calls": tool_calls,
            "signal_trajectories": sig,
            "tool_calls_per_signal": (tool_calls / sig) if sig else None,
            "critic_calls": self.s["critic_calls"],
            "critic_latency_mean_s": (self.s["critic_latency_s"] / self.s["critic_calls"]) if self.s["critic_calls"] else None,
            "critic_unparseable": self.s["critic_unparseable"],
            "critic_errors": self.s["critic_errors"],
            "weight_mean_per_step": list(self.s["weight_mean_per_step"]),
            "weight_std_per_step": list(self.s["weight_std_per_step"]),
        }


def format_recovery(r: dict[str, Any], variant: str) -> list[str]:
    """Summary lines for ``format_summary`` (``r`` = :meth:`RecoveryLedger.summary`)."""
    def num(x: Any, fmt: str = ".0f") -> str:
        return "n/a" if x is None else format(x, fmt)

    lines = [
        f"recovery ({variant}): {num(r['failed'])} failed rollouts of {num(r['rollouts'])} "
        f"({num(r['failed_env_fault'])} env fault, {num(r['failed_policy_error'])} policy error); "
        f"{num(r['recovered_by_retry'])} recovered by the client's retries; "
        + (f"{num(r['recovered_by_policy'])} recovered by the policy calling again; "
           if r.get("recovered_by_policy") else "") +
        f"{num(r['recovered_by_reflection'])} recovered by reflection "
        f"(ratio {'n/a' if r['recovered_ratio'] is None else format(r['recovered_ratio'], '.1%')}, "
        f"{num(r['retries'])} retries in {num(r['generate_calls'])} batched generate calls; repaired "
        f"{_ratio(r, 'env_fault')} of the fault-caused failures reflected on, {_ratio(r, 'policy_error')} of the "
        f"policy errors); {num(r['discarded'])} discarded",
        f"learning signal: {num(r['signal_trajectories'])} trained trajectories for {num(r['tool_calls'])} billed "
        f"tool calls ({num(r['tool_calls_per_signal'], '.2f')} calls per signal); critic: {num(r['critic_calls'])} calls, "
        f"mean latency {num(r['critic_latency_mean_s'], '.3f')} s, {num(r['critic_unparseable'])} unparseable, "
        f"{num(r['critic_errors'])} errors",
    ]
    w = r.get("weight_mean_per_step") or []
    if w:
        lines.append(f"importance weights (eq. 2): mean per step {min(w):.3g}..{max(w):.3g}, last {w[-1]:.3g}")
    return lines


def _ratio(r: dict[str, Any], cause: str) -> str:
    """``3/5 (60.0%)``: repaired / reflected on for one cause of failure ("n/a" when none)."""
    done, of = r.get(f"recovered_{cause}"), r.get(f"reflected_{cause}")
    if not of:
        return "n/a"
    return f"{done:.0f}/{of:.0f} ({done / of:.1%})"


def dpo_pairs(trajs: Sequence[R.Trajectory]) -> list[tuple[R.Trajectory, R.Trajectory]]:
    """(chosen tau*, rejected tau) for every repaired POLICY error among ``trajs`` (sec. 4.1's DPO
    baseline: "an initial invalid call followed by a valid call obtained after reflection retry")."""
    out = []
    for t in trajs:
        rec = getattr(t, "repair", None)
        if rec is not None and rec.repaired and rec.cause == "policy_error" and t.original is not None \
                and t.original.n_action_tokens > 0 and t.n_action_tokens > 0:
            out.append((t, t.original))
    return out
