"""Tool-ReRL's reflection-recovery loop inside the CPU trainer, the paper's variants, and accounting.

Tool-ReRL (Reflective Reinforcement Tool Learning):

- sec. 3.2 (Reflection-Recovery Strategy): a failed trajectory tau is not thrown away; a reflection
  module diagnoses it and the augmented query ``q* = [q, t, a, rfl]`` guides the policy to a revised
  trajectory tau*;
- sec. 3.3, Definition 1 (ii): tau* comes from iterative sampling under q* with early stopping at the
  first valid candidate or after a maximum number of attempts (:func:`reflrl.reflection.reflect_and_retry`);
- Assumption 1 + eq. 2: tau* is trained on the ORIGINAL prompt q with the clipped importance weight
  ``pi_theta(tau*|q) / pi_theta(tau*|q*)``, the denominator being the log-probs recorded when tau* was
  sampled (:mod:`reflrl.algos.importance`);
- appendix A.3: eq. 2 replaces PPO's pi_theta_old by the reflection behaviour policy;
- appendix C: the critic's Score/Analysis and the retry prompt.

What happens in a training step (:func:`arecover`, called by ``Trainer.train_step`` right after a round
of rollouts):

1. **Triage** of every rollout (the env's info of its step, i.e. the fault ledger's view):
   ``env_fault`` -- an env fault the tool client's retry policy could not recover (the rollout is
   masked); ``policy_error`` -- parsed and executed but wrong (or unparseable); rollouts whose faults
   the client's retries DID recover are counted as "recovered by retry" and are not failures.
2. **Reflection** on the failures (``reflection.reflect_on``; at most ``reflection.max_per_step``, env
   faults first): the critic judges the failed response -- an env fault gets its exact description
   ("the tool answered 429 rate limit after 4 attempts; retry after 2 s"), a policy error the critic's
   analysis -- then :func:`reflect_and_retry` samples under q* until the first positive critique or
   ``reflection.max_attempts`` retries. Each retry runs in a fresh episode of the same task on the same
   env (new episode seed, so new fault draws).
3. **Batched generation.** All failures of the round are repaired together: their coroutines share a
   :class:`RoundBatcher`, which waits until every still-active repair is waiting for a sample and then
   draws all of them in ONE ``engine.generate`` call -- one call per attempt round, never one per
   trajectory.
4. **Group membership (decision, ``reflection.group``).** The paper trains with PPO (per-trajectory
   GAE advantages, appendix A.2) and speaks of failures being *transformed* into repaired trajectories,
   so it has no groups. Default ``"replace"``, as in the verl agent loop
   (``reflrl.verl_backend.agent_loop``): a repaired tau* REPLACES its failed tau in tau's group, with
   tau*'s reward, so the group-normalised advantage is computed with it (a group whose n rollouts all
   failed gets a non-zero variance from its repairs -- exactly the learning signal the paper recovers).
   GRPO caveat: when EVERY failure of a group is repaired, all its rewards become equal and the group
   has no signal at all (it had one before: the failures' negatives); ``"add"`` avoids this -- tau*
   joins the group beside tau, which keeps its negative advantage, and the group's mean/std are taken
   over the n + k rollouts. An env-fault failure is always replaced (it is masked: no signal to keep).
   Either way tau*'s prompt stays q's tokens, its ``old_logprobs`` are the behaviour log-probs under q*,
   and ``Trajectory.repair`` keeps the whole :class:`RepairRecord` (q, q*, attempts, critiques);
   ``Trajectory.original`` is the failed tau. The pre-rollout filter's all-correct streak and the
   step's reward/accuracy metrics use the policy's own samples (:func:`own_rollouts`), not the repairs.

Variants (``reflection.variant``; Table 1 and Table 2 of the paper), each a config in ``configs/``:

=============  ===========  ===============================  ============  ===========
variant        reflection   reflection source                weight eq. 2  thought
=============  ===========  ===============================  ============  ===========
grpo           no           --                               --            no
ppo            --           needs a value head: verl backend --            --
cot            no           --                               --            yes
ref            yes          critic (``reflection.critic``)   no (+Ref)     no
cot_is         yes          the policy's own thought         yes           yes
external       yes          LLM endpoint, reasoning prompt   no            no
external_is    yes          LLM endpoint, reasoning prompt   yes           no
tool_rerl      yes          critic (``reflection.critic``)   yes           no
dpo            yes          critic                           DPO loss      no
=============  ===========  ===============================  ============  ===========

``ref`` ("reflection trajectories naively treated as on-policy", sec. 4.1): tau* enters its group like
in ``tool_rerl`` and is trained on q with the plain clipped loss and old log-probs = the current
policy's on q (ratio 1): no weight. ``cot_is`` (sec. 4.2.2): q* carries the model's own thought instead
of an external reflection (:class:`SelfThoughtCritic`; the ground-truth verdict still decides when to
stop, as the env's reward would). ``external*`` (Table 2): the critic endpoint is asked for step-by-step
reasoning about how to answer the request (:data:`EXTERNAL_INSTRUCTION`) instead of appendix C's
critique. ``dpo`` (sec. 4.1): DPO on (repaired tau*, failed tau) pairs under q, only for policy errors
(a response that failed because of the environment is not a "rejected" answer), against a frozen
reference (the policy as RL starts). ``think`` is the paper's thought-then-call format; it is on by
default only for ``cot`` and ``cot_is`` (``reflection.think`` overrides): the embedded 135M model is
warmed up on bare calls.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from reflrl import config as C
from reflrl import rollout as R
from reflrl.critic.base import Critique, CriticStats, CritiqueRequest, SyncCritic
from reflrl.critic.format import format_critique
from reflrl.reflection import EnvFeedback, Generation, RepairRecord, feedback_from_step, reflect_and_retry, split_response


# ============================================================================ variants
@dataclass(frozen=True)
class Variant:
    """What a variant does (module doc table).

    reflect: failed trajectories are repaired; source: "critic" | "self" | "external";
    importance: repaired rows get eq. 2's weight (the ``tool_rerl`` loss); think: default of
    ``reflection.think``; dpo: train with DPO on (repair, failure) pairs; cpu_error: why the CPU
    trainer cannot run it (None: it can).
    """

    name: str
    reflect: bool = False
    source: str = "critic"
    importance: bool = False
    think: bool = False
    dpo: bool = False
    cpu_error: str | None = None


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("grpo"),
    Variant("ppo", cpu_error=(
        "reflection.variant='ppo' is PPO with a learned value function (GAE, Tool-ReRL appendix A.2); the "
        "CPU trainer has no value head -- use 'grpo' here, or the verl backend (reflrl train --backend verl "
        "--config configs/verl/tool_rerl_qwen2.5-7b.yaml, algo.advantage=gae)")),
    Variant("cot", think=True),
    Variant("ref", reflect=True, source="critic"),
    Variant("cot_is", reflect=True, source="self", importance=True, think=True),
    Variant("external", reflect=True, source="external"),
    Variant("external_is", reflect=True, source="external", importance=True),
    Variant("tool_rerl", reflect=True, source="critic", importance=True),
    Variant("dpo", reflect=True, source="critic", dpo=True),
)}
assert tuple(VARIANTS) == C.VARIANTS


def variant_of(cfg: C.Config) -> Variant:
    return VARIANTS[cfg.reflection.variant]


def think_of(cfg: C.Config) -> bool:
    """Whether prompts ask for a <think> block: ``reflection.think``, else the variant's default."""
    t = cfg.reflection.think
    return variant_of(cfg).think if t is None else bool(t)


