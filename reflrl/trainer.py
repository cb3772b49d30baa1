"""`reflrl train`: GRPO on the tool environments, on the CPU, with the efficiency filters.

One path from the config to the loss, in the order it runs (CleanRL style; read top to bottom):

    cfg -> splits (train/val/test tasks) -> model + tokenizer (reflrl.models) -> engine
        -> envs (gymnasium, with the fault plan) -> run folder (reflrl.runlog)
    eval before (greedy exact match on the test split)
    warm-up: if the sampled format rate on probe tasks < threshold, SFT on the train split's gold calls
    for each RL step:
        prompts   = next prompts of a seeded per-epoch permutation, minus the prompts the online
                    pre-rollout filter skips (efficiency paper, arXiv:2606.00135, sec. 4.1, eqs. 4-6)
        rollouts  = n samples per prompt, env steps run concurrently (VerlTool sec. 3.3)
        filter    <- all-correct streak per prompt
        [DAPO dynamic sampling: drop zero-variance groups and refill]
        [DSCL: curriculum stage reward (eq. 7) and RDS/SMV/SMR prompt selection (eq. 12)]
        [max-variance down-sampling: keep m of n rollouts per prompt (efficiency paper, arXiv:2606.00135, sec. 4.2, eq. 7)]
        advantages = GRPO group-normalised (efficiency paper, arXiv:2606.00135, eq. 2), masked rollouts excluded
        loss       = clipped surrogate with clip-higher (efficiency paper, arXiv:2606.00135, eq. 3, appendix F), token-mean
        AdamW step with grad clipping
    eval after; summary.json; a short human summary.

Masked rollouts (an env fault the client's retries did not recover) are dropped from the advantage
groups and from the loss: env faults never become negative rewards (Tool-ReRL, sec. 3.2).

Old log-probs: with one optimiser step per rollout batch (``algo.epochs_per_batch == 1``) the policy
that sampled is exactly the current one, so old_logprob = current logprob, detached (ratio 1, the
gradient is the plain policy gradient); we do not use the engine's log-probs as "old" because they
come from a different kernel path (KV-cache decoding, bfloat16) and their numerical noise would show
up as spurious ratios and clipping. With several epochs the old log-probs are recomputed once with the
current model before the first update. The engine/trainer log-prob gap is logged as a diagnostic.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import config as C
from . import rollout as R
from .budget import EXIT_BUDGET_CUT, budget_cut_text, cut_record
from .threads import describe as threads_summary
from .algos import (PreRolloutFilter, drop_zero_variance_groups, get_advantage_fn, get_policy_loss_fn,
                    groups_to_request, kl_loss, max_variance_subset)
from .recovery import own_rollouts
from .runlog import RunLog, latest_checkpoint, load_checkpoint, refuse_existing_run

# ============================================================================ data order
class PromptSampler:
    """Which training prompts come next: a seeded permutation per epoch, filtered at the start of
    each epoch by the online pre-rollout filter (efficiency paper, arXiv:2606.00135, sec. 4.1, eq. 6).

    State (``state_dict``): epoch, position in the epoch's order, and the order itself; with the
    filter's streaks (saved separately) a resumed run draws exactly the same prompts.
    """

    def __init__(self, task_ids: Sequence[str], seed: int, prefilter: PreRolloutFilter):
        if not task_ids:
            raise ValueError("no training tasks")
        self.task_ids = list(task_ids)
        self.seed = int(seed)
        self.filter = prefilter
        self.epoch = -1
        self.pos = 0
        self.order: list[int] = []
        self.skipped: dict[int, int] = {}  # epoch -> prompts skipped by the filter

    def _start_epoch(self) -> None:
        self.epoch += 1
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.task_ids)).tolist()
        kept = set(self.filter.keep([self.task_ids[i] for i in perm], epoch=self.epoch))
        self.order = [i for i in perm if self.task_ids[i] in kept]
        self.skipped[self.epoch] = len(perm) - len(self.order)
        self.pos = 0

    def next(self, count: int) -> list[int]:
        """The next ``count`` task indices (crossing into new epochs as needed)."""
        out: list[int] = []
        empty_epochs = 0
        while len(out) < count:
            if self.pos >= len(self.order):
                self._start_epoch()
                if not self.order:
                    empty_epochs += 1
                    if empty_epochs > 2:  # cannot happen with re-entry after one skipped epoch
                        raise RuntimeError("the pre-rollout filter skipped every training prompt")
                    continue
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "order": list(self.order),
                "skipped": {str(k): v for k, v in self.skipped.items()}}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if int(s["seed"]) != self.seed:
            raise ValueError(f"checkpoint data order has seed {s['seed']}, this run {self.seed}")
        self.epoch, self.pos, self.order = int(s["epoch"]), int(s["pos"]), [int(i) for i in s["order"]]
        self.skipped = {int(k): int(v) for k, v in s.get("skipped", {}).items()}


def group_all_correct(group: Sequence[R.Trajectory]) -> bool | None:
    """Were all of a prompt's own live rollouts correct (repairs not counted; None when all were
    masked)? Logged per step for the temporal stability of all-correct prompts (efficiency paper, arXiv:2606.00135, Fig. 5)."""
    own = [o for o in (t.original if t.original is not None else t for t in group) if not o.masked]
    return all(bool(o.correct) for o in own) if own else None


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (numpy SeedSequence)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] >> 1)


# ============================================================================ batches
@dataclass
class UpdateBatch:
    """The rollouts of one update, stored prompt-once.

    prompts:          the distinct prompts (token id lists); the n rollouts of a task share one.
    owner:            [B] long, index into ``prompts`` of each rollout.
    resp_ids:         [B, R] long, right-padded response tokens (actions + observations).
    resp_attn:        [B, R] 1 on real response tokens, 0 on padding.
    response_mask:    [B, R] 1 on sampled action tokens (trained), 0 on observations and padding.
    engine_logprobs:  [B, R] the rollout engine's log-probs of the action tokens (0 elsewhere).
    advantages:       [B, R] per-token advantage (0 off the action tokens).
    """

    prompts: list[list[int]]
    owner: torch.Tensor
    resp_ids: torch.Tensor
    resp_attn: torch.Tensor
    response_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    advantages: torch.Tensor
    pad_id: int = 0
    repaired: torch.Tensor | None = None  # [B] bool: reflection-repaired rows (Tool-ReRL, reflrl.recovery)

    def __len__(self) -> int:
        return int(self.resp_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        """Tokens a full-sequence forward processes (prompt + response, no padding)."""
        return int(sum(len(self.prompts[o]) for o in self.owner.tolist()) + self.resp_attn.sum())

    def select(self, idx: Sequence[int]) -> "UpdateBatch":
        """Rows ``idx`` (prompts renumbered, shared right padding trimmed)."""
        ix = torch.as_tensor(list(idx), dtype=torch.long)
        owners = self.owner[ix].tolist()
        keep = sorted(set(owners))
        remap = {o: i for i, o in enumerate(keep)}
        width = int(self.resp_attn[ix].sum(-1).max()) if len(ix) else 0
        return UpdateBatch([self.prompts[o] for o in keep], torch.tensor([remap[o] for o in owners]),
                           *(t[ix][:, :width] for t in (self.resp_ids, self.resp_attn, self.response_mask,
                                                         self.engine_logprobs, self.advantages)),
                           pad_id=self.pad_id, repaired=None if self.repaired is None else self.repaired[ix])

    def full(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded full sequences: (input_ids, attention_mask, response_mask), each [B, L], with
        the response mask on the action tokens (the layout of ``reflrl.logprobs.sequence_logprobs``)."""
        B = len(self)
        lens = [len(self.prompts[o]) + int(self.resp_attn[i].sum()) for i, o in enumerate(self.owner.tolist())]
        L = max(lens)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        resp = torch.zeros((B, L), dtype=torch.long)
        for i, o in enumerate(self.owner.tolist()):
            P, Rn = len(self.prompts[o]), int(self.resp_attn[i].sum())
            ids[i, :P] = torch.tensor(self.prompts[o], dtype=torch.long)
            ids[i, P: P + Rn] = self.resp_ids[i, :Rn]
            attn[i, : P + Rn] = 1
            resp[i, P: P + Rn] = self.response_mask[i, :Rn]
        return ids, attn, resp

    def to_full(self, x: torch.Tensor) -> torch.Tensor:
        """Map a [B, R] response-layout tensor to the [B, L] layout of :meth:`full` (0 on prompts)."""
        L = max(len(self.prompts[o]) + int(self.resp_attn[i].sum()) for i, o in enumerate(self.owner.tolist()))
        out = torch.zeros((len(self), L), dtype=x.dtype)
        for i, o in enumerate(self.owner.tolist()):
            P, Rn = len(self.prompts[o]), int(self.resp_attn[i].sum())
            out[i, P: P + Rn] = x[i, :Rn]
        return out

    def from_full(self, x: torch.Tensor) -> torch.Tensor:
        """Map a [B, L] tensor laid out like :meth:`full` back to the [B, R] response layout."""
        out = torch.zeros(self.resp_ids.shape, dtype=x.dtype)
        for i, o in enumerate(self.owner.tolist()):
            P, Rn = len(self.prompts[o]), int(self.resp_attn[i].sum())
            out[i, :Rn] = x[i, P: P + Rn]
        return out


