"""Policy, KL and value losses over [B, T] token tensors.

* :func:`clipped_policy_loss`: PPO/GRPO clipped surrogate with clip-higher (DAPO; the
  efficiency paper (arXiv:2606.00135), appendix F uses eps_low 0.2, eps_high 0.28),
  optional dual clip, optional per-token importance weights. Registered as
  ``"clip_higher"`` (and ``"ppo_clip"``: the same function; set clip_high == clip_low
  for the symmetric PPO clip).
* :func:`kl_penalty` / :func:`kl_loss`: KL to a reference policy, estimators k1/k2/k3.
* :func:`value_loss`: clipped critic loss for PPO (Tool-ReRL appendix A.2, eq. 3).

Tool-ReRL's importance-weighted objective (Tool-ReRL, sec. 3.3 eq. 2) is this same clipped
loss with the behaviour policy's log-probs (the reflection-conditioned pi(tau*|q*)) passed
as ``old_log_prob``; ``importance_weights`` is a separate, detached per-token multiplier
(e.g. truncated IS weights between a rollout engine and the trainer).

Observation tokens and padding (mask 0) get exactly zero gradient: inputs are sanitised
with ``torch.where`` before any arithmetic, so even NaN/inf at masked positions is harmless.
"""

from __future__ import annotations

import torch