def check_cpu_support(cfg: C.Config) -> None:
    """Raise ConfigError when the CPU trainer cannot run ``cfg``'s variant (e.g. ``ppo``)."""
    v = variant_of(cfg)
    if v.cpu_error:
        raise C.ConfigError(v.cpu_error)
    if v.dpo and cfg.algo.epochs_per_batch != 1:
        raise C.ConfigError("reflection.variant='dpo' makes one DPO step per batch; set algo.epochs_per_batch=1")


# ============================================================================ critics
EXTERNAL_INSTRUCTION = (
    "You are an expert tool-use assistant. Given an agent response to a user request and the ground "
    "truth, reason step by step about how the request should be answered with the available tools: "
    "which tool to call and how to fill each argument from the request.\n"
    "\n"
    "Format your answer as follows:\n"
    "Score: positive or negative\n"
    "Analysis: your step-by-step reasoning about how to answer the request, in a few sentences, "
    "avoiding bullet points."
)


class SelfThoughtCritic(SyncCritic):
    """``cot_is`` (sec. 4.2.2): q* is formed with the model's OWN thought, no external feedback.

    The verdict (positive/negative) is the ground-truth comparison of ``judge`` (the rule critic: the
    same check as the env's exact-match reward), so retries still stop at the first valid one; the
    analysis put into q* is the failed response's own ``<think>`` text ("Your own reasoning was: ..."),
    or a bare "The answer was not accepted." when it had none. An env fault keeps its description:
    it is what the tool answered, not reasoning.
    """

    name = "self"

    def __init__(self, judge: Any):
        self.judge = judge

    def critique(self, request: CritiqueRequest) -> Critique:
        c = self.judge.critique(request)
        if c.positive or request.env_fault is not None:
            return c
        thought, _ = split_response(request.response)
        analysis = f"Your own reasoning was: {thought}" if thought else "The answer was not accepted."
        return Critique("negative", analysis, raw=format_critique("negative", analysis), parsed=True,
                        latency_s=c.latency_s)


