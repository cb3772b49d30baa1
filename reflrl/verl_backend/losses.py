"""Tool-ReRL's eq. 2 as a verl policy loss (Tool-ReRL, sec. 3.3, eq. 2; A.3).

Why our own loss and not verl's rollout correction alone
--------------------------------------------------------
verl 0.9.1 (``verl/trainer/ppo/rollout_corr_helper.py``) computes, in "decoupled" mode,
``w = min(exp(clamp(sum_t old_t - rollout_t, +-20)), rollout_is_threshold)`` (``rollout_is="sequence"``)
and the vanilla loss (``core_algos.compute_policy_loss_vanilla``) returns
``w * max(-A rho_t, -A clip(rho_t, 1-eps, 1+eps))`` with the TOKEN ratio ``rho_t = pi_theta / pi_old``.
With our agent loop, ``old`` is the actor's recomputation on (q, tau*) and ``rollout`` the
behaviour log-probs of tau* under q*, so ``w`` IS the Tool-ReRL weight pi_theta_old(tau*|q) /
pi_rfl(tau*|q*) -- but it is a detached multiplier OUTSIDE the clip, truncated only from above.
Eq. 2 clips the whole ratio ``r = pi_theta(tau*|q) / pi_rfl(tau*|q*)`` to [1-eps, 1+eps]:
for a reflected trajectory with r = 3 and A > 0, eq. 2 gives zero gradient (the clipped branch is
active), verl's decoupled loss gives ``3 A grad log pi``. They differ, so we register our own loss.

How the behaviour log-probs reach the loss
------------------------------------------
verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) passes only ``old_log_prob``, ``log_prob``,
``advantages``, ``response_mask``, ``loss_agg_mode``, ``config`` and ``rollout_is_weights`` to a
registered loss. We configure ``algorithm.rollout_correction`` with ``rollout_is="token"``, no
batch normalisation, no rejection sampling and a threshold above e^20 (never truncates), so
``w_t = exp(clamp(old_t - rollout_t, -20, 20))`` per token and the behaviour log-prob is recovered
exactly: ``rollout_t = old_t - log w_t`` (float32 exp/log round trip, ~1e-7 relative; a token whose
``|old_t - rollout_t|`` exceeds verl's clamp of 20 is seen at +-20 -- with our trajectory cap
``log_cap = 5`` such a row is capped either way unless the other tokens almost cancel it). The loss
then calls :func:`reflrl.algos.importance.tool_rerl_policy_loss` -- the CPU trainer's function --
on ``(log_prob, rollout, advantages, mask)``, so both backends compute the same value and gradient
(tests/test_verl_loss.py checks it through verl's own ``ppo_loss``).

Repaired vs ordinary rows (the CPU loss's ``repaired`` mask)
------------------------------------------------------------
verl's ``ppo_loss`` forwards no per-row field, so the agent loop marks ORDINARY rows (tau sampled under
q itself) through the only per-token channel that reaches the loss: their rollout log-probs are set to
:data:`UNREPAIRED_LOGPROB` (+21, impossible for a log-probability), so verl's clamp gives every action
token of such a row exactly ``w = exp(-20)`` (``old - 21 <= -21``). The marker is small enough that
verl's debug metrics, which take ``exp`` of the rollout log-probs (``verl.utils.debug.metrics``), stay
finite: ``exp(21)`` is about 1.3e9 and its square 1.7e18 (float32 reaches 3.4e38). :func:`split_behaviour` reads that back exactly: those
rows get the CPU trainer's token-level PPO ratio against ``old`` (the actor's recomputation, as the
CPU trainer does), the others eq. 2 against their behaviour log-probs. The loss then equals
``tool_rerl_policy_loss(..., repaired=<mask>)`` of the CPU trainer (tested). Costs: verl's
``rollout_corr/*`` mismatch metrics are meaningless for marked rows (use ``actor/rerl/*``), and a
repaired row whose EVERY token has ``old - rollout <= -20`` would read as ordinary (its eq. 2 weight
would be below e^-20 per token, i.e. capped anyway). Without marked rows (``mark_unrepaired: false``
in the episode settings) every row is trained with eq. 2 against the policy that sampled it, i.e. the
CPU loss with ``repaired=None``.

Registered names (``actor_rollout_ref.actor.policy_loss.loss_mode``):
``reflrl_tool_rerl`` (eq. 2, trajectory ratio), ``reflrl_tool_rerl_seqmean`` (GSPO-style
length-normalised ratio), ``reflrl_tool_rerl_token`` (per-token ratios).
Clip range: ``actor.clip_ratio_low`` / ``clip_ratio_high`` (eq. 2: both eps = 0.2);
dual clip: ``actor.clip_ratio_c`` (verl's vanilla loss always applies it; set it large to disable).
"""
from __future__ import annotations

from typing import Any

import torch

from reflrl.algos.importance import DEFAULT_LOG_CAP, tool_rerl_policy_loss

