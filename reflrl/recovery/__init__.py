"""Tool-ReRL's reflection-recovery loop inside the CPU trainer, the paper's variants, and accounting.

Tool-ReRL (Reflective Reinforcement Tool Learning):

- sec. 3.2 (Reflection-Recovery Strategy): a failed trajectory tau is not thrown away; a reflection
  module diagnoses it and the augmented query ``q* = [q, t, a, rfl]`` guides the policy to a revised
  trajectory tau*;
- sec. 3.3, Definition 1 (ii): tau* comes from iterative sampling under q* with early stopping at the
  first valid candidate or after a maximum number of attempts (:func:`reflrl.recovery.reflection.reflect_and_retry`);
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
   ``reflection.max_attempts`` retries. Each retry replays the failed episode on the same env (its seed: the
   same API changes) with fresh fault draws for the retried step.
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

from .accounting import (COUNT_KEYS, RecoveryLedger, RecoveryResult, count_rollouts, dpo_pairs, format_recovery,
                         own_rollouts, step_accounting, triage)
from .batcher import RoundBatcher
from .critics import (CRITICS, EXTERNAL_INSTRUCTION, SelfThoughtCritic, build_critic, check_endpoint,
                      get_critic, uses_endpoint)
from .recover import arecover, repaired_trajectory
from .reflection import (Attempt, EnvFeedback, Generation, RepairRecord, augmented_messages, build_retry_prompt,
                         feedback_from_step, reflect_and_retry, split_response)
from .variants import VARIANTS, Variant, think_of, variant_of

__all__ = [
    "Attempt", "COUNT_KEYS", "CRITICS", "EXTERNAL_INSTRUCTION", "EnvFeedback", "Generation", "RecoveryLedger",
    "RecoveryResult", "RepairRecord", "RoundBatcher", "SelfThoughtCritic", "VARIANTS", "Variant", "arecover",
    "augmented_messages", "build_critic", "check_endpoint", "uses_endpoint", "build_retry_prompt", "count_rollouts", "dpo_pairs",
    "feedback_from_step", "format_recovery", "get_critic", "own_rollouts", "reflect_and_retry", "repaired_trajectory",
    "split_response", "step_accounting", "think_of", "triage", "variant_of",
]
