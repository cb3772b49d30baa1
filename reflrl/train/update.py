"""What the update step needs beside the loss itself: :class:`LossMeter` (the metrics of
:func:`reflrl.train.step.policy_update`) and DPO's own update, :func:`dpo_update` (Tool-ReRL's DPO
baseline trains (repair, failure) pairs instead of the clipped surrogate)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from reflrl import config as C
from reflrl.algos import dpo_loss, pooled_weight_stats
from reflrl.rollout import Trajectory

from .batch import UpdateBatch, batch_logprobs, make_batch


class LossMeter:
    """Metrics of one update over its epochs and micro-batches: the loss function's metrics weighted by
    action tokens; the loss per epoch (micro-batch losses summed) and the grad norm, averaged over epochs;
    auxiliary losses' metrics summed over micro-batches and averaged over epochs; the gap between the
    engine's and the trainer's log-probs on rows sampled under their own prompt; eq. 2's weight
    statistics pooled over the repaired rows of the first epoch."""

    def __init__(self) -> None:
        self.tok_sums: dict[str, float] = {}
        self.tok_count = 0.0
        self.aux: dict[str, float] = {}
        self.rerl_parts: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self._epoch_loss = 0.0

    def add(self, epoch: int, loss: torch.Tensor, lm: dict[str, float], lp: torch.Tensor, mb: UpdateBatch) -> None:
        """One micro-batch's loss and its loss function's metrics ``lm``."""
        if epoch == 0:
            self.rerl_parts.append({k: v for k, v in lm.items() if k.startswith("rerl/")})
        self._epoch_loss += float(loss.detach())
        mask = mb.response_mask.bool()
        on_q = mask & ~mb.repaired[:, None]  # repaired rows' engine log-probs are under q*, not q
        if bool(on_q.any()):
            lm["engine_logprob_gap"] = float((lp.detach() - mb.engine_logprobs)[on_q].abs().mean())
        w = float(mask.sum())
        for k, v in lm.items():
            if k not in ("pg_loss", "tokens", "kl") and not k.startswith("rerl/"):
                self.tok_sums[k] = self.tok_sums.get(k, 0.0) + w * float(v)
        self.tok_count += w

    def add_aux(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.aux[k] = self.aux.get(k, 0.0) + float(v)

    def end_epoch(self, grad_norm: torch.Tensor) -> None:
        self.losses.append(self._epoch_loss)
        self.grad_norms.append(float(grad_norm))
        self._epoch_loss = 0.0

    def metrics(self, epochs: int, batch: UpdateBatch, *, pooled: bool) -> dict[str, float]:
        out = {k: v / max(self.tok_count, 1.0) for k, v in self.tok_sums.items()}
        out["loss"] = float(np.mean(self.losses))
        out.update({k: v / epochs for k, v in self.aux.items()})
        out["grad_norm"] = float(np.mean(self.grad_norms))
        out["update_tokens"] = float(batch.response_mask.sum())
        out["update_sequences"] = float(len(batch))
        if pooled:
            out.update(pooled_weight_stats(self.rerl_parts))
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