#: above e^20 (verl's per-token clamp), so verl's truncation never changes a weight
UNTRUNCATED_THRESHOLD = 1.0e9
#: verl's clamp of the log IS ratio (rollout_corr_helper.SAFETY_BOUND)
VERL_SAFETY_BOUND = 20.0
#: rollout log-prob written by the agent loop for every token of an ordinary (not repaired) row: above
#: any log-probability by more than verl's clamp (so w = exp(-20) exactly), and finite under exp
UNREPAIRED_LOGPROB = VERL_SAFETY_BOUND + 1.0
LOSS_LEVELS = {
    "reflrl_tool_rerl": "sequence",
    "reflrl_tool_rerl_seqmean": "sequence_mean",
    "reflrl_tool_rerl_token": "token",
}
_AGG = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def _cfg(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    v = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if v is None else v


def behaviour_from_is_weights(old_log_prob: torch.Tensor, rollout_is_weights: torch.Tensor,
                              response_mask: torch.Tensor) -> torch.Tensor:
    """Behaviour (rollout) log-probs from verl's token-level IS weights: [B, T] -> [B, T].

    ``w_t = exp(old_t - rollout_t)`` (untruncated, token level) gives ``rollout_t = old_t - log w_t``;
    0 at masked tokens. Raises ValueError when a weight at an action token is not positive
    (rejection sampling or IcePop zeroed it: not supported with this loss).
    """
    m = response_mask.bool()
    w = rollout_is_weights.detach().float()
    if bool((w[m] <= 0).any()):
        raise ValueError("reflrl_tool_rerl: a rollout_is weight at an action token is <= 0; configure "
                         "algorithm.rollout_correction with rollout_is='token', no rollout_rs and a plain "
                         f"(non-IcePop) threshold >= {UNTRUNCATED_THRESHOLD:g}")
    logw = torch.log(torch.where(m, w, torch.ones_like(w)))
    return torch.where(m, old_log_prob.detach().float() - logw, torch.zeros_like(logw))


def split_behaviour(old_log_prob: torch.Tensor, rollout_is_weights: torch.Tensor,
                    response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour log-probs [B, T], repaired [B] bool) from verl's token IS weights (module doc).

    A row is ordinary (``repaired`` False) when every action token has ``w == exp(-20)``, the weight
    verl computes for the agent loop's :data:`UNREPAIRED_LOGPROB` marker; its behaviour log-probs are
    then ``old`` itself. Rows without action tokens count as repaired (they add nothing to the loss).
    """
    m = response_mask.bool()
    beh = behaviour_from_is_weights(old_log_prob, rollout_is_weights, response_mask)
    marker = torch.exp(torch.tensor(-VERL_SAFETY_BOUND, dtype=torch.float32))
    hit = (rollout_is_weights.detach().float() == marker) | ~m
    ordinary = hit.all(dim=-1) & m.any(dim=-1)
    beh = torch.where(ordinary[:, None] & m, old_log_prob.detach().float(), beh)
    return beh, ~ordinary


def _agg_kwargs(loss_agg_mode: str, config: Any, mask: torch.Tensor) -> dict[str, Any]:
    """Map verl's global batch info (dp_size, batch_num_tokens, global_batch_size) to our
    ``global_denominator`` so :func:`reflrl.algos.masked.agg_loss` equals verl's ``agg_loss``."""
    if loss_agg_mode not in _AGG:
        raise ValueError(f"reflrl_tool_rerl: loss_agg_mode {loss_agg_mode!r} is not supported; use one of "
                         f"{sorted(_AGG)}")
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    dp = int(info.get("dp_size") or 1)
    if loss_agg_mode == "token-mean":
        n = info.get("batch_num_tokens")
        if n is None:
            if dp > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            return {}
        return {"global_denominator": float(n) / dp}
    n = info.get("global_batch_size")
    if n is None:
        if dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        out: dict[str, Any] = {}
    else:
        out = {"global_denominator": float(n) / dp}
    if loss_agg_mode == "seq-mean-token-sum-norm" and info.get("loss_scale_factor") is not None:
        raise ValueError("reflrl_tool_rerl: loss_scale_factor is not supported (the CPU loss normalises by T)")
    return out


def make_verl_loss(level: str, log_cap: float | None = DEFAULT_LOG_CAP):
    """A verl policy-loss function (verl's calling convention) running eq. 2 at ``level``."""

    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Eq. 2 on verl tensors [B, T]; see the module doc. Returns (loss, metrics with actor/ prefix)."""
        if rollout_is_weights is None:
            raise ValueError(
                "reflrl_tool_rerl needs the behaviour log-probs: set actor_rollout_ref.rollout.calculate_log_probs"
                "=true and algorithm.rollout_correction.rollout_is='token' with rollout_is_threshold="
                f"{UNTRUNCATED_THRESHOLD:g} (reflrl.verl_backend.config does this)")
        beh, repaired = split_behaviour(old_log_prob, rollout_is_weights, response_mask)
        clip = float(_cfg(config, "clip_ratio", 0.2))
        lo = float(_cfg(config, "clip_ratio_low", clip))
        hi = float(_cfg(config, "clip_ratio_high", clip))
        c = float(_cfg(config, "clip_ratio_c", 3.0))
        loss, m = tool_rerl_policy_loss(
            log_prob, beh, advantages, response_mask, repaired=repaired, level=level, log_cap=log_cap,
            clip_low=lo, clip_high=hi, dual_clip_c=c, loss_agg_mode=loss_agg_mode,
            **_agg_kwargs(loss_agg_mode, config, response_mask))
        metrics = {"actor/pg_clipfrac": m["clipfrac"], "actor/ppo_kl": m["approx_kl"],
                   "actor/pg_clipfrac_lower": m["dual_clipfrac"]}
        metrics.update({f"actor/{k}": v for k, v in m.items() if k.startswith("rerl/")})
        return loss, metrics

    loss_fn.__name__ = f"reflrl_tool_rerl_{level}"
    loss_fn.__doc__ = f"Tool-ReRL eq. 2 ({level} ratio) for verl's ppo_loss; see reflrl.verl_backend.losses."
    return loss_fn


def register_losses() -> list[str]:
    """Register every name of :data:`LOSS_LEVELS` with verl's ``register_policy_loss``."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    for name, level in LOSS_LEVELS.items():
        register_policy_loss(name)(make_verl_loss(level))
    return list(LOSS_LEVELS)