from .masked import agg_loss, as_bool_mask, masked_fill_zero, masked_mean
from .registry import register_policy_loss

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _check_shapes(**tensors: torch.Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    ref = next(iter(shapes.values()))
    if len(ref) != 2 or any(s != ref for s in shapes.values()):
        raise ValueError(f"all inputs must share one [B, T] shape, got {shapes}")


@register_policy_loss("clip_higher")
@register_policy_loss("ppo_clip")
def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    global_denominator: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss, efficiency paper eq. 3 with clip-higher (appendix F).

    per-token loss = -min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A), rho = exp(logp - old_logp).
    With ``dual_clip_c`` (> 1; Ye et al. 2020, as verl's clip_ratio_c) the loss of tokens
    with A < 0 is additionally capped at -c*A, so a huge ratio cannot blow up.

    Args:
        log_prob: [B, T] log-probs of the sampled tokens under the current policy (has grad).
        old_log_prob: [B, T] log-probs under the policy that generated them (no grad).
        advantages: [B, T] (constant).
        response_mask: [B, T] 1 on action tokens, 0 on observation tokens/padding.
        clip_low / clip_high: epsilon_low / epsilon_high of the clip range.
        loss_agg_mode: see :func:`reflrl.algos.masked.agg_loss`.
        importance_weights: optional [B, T] per-token weights (detached) multiplying the loss.
        global_denominator: see :func:`agg_loss` (micro-batch gradient accumulation).
    Returns:
        (scalar loss, metrics) with metrics as floats: ``pg_loss``, ``clipfrac`` (tokens
        whose clipped branch is active), ``clipfrac_high`` / ``clipfrac_low``,
        ``dual_clipfrac``, ``approx_kl`` (mean old_logp - logp), ``ratio_mean``,
        ``ratio_max``, ``ratio_min``, ``tokens``.
    """
    _check_shapes(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                  response_mask=response_mask, importance_weights=importance_weights)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    m = as_bool_mask(response_mask)
    f32 = torch.float32  # ratios in float32 even when the model runs in bfloat16
    logp = masked_fill_zero(log_prob.to(f32), m)
    old = masked_fill_zero(old_log_prob.detach().to(f32), m)
    adv = masked_fill_zero(advantages.detach().to(f32), m)

    log_ratio = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    per_token = clipped
    dual_active = torch.zeros_like(m)
    if dual_clip_c is not None:
        loss3 = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss3 < clipped) & m
        per_token = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    if importance_weights is not None:
        w = masked_fill_zero(importance_weights.detach().to(f32), m)
        per_token = per_token * w
    loss = agg_loss(per_token, m, loss_agg_mode, global_denominator=global_denominator)

    with torch.no_grad():
        r = ratio.detach()
        n = int(m.sum())
        metrics = {
            "pg_loss": float(loss.detach()),
            "clipfrac": float(masked_mean((loss2 > loss1).float(), m)),
            "clipfrac_high": float(masked_mean(((r > 1 + clip_high) & (adv > 0)).float(), m)),
            "clipfrac_low": float(masked_mean(((r < 1 - clip_low) & (adv < 0)).float(), m)),
            "dual_clipfrac": float(masked_mean(dual_active.float(), m)),
            "approx_kl": float(masked_mean(-log_ratio.detach(), m)),
            "ratio_mean": float(masked_mean(r, m)),
            "ratio_max": float(r[m].max()) if n else 1.0,
            "ratio_min": float(r[m].min()) if n else 1.0,
            "tokens": float(n),
        }
    return loss, metrics


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs [B, T] -> [B, T].

    Estimators (Schulman, "Approximating KL divergence"; same names as verl's kl_penalty):
      * ``"k1"`` / ``"kl"``: logp - ref_logp (unbiased, high variance, can be negative)
      * ``"abs"``: |logp - ref_logp|
      * ``"k2"`` / ``"mse"``: 0.5 * (logp - ref_logp)^2
      * ``"k3"`` / ``"low_var_kl"``: exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0,
        low variance), clamped to [-10, 10] as verl does.
    Gradients flow through ``log_prob`` only.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    _check_shapes(log_prob=log_prob, ref_log_prob=ref_log_prob)
    diff = log_prob.float() - ref_log_prob.detach().float()
    if estimator in ("k1", "kl"):
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * diff.square()
    kl = torch.clamp(-diff, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    global_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-to-reference loss term (add ``kl_coef * loss`` to the policy loss).

    Inputs [B, T]; masked tokens get zero gradient. Returns (scalar, {"kl": float}).
    """
    m = as_bool_mask(response_mask, log_prob)
    kl = kl_penalty(masked_fill_zero(log_prob, m), masked_fill_zero(ref_log_prob, m), estimator)
    loss = agg_loss(kl, m, loss_agg_mode, global_denominator=global_denominator)
    return loss, {"kl": float(loss.detach())}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range_value: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    global_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO critic loss (Tool-ReRL appendix A.2 eq. 3, with PPO's value clipping).

    per-token 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, -c, c);
    ``clip_range_value=None`` disables clipping. Inputs [B, T]; returns (scalar, metrics:
    ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``).
    """
    _check_shapes(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    m = as_bool_mask(response_mask)
    v = masked_fill_zero(values.float(), m)
    v_old = masked_fill_zero(old_values.detach().float(), m)
    ret = masked_fill_zero(returns.detach().float(), m)
    l1 = (v - ret).square()
    if clip_range_value is None:
        per_token = 0.5 * l1
        clip_active = torch.zeros_like(m)
    else:
        v_clip = v_old + torch.clamp(v - v_old, -clip_range_value, clip_range_value)
        l2 = (v_clip - ret).square()
        per_token = 0.5 * torch.maximum(l1, l2)
        clip_active = (l2 > l1) & m
    loss = agg_loss(per_token, m, loss_agg_mode, global_denominator=global_denominator)
    return loss, {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(masked_mean(clip_active.float(), m)),
        "vpred_mean": float(masked_mean(v.detach(), m)),
    }


def importance_weights(
    target_log_prob: torch.Tensor,
    behavior_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float | None = None,
) -> torch.Tensor:
    """Detached importance weights pi_target / pi_behavior for off-policy tokens -> [B, T].

    For data sampled by a different policy than the one trained (Tool-ReRL sec. 3.3:
    reflection-conditioned trajectories, behaviour pi(tau*|q*) vs target pi(tau*|q); or a
    rollout engine whose numerics differ from the trainer's).
    ``level="token"``: w_t = exp(logp_t - logp_beh_t); ``level="sequence"``: every action
    token of a response gets exp(sum_t (logp_t - logp_beh_t)), the trajectory ratio of eq. 2.
    ``cap`` truncates weights from above (truncated IS). Log-ratios are clamped to [-20, 20].
    Inputs [B, T]; masked tokens get weight 0.
    """
    _check_shapes(target_log_prob=target_log_prob, behavior_log_prob=behavior_log_prob, response_mask=response_mask)
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    m = as_bool_mask(response_mask)
    with torch.no_grad():
        diff = masked_fill_zero(target_log_prob.detach().float() - behavior_log_prob.detach().float(), m)
        if level == "sequence":
            diff = diff.sum(dim=-1, keepdim=True).expand_as(diff)
        w = torch.exp(diff.clamp(-20.0, 20.0))
        if cap is not None:
            w = w.clamp(max=cap)
        return masked_fill_zero(w, m)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: logits [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
