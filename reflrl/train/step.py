"""The stages of one RL training step, in the order they run (each a function of plain inputs):

    collect   -> n rollouts per prompt from the prompt sampler          (:class:`reflrl.train.loop.Trainer`)
    recover   -> Tool-ReRL repairs of the failures, in their groups     (:func:`reflrl.recovery.arecover`)
    score     -> DSCL curriculum rewards (eq. 7) on the live rollouts   :func:`score_groups`
    select    -> pre-rollout filter streaks, zero-variance (DAPO) and   :func:`select_groups`
                 DSCL samplers' keep mask; the refill request
    advantages-> masked GRPO over the live rollouts, with max-variance  :func:`group_advantages`
                 down-sampling
    update    -> the clipped surrogate / DPO                            (:mod:`reflrl.train.update`)
    account   -> step metrics and the run's accounting                  :func:`step_metrics`

Masked rollouts (an env fault the client's retries did not recover) are dropped from the advantage
groups and from the loss: env faults never become negative rewards (Tool-ReRL sec. 3.2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from reflrl import config as C
from reflrl.algos import PreRolloutFilter, live_group_advantages, max_variance_subset, zero_variance
from reflrl.algos.dscl import SamplingController, scored_turn_parts
from reflrl.recovery import own_rollouts
from reflrl.rollout import Trajectory


def group_all_correct(group: Sequence[Trajectory]) -> bool | None:
    """Were all of a prompt's own live rollouts correct (repairs not counted; None when all were
    masked)? Logged per step for the temporal stability of all-correct prompts (efficiency paper,
    arXiv:2606.00135, Fig. 5)."""
    own = [o for o in own_rollouts(group) if not o.masked]
    return all(bool(o.correct) for o in own) if own else None


def score_groups(groups: Sequence[Sequence[Trajectory]], ctl: SamplingController, step: int, max_turns: int) -> None:
    """DSCL TDCL (sec. 4.1): feed the live rollouts' sub-reward fractions to the stage machine, then
    re-score each live rollout with the stage's reward (eq. 7) when the curriculum is on (the env's
    reward is kept otherwise)."""
    live = [t for grp in groups for t in grp if not t.masked]
    parts = [scored_turn_parts([s.reward_parts for s in t.steps]) for t in live]
    ctl.observe_episodes(step, [(p, t.task.gold) for p, t in zip(parts, live)])
    for t, p in zip(live, parts):
        if p:
            n_turns = 1 + len(t.task.turns) if max_turns > 1 else 1
            t.reward = ctl.episode_reward(p, t.task.gold, n_turns, t.reward)


@dataclass
class Selection:
    """What :func:`select_groups` decided for one sampling round."""

    keep: list[bool]                 # per group: train on it
    live_groups: int = 0             # groups with at least one live rollout
    zero_var: int = 0                # of those, groups whose live rewards are all equal (no GRPO signal)


def select_groups(groups: Sequence[Sequence[Trajectory]], *, prefilter: PreRolloutFilter,
                  ctl: SamplingController | None, step: int, epoch: int, round_: int) -> Selection:
    """Which groups of a sampling round to train on.

    A group whose rollouts were all masked has nothing to learn and nothing to blame: dropped. The
    pre-rollout filter's all-correct streak (efficiency paper eqs. 4-5) is updated from the policy's
    own live rollouts (not repairs). A group sampler (``sampling.sampler``: DAPO drops the
    zero-variance groups, RDS / SMV / SMR select by reward statistics) decides on the rest."""
    sel = Selection(keep=[])
    for grp in groups:
        live = [t for t in grp if not t.masked]
        if not live:
            sel.keep.append(False)
            continue
        own_live = [o for o in own_rollouts(grp) if not o.masked]
        if own_live:
            prefilter.update(grp[0].task.id, [float(t.correct) for t in own_live], r_max=1.0)
        sel.live_groups += 1
        zv = zero_variance([t.reward for t in live])
        sel.zero_var += zv
        sel.keep.append(True)
    if ctl is not None:  # DSCL RDS / SMV / SMR / DAPO selection over the groups
        chosen = ctl.select(step, epoch, [(g[0].task.id, [t.reward for t in g if not t.masked]) for g in groups],
                            round_=round_)
        sel.keep = [k and c for k, c in zip(sel.keep, chosen)]
    return sel


def group_advantages(groups: Sequence[Sequence[Trajectory]], a: C.AlgoConfig
                     ) -> tuple[list[Trajectory], list[float], list[int]]:
    """The rollouts to train on, their advantages and group ids.

    Per group: masked rollouts are dropped (they neither get an advantage nor shift the baseline);
    with ``a.downsample_m`` the m live rollouts of maximal reward variance are kept (efficiency paper
    sec. 4.2, eq. 7); the advantage estimator (GRPO eq. 2 by default) runs on what is left
    (:func:`reflrl.algos.live_group_advantages`). Zero-variance groups get advantage 0.
    """
    trajs: list[Trajectory] = []
    group_ids: list[int] = []
    for gi, grp in enumerate(groups):
        live = [t for t in grp if not t.masked]
        if a.downsample_m and len(live) > a.downsample_m:
            live = [live[i] for i in max_variance_subset([t.reward for t in live], a.downsample_m)]
        trajs.extend(live)
        group_ids.extend([gi] * len(live))
    if not trajs:
        return [], [], []
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv = live_group_advantages(rewards, torch.ones(len(trajs), dtype=torch.bool), group_ids,
                                estimator=a.advantage, eps=a.adv_eps, gamma=a.gamma, lam=a.lam)
    return trajs, [float(x) for x in adv], group_ids


@dataclass
class StepRollouts:
    """Everything a step sampled: its groups (rounds concatenated), the kept ones, the recovery results."""

    groups: list[list[Trajectory]] = field(default_factory=list)
    kept: list[list[Trajectory]] = field(default_factory=list)
    recoveries: list[Any] = field(default_factory=list)
    rounds: int = 0
    live_groups: int = 0
    zero_var: int = 0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


def rollout_records(groups: Sequence[Sequence[Trajectory]], advantages: dict[int, float]) -> list[dict[str, Any]]:
    """One JSON-ready record per rollout of a step, for ``train.log_rollouts``.

    ``advantages`` maps ``id(trajectory)`` to the advantage it was trained with; a rollout not in it
    (zero advantage, masked, or its group not kept) records ``advantage: null``. A reflection repair
    (``repaired``) also records the retry prompt it was sampled under (q*'s last user message) and the
    failed attempt it repairs; the loss trains it on the original prompt q (Tool-ReRL eq. 2)."""
    out: list[dict[str, Any]] = []
    for grp in groups:
        for t in grp:
            rec: dict[str, Any] = {"task_id": t.task.id, "group": t.group, "text": "\n".join(t.texts),
                                   "reward": t.reward, "correct": bool(t.correct), "masked": bool(t.masked),
                                   "advantage": advantages.get(id(t)), "repaired": t.repaired, "added": t.added}
            if t.repaired:
                msgs = t.repair.augmented_messages
                rec["q_star"] = next((m["content"] for m in reversed(msgs) if m.get("role") == "user"), None)
                rec["failed"] = t.repair.first.text
            out.append(rec)
    return out