def build_critic(cfg: C.Config, engine: Any = None, tokenizer: Any = None) -> Any:
    """The critic of ``cfg``'s variant (module doc): rule / llm / policy, self-thought for ``cot_is``,
    the LLM endpoint with :data:`EXTERNAL_INSTRUCTION` for ``external*``."""
    from reflrl.critic import get_critic

    f, v = cfg.reflection, variant_of(cfg)
    if v.source == "self":
        return SelfThoughtCritic(get_critic("rule", reveal=f.reveal))
    if v.source == "external":
        return get_critic("llm", base_url=f.critic_base_url, model=f.critic_model, timeout=f.critic_timeout_s,
                          instruction=EXTERNAL_INSTRUCTION, max_tokens=320)
    if f.critic == "rule":
        return get_critic("rule", reveal=f.reveal)
    if f.critic == "llm":
        return get_critic("llm", base_url=f.critic_base_url, model=f.critic_model, timeout=f.critic_timeout_s)
    from reflrl.critic.policy import chat_generate_fn

    return get_critic("policy", generate=chat_generate_fn(engine, tokenizer), as_messages=True)


# ============================================================================ batched generation
class RoundBatcher:
    """Collects the ``generate`` requests of concurrent repairs and serves them in one batch.

    ``n`` coroutines share it; each calls :meth:`generate` (awaits a sample) zero or more times and
    :meth:`done` once when it finishes. When every live coroutine is waiting for a sample, all pending
    requests go to ``sample(list of message lists) -> list of Generation`` in ONE call (one attempt
    round). Errors of ``sample`` are raised in every waiting coroutine.
    """

    def __init__(self, n: int, sample: Callable[[list[list[dict]]], list[Generation]]):
        self.live = int(n)
        self.sample = sample
        self.pending: list[tuple[list[dict], asyncio.Future]] = []
        self.calls = 0
        self.sizes: list[int] = []

    async def generate(self, messages: list[dict]) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((messages, fut))
        self._maybe_flush()
        return await fut

    def done(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        self.calls += 1
        self.sizes.append(len(batch))
        try:
            gens = self.sample([m for m, _ in batch])
            if len(gens) != len(batch):
                raise RuntimeError(f"sampler returned {len(gens)} generations for {len(batch)} prompts")
        except Exception as e:  # noqa: BLE001 - delivered to every waiter
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), g in zip(batch, gens):
            if not fut.done():
                fut.set_result(g)


