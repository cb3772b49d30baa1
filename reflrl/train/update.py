"""The policy update: one rollout batch -> optimiser steps of the clipped surrogate (or, for the DPO
baseline, of DPO on (repair, failure) pairs)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from reflrl import config as C
from reflrl.algos import dpo_loss, get_policy_loss_fn, kl_loss, pooled_weight_stats
from reflrl.rollout import Trajectory

from .batch import UpdateBatch, batch_logprobs, make_batch, micro_batches


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: UpdateBatch | None,
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
    dev = next(model.parameters()).device  # train.device: micro-batches go where the model is
    mbs = [mb.to(dev) for mb in micro_batches(batch, cfg.micro_batch_size)] if batch is not None else []
    total_tokens = float(batch.response_mask.sum()) if batch is not None else 0.0
    n_seq = float((batch.response_mask.sum(-1) > 0).sum()) if batch is not None else 0.0
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
            rep = mb.repaired if mb.repaired is not None else torch.zeros(len(mb), dtype=torch.bool, device=dev)
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
    out["update_sequences"] = float(len(batch)) if batch is not None else 0.0
    if importance is not None:
        out.update(pooled_weight_stats(rerl_parts))
    return out



def dpo_update(model: Any, optimizer: Any, ref_model: Any, pairs: Sequence[tuple[Trajectory, Trajectory]],
               cfg: C.Config, pad_id: int) -> dict[str, float]:
    """One optimiser step of DPO on ``pairs`` (both sides under the ORIGINAL prompt q; the reference is
    the frozen policy as RL started). Micro-batches of ``algo.micro_batch_size`` pairs."""
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
        batch = make_batch(trajs, [1.0] * len(trajs), pad_id).to(next(model.parameters()).device)
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
