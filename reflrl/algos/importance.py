"""Tool-ReRL's importance-weighted correction (Tool-ReRL, sec. 3.3, eq. 2; A.3).

A repaired trajectory tau* was sampled under the augmented prompt q* but is trained on the
original prompt q. Its weight is the ratio of the target policy on q to the behaviour policy
(Assumption 1: pi_theta_rfl(tau* | q) ~ pi_theta(tau* | q*), taken at sampling time)::

    r(tau*) = pi_theta(tau* | q) / pi_theta_rfl(tau* | q*)
            = exp( sum_t [log pi_theta(y_t | q, y_<t) - log pi_rfl(y_t | q*, y_<t)] )

and eq. 2 maximises E[min(r A, clip(r, 1-eps, 1+eps) A)]. Appendix A.3: "unlike standard PPO,
where the denominator of the importance weight comes from the old policy pi_theta_old, we instead
use a reflection-based behavior policy pi_theta_rfl". So for repaired rows ``old_log_prob`` IS the
behaviour log-prob under q*, and the clipped loss runs on the resulting ratio.

Decisions (documented and tested):

- **Level.** ``level="sequence"`` (default) is eq. 2 as written: pi(tau*) is a trajectory
  probability, so one ratio per trajectory, ``exp(sum_t log-ratio_t)`` over its action tokens,
  and the clip acts on that trajectory ratio. ``level="token"`` uses per-token ratios
  (PPO-style; lower variance, biased). ``level="sequence_mean"`` uses the length-normalised
  ``exp(mean_t log-ratio_t)`` (GSPO, Zheng et al. 2025, cited by the paper) -- a middle ground
  for long responses.
- **Gradient.** For the sequence levels every token t of a trajectory gets the loss
  ``-min(r A_t, clip(r) A_t)`` with the GSPO stop-gradient form
  ``r_t = sg(r) * exp(logp_t - sg(logp_t))``, so the gradient at token t is
  ``A_t r grad log pi(y_t)`` -- exactly the gradient of eq. 2, ``A r grad log pi(tau*)``, spread
  over the tokens -- and aggregation (token-mean, ...) works as for the plain clipped loss.
- **Numerical safety.** Everything is computed in log space in float32; the log-ratio is
  clamped to ``[-log_cap, log_cap]`` (default 5: ratio within [0.0067, 148]). Beyond the cap
  the clamp has zero gradient, so a huge ratio can neither overflow nor produce a huge gradient
  (PPO's clip leaves the ``r > 1+eps, A < 0`` branch unbounded; the cap bounds it by
  ``e^log_cap |A|``). Masked tokens (prompt, observations, padding) are zeroed with
  ``torch.where`` before any arithmetic.
- **Mixed batches.** ``repaired`` ([B] bool) marks the repaired rows; other rows get the plain
  token-level PPO ratio against their old log-probs with the same clamp as
  :func:`reflrl.algos.losses.clipped_policy_loss`, so on a batch with no repaired row the loss
  equals that function exactly. ``repaired=None`` treats every row as repaired.

Registered as the policy loss ``"tool_rerl"``. Metrics include the mean, std, min, max of the
repaired trajectories' weights (the paper's Fig. 3, top-left, plots them) and the fraction capped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .masked import agg_loss, as_bool_mask, masked_fill_zero, masked_mean
from .registry import register_policy_loss

LEVELS = ("sequence", "token", "sequence_mean")
DEFAULT_LOG_CAP = 5.0
_PPO_CLAMP = 20.0  # losses.clipped_policy_loss's clamp for ordinary rows


def _check(log_prob: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> None:
    if log_prob.dim() != 2 or log_prob.shape != other.shape or log_prob.shape != mask.shape:
        raise ValueError(
            f"inputs must share one [B, T] shape, got {tuple(log_prob.shape)}, "
            f"{tuple(other.shape)}, mask {tuple(mask.shape)}")


def rerl_log_ratio(
    logp_q: torch.Tensor,
    logp_rfl_qstar: torch.Tensor,
    mask: torch.Tensor,
    level: str = "sequence",
) -> torch.Tensor:
    """Uncapped log importance ratio per token, [B, T] -> [B, T] (0 at masked tokens).

    token: ``logp_q - logp_rfl``; sequence: every action token of a row holds
    ``sum_t (logp_q - logp_rfl)``; sequence_mean: the mean over the row's action tokens.
    For the sequence levels the value is per row but the gradient at token t flows only through
    ``logp_q[t]`` with unit weight (GSPO stop-gradient form; module doc).

    Args:
        logp_q: [B, T] log pi_theta(y_t | q, y_<t) of tau*'s tokens under the ORIGINAL prompt
            (current policy; may carry grad).
        logp_rfl_qstar: [B, T] log pi(y_t | q*, y_<t) at sampling time (behaviour; detached).
            Both are aligned on the same response token positions.
        mask: [B, T] 1 on tau*'s action tokens.
    """
    _check(logp_q, logp_rfl_qstar, mask)
    if level not in LEVELS:
        raise ValueError(f"level={level!r}: expected one of {', '.join(LEVELS)}")
    m = as_bool_mask(mask)
    lp = masked_fill_zero(logp_q.float(), m)
    beh = masked_fill_zero(logp_rfl_qstar.detach().float(), m)
    diff = lp - beh
    if level == "token":
        return diff
    seq = diff.detach().sum(dim=-1, keepdim=True)
    if level == "sequence_mean":
        seq = seq / m.sum(dim=-1, keepdim=True).clamp(min=1).float()
    out = seq + (lp - lp.detach())  # value: row log-ratio; d/d logp_q[t] = 1
    return masked_fill_zero(out.expand_as(diff), m)


def rerl_importance_ratio(
    logp_q: torch.Tensor,
    logp_rfl_qstar: torch.Tensor,
    mask: torch.Tensor,
    level: str = "sequence",
    log_cap: float | None = DEFAULT_LOG_CAP,
) -> torch.Tensor:
    """Importance weight pi_theta(tau*|q) / pi_theta_rfl(tau*|q*) of eq. 2, [B, T] -> [B, T].

    ``exp(clamp(rerl_log_ratio(...), -log_cap, log_cap))`` at action tokens, 0 elsewhere; with
    ``level="sequence"`` every action token of a row holds the row's trajectory ratio
    ``exp(sum_t log pi(y_t|q) - log pi_rfl(y_t|q*))``. ``log_cap=None`` disables the cap (the
    log-ratio is still clamped to [-80, 80] so float32 cannot overflow). Differentiable with
    respect to ``logp_q`` (module doc).
    """
    lr = rerl_log_ratio(logp_q, logp_rfl_qstar, mask, level)
    cap = 80.0 if log_cap is None else float(log_cap)
    if cap <= 0:
        raise ValueError(f"log_cap={log_cap}: must be > 0")
    return masked_fill_zero(torch.exp(lr.clamp(-cap, cap)), as_bool_mask(mask))


def _row_stats(log_ratio_rows: torch.Tensor, capped_rows: torch.Tensor, prefix: str) -> dict[str, float]:
    n = int(log_ratio_rows.numel())
    if n == 0:
        return {f"{prefix}count": 0.0}
    w = torch.exp(log_ratio_rows.clamp(-80.0, 80.0))
    return {
        f"{prefix}count": float(n),
        f"{prefix}weight_mean": float(w.mean()),
        f"{prefix}weight_std": float(w.std(unbiased=False)) if n > 1 else 0.0,
        f"{prefix}weight_min": float(w.min()),
        f"{prefix}weight_max": float(w.max()),
        f"{prefix}log_weight_mean": float(log_ratio_rows.mean()),
        f"{prefix}log_weight_std": float(log_ratio_rows.std(unbiased=False)) if n > 1 else 0.0,
        f"{prefix}capped_frac": float(capped_rows.float().mean()),
    }


@register_policy_loss("tool_rerl")
def tool_rerl_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    repaired: torch.Tensor | None = None,
    level: str = "sequence",
    log_cap: float | None = DEFAULT_LOG_CAP,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    global_denominator: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 2's clipped importance-weighted objective, as a loss (negated), over [B, T] tokens.

    per-token loss = -min(r A, clip(r, 1-clip_low, 1+clip_high) A) with
    r = :func:`rerl_importance_ratio` on repaired rows and the token-level PPO ratio
    ``exp(logp - old_logp)`` on the others (module doc). Symmetric clip (eps = 0.2) by default,
    as in PPO and the paper.

    Args:
        log_prob: [B, T] log-probs of the trained tokens under the ORIGINAL prompt q (has grad).
        old_log_prob: [B, T] behaviour log-probs: for repaired rows log pi(tau*|q*) recorded at
            sampling time (Assumption 1); for the other rows the usual old-policy log-probs.
        advantages: [B, T] (constant).
        response_mask: [B, T] 1 on action tokens.
        repaired: [B] bool, rows that are reflection-repaired trajectories (None: all rows).
        level: "sequence" | "token" | "sequence_mean" for repaired rows.
        log_cap: clamp of the repaired rows' log-ratio (None: no cap beyond float safety).
        dual_clip_c, loss_agg_mode, importance_weights, global_denominator: as in
            :func:`reflrl.algos.losses.clipped_policy_loss`.
    Returns:
        (scalar loss, metrics): ``pg_loss``, ``clipfrac``, ``approx_kl``, ``ratio_mean/max/min``,
        ``tokens`` like the plain loss, plus ``rerl/count`` and, over repaired rows,
        ``rerl/weight_mean|std|min|max``, ``rerl/log_weight_mean|std``, ``rerl/capped_frac``.
    """
    _check(log_prob, old_log_prob, response_mask)
    _check(log_prob, advantages, response_mask)
    if importance_weights is not None:
        _check(log_prob, importance_weights, response_mask)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if level not in LEVELS:
        raise ValueError(f"level={level!r}: expected one of {', '.join(LEVELS)}")
    cap = 80.0 if log_cap is None else float(log_cap)
    if cap <= 0:
        raise ValueError(f"log_cap={log_cap}: must be > 0")
    bsz = log_prob.shape[0]
    if repaired is None:
        rep = torch.ones(bsz, dtype=torch.bool, device=log_prob.device)
    else:
        if repaired.shape != (bsz,):
            raise ValueError(f"repaired must be [B]={bsz} bools, got shape {tuple(repaired.shape)}")
        rep = repaired.to(torch.bool)
    m = as_bool_mask(response_mask)
    f32 = torch.float32
    lp = masked_fill_zero(log_prob.to(f32), m)
    old = masked_fill_zero(old_log_prob.detach().to(f32), m)
    adv = masked_fill_zero(advantages.detach().to(f32), m)

    ppo_lr = torch.clamp(lp - old, min=-_PPO_CLAMP, max=_PPO_CLAMP)
    raw_lr = rerl_log_ratio(lp, old, m, level)
    rerl_lr = raw_lr.clamp(-cap, cap)
    log_ratio = torch.where(rep[:, None], rerl_lr, ppo_lr)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss1, loss2)
    dual_active = torch.zeros_like(m)
    if dual_clip_c is not None:
        loss3 = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss3 < per_token) & m
        per_token = torch.where(adv < 0, torch.minimum(loss3, per_token), per_token)
    if importance_weights is not None:
        per_token = per_token * masked_fill_zero(importance_weights.detach().to(f32), m)
    loss = agg_loss(per_token, m, loss_agg_mode, global_denominator=global_denominator)

    with torch.no_grad():
        r = ratio.detach()
        n = int(m.sum())
        metrics = {
            "pg_loss": float(loss.detach()),
            "clipfrac": float(masked_mean((loss2 > loss1).float(), m)),
            "dual_clipfrac": float(masked_mean(dual_active.float(), m)),
            "approx_kl": float(masked_mean(-log_ratio.detach(), m)),
            "ratio_mean": float(masked_mean(r, m)),
            "ratio_max": float(r[m].max()) if n else 1.0,
            "ratio_min": float(r[m].min()) if n else 1.0,
            "tokens": float(n),
        }
        rows = rep & m.any(dim=-1)
        if level == "token":
            # per-row trajectory log-weight for the logs even when the loss is token-level
            row_lr = masked_fill_zero(lp - old, m).sum(-1)
        else:
            first = m.float().argmax(dim=-1)
            row_lr = raw_lr.detach().gather(-1, first[:, None]).squeeze(-1)
        capped = (row_lr.abs() > cap) if level != "token" else ((raw_lr.detach().abs() > cap) & m).any(-1)
        metrics.update(_row_stats(row_lr[rows], capped[rows], "rerl/"))
    return loss, metrics


def log_weight_bounds(log_cap: float = DEFAULT_LOG_CAP) -> tuple[float, float]:
    """The range of a capped weight: (e^-log_cap, e^log_cap)."""
    return math.exp(-log_cap), math.exp(log_cap)


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