# ============================================================================ triage and accounting
def triage(t: R.Trajectory) -> str:
    """"ok" | "recovered_by_retry" (env faults the client's retries recovered, answer right) |
    "env_fault" (an unrecovered env fault: masked) | "policy_error" (wrong, unparseable or no call)."""
    if t.masked:
        return "env_fault"
    if not t.correct:
        return "policy_error"
    last = t.info.get("last") or {}
    return "recovered_by_retry" if last.get("env_fault_treatment") == "retried-recovered" else "ok"


COUNT_KEYS = ("rollouts", "failed", "failed_env_fault", "failed_policy_error", "recovered_by_retry",
              "reflected", "recovered_by_reflection", "recovered_env_fault", "recovered_policy_error",
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


def _first_generation(t: R.Trajectory) -> Generation:
    ids = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    lps = [x for x, m in zip(t.old_logprobs, t.loss_mask) if m]
    return Generation(t.texts[0] if t.texts else "", ids, lps)


def repaired_trajectory(t: R.Trajectory, rec: RepairRecord) -> R.Trajectory:
    """tau* as a rollout of t's group: q's prompt tokens, tau*'s ids with their behaviour log-probs
    under q* (``old_logprobs``), tau*'s env verdict; ``repair`` = the record, ``original`` = t."""
    new = R.Trajectory(task=t.task, group=t.group, prompt_ids=list(t.prompt_ids))
    new.append_action(rec.response_ids, rec.behaviour_logprobs)
    new.turns = 1
    new.texts = [rec.response_text]
    fb = rec.final_feedback
    R._record_step(new, fb.reward, dict(fb.info) if fb.info else {"correct": fb.correct})
    new.repair = rec
    new.original = t
    return new


async def arecover(trajs: list[R.Trajectory], *, cfg: C.Config, engine: Any, tokenizer: Any, envs: Sequence[Any],
                   critic: Any, messages_of: Callable[[Any], list[dict]], rollout_cfg: R.RolloutConfig,
                   seed: int = 0) -> RecoveryResult:
    """Triage ``trajs`` (one round's single-turn rollouts; env k served trajs[k]), repair the selected
    failures with batched reflection-guided retries, and replace each repaired rollout in place
    -- or, with ``reflection.group="add"``, append it to ``trajs`` with the same ``group`` --
    (module doc). Never raises for a critic's or a repair's failure: those are counted
    (``reflection_errors``) and the failed rollout is kept as it was."""
    t0 = time.perf_counter()
    f = cfg.reflection
    counts = {k: 0.0 for k in COUNT_KEYS}
    stats = CriticStats()
    counts["rollouts"] = len(trajs)
    failed: list[tuple[int, str]] = []
    for k, t in enumerate(trajs):
        counts["rollout_tool_calls"] += float((t.info.get("last") or {}).get("billed_calls") or 0)
        tri = triage(t)
        if tri == "recovered_by_retry":
            counts["recovered_by_retry"] += 1
        if tri in ("env_fault", "policy_error"):
            counts["failed"] += 1
            counts[f"failed_{tri}"] += 1
            failed.append((k, tri))
    chosen = [(k, c) for k, c in failed if f.reflect_on == "failure" or c == "env_fault"]
    chosen.sort(key=lambda kc: (kc[1] != "env_fault", kc[0]))  # env faults first: they carry no signal otherwise
    if f.max_per_step:
        chosen = chosen[: f.max_per_step]
    counts["reflected"] = len(chosen)
    gen_s = [0.0]
    rounds = [0]

    def sample(batch: list[list[dict]]) -> list[Generation]:
        tg = time.perf_counter()
        prompts = [R.render_prompt(tokenizer, m) for m in batch]
        out = R.generate_batch(engine, prompts, rollout_cfg, n=1, seed=seed + 7919 * (rounds[0] + 1))
        rounds[0] += 1
        gen_s[0] += time.perf_counter() - tg
        return [Generation(tokenizer.decode(ids, skip_special_tokens=True), ids, lps) for ids, lps, _fin in out]

    batcher = RoundBatcher(len(chosen), sample)
    errors: list[str] = []

    async def repair(k: int) -> RepairRecord | None:
        t = trajs[k]
        env = envs[k]
        attempt = [0]

        async def step_env(text: str) -> EnvFeedback:
            attempt[0] += 1
            await R._reset(env, t.task, seed + 104729 * attempt[0] + k)  # a fresh episode of the same task
            _obs, reward, _term, _trunc, info = await R._step(env, text)
            return feedback_from_step(info, reward)

        try:
            fb0 = feedback_from_step(t.info.get("last") or {}, t.reward)
            gold = list(t.task.gold[0]) if t.task.gold else None
            return await reflect_and_retry(batcher.generate, critic, step_env, t.task, _first_generation(t),
                                           f.max_attempts, first_feedback=fb0, messages=messages_of(t.task),
                                           gold=gold, mode=f.mode, stats=stats)
        except Exception as e:  # noqa: BLE001 - a broken critic/repair must not stop training
            errors.append(f"{type(e).__name__}: {e}")
            return None
        finally:
            batcher.done()

    recs = await asyncio.gather(*(repair(k) for k, _ in chosen)) if chosen else []
    records: list[RepairRecord] = []
    added: list[R.Trajectory] = []
    for (k, cause), rec in zip(chosen, recs):
        if rec is None:
            counts["reflection_errors"] += 1
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
            continue
        records.append(rec)
        counts["retries"] += rec.retries
        counts["reflection_tool_calls"] += rec.tool_calls
        if rec.repaired and not (rec.final_feedback.info or {}).get("masked"):
            new = repaired_trajectory(trajs[k], rec)
            if f.group == "add" and cause == "policy_error":
                new.info["added"] = True  # beside the failure, which keeps its (negative) advantage
                added.append(new)
            else:  # an env-fault failure is masked (no signal to keep): the repair always takes its place
                trajs[k] = new
            counts["recovered_by_reflection"] += 1
            counts[f"recovered_{cause}"] += 1
        else:
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
    # failures not reflected on: env faults stay masked (no learning signal)
    picked = {k for k, _ in chosen}
    for k, cause in failed:
        if k not in picked:
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
    counts["generate_calls"] = batcher.calls
    trajs.extend(added)
    return RecoveryResult(records, counts, stats, time.perf_counter() - t0, gen_s[0], errors)


def own_rollouts(trajs: Sequence[R.Trajectory]) -> list[R.Trajectory]:
    """The policy's own samples among ``trajs``: a repair that replaced a failure stands for that
    failure, a repair added beside it is left out (for the pre-rollout filter and reward metrics)."""
    out = []
    for t in trajs:
        if t.original is None:
            out.append(t)
        elif not t.info.get("added"):
            out.append(t.original)
    return out


# ============================================================================ run-level accounting
def count_rollouts(trajs: Sequence[R.Trajectory]) -> dict[str, float]:
    """The counts of :data:`COUNT_KEYS` for rollouts with no reflection (variants without it)."""
    c = {k: 0.0 for k in COUNT_KEYS}
    for t in trajs:
        c["rollouts"] += 1
        c["rollout_tool_calls"] += float((t.info.get("last") or {}).get("billed_calls") or 0)
        tri = triage(t)
        if tri == "recovered_by_retry":
            c["recovered_by_retry"] += 1
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
        f"{num(r['recovered_by_reflection'])} recovered by reflection "
        f"(ratio {'n/a' if r['recovered_ratio'] is None else format(r['recovered_ratio'], '.1%')}, "
        f"{num(r['retries'])} retries in {num(r['generate_calls'])} batched generate calls); "
        f"{num(r['discarded'])} discarded",
        f"learning signal: {num(r['signal_trajectories'])} trained trajectories for {num(r['tool_calls'])} billed "
        f"tool calls ({num(r['tool_calls_per_signal'], '.2f')} calls per signal); critic: {num(r['critic_calls'])} calls, "
        f"mean latency {num(r['critic_latency_mean_s'], '.3f')} s, {num(r['critic_unparseable'])} unparseable, "
        f"{num(r['critic_errors'])} errors",
    ]
    w = r.get("weight_mean_per_step") or []
    if w:
        lines.append(f"importance weights (eq. 2): mean per step {min(w):.3g}..{max(w):.3g}, last {w[-1]:.3g}")
    return lines


