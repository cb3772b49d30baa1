"""One RL training step, in one read: :func:`train_step` goes top to bottom through

    1. collect    n rollouts per prompt of the seeded data order          Trainer.rollout (reflrl.rollout)
    2. recover    Tool-ReRL: failures critiqued, retried under q*,        Trainer.recover (reflrl.recovery)
                  repairs join their groups
    3. select     DSCL stage rewards, filter streaks, DAPO / DSCL         :func:`score_groups`, :func:`select_groups`
                  samplers (refill rounds)
    4. advantages masked GRPO over the live rollouts (eq. 2), max-        :func:`group_advantages` -> :class:`Row`
                  variance down-sampling
    5. batch      the rows packed prompt-once                             reflrl.train.batch.make_batch
    6. loss       clipped surrogate, eq. 2's weight on repairs, plus      :func:`policy_update` (below it)
                  the auxiliary losses of reflrl.train.extras (KL,
                  value, the supervised anchor on demonstrations)
    7. optimiser  AdamW step(s); the engine hook on_weights_updated
    8. account    metrics, recovery ledger, callbacks                     Trainer.account

DPO (a baseline) has its own update (:func:`reflrl.train.update.dpo_update`). Research options plug in
through :mod:`reflrl.train.extras` (advantage shapers, auxiliary losses) and cost the step nothing when off.

Masked rollouts (an env fault the client's retries did not recover) are dropped from the advantage
groups and from the loss: env faults never become negative rewards (Tool-ReRL sec. 3.2).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from reflrl import config as C
from reflrl.algos import (PreRolloutFilter, advantage_needs_critic, get_policy_loss_fn, groups_to_request,
                          live_group_advantages, max_variance_subset, zero_variance)
from reflrl.algos.dscl import SamplingController, scored_turn_parts
from reflrl.memory import ActivationCost, budget_bytes, release_heap
from reflrl.recovery import own_rollouts
from reflrl.rollout import Trajectory

from . import extras
from .batch import UpdateBatch, batch_logprobs, make_batch, micro_batches
from .update import LossMeter


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


@dataclass
class Row:
    """One rollout of the update with the advantage it is trained with (the batch is made of rows)."""

    traj: Trajectory
    advantage: float  # the estimator's outcome advantage; for a critic estimator (gae), the outcome reward
    group: int        # index of its group among the step's kept groups


def group_advantages(groups: Sequence[Sequence[Trajectory]], a: C.AlgoConfig) -> list[Row]:
    """The rollouts to train on, each with its advantage and group.

    Per group: masked rollouts are dropped (they neither get an advantage nor shift the baseline);
    with ``a.downsample_m`` the m live rollouts of maximal reward variance are kept (efficiency paper
    sec. 4.2, eq. 7); the advantage estimator (GRPO eq. 2 by default) runs on what is left
    (:func:`reflrl.algos.live_group_advantages`). Zero-variance groups get advantage 0. An estimator
    that needs a critic (``gae``) is computed per token later, on the batch (:mod:`reflrl.train.extras`):
    its rows carry their outcome reward.
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
        return []
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    if advantage_needs_critic(a.advantage):
        adv = rewards
    else:
        adv = live_group_advantages(rewards, torch.ones(len(trajs), dtype=torch.bool), group_ids,
                                    estimator=a.advantage, eps=a.adv_eps, gamma=a.gamma, lam=a.lam)
    return [Row(t, float(v), g) for t, v, g in zip(trajs, adv, group_ids)]


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

    def add(self, groups: list[list[Trajectory]], sel: Selection) -> None:
        """One sampling round's groups and what :func:`select_groups` decided for them."""
        self.groups.extend(groups)
        self.kept.extend(g for g, k in zip(groups, sel.keep) if k)
        self.live_groups += sel.live_groups
        self.zero_var += sel.zero_var
        self.rounds += 1