def make_batch(trajs: Sequence[R.Trajectory], advantages: Sequence[float], pad_id: int) -> UpdateBatch:
    """Pack trajectories into an :class:`UpdateBatch`; the per-rollout advantage is broadcast over
    its action tokens (loss_mask 1) only, so observation tokens carry none."""
    if len(trajs) != len(advantages):
        raise ValueError(f"{len(trajs)} trajectories but {len(advantages)} advantages")
    prompts: list[list[int]] = []
    index: dict[tuple[int, ...], int] = {}
    owner = []
    for t in trajs:
        key = tuple(t.prompt_ids)
        if key not in index:
            index[key] = len(prompts)
            prompts.append(list(t.prompt_ids))
        owner.append(index[key])
    B, Rn = len(trajs), max(1, max(len(t.response_ids) for t in trajs))
    ids = torch.full((B, Rn), pad_id, dtype=torch.long)
    attn = torch.zeros((B, Rn), dtype=torch.long)
    resp = torch.zeros((B, Rn), dtype=torch.long)
    elp = torch.zeros((B, Rn), dtype=torch.float32)
    adv = torch.zeros((B, Rn), dtype=torch.float32)
    for i, (t, a) in enumerate(zip(trajs, advantages)):
        n = len(t.response_ids)
        ids[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
        attn[i, :n] = 1
        resp[i, :n] = torch.tensor(t.loss_mask, dtype=torch.long)
        elp[i, :n] = torch.tensor(t.old_logprobs, dtype=torch.float32)
        adv[i, :n] = float(a) * resp[i, :n].float()
    return UpdateBatch(prompts, torch.tensor(owner, dtype=torch.long), ids, attn, resp, elp, adv, pad_id=pad_id,
                       repaired=torch.tensor([bool(getattr(t, "repaired", False)) for t in trajs], dtype=torch.bool))


def micro_batches(batch: UpdateBatch, size: int) -> list[UpdateBatch]:
    """Split into micro-batches of at most ``size`` rollouts, keeping a prompt's rollouts together
    (its prompt is then computed once) and grouping similar lengths."""
    owners = batch.owner.tolist()
    plen = [len(batch.prompts[o]) for o in owners]
    order = sorted(range(len(batch)), key=lambda i: (plen[i], owners[i], int(batch.resp_attn[i].sum())))
    return [batch.select(order[s: s + size]) for s in range(0, len(order), size)]


def batch_logprobs(model: torch.nn.Module, mb: UpdateBatch, temperature: float = 1.0,
                   share_prompt: bool = True) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``: [B, R] float32, 0 off ``response_mask``.

    share_prompt=True runs each distinct prompt through the decoder ONCE (left-padded, with a KV
    cache), copies its cache to the rollouts that share it, then runs only the response tokens:
    the same numbers as a full-sequence forward (up to float rounding) for about
    (P + n R) / (n (P + R)) of the compute -- with 260-token prompts and 50-token answers, 4 rollouts
    per prompt, about 2.7x less. Gradients flow through the prompt's keys/values into the trainable
    layers exactly as in the full forward. share_prompt=False is the plain full-sequence path
    (``reflrl.logprobs.sequence_logprobs``).
    """
    from .logprobs import head_of, sequence_logprobs, token_logprobs_from_hidden

    if not share_prompt:
        ids, attn, resp = mb.full()
        return mb.from_full(sequence_logprobs(model, ids, attn, resp, temperature))
    from transformers import DynamicCache

    decoder, weight, bias = head_of(model)
    G, P = len(mb.prompts), max(len(p) for p in mb.prompts)
    p_ids = torch.full((G, P), mb.pad_id, dtype=torch.long)
    p_mask = torch.zeros((G, P), dtype=torch.long)
    for g, p in enumerate(mb.prompts):  # left padding: every prompt ends at column P-1
        p_ids[g, P - len(p):] = torch.tensor(p, dtype=torch.long)
        p_mask[g, P - len(p):] = 1
    cache = DynamicCache(config=model.config)
    h_p = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache, use_cache=True).last_hidden_state  # [G, P, H]
    owner = mb.owner
    cache.batch_select_indices(owner)  # each rollout gets (a view of) its prompt's keys/values
    B, Rn = mb.resp_ids.shape
    full_mask = torch.cat([p_mask[owner], mb.resp_attn], dim=1)
    pos = p_mask.sum(-1)[owner][:, None] + torch.arange(Rn)[None, :]
    h_r = decoder(input_ids=mb.resp_ids, attention_mask=full_mask, position_ids=pos, past_key_values=cache,
                  use_cache=True).last_hidden_state  # [B, R, H]
    # the hidden state predicting response token t: the prompt's last position for t = 0, else h_r[t-1]
    pred = torch.cat([h_p[owner, -1:].to(h_r.dtype), h_r[:, :-1]], dim=1)
    rows, cols = (mb.response_mask.bool() & mb.resp_attn.bool()).nonzero(as_tuple=True)
    lp = token_logprobs_from_hidden(pred[rows, cols], mb.resp_ids[rows, cols], weight, bias,
                                    temperature=temperature)
    out = torch.zeros((B, Rn), dtype=torch.float32)
    return out.index_put((rows, cols), lp)


# ============================================================================ advantages
def select_and_score(groups: Sequence[Sequence[R.Trajectory]], a: C.AlgoConfig
                     ) -> tuple[list[R.Trajectory], list[float], list[int]]:
    """The rollouts to train on, their advantages and group ids.

    Per group (the n rollouts of one prompt): masked rollouts (unrecovered env faults) are dropped
    first, so they neither get an advantage nor shift the group baseline (env faults are never
    penalised); then, with ``a.downsample_m``, the m live rollouts of maximal reward variance are
    kept (efficiency paper, arXiv:2606.00135, sec. 4.2, eq. 7); the advantage estimator (GRPO eq. 2 by default) runs on what
    is left. Zero-variance groups get advantage 0.
    Returns (trajectories, advantages [one per trajectory], group ids).
    """
    trajs: list[R.Trajectory] = []
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
    one = torch.ones((len(trajs), 1), dtype=torch.long)  # outcome advantages: one value per rollout
    adv_tok, _ = get_advantage_fn(a.advantage)(rewards=rewards, group_ids=group_ids, response_mask=one,
                                               eps=a.adv_eps, gamma=a.gamma, lam=a.lam)
    return trajs, [float(x) for x in adv_tok[:, 0]], group_ids


# ============================================================================ the policy update
def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: UpdateBatch,
                  cfg: C.AlgoConfig, *, temperature: float = 1.0, ref_model: torch.nn.Module | None = None,
                  share_prompt: bool = True, importance: dict[str, Any] | None = None) -> dict[str, float]:
    """One rollout batch -> ``cfg.epochs_per_batch`` optimiser steps of the clipped surrogate.

    Token-mean over the whole batch with gradient accumulation over micro-batches
    (``global_denominator`` = action tokens of the batch), so the result equals one full-batch
    step. Returns averaged loss metrics, grad norm and the engine/trainer log-prob gap.

    ``importance`` (Tool-ReRL variants with the weight, ``{"level": ..., "log_cap": ...}``): the loss is
    ``tool_rerl`` (:mod:`reflrl.algos.importance`, eq. 2). ``lp`` is always log pi_theta of the response
    under the row's OWN prompt tokens, which for a repaired row are the ORIGINAL prompt q's, so the
    numerator is log pi_theta(tau*|q); the repaired rows' old log-probs are their recorded behaviour
    log-probs log pi_theta(tau*|q*) at sampling time (``engine_logprobs``, Assumption 1), the other
    rows' stay as above (ratio 1 at one epoch: the plain clipped loss exactly). Without it, repaired
    rows are trained like any rollout (variant ``ref``: no weight). ``rerl/*`` metrics are pooled
    exactly over the repaired rows of the first epoch (the weights at the update's start).
    """
    loss_fn = get_policy_loss_fn("tool_rerl" if importance is not None else cfg.policy_loss)
    rerl_parts: list[dict[str, float]] = []
    params = [p for p in model.parameters() if p.requires_grad]
    mbs = micro_batches(batch, cfg.micro_batch_size)
    total_tokens = float(batch.response_mask.sum())
    n_seq = float((batch.response_mask.sum(-1) > 0).sum())
    denom = total_tokens if cfg.loss_agg == "token-mean" else n_seq
    old: list[torch.Tensor | None] = [None] * len(mbs)
    if cfg.epochs_per_batch > 1:  # recompute old log-probs once with the current (= sampling) policy
        with torch.no_grad():
            old = [batch_logprobs(model, mb, temperature, share_prompt) for mb in mbs]
    ref: list[torch.Tensor | None] = [None] * len(mbs)
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = [batch_logprobs(ref_model, mb, temperature, share_prompt) for mb in mbs]
    tok_sums: dict[str, float] = {}  # token-weighted sums of the loss function's metrics
    tok_count = 0.0
    losses, grad_norms = [], []
    kl_sum = 0.0
    model.train()
    for _epoch in range(cfg.epochs_per_batch):
        optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for j, mb in enumerate(mbs):
            lp = batch_logprobs(model, mb, temperature, share_prompt)
            old_lp = old[j] if old[j] is not None else lp.detach()
            rep = mb.repaired if mb.repaired is not None else torch.zeros(len(mb), dtype=torch.bool)
            extra: dict[str, Any] = {}
            if importance is not None:
                old_lp = torch.where(rep[:, None], mb.engine_logprobs, old_lp)
                extra = {"repaired": rep, "level": importance["level"], "log_cap": importance["log_cap"]}
            loss, m = loss_fn(lp, old_lp, mb.advantages, mb.response_mask, clip_low=cfg.clip_low,
                              clip_high=cfg.clip_high, dual_clip_c=cfg.dual_clip_c,
                              loss_agg_mode=cfg.loss_agg, global_denominator=denom, **extra)
            if _epoch == 0:
                rerl_parts.append({k: v for k, v in m.items() if k.startswith("rerl/")})
            if ref[j] is not None:
                kl, km = kl_loss(lp, ref[j], mb.response_mask, cfg.kl_estimator, cfg.loss_agg,
                                 global_denominator=denom)
                loss = loss + cfg.kl_coef * kl
                kl_sum += float(km["kl"])  # partial sums over micro-batches add up to the batch's KL
            if not torch.isfinite(loss):
                raise FloatingPointError(f"policy loss is {float(loss)}; check the learning rate")
            loss.backward()
            loss_total += float(loss.detach())
            mask = mb.response_mask.bool()
            w = float(mask.sum())
            on_q = mask & ~rep[:, None]  # repaired rows' engine log-probs are under q*, not q
            if bool(on_q.any()):
                m["engine_logprob_gap"] = float((lp.detach() - mb.engine_logprobs)[on_q].abs().mean())
            for k, v in m.items():
                if k not in ("pg_loss", "tokens", "kl") and not k.startswith("rerl/"):
                    tok_sums[k] = tok_sums.get(k, 0.0) + w * float(v)
            tok_count += w
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        losses.append(loss_total)
        grad_norms.append(float(gn))
    optimizer.zero_grad(set_to_none=True)
    out = {k: v / max(tok_count, 1.0) for k, v in tok_sums.items()}
    out["loss"] = float(np.mean(losses))
    if ref_model is not None and cfg.kl_coef > 0:
        out["kl"] = kl_sum / cfg.epochs_per_batch
    out["grad_norm"] = float(np.mean(grad_norms))
    out["update_tokens"] = total_tokens
    out["update_sequences"] = float(len(batch))
    if importance is not None:
        from .recovery import pooled_weight_stats

        out.update(pooled_weight_stats(rerl_parts))
    return out


# ============================================================================ the trainer
def splits_from_config(d: C.DataConfig) -> dict[str, list]:
    """train/val/test task lists for the data section (synthetic generator or a loader)."""
    from reflrl.envs import datasets as ds

    if d.source == "synthetic":
        sp = ds.synthetic_splits(n_train=d.n_train, n_val=d.n_val, n_test=d.n_test, seed=d.seed,
                                 kinds=tuple(d.kinds))
        splits = {k: list(sp[k]) for k in ("train", "val", "test")}
    else:
        if d.path is None:
            raise C.ConfigError(f"data.source={d.source!r} needs data.path (a local file)")
        fmt = d.fmt or (d.source if d.source in ds.FORMATS else "auto")
        report = ds.load_tasks(d.path, fmt=fmt)
        if report.n_skipped:
            print(f"[reflrl] {report.summary()}", file=sys.stderr)
        tasks = list(report.tasks)
        rng = random.Random(d.seed)
        rng.shuffle(tasks)
        splits = {"test": tasks[: d.n_test], "val": tasks[d.n_test: d.n_test + d.n_val],
                  "train": tasks[d.n_test + d.n_val: d.n_test + d.n_val + d.n_train]}
    for k in splits:
        splits[k] = [t for t in splits[k] if t.kind in d.kinds]
    if not splits["train"]:
        raise C.ConfigError(f"data: no training task of kinds {d.kinds} in source {d.source!r}")
    return splits


class Trainer:
    """Holds everything a run needs; :meth:`run` executes it (see the module docstring).

    ``run_dir``: the run folder (created; with ``resume=True`` the run continues from its last
    checkpoint with the same data order and filter state).
    """

    def __init__(self, cfg: C.Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 quiet: bool = False):
        self.cfg = cfg
        self.progress = progress
        self.quiet = quiet
        self.t_start = time.perf_counter()
        if not resume:
            refuse_existing_run(run_dir)  # before the model loads (issue 18)
        from .progress import Progress

        # bars on a terminal, plain lines with elapsed time and ETA elsewhere (CI logs, nohup, pipes)
        self.progress_out = Progress(enabled=progress and not quiet, clock=self.elapsed, start=0.0,
                                     remaining_after=self._remaining_after)
        tr = cfg.train
        if tr.threads:  # fixed for the run (reflrl.threads: why the count never changes mid-run)
            torch.set_num_threads(tr.threads)
        random.seed(tr.seed)
        np.random.seed(tr.seed)
        torch.manual_seed(tr.seed)
        if cfg.algo.advantage == "gae" or cfg.algo.entropy_coef > 0:
            raise C.ConfigError("the CPU trainer supports outcome advantages (grpo, dr_grpo, rloo) without "
                                "an entropy bonus; algo.advantage='gae' and algo.entropy_coef>0 need a "
                                "value head / full-vocabulary logits it does not compute")
        from . import recovery as RC

        RC.check_cpu_support(cfg)  # e.g. reflection.variant='ppo' needs a value head

        # ---- data ------------------------------------------------------------------
        self.splits = splits_from_config(cfg.data)
        self.train_tasks = self.splits["train"]
        self.prefilter = PreRolloutFilter(cfg.algo.prefilter_k)
        self.sampler = PromptSampler([t.id for t in self.train_tasks], tr.seed, self.prefilter)
        self.sampling = None
        sc = cfg.sampling
        if sc.curriculum and not cfg.env.reward.startswith("fine"):
            raise C.ConfigError(f"sampling.curriculum=true needs a fine-grained reward (env.reward='fine'), "
                                f"got env.reward={cfg.env.reward!r}")
        if sc.sampler != "none" or sc.curriculum:
            from .algos.dscl import SamplingController, batches_per_epoch

            self.sampling = SamplingController.from_config(
                sc, reward_name=cfg.env.reward, seed=tr.seed,
                batches_per_epoch=batches_per_epoch(len(self.train_tasks), cfg.rollout.batch_prompts))

        # ---- model, engine ---------------------------------------------------------
        from .engine import TransformersEngine
        from .models import load_model

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bars only
        t0 = time.perf_counter()
        m = cfg.model
        from .precision import resolve_dtype

        self.precision = resolve_dtype(m.dtype)  # 'auto': bfloat16 only where the CPU computes it natively
        self.say(self.precision.log_line())
        if self.precision.warning:
            print(f"[reflrl] warning: {self.precision.warning}", file=sys.stderr, flush=True)
        self.model, self.tokenizer = load_model(m.name, dtype=self.precision.dtype, trainable=m.trainable, lora_r=m.lora_r,
                                                lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                                                seed=tr.seed, trainable_dtype=m.trainable_dtype)
        if m.init_from:  # e.g. RL variants that share one warm-up (scripts/paper_table.py --warm-start)
            load_checkpoint(Path(m.init_from).expanduser(), model=self.model, optimizer=None, restore_rng=False)
        self.load_s = time.perf_counter() - t0
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.engine = TransformersEngine(self.model, self.tokenizer,
                                         max_batch_size=max(64, cfg.rollout.n * cfg.rollout.batch_prompts))
        self.remote_engine = self._remote_engine()  # rollout.engine='openai'; None = sample with self.engine
        from .trunk_cache import TrunkCache

        # held-out evaluations see the same prompts each time: the frozen bottom layers run once per prompt
        self.eval_engine = TransformersEngine(self.model, self.tokenizer, max_batch_size=64,
                                              trunk_cache=TrunkCache(self.model))
        self.eval_batch = 64  # greedy evaluation: prompts decoded together (sorted by length)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise C.ConfigError(f"model.trainable={m.trainable!r} leaves no trainable parameter")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
        self.ref_model = None  # KL reference (algo.kl_coef > 0): the policy as RL starts, see run()
        # Tool-ReRL variant (reflection.variant; reflrl.recovery): its critic when it repairs failures
        self.variant = RC.variant_of(cfg)
        self.critic = RC.build_critic(cfg, self.engine, self.tokenizer) if self.variant.reflect else None

        # ---- envs --------------------------------------------------------------------
        self.n_envs = cfg.rollout.n * cfg.rollout.batch_prompts
        self.envs = self._make_envs(self.n_envs)
        self.loop = asyncio.new_event_loop()
        self.rollout_cfg = R.RolloutConfig(
            max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, max_turns=cfg.rollout.max_turns,
            max_total_tokens=cfg.rollout.max_total_tokens, concurrent=cfg.env.concurrency > 1,
            concurrency=cfg.env.concurrency, answer_cap=cfg.rollout.answer_cap,
            stop_at_complete=cfg.rollout.stop_at_complete, fmt=self._fmt(), think=self._think())
        # greedy held-out evaluation: the rollouts' caps and early stop, temperature 0
        self.eval_cfg = dataclasses.replace(self.rollout_cfg, temperature=0.0)

        # ---- run folder and state -------------------------------------------------------
        self.log = RunLog(run_dir, None, resume=resume)
        if not resume:
            C.save_config(cfg, self.log.path / "config.yaml", header="resolved config of this run "
                          "(reflrl train --resume RUN_DIR reads it back)")
        self.step = 0
        self.state: dict[str, Any] = {"phase": "start", "timers": {"rollout_s": 0.0, "update_s": 0.0,
                                                                    "eval_s": 0.0, "warmup_s": 0.0},
                                      "elapsed_before_s": 0.0, "zero_var_ratio": [], "rewards": [],
                                      "masked": 0, "trajectories": 0, "episodes": 0}
        if resume:
            ck = latest_checkpoint(self.log.path)
            if ck is None:  # killed before the first checkpoint (issue 18): RunLog emptied the metrics
                self.say(f"{self.log.path} has no checkpoint yet: the run starts from the beginning")
            else:
                self._load(ck)

    # -------------------------------------------------------------------------------- set-up
    @property
    def rollout_engine(self):
        """The engine that samples RL rollouts: the remote one when configured, else ``self.engine``."""
        return self.remote_engine if self.remote_engine is not None else self.engine

    def _remote_engine(self):
        """The remote engine that samples RL rollouts (``rollout.engine``). 'transformers': None (rollouts
        come from ``self.engine``, the trained model itself, so they are always on-policy). 'vllm': the vLLM
        offline engine (reflrl.engines.vllm_engine, one GPU), whose weights :meth:`train_step` replaces after
        every update, so rollouts stay on-policy. 'openai': an OpenAI-compatible
        server (reflrl.engines.openai_engine) that samples from ITS OWN weights; the trainer cannot push
        updates to it (``update_weights`` raises), so after the first update the rollouts are
        off-policy and the loss does not correct for it. Config validation refuses it unless
        ``rollout.engine_off_policy=true``; held-out evaluation still scores the local, trained model."""
        r = self.cfg.rollout
        if r.engine == "transformers":
            return None
        from .engines import get_engine

        if r.engine == "vllm":  # on-policy: train_step pushes the weights after every update
            return get_engine("vllm", model_path=self._model_path(), dtype=self.cfg.model.dtype,
                              seed=self.cfg.train.seed)

        print(f"[reflrl] warning: rollouts come from {r.engine_base_url} (rollout.engine=openai), whose weights "
              "are never synced with the trained model: off-policy after the first update", file=sys.stderr)
        return get_engine("openai", base_url=r.engine_base_url, model=r.engine_model or self.cfg.model.name,
                          tokenizer=self.tokenizer, max_concurrency=max(1, self.cfg.env.concurrency))

    def _model_path(self) -> str:
        """A folder or hub id vLLM can load for ``model.name`` (the embedded GGUF: its converted copy)."""
        from .models import _convert_embedded

        name = self.cfg.model.name
        return str(_convert_embedded()) if name == "smollm2-135m-instruct" else name

    def _make_envs(self, count: int) -> list:
        import gymnasium as gym

        import reflrl.envs  # noqa: F401  (registers the env ids)
        from reflrl.envs.server import create_app

        e = self.cfg.env
        app = create_app()  # one in-process tool server shared by all envs
        self.tool_server = app.server  # close() deletes its sandboxes (issue 18)
        return [gym.make(e.id, dataset=self.train_tasks, faults=e.faults or None, fault_seed=e.fault_seed,
                         seed=self.cfg.train.seed + k, reward=e.reward, parser=e.parser,
                         prompt_style=self.cfg.data.prompt_style, max_steps=e.max_steps,
                         retry={"max_attempts": e.retry.max_attempts, "budget_s": e.retry.budget_s},
                         app=app, episode_prefix=f"w{k}", think=self._think()).unwrapped
                for k in range(count)]

    def messages(self, task) -> list[dict]:
        """The chat messages that start an episode of ``task`` (same rendering as the envs)."""
        from reflrl.envs.prompts import build_messages

        return build_messages(task, style=self.cfg.data.prompt_style, fmt=self._fmt(), think=self._think())

    def _think(self) -> bool:
        """Thought-then-call prompts (reflection.think, or the variant's default: cot, cot_is)."""
        from .recovery import think_of

        return think_of(self.cfg)

    def _fmt(self) -> str:
        return "hermes" if self.cfg.env.parser == "auto" else self.cfg.env.parser

    def elapsed(self) -> float:
        """Seconds of this run so far (across --resume)."""
        before = self.state["elapsed_before_s"] if hasattr(self, "state") else 0.0
        return before + (time.perf_counter() - self.t_start)

    def _remaining_after(self) -> float | None:
        """Estimated seconds after the current phase (progress ETA): during RL, the final evaluation."""
        return self._eval_estimate_s() if self.state.get("phase") == "rl" else None

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[reflrl] {msg}", flush=True)

    # -------------------------------------------------------------------------------- evaluation
    def evaluate(self, split: str = "test") -> dict[str, Any]:
        from .evaluate import evaluate

        t0 = time.perf_counter()
        res = evaluate(self.eval_engine, self.tokenizer, self.splits[split], self.messages, self.eval_cfg,
                       batch_size=self.eval_batch)
        self.state["timers"]["eval_s"] += time.perf_counter() - t0
        return res.to_dict()

    def probe_format_rate(self) -> float:
        from .evaluate import format_rate

        w = self.cfg.warmup
        pool = self.splits["val"] or self.train_tasks
        tasks = [pool[i % len(pool)] for i in range(w.probe_n)]
        t0 = time.perf_counter()
        r = format_rate(self.engine, self.tokenizer, tasks, self.messages, self.rollout_cfg,
                        batch_size=self.eval_batch, seed=derive_seed(self.cfg.train.seed, 77))
        self.state["timers"]["eval_s"] += time.perf_counter() - t0
        return r

    # -------------------------------------------------------------------------------- warm-up
    def warmup(self) -> dict[str, Any]:
        """Supervised warm-up when the format rate is below the threshold (or always/never): exactly
        ``warmup.steps`` SFT steps unless the time guard cuts it (then recorded as a budget cut)."""
        from .sft import build_examples, train_sft

        w, tr = self.cfg.warmup, self.cfg.train
        out: dict[str, Any] = {"ran": False}
        if w.enabled is False or w.steps == 0:
            return out
        if w.probe_n > 0:  # sampled at the rollout temperature on probe_n tasks (costs a generation pass)
            out["format_rate_before"] = self.probe_format_rate()
            out["format_rate_source"] = f"{w.probe_n} sampled answers (temperature {self.cfg.rollout.temperature})"
        else:  # free: the greedy answers of the held-out evaluation that just ran
            out["format_rate_before"] = float(self.state["eval_before"]["format_rate"])
            out["format_rate_source"] = "greedy held-out evaluation"
        self.say(f"format rate before warm-up: {out['format_rate_before']:.0%} "
                 f"(threshold {w.format_rate_threshold:.0%}; {out['format_rate_source']})")
        if w.enabled == "auto" and out.get("format_rate_before", 0.0) >= w.format_rate_threshold:
            return out
        t0 = time.perf_counter()
        examples = build_examples(self.train_tasks, self.tokenizer, self.messages, fmt=self._fmt())
        # evaluations still to come: after the warm-up (if on) and after RL, each about the first one's cost
        n_evals = 1 + int(bool(w.eval_after or tr.eval_every))
        reserve = n_evals * self._eval_estimate_s()

        def should_stop(done: int, sps: float | None) -> bool:
            est = sps or 0.0
            if w.time_budget_min is not None and time.perf_counter() - t0 + est > w.time_budget_min * 60:
                return True
            return self._over_budget(est + reserve)

        phase = self.progress_out.phase("warm-up", w.steps)
        res = train_sft(self.model, self.tokenizer, examples, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                        seed=derive_seed(self.cfg.train.seed, 11), grad_clip=self.cfg.algo.grad_clip or 1.0,
                        warmup_steps=min(5, w.steps // 10), should_stop=should_stop,
                        log=lambda s, m: self.log.log(s, m, phase="warmup"),
                        on_step=lambda done, loss: phase.update(1, loss=loss))
        phase.close("cut by the time budget" if res["cut"] else "")
        if res["cut"]:
            self._record_cut("warm-up", res["steps"], w.steps)
        self.state["timers"]["warmup_s"] += time.perf_counter() - t0
        out.update(ran=True, **{f"sft_{k}": v for k, v in res.items()})
        if w.probe_n > 0:
            out["format_rate_after"] = self.probe_format_rate()
        loss = ("n/a" if res.get("loss_first") is None  # 0 steps: the time budget left none
                else f"{res['loss_first']:.2f} -> {res['loss_last']:.2f}")
        self.say(f"warm-up: {res['steps']} SFT steps in {res['seconds']:.0f}s, loss {loss}")
        return out

    # -------------------------------------------------------------------------------- one RL step
    def rollout(self, task_idx: list[int], round_: int, timings: dict[str, float]) -> list[R.Trajectory]:
        tasks = [self.train_tasks[i] for i in task_idx]
        seed = derive_seed(self.cfg.train.seed, self.step, round_, 1)
        n = self.cfg.rollout.n
        self.state["episodes"] += len(tasks) * n
        return self.loop.run_until_complete(
            R.arollout(self.rollout_engine, self.tokenizer, self.envs, tasks, n, self.rollout_cfg, seed=seed,
                       timings=timings))

    def recover(self, trajs: list[R.Trajectory], round_: int) -> Any:
        """Tool-ReRL's reflection-recovery on one round of rollouts (:func:`reflrl.recovery.arecover`):
        triage, batched reflection-guided retries, repaired rollouts swapped into ``trajs``."""
        from .recovery import arecover

        res = self.loop.run_until_complete(arecover(
            trajs, cfg=self.cfg, engine=self.engine, tokenizer=self.tokenizer, envs=self.envs, critic=self.critic,
            messages_of=self.messages, rollout_cfg=self.rollout_cfg,
            seed=derive_seed(self.cfg.train.seed, self.step, round_, 2)))
        if res.errors and not self.state.get("reflection_error_shown"):
            self.state["reflection_error_shown"] = True
            self.say(f"reflection failed for {len(res.errors)} rollout(s) (counted, training goes on): {res.errors[0]}")
        return res

    def train_step(self) -> dict[str, Any]:
        """Sample prompts, roll out, filter, compute advantages, update. Returns the step's metrics."""
        cfg, a, n = self.cfg, self.cfg.algo, self.cfg.rollout.n
        B = cfg.rollout.batch_prompts
        t_step = time.perf_counter()
        timings: dict[str, float] = {}
        epoch_before = self.sampler.epoch

        # 1. prompts (the pre-rollout filter acts when an epoch starts) + rollouts
        groups: list[list[R.Trajectory]] = []
        kept_groups: list[list[R.Trajectory]] = []
        zero_var = live_groups = 0
        rounds = 0
        want = B
        ctl = self.sampling  # DSCL curriculum / prompt-level samplers (DSCL); None = off
        recoveries: list[Any] = []  # Tool-ReRL per-round results (reflrl.recovery)
        while want > 0:
            idx = self.sampler.next(want)
            trajs = self.rollout(idx, rounds, timings)
            if self.critic is not None:  # Tool-ReRL: failed rollouts repaired in place, in their groups
                recoveries.append(self.recover(trajs, rounds))
            round_groups = [[t for t in trajs if t.group == g] for g in range(len(idx))]  # n (+ added repairs)
            groups.extend(round_groups)
            if ctl is not None:
                self._dscl_rewards(round_groups)
            kept_mask = []
            for grp in round_groups:
                live = [t for t in grp if not t.masked]
                if not live:  # every rollout hit an unrecovered env fault: nothing to learn, nothing to blame
                    kept_mask.append(False)
                    continue
                # 2. the filter's all-correct streak (eqs. 4-5), on the policy's own live rollouts (not repairs)
                own_live = [o for o in own_rollouts(grp) if not o.masked]
                if own_live:
                    self.prefilter.update(grp[0].task.id, [float(t.correct) for t in own_live], r_max=1.0)
                live_groups += 1
                rs = [t.reward for t in live]
                zv = len(live) < 2 or max(rs) == min(rs)
                zero_var += zv
                # DAPO dynamic sampling: drop the zero-variance group, refill below
                kept_mask.append(not (a.dynamic_sampling and zv))
            if ctl is not None:  # DSCL RDS / SMV / SMR / DAPO selection over the groups
                sel = ctl.select(self.step, self.sampler.epoch,
                                 [(g[0].task.id, [t.reward for t in g if not t.masked]) for g in round_groups],
                                 round_=rounds)
                kept_mask = [k and s_ for k, s_ in zip(kept_mask, sel)]
            kept_groups.extend(g for g, k in zip(round_groups, kept_mask) if k)
            rounds += 1
            refill = a.dynamic_sampling or (ctl is not None and ctl.refill)
            if not refill or rounds > a.max_refill_rounds:
                break
            keep_rate = len(kept_groups) / max(1, len(groups))
            want = min(B, groups_to_request(B, len(kept_groups), keep_rate, max_request=B))
        rollout_s = time.perf_counter() - t_step
        all_trajs = [t for g in groups for t in g]

        # 3. max-variance down-sampling (eq. 7), GRPO advantages over the live rollouts of each group
        metrics: dict[str, Any] = {}
        t_up = time.perf_counter()
        train_trajs, adv, group_ids = select_and_score(kept_groups[:B], a)
        # rollouts with zero advantage give exactly zero gradient: leave them out of the compute
        use = [i for i, v in enumerate(adv) if v != 0.0 and train_trajs[i].n_action_tokens > 0]
        metrics["groups_trained"] = len({group_ids[i] for i in use})
        metrics["adv_abs_mean"] = float(np.mean(np.abs(adv))) if adv else 0.0
        n_signal = len(use)
        metrics["repaired_trained"] = float(sum(bool(train_trajs[i].repaired) for i in use))
        if self.variant.dpo:  # Tool-ReRL's DPO baseline: DPO on (repaired, failed) pairs only (reflrl.recovery)
            from .recovery import dpo_pairs, dpo_update

            pairs = dpo_pairs([t for g in kept_groups[:B] for t in g])
            n_signal = 2 * len(pairs)
            if pairs:
                if self.ref_model is None:  # the policy as DPO starts (no update happened before the first pair)
                    self.ref_model = copy.deepcopy(self.model).eval()
                    for p in self.ref_model.parameters():
                        p.requires_grad_(False)
                metrics.update(dpo_update(self.model, self.optimizer, self.ref_model, pairs, cfg, self.pad_id))
        elif use:
            batch = make_batch([train_trajs[i] for i in use], [adv[i] for i in use], self.pad_id)
            imp = ({"level": cfg.reflection.level, "log_cap": cfg.reflection.log_cap}
                   if self.variant.importance else None)  # eq. 2 on repaired rows (tool_rerl, cot_is, external_is)
            metrics.update(policy_update(self.model, self.optimizer, batch, a, importance=imp,
                                         temperature=cfg.rollout.temperature, ref_model=self.ref_model))
        metrics["update_skipped"] = float("loss" not in metrics)
        if "loss" in metrics and self.cfg.rollout.engine == "vllm":
            self.remote_engine.update_weights(self.model)  # the next rollouts sample the updated policy
        update_s = time.perf_counter() - t_up

        # 4. bookkeeping (reward/accuracy of the policy's own samples; `masked`: left out of the loss)
        from .recovery import RecoveryLedger, step_accounting

        stats = R.rollout_stats(own_rollouts(all_trajs))
        counts, rec_metrics = step_accounting(recoveries, all_trajs, n_signal)
        RecoveryLedger(self.state.setdefault("recovery", {})).add_step(
            counts, [r.critic for r in recoveries], n_signal, metrics)
        metrics.update(rec_metrics)
        masked = sum(t.masked for t in all_trajs)
        self.state["masked"] += masked
        self.state["trajectories"] += len(all_trajs)
        zvr = zero_var / max(1, live_groups)
        self.state["zero_var_ratio"].append(zvr)
        self.state["rewards"].append(stats["reward_mean"])
        self.state["timers"]["rollout_s"] += rollout_s
        self.state["timers"]["update_s"] += update_s
        metrics.update(stats)
        metrics.update({
            "epoch": self.sampler.epoch, "groups": len(groups),
            "zero_var_ratio": zvr, "masked": masked, "sampling_rounds": rounds,
            "prefilter_skipped_epoch": self.sampler.skipped.get(self.sampler.epoch, 0),
            "trained_rollouts": len(train_trajs), "task_ids": [g[0].task.id for g in groups],
            "group_all_correct": [group_all_correct(g) for g in groups],  # aligned with task_ids (reflrl.report)
            "time_rollout_s": rollout_s, "time_generate_s": timings.get("generate_s", 0.0),
            "time_env_s": timings.get("env_s", 0.0), "time_update_s": update_s,
            "time_step_s": time.perf_counter() - t_step,
        })
        if ctl is not None:
            metrics.update(ctl.step_metrics())
        if self.sampler.epoch != epoch_before:
            metrics["new_epoch"] = True
            if ctl is not None and epoch_before >= 0:  # the finished epoch's category shares (dscl docstring)
                self.log.log(self.step, ctl.epoch_record(epoch_before), phase="epoch")
        return metrics

    def _dscl_rewards(self, groups: list[list[R.Trajectory]]) -> None:
        """DSCL TDCL (DSCL sec. 4.1): feed the batch's sub-reward fractions to the stage
        machine, then re-score each live rollout with the stage's reward (eq. 7) when the
        curriculum is on (otherwise the env reward is kept)."""
        from .algos.dscl import episode_stage_reward, scored_turn_parts, subreward_fractions

        ctl = self.sampling
        rows, live = [], []
        for grp in groups:
            for t in grp:
                if t.masked:
                    continue
                parts = scored_turn_parts(t.info.get("steps", []))
                if parts:
                    rows.append(subreward_fractions(parts[-1], t.task.gold[min(len(parts), len(t.task.gold)) - 1]))
                    live.append((t, parts))
        ctl.observe_subrewards(self.step, rows)
        if not ctl.curriculum.weighted:
            return
        for t, parts in live:
            n_turns = 1 + len(t.task.turns) if self.rollout_cfg.max_turns > 1 else 1
            t.reward = episode_stage_reward(parts, t.task.gold, n_turns, ctl.curriculum.lambdas)

    # -------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        s = dict(self.state)
        s["step"] = self.step
        s["elapsed_before_s"] = self.elapsed()
        s["sampler"] = self.sampler.state_dict()
        s["prefilter"] = self.prefilter.state_dict()
        if self.sampling is not None:
            s["sampling"] = self.sampling.state_dict()
        return s

    def save(self) -> Path:
        return self.log.save_checkpoint(self.step, model=self.model, tokenizer=self.tokenizer,
                                        optimizer=self.optimizer, state=self.checkpoint_state(),
                                        keep_last=self.cfg.train.keep_checkpoints)

    def _load(self, ck: Path) -> None:
        s = load_checkpoint(ck, model=self.model, optimizer=self.optimizer)
        self.step = int(s.pop("step"))
        self.sampler.load_state_dict(s.pop("sampler"))
        self.prefilter.load_state_dict(s.pop("prefilter"))
        sampling = s.pop("sampling", None)
        if self.sampling is not None and sampling is not None:
            self.sampling.load_state_dict(sampling)
        self.state.update(s)
        self.t_start = time.perf_counter()
        self.say(f"resumed {self.log.path} at step {self.step} ({ck.name})")

    # -------------------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        """Eval before, warm-up, eval after warm-up, RL steps, eval after, summary.

        The recipe is defined by step counts (warm-up steps, RL steps, evaluation sizes, token caps), so
        the same seed gives the same numbers on a fast or slow, idle or busy machine. The time budget
        (``train.time_budget_min``, ``warmup.time_budget_min``) is only a guard: a phase it cuts is
        recorded in ``state["budget_cuts"]`` and reported loudly (log, summary, report, exit status)."""
        cfg, tr = self.cfg, self.cfg.train
        st = self.state
        st.setdefault("budget_cuts", [])
        if st["phase"] == "done":  # resumed after the final checkpoint (issue 18): nothing to redo
            summary = self.summary()
            self.log.write_summary(summary)
            return summary
        if st["phase"] == "start":
            self.say(f"run folder {self.log.path}; model {cfg.model.name} loaded in {self.load_s:.0f}s; "
                     f"{len(self.train_tasks)} train / {len(self.splits['test'])} test tasks; "
                     f"faults: {cfg.env.faults or 'none'}")
            st["eval_before"] = self._evaluate_phase("eval before", "test")
            self.log.log(0, {f"test_{k}": v for k, v in st["eval_before"].items()}, phase="eval")
            self.say(f"held-out accuracy before: {st['eval_before']['accuracy']:.1%} "
                     f"({st['eval_before']['n']} tasks, {st['eval_before']['seconds']:.0f}s)")
            st["warmup"] = self.warmup()
            if st["warmup"].get("ran") and (cfg.warmup.eval_after or tr.eval_every):
                # what the warm-up alone gives, to tell it apart from RL's gain (costs one more evaluation)
                st["eval_after_warmup"] = self._evaluate_phase("eval after warm-up", "test")
                self.log.log(0, {f"test_after_warmup_{k}": v for k, v in st["eval_after_warmup"].items()},
                             phase="eval")
                self.say(f"held-out accuracy after warm-up: {st['eval_after_warmup']['accuracy']:.1%} "
                         f"({st['eval_after_warmup']['seconds']:.0f}s)")
                if cfg.warmup.probe_n == 0:  # the warm-up's format rate, from the same greedy answers
                    st["warmup"]["format_rate_after"] = float(st["eval_after_warmup"]["format_rate"])
            st["phase"] = "rl"
            self.save()
        if cfg.algo.kl_coef > 0 and self.ref_model is None:
            # the reference is the policy RL starts from (after the warm-up; on --resume, the resumed one)
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        final_eval_s = self._eval_estimate_s()
        step_times: list[float] = []
        stop_reason = "steps"
        phase = self.progress_out.phase("RL", tr.steps, initial=self.step) if tr.steps else None
        while self.step < tr.steps:
            est = float(np.mean(step_times[-3:])) if step_times else 0.0
            if self._over_budget(est + final_eval_s):
                stop_reason = "time_budget"
                self._record_cut("RL", self.step, tr.steps)
                break
            m = self.train_step()
            self.step += 1
            step_times.append(m["time_step_s"])
            if self.step % tr.log_every == 0 or self.step == tr.steps:
                self.log.log(self.step, m)
            if tr.eval_every and self.step % tr.eval_every == 0 and self.splits["val"]:
                ev = self.evaluate("val")
                self.log.log(self.step, {f"val_{k}": v for k, v in ev.items()}, phase="eval")
            if tr.save_every and self.step % tr.save_every == 0:
                self.save()
            if phase is not None:
                phase.update(1, reward=m["reward_mean"], acc=m["correct_rate"], zero_var=m["zero_var_ratio"],
                             masked=int(m["masked"]))
        if phase is not None:
            phase.close("cut by the time budget" if stop_reason == "time_budget" else "")
        st["stop_reason"] = stop_reason
        if self.sampling is not None and self.sampler.epoch >= 0:  # the last epoch's shares so far
            self.log.log(self.step, self.sampling.epoch_record(
                self.sampler.epoch, partial=self.sampler.pos < len(self.sampler.order)), phase="epoch")
        st["phase"] = "done"
        st["eval_after"] = self._evaluate_phase("eval after", "test")
        self.log.log(self.step, {f"test_{k}": v for k, v in st["eval_after"].items()}, phase="eval")
        self.save()
        summary = self.summary()
        self.log.write_summary(summary)
        return summary

    # -------------------------------------------------------------------------------- the time guard
    def _evaluate_phase(self, name: str, split: str) -> dict[str, Any]:
        """A held-out evaluation as a progress phase (a line when it starts and when it ends)."""
        n = len(self.splits[split])
        if self.progress_out.enabled:
            self.progress_out.line(f"{name}: {n} held-out tasks, greedy")
        res = self.evaluate(split)
        if self.progress_out.enabled:
            self.progress_out.line(f"{name} done: accuracy {res['accuracy']:.1%} in {res['seconds']:.0f}s "
                                   f"({res.get('new_tokens', 0)} new tokens)")
        return res

    def _eval_estimate_s(self) -> float:
        """Seconds the next held-out evaluation should take: the last one's."""
        for key in ("eval_after_warmup", "eval_before"):
            if key in self.state:
                return float(self.state[key].get("seconds", 0.0))
        return 0.0

    def _over_budget(self, upcoming_s: float) -> bool:
        """Would ``upcoming_s`` more seconds overrun ``train.time_budget_min`` (the whole run's guard)?"""
        b = self.cfg.train.time_budget_min
        return b is not None and self.elapsed() + upcoming_s > b * 60

    def _record_cut(self, phase: str, done: int, planned: int) -> None:
        """Record (and say loudly) that the time budget cut ``phase`` at ``done`` of ``planned`` steps."""
        cut = cut_record(phase, done, planned, elapsed_s=self.elapsed(), budget_min=self.cfg.train.time_budget_min,
                         warmup_budget_min=self.cfg.warmup.time_budget_min)
        self.state.setdefault("budget_cuts", []).append(cut)
        print(f"[reflrl] WARNING: {budget_cut_text(cut)}", file=sys.stderr, flush=True)
        self.log.log(self.step, {"budget_cut_phase": phase, "budget_cut_done": done, "budget_cut_planned": planned},
                     phase="budget")

    def ledger_totals(self) -> dict[str, Any]:
        """Fault and triage counts summed over the envs' ledgers (this process's episodes)."""
        tot: dict[str, Any] = {"calls": 0, "attempts": 0, "retries": 0, "recovered": 0, "given_up": 0,
                               "policy_errors": 0, "tool_bugs": 0, "faults_by_kind": {}, "injected_by_kind": {}}
        for env in self.envs:
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

    def summary(self) -> dict[str, Any]:
        st = self.state
        before, after = st.get("eval_before", {}), st.get("eval_after", {})
        wu = st.get("warmup", {})
        mid = st.get("eval_after_warmup", {})
        cuts = list(st.get("budget_cuts", []))
        return {
            "run_dir": str(self.log.path),
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
            "precision": self.precision.to_dict(), **threads_summary(),
            "format_rate_before": wu.get("format_rate_before"), "format_rate_after": wu.get("format_rate_after"),
            "warmup": wu,
            "steps": self.step, "stop_reason": st.get("stop_reason"),
            "reward_per_step": st["rewards"], "zero_var_ratio_per_step": st["zero_var_ratio"],
            "prefilter_skipped_per_epoch": dict(self.sampler.skipped),
            "trajectories": st["trajectories"], "masked_trajectories": st["masked"],
            # RL rollouts sampled (n per prompt, DAPO-style refills included; not reflection re-attempts)
            "rollouts": st.get("episodes", st["trajectories"]),
            "sampling": self.sampling.summary() if self.sampling is not None else None,
            "faults": self.ledger_totals(),
            "time_s": {**{k: round(v, 1) for k, v in st["timers"].items()}, "load_s": round(self.load_s, 1),
                       "total_s": round(self.elapsed(), 1)},
            "config": {"faults": self.cfg.env.faults, "model": self.cfg.model.name, "seed": self.cfg.train.seed,
                       "variant": self.cfg.reflection.variant},
            "recovery": self._recovery_summary(),
        }

    def _recovery_summary(self) -> dict[str, Any]:
        """Tool-ReRL accounting over the run (reflrl.recovery.RecoveryLedger): failures by cause,
        recovered by the client's retries / by reflection, discarded, tool calls per trajectory with a
        learning signal, critic calls and latency, importance weights per step."""
        from .recovery import RecoveryLedger

        return {"variant": self.cfg.reflection.variant,
                **RecoveryLedger(self.state.setdefault("recovery", {})).summary()}

    def close(self) -> None:
        for env in self.envs:
            try:
                if getattr(env, "_client", None) is not None:
                    self.loop.run_until_complete(env.aclose())
            except Exception:  # noqa: BLE001  closing is best-effort at shutdown
                pass
        if not self.loop.is_closed():
            self.loop.close()
        self.tool_server.shutdown()
        self.log.close()


# ============================================================================ CLI
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
        from .recovery import format_recovery

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
    else:
        lines.append("result: the recipe ran whole (every planned step)")
    return "\n".join(lines)


DEFAULT_CONFIG = C.default_recipe()  # configs/default.yaml, shipped as package data (same in a wheel)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reflrl train", description="Train a tool-calling policy with GRPO on the "
                                "CPU, through fault-injecting tools. Writes a run folder.")
    p.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.name}, the default recipe)")
    p.add_argument("--faults", help="fault spec, e.g. rate_limit=0.1,timeout=0.05 (sets env.faults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set algo.lr=2e-5 (repeatable)")
    p.add_argument("--seed", type=int, help="sets train.seed")
    p.add_argument("--name", help="run folder name (sets train.run_name)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--no-report", action="store_true",
                   help="do not write the run report (report.html, report.md, plots/) at the end")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the recipe, --config, --faults and --set applied) as YAML and exit")
    p.add_argument("--backend", choices=("cpu", "verl"), default="cpu",
                   help="cpu: this process's trainer (default); verl: build a verl config from --config "
                        "(a configs/verl/*.yaml recipe) and launch verl's trainer on Ray (docs/scale-out.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --backend verl: build and validate the verl config, print it, don't train")
    return p


def resolve_config(args: argparse.Namespace) -> tuple[C.Config, Path, bool]:
    """(config, run folder, resume?) from the parsed command line."""
    overrides = list(args.overrides)
    if args.faults is not None:
        from reflrl.faults.spec import FaultPlan

        overrides.append(f"env.faults={'' if args.faults in ('', 'none') else str(FaultPlan.parse(args.faults))}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise C.ConfigError(f"--resume {run_dir}: no config.yaml there (not a reflrl run folder)")
        cfg = C.load_config(run_dir / "config.yaml", overrides)
        return cfg, run_dir, True
    if args.name:
        overrides.append(f"train.run_name={args.name}")
    path = args.config if args.config else DEFAULT_CONFIG
    if not Path(path).is_file():
        raise C.ConfigError(f"config file {str(path)!r} does not exist"
                            + ("" if args.config else " (the default recipe is missing from this installation)"))
    cfg = C.load_config(path, overrides)
    name = cfg.train.run_name or (datetime.now().strftime("%Y%m%d-%H%M%S") + f"-s{cfg.train.seed}")
    run_dir = Path(cfg.train.out_dir) / name
    try:
        refuse_existing_run(run_dir)
    except FileExistsError as e:
        raise C.ConfigError(str(e)) from None
    return cfg, run_dir, False


def train(cfg: C.Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
          quiet: bool = False, report: bool = True) -> dict[str, Any]:
    """Run a whole training job; returns the summary (also in run_dir/summary.json). With ``report``
    the run report (reflrl.report: report.html, report.md, plots/) is written at the end and its
    path returned as ``summary["report"]`` (None, with the reason on stderr, if it failed: the
    finished training is never lost to a report error)."""
    trainer = Trainer(cfg, run_dir, resume=resume, progress=progress, quiet=quiet)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    if report:
        summary["report"] = write_run_report(trainer.log.path)
    return summary


def write_run_report(run_dir: str | Path) -> str | None:
    """``reflrl report RUN_DIR`` for a finished run; logs (never raises) a failure."""
    try:
        from .report import build_report

        return str(build_report(run_dir).html)
    except Exception as e:  # noqa: BLE001  the training is done; the report can be redone by hand
        print(f"[reflrl] the run finished but its report could not be written: {type(e).__name__}: {e}\n"
              f"[reflrl] retry with: reflrl report {run_dir}", file=sys.stderr, flush=True)
        return None


def _main_verl(args: argparse.Namespace) -> int:
    """``reflrl train --backend verl --config configs/verl/X.yaml``: hand over to verl (GPU; not run
    here, see docs/scale-out.md). Configuration errors exit 2 with the message."""
    if not args.config:
        print("reflrl train: error: --backend verl needs --config configs/verl/<recipe>.yaml", file=sys.stderr)
        return 2
    try:
        from reflrl.verl_backend.launch import main as verl_main
    except ImportError as e:
        print(f"reflrl train: error: the verl backend needs the verl extra (pip install 'reflrl[verl]'): {e}",
              file=sys.stderr)
        return 2
    overrides = list(args.overrides) + ([f"env.faults={args.faults}"] if args.faults else [])
    try:
        out = verl_main(args.config, overrides, dry_run=args.dry_run, write_data=not args.dry_run)
    except (C.ConfigError, ValueError) as e:
        print(f"reflrl train: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``reflrl train`` entry point; returns the exit status (2 for configuration errors)."""
    args = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config:
        print(C.config_help())
        return 0
    if args.backend == "verl":
        return _main_verl(args)
    try:
        cfg, run_dir, resume = resolve_config(args)
        from .recovery import check_cpu_support

        check_cpu_support(cfg)  # e.g. reflection.variant='ppo': exit 2 with the reason, before loading anything
    except (C.ConfigError, ValueError) as e:
        print(f"reflrl train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        src = args.resume or args.config or str(DEFAULT_CONFIG)
        print(C.dump_config(cfg, header=f"resolved config: {src}"), end="")
        return 0
    summary = train(cfg, run_dir, resume=resume, progress=not args.no_progress, quiet=args.quiet,
                    report=not args.no_report)
    print(format_summary(summary), flush=True)
    return EXIT_BUDGET_CUT if summary.get("budget_cuts") else 0


if __name__ == "__main__":
    raise SystemExit(main())