# ============================================================================ DPO on failure/repair pairs
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


def dpo_loss(chosen_lp, rejected_lp, chosen_ref, rejected_ref, beta: float):
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta [(c - c_ref) - (r - r_ref)])``, mean over pairs;
    inputs are [P] sequence log-probs. Returns (loss, metrics)."""
    import torch.nn.functional as F

    margin = beta * ((chosen_lp - chosen_ref.detach()) - (rejected_lp - rejected_ref.detach()))
    loss = -F.logsigmoid(margin).mean()
    return loss, {"dpo/loss": float(loss.detach()), "dpo/margin_mean": float(margin.detach().mean()),
                  "dpo/accuracy": float((margin.detach() > 0).float().mean()), "dpo/pairs": float(len(margin))}


def dpo_update(model: Any, optimizer: Any, ref_model: Any, pairs: Sequence[tuple[R.Trajectory, R.Trajectory]],
               cfg: C.Config, pad_id: int) -> dict[str, float]:
    """One optimiser step of DPO on ``pairs`` (both sides under the ORIGINAL prompt q; the reference is
    the frozen policy as RL started). Micro-batches of ``algo.micro_batch_size`` pairs."""
    import torch

    from .trainer import batch_logprobs, make_batch

    a = cfg.algo
    temp = cfg.rollout.temperature
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    model.train()
    agg: dict[str, float] = {}
    P = len(pairs)
    size = max(1, a.micro_batch_size // 2)
    for s in range(0, P, size):
        chunk = pairs[s: s + size]
        trajs = [c for c, _ in chunk] + [r for _, r in chunk]
        batch = make_batch(trajs, [1.0] * len(trajs), pad_id)
        seq = lambda lp: (lp * batch.response_mask.float()).sum(-1)  # noqa: E731
        lp = seq(batch_logprobs(model, batch, temp))
        with torch.no_grad():
            ref = seq(batch_logprobs(ref_model, batch, temp))
        m = len(chunk)
        loss, mets = dpo_loss(lp[:m], lp[m:], ref[:m], ref[m:], cfg.reflection.dpo_beta)
        (loss * (m / P)).backward()
        for k, v in mets.items():
            agg[k] = agg.get(k, 0.0) + (v * m / P if k != "dpo/pairs" else v)
    gn = torch.nn.utils.clip_grad_norm_(params, a.grad_clip if a.grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    agg["loss"] = agg.get("dpo/loss", 0.0)
    agg["grad_norm"] = float(gn)
    agg["update_sequences"] = float(2 * P)
    return agg


def pooled_weight_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Exact weight statistics over all repaired rows from per-micro-batch ``rerl/*`` metrics
    (count, mean, std, min, max, capped_frac, log_weight_mean) -- averaging them token-weighted would
    be wrong."""
    parts = [p for p in parts if p.get("rerl/count")]
    n = sum(p["rerl/count"] for p in parts)
    if not n:
        return {"rerl/count": 0.0}
    mean = sum(p["rerl/count"] * p["rerl/weight_mean"] for p in parts) / n
    ex2 = sum(p["rerl/count"] * (p["rerl/weight_std"] ** 2 + p["rerl/weight_mean"] ** 2) for p in parts) / n
    return {
        "rerl/count": float(n),
        "rerl/weight_mean": mean,
        "rerl/weight_std": math.sqrt(max(0.0, ex2 - mean * mean)),
        "rerl/weight_min": min(p["rerl/weight_min"] for p in parts),
        "rerl/weight_max": max(p["rerl/weight_max"] for p in parts),
        "rerl/log_weight_mean": sum(p["rerl/count"] * p["rerl/log_weight_mean"] for p in parts) / n,
        "rerl/capped_frac": sum(p["rerl/count"] * p["rerl/capped_frac"] for p in parts) / n,
    }