def train_step(tr: Any) -> dict[str, Any]:
    """One RL step of the trainer ``tr`` (:class:`reflrl.train.Trainer`), top to bottom:
    collect -> recover -> select -> advantages -> batch -> loss -> optimiser step -> account.
    Returns the step's metrics (one line of metrics.jsonl)."""
    cfg, a = tr.cfg, tr.cfg.algo
    B, ctl = cfg.rollout.batch_prompts, tr.sampling
    t_step, timings, epoch_before = time.perf_counter(), {}, tr.sampler.epoch
    got, want = StepRollouts(), B
    tr.release_memory()  # what the step before freed or read (a checkpoint) back before the generation's peak
    while want > 0:  # sampling rounds: one, or more when a sampler refills the batch (DAPO)
        # 1. collect: n rollouts for each of the next prompts of the seeded data order
        idx = tr.sampler.next(want)
        trajs = tr.rollout(idx, got.rounds, timings)
        # 2. recover (Tool-ReRL): failures critiqued and retried under q*, repairs join their groups
        if tr.critic is not None:
            got.recoveries.append(tr.recover(trajs, got.rounds))
        groups = [[t for t in trajs if t.group == g] for g in range(len(idx))]
        # 3. select: DSCL stage rewards, filter streaks, group samplers
        if ctl is not None:
            score_groups(groups, ctl, tr.step, tr.rollout_cfg.max_turns)
        got.add(groups, select_groups(groups, prefilter=tr.prefilter, ctl=ctl, step=tr.step,
                                      epoch=tr.sampler.epoch, round_=got.rounds))
        if ctl is None or not ctl.refill or got.rounds > cfg.sampling.max_refill_rounds:
            break
        want = min(B, groups_to_request(B, len(got.kept), len(got.kept) / max(1, len(got.groups)), max_request=B))
    release_heap()  # the generation's KV and prefill buffers back to the system before the update's activations
    rollout_s, t_up = time.perf_counter() - t_step, time.perf_counter()
    kept = got.kept[:B]

    # 4. advantages: masked GRPO over the live rollouts of the kept groups (eq. 2); zero ones give no gradient
    shapers = extras.active_shapers(a)
    rows = group_advantages(kept, a)
    trained = [r for r in rows if (r.advantage != 0.0 or shapers) and r.traj.n_action_tokens > 0]
    m: dict[str, Any] = {"groups_trained": len({r.group for r in trained}),
                         "adv_abs_mean": float(np.mean([abs(r.advantage) for r in rows])) if rows else 0.0,
                         "repaired_trained": float(sum(bool(r.traj.repaired) for r in trained)),
                         "trained_rollouts": len(rows)}
    n_signal = len(trained)
    if tr.variant.dpo:  # Tool-ReRL's DPO baseline: its own update, on (repaired, failed) pairs
        n_signal, dpo_metrics = tr.dpo_step(kept)
        m.update(dpo_metrics)
    elif trained:
        # 5. batch: the rows packed prompt-once; 6.-7. loss and optimiser step(s) (policy_update, below)
        batch = make_batch([r.traj for r in trained], [r.advantage for r in trained], tr.pad_id)
        imp = ({"level": cfg.reflection.level, "log_cap": cfg.reflection.log_cap}
               if tr.variant.importance else None)  # eq. 2's weight on repaired rows (tool_rerl, cot_is, ...)
        tr.weights_changing()  # the engine hook: its copies of the trained weights make room for the update
        with tr.training_forwards():  # the frozen float32 layers multiply by the decode step's packed copies
            m.update(policy_update(tr.model, tr.optimizer, batch, a, temperature=cfg.rollout.temperature,
                                   ref_model=tr.ref_model, importance=imp, value_head=tr.value_head,
                                   demos=tr.demo_batch() if a.sft_coef > 0 else None))
        tr.weights_updated()  # the engine hook: the next rollouts sample the updated policy
    m["update_skipped"] = float("loss" not in m)
    update_s = time.perf_counter() - t_up

    # 8. account: the step's metrics, the run's totals, callbacks
    m.update(tr.account(got, n_signal, m, timings, rollout_s, update_s, t_step))
    if ctl is not None:
        m.update(ctl.step_metrics())
    if tr.sampler.epoch != epoch_before:
        m["new_epoch"] = True
        if ctl is not None and epoch_before >= 0:  # the finished epoch's category shares (reflrl.algos.dscl)
            tr.log.log(tr.step, ctl.epoch_record(epoch_before), phase="epoch")
    tr.callbacks.on_step_end(tr, got, trained, m)
    return m


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: UpdateBatch, a: C.AlgoConfig, *,
                  temperature: float = 1.0, ref_model: torch.nn.Module | None = None, share_prompt: bool = True,
                  importance: dict[str, Any] | None = None, value_head: torch.nn.Module | None = None,
                  demos: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Steps 6-7 of :func:`train_step`: one rollout batch -> ``a.epochs_per_batch`` optimiser steps of the
    clipped surrogate, token-mean over the whole batch with gradient accumulation over micro-batches
    (``global_denominator`` = the batch's action tokens), so the result equals one full-batch step.

    ``importance`` (Tool-ReRL variants with the weight, ``{"level", "log_cap"}``): the loss is ``tool_rerl``
    (eq. 2, :mod:`reflrl.algos.importance`). ``lp`` is log pi_theta of the response under the row's own prompt,
    for a repair the ORIGINAL q, and its old log-probs are the behaviour log-probs recorded under q*
    (``engine_logprobs``, Assumption 1); other rows keep ratio 1 at one epoch. Research options plug in
    through :mod:`reflrl.train.extras` (advantage shapers such as GAE, auxiliary losses such as the KL to
    ``ref_model``, the value loss of ``value_head`` or the supervised loss on ``demos``) and cost nothing
    when off."""
    dev = next(model.parameters()).device  # train.device: micro-batches go where the model is
    budget = budget_bytes(a.activation_budget_mb)  # micro-batches also cut to fit the activation budget
    mbs = [mb.to(dev) for mb in micro_batches(batch, a.micro_batch_size, budget, ActivationCost.of(model), share_prompt)]
    mask = batch.response_mask
    denom = float(mask.sum()) if a.loss_agg == "token-mean" else float((mask.sum(-1) > 0).sum())
    if demos is not None:
        demos = {k: v.to(dev) for k, v in demos.items()}
    ctx = extras.UpdateContext(model, mbs, a, denom, temperature, share_prompt, ref_model, value_head, demos)
    shaped = {k: v for shape in extras.active_shapers(a) for k, v in shape(ctx).items()}  # e.g. GAE
    aux = [fn for fn in (make(ctx) for make in extras.active_aux_losses(a)) if fn is not None]
    old: list[torch.Tensor | None] = [None] * len(mbs)  # the sampling policy is the current one: ratio 1
    if a.epochs_per_batch > 1:  # several passes over the batch: old log-probs once, before the first update
        with torch.no_grad():
            old = [batch_logprobs(model, mb, temperature, share_prompt) for mb in mbs]
    loss_fn = get_policy_loss_fn("tool_rerl" if importance is not None else a.policy_loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    meter = LossMeter()
    model.train()
    for epoch in range(a.epochs_per_batch):
        optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(mbs):
            lp = batch_logprobs(model, mb, temperature, share_prompt)
            old_lp = old[j] if old[j] is not None else lp.detach()
            kw: dict[str, Any] = {}
            if importance is not None:  # a repaired row's behaviour log-probs are its engine's, under q*
                old_lp = torch.where(mb.repaired[:, None], mb.engine_logprobs, old_lp)
                kw = {"repaired": mb.repaired, **importance}
            loss, lm = loss_fn(lp, old_lp, mb.advantages, mb.response_mask, clip_low=a.clip_low,
                               clip_high=a.clip_high, dual_clip_c=a.dual_clip_c, loss_agg_mode=a.loss_agg,
                               global_denominator=denom, **kw)
            for fn in aux:  # e.g. kl_coef x KL to the reference, value_coef x the clipped value loss
                if not getattr(fn, "own_backward", False):
                    extra, am = fn(j, mb, lp)
                    loss = loss + extra
                    meter.add_aux(am)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"policy loss is {float(loss)}; check the learning rate")
            loss.backward()
            loss = loss.detach()
            for fn in aux:  # losses on other data (the supervised anchor): their own backward, after this one
                if getattr(fn, "own_backward", False):
                    extra, am = fn(j, mb, None)
                    loss = loss + extra.to(loss.device)
                    meter.add_aux(am)
            meter.add(epoch, loss, lm, lp, mb)
            del lp, loss
            # this micro-batch's activations, freed into the heap, go back before the next micro-batch's
            # (and, after the last, before the step reads AdamW's moments in from disk)
            release_heap()
        gn = torch.nn.utils.clip_grad_norm_(params, a.grad_clip if a.grad_clip > 0 else float("inf"))
        optimizer.step()
        meter.end_epoch(gn)
    optimizer.zero_grad(set_to_none=True)
    release_heap()  # the activations' freed memory back to the system (reflrl.memory)
    return {**shaped, **meter.metrics(a.epochs_per_batch, batch, pooled=importance is not None)}


def rollout_records(groups: Sequence[Sequence[Trajectory]], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """One JSON-ready record per rollout of a step, for ``train.log_rollouts``.

    ``rows``: the rows the step trained on, each with its advantage; a rollout that is not one of them
    (zero advantage, masked, or its group not kept) records ``advantage: null``. A reflection repair
    (``repaired``) also records the retry prompt it was sampled under (q*'s last user message) and the
    failed attempt it repairs; the loss trains it on the original prompt q (Tool-ReRL eq. 2)."""
    out: list[dict[str, Any]] = []
    for grp in groups:
        for t in grp:
            adv = next((r.advantage for r in rows if r.traj is t), None)
            rec: dict[str, Any] = {"task_id": t.task.id, "group": t.group, "text": "\n".join(t.texts),
                                   "reward": t.reward, "correct": bool(t.correct), "masked": bool(t.masked),
                                   "advantage": adv, "repaired": t.repaired, "added": t.added}
            if t.repaired:
                msgs = t.repair.augmented_messages
                rec["q_star"] = next((m["content"] for m in reversed(msgs) if m.get("role") == "user"), None)
                rec["failed"] = t.repair.first.text
            out.append(rec)
    return out
