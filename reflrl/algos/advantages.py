"""Advantage estimators: GRPO (group-normalised), Dr.GRPO, RLOO, and PPO's GAE.

Outcome estimators work on one scalar reward per response; the trainer broadcasts
the result over the response's action tokens with :func:`broadcast_to_tokens`.
All functions are pure and run under ``torch.no_grad()`` semantics (advantages are
constants for the policy gradient).

Registered names (see :mod:`reflrl.algos.registry` for the calling convention):
``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"gae"`` (needs a critic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .masked import as_bool_mask, masked_fill_zero, masked_whiten
from .registry import register_advantage

GroupIds = torch.Tensor | Sequence


def group_index(group_ids: GroupIds, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (ints, strings, a tensor) of length B to contiguous indices.

    Returns (index [B] int64 in 0..G-1, G). Groups are numbered in order of first appearance.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(f"group_ids must have shape [{batch_size}], got {tuple(group_ids.shape)}")
        ids = group_ids.tolist()
    else:
        ids = list(group_ids)
        if len(ids) != batch_size:
            raise ValueError(f"group_ids has {len(ids)} entries but there are {batch_size} rewards")
    seen: dict = {}
    index = [seen.setdefault(g, len(seen)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(seen)


def _flatten_groups(rewards: torch.Tensor, group_ids: GroupIds | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """rewards [B] + ids, or rewards [G, n] (one row per group) -> (flat [B], index [B], G)."""
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards.reshape(-1))).nonzero().flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite at flat positions {bad}")
    if rewards.dim() == 2 and group_ids is None:
        g, n = rewards.shape
        return rewards.reshape(-1), torch.arange(g).repeat_interleave(n), g
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B] with group_ids, or [G, n] without; got shape {tuple(rewards.shape)}")
    if group_ids is None:
        raise ValueError("group_ids is required when rewards is one-dimensional [B]")
    index, g = group_index(group_ids, rewards.shape[0])
    return rewards, index.to(rewards.device), g


def group_stats(
    rewards: torch.Tensor, index: torch.Tensor, num_groups: int, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (mean [G], std [G], count [G], zero_variance [G] bool) of rewards [B].

    ``zero_variance`` is exact (max == min within the group), not a threshold on std.
    A group of one has std 0 and counts as zero-variance.
    """
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, index, r) / count.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, index, (r - mean[index]) ** 2)
    denom = (count - 1) if unbiased else count
    std = torch.sqrt(sq / denom.clamp(min=1))
    big = torch.finfo(torch.float64).max
    gmax = torch.full((num_groups,), -big, dtype=torch.float64, device=r.device).scatter_reduce(
        0, index, r, reduce="amax"
    )
    gmin = torch.full((num_groups,), big, dtype=torch.float64, device=r.device).scatter_reduce(
        0, index, r, reduce="amin"
    )
    zero_var = gmax == gmin
    std = torch.where(zero_var, torch.zeros_like(std), std)
    return mean, std, count, zero_var


def grpo_advantage(
    rewards: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    eps: float = 1e-6,
    norm_std: bool = True,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """GRPO group-normalised advantage, efficiency paper (arXiv:2606.00135) eq. 2.

    A_j = (r_j - mean_group) / (std_group + eps); with ``norm_std=False`` it is
    r_j - mean_group (Dr.GRPO, Liu et al. 2025: no std division).

    Args:
        rewards: [B] with ``group_ids`` [B] (a tensor or a list of hashable prompt ids),
            or [G, n] (one row per prompt) with ``group_ids=None``.
        eps: added to the std (the paper's epsilon).
        norm_std: divide by the group std (GRPO) or not (Dr.GRPO).
        unbiased_std: Bessel-corrected std (n-1), as ``torch.std`` and verl use.
    Returns:
        advantages with the shape of ``rewards`` (float32).

    Every member of a zero-variance group (all rewards equal, including a group of one)
    gets exactly 0. Note verl gives a singleton group mean 0 / std 1 instead; here a lone
    response has no baseline, so it carries no GRPO signal.
    """
    flat, index, g = _flatten_groups(rewards, group_ids)
    mean, std, _, zero_var = group_stats(flat, index, g, unbiased=unbiased_std)
    dev = flat.to(torch.float64) - mean[index]
    adv = dev / (std[index] + eps) if norm_std else dev
    adv = torch.where(zero_var[index], torch.zeros_like(adv), adv)
    return adv.to(torch.float32).reshape(rewards.shape)


def dr_grpo_advantage(rewards: torch.Tensor, group_ids: GroupIds | None = None) -> torch.Tensor:
    """Dr.GRPO advantage r_j - mean_group (no std division). Shapes as :func:`grpo_advantage`."""
    return grpo_advantage(rewards, group_ids, norm_std=False)


def rloo_advantage(rewards: torch.Tensor, group_ids: GroupIds | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_j minus the mean of the OTHER group members.

    Equals n/(n-1) * (r_j - mean_group). Shapes as :func:`grpo_advantage`; zero-variance
    groups (and groups of one) give exactly 0.
    """
    flat, index, g = _flatten_groups(rewards, group_ids)
    mean, _, count, zero_var = group_stats(flat, index, g)
    n = count[index]
    adv = (flat.to(torch.float64) - mean[index]) * n / (n - 1).clamp(min=1)
    adv = torch.where(zero_var[index], torch.zeros_like(adv), adv)
    return adv.to(torch.float32).reshape(rewards.shape)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantages [B] -> per-token [B, T], zero on masked (observation/padding) tokens."""
    if advantages.dim() != 1 or response_mask.dim() != 2 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"expected advantages [B] and response_mask [B, T], got {tuple(advantages.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    m = as_bool_mask(response_mask)
    return torch.where(m, advantages[:, None].to(torch.float32), torch.zeros((), dtype=torch.float32))


def outcome_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each response's outcome reward [B] on its LAST action token -> [B, T].

    Rows with no action token raise ValueError (their reward would be lost).
    """
    m = as_bool_mask(response_mask)
    if not bool(m.any(dim=-1).all()):
        bad = (~m.any(dim=-1)).nonzero().flatten().tolist()
        raise ValueError(f"responses {bad} have no action token to carry their reward")
    t = m.shape[-1]
    last = t - 1 - m.flip(-1).to(torch.int64).argmax(dim=-1)  # index of the last True per row
    out = torch.zeros(m.shape, dtype=torch.float32, device=rewards.device)
    out[torch.arange(m.shape[0]), last] = rewards.to(torch.float32)
    return out


def gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for PPO, Tool-ReRL appendix A.2 eq. 4.

    A_t = sum_l (gamma*lam)^l delta_{t+l},  delta_t = r_t + gamma V_{t+1} - V_t;  returns = A + V.

    Args:
        token_rewards: [B, T] (the outcome reward normally sits on the last action token;
            see :func:`outcome_to_token_rewards`).
        values: [B, T] critic values V(s_t) at each response token.
        response_mask: [B, T], 1 on action tokens, 0 on observation tokens and padding.
        gamma, lam: discount and GAE lambda (verl's PPO defaults are 1.0, 1.0).
        whiten: normalise advantages to mean 0 / std 1 over the action tokens of the batch
            (as verl does); returns are computed before whitening.
    Returns:
        (advantages [B, T], returns [B, T]), both 0 on masked tokens.

    Multi-turn choice (same as verl's multi-turn GAE): masked tokens are SKIPPED, not
    treated as steps. The recursion carries V_{t+1} and the running GAE sum straight
    through observation tokens, so the action tokens of all turns form one contiguous
    MDP: the last token of turn 1 bootstraps from the value of the first token of turn 2.
    A non-zero reward on a masked token would be silently dropped by that rule, so it
    raises ValueError instead.
    """
    if not (token_rewards.shape == values.shape == response_mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            "token_rewards, values and response_mask must all be [B, T]; got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    m = as_bool_mask(response_mask)
    with torch.no_grad():
        r = token_rewards.detach().to(torch.float32)
        v = masked_fill_zero(values.detach().to(torch.float32), m)
        if bool((r[~m] != 0).any()):
            raise ValueError("token_rewards has non-zero rewards on masked (observation/padding) tokens")
        mf = m.to(torch.float32)
        b, t_len = r.shape
        next_value = torch.zeros(b, device=r.device)
        last_gae = torch.zeros(b, device=r.device)
        adv = torch.zeros(b, t_len, device=r.device)
        for t in reversed(range(t_len)):
            delta = r[:, t] + gamma * next_value - v[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_value = mf[:, t] * v[:, t] + (1 - mf[:, t]) * next_value
            last_gae = mf[:, t] * gae_t + (1 - mf[:, t]) * last_gae
            adv[:, t] = gae_t
        adv = masked_fill_zero(adv, m)
        returns = masked_fill_zero(adv + v, m)
        if whiten:
            adv = masked_whiten(adv, m)
    return adv, returns


# ---- registry adapters: uniform keyword interface -> ([B, T], [B, T]) ----------------------


def _outcome_rewards(rewards, token_rewards, response_mask) -> torch.Tensor:
    if rewards is not None:
        return rewards
    if token_rewards is None:
        raise ValueError("an outcome advantage estimator needs rewards [B] or token_rewards [B, T]")
    return masked_fill_zero(token_rewards, response_mask).sum(dim=-1)


@register_advantage("grpo")
def _grpo(*, response_mask, group_ids, rewards=None, token_rewards=None, eps: float = 1e-6, **_):
    """GRPO (eq. 2 of the efficiency paper) broadcast over action tokens; returns == advantages."""
    r = _outcome_rewards(rewards, token_rewards, response_mask)
    adv = broadcast_to_tokens(grpo_advantage(r, group_ids, eps=eps), response_mask)
    return adv, adv


@register_advantage("dr_grpo")
def _dr_grpo(*, response_mask, group_ids, rewards=None, token_rewards=None, **_):
    """Dr.GRPO (no std division) broadcast over action tokens; returns == advantages."""
    r = _outcome_rewards(rewards, token_rewards, response_mask)
    adv = broadcast_to_tokens(dr_grpo_advantage(r, group_ids), response_mask)
    return adv, adv


@register_advantage("rloo")
def _rloo(*, response_mask, group_ids, rewards=None, token_rewards=None, **_):
    """RLOO broadcast over action tokens; returns == advantages."""
    r = _outcome_rewards(rewards, token_rewards, response_mask)
    adv = broadcast_to_tokens(rloo_advantage(r, group_ids), response_mask)
    return adv, adv


@register_advantage("gae", needs_critic=True)
def _gae(*, response_mask, values, rewards=None, token_rewards=None, gamma: float = 1.0, lam: float = 1.0,
         whiten: bool = True, **_):
    """PPO GAE; outcome ``rewards`` [B] are placed on each response's last action token."""
    if values is None:
        raise ValueError("advantage 'gae' needs critic values [B, T]")
    if token_rewards is None:
        if rewards is None:
            raise ValueError("advantage 'gae' needs rewards [B] or token_rewards [B, T]")
        token_rewards = outcome_to_token_rewards(rewards, response_mask)
    return gae_advantage(token_rewards, values, response_mask, gamma, lam, whiten=whiten)


def live_group_advantages(rewards: torch.Tensor, live: torch.Tensor, group_ids: GroupIds, *,
                          estimator: str = "grpo", eps: float = 1e-6, gamma: float = 1.0,
                          lam: float = 1.0) -> torch.Tensor:
    """Outcome advantages [B] over the LIVE rollouts of each group; the others get 0.

    rewards: [B] one outcome reward per rollout; live: [B] bool, False for a rollout whose env
    fault was not recovered (masked); group_ids: [B] prompt of each rollout. A masked rollout gets
    no advantage AND is left out of its group's mean and std, so an env fault never shifts the
    baseline of the policy's own rollouts (Tool-ReRL sec. 3.2: env faults are never turned into a
    learning signal). ``estimator`` is a registered outcome estimator ("grpo", "dr_grpo", "rloo").
    Used by the CPU trainer and by the verl backend's estimators alike.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    live = torch.as_tensor(live, dtype=torch.bool)
    if rewards.dim() != 1 or live.shape != rewards.shape or len(group_ids) != rewards.shape[0]:
        raise ValueError(f"shape mismatch: rewards {tuple(rewards.shape)}, live {tuple(live.shape)}, "
                         f"{len(group_ids)} group ids")
    out = torch.zeros_like(rewards)
    rows = live.nonzero().flatten().tolist()
    if not rows:
        return out
    from .registry import get_advantage_fn

    one = torch.ones((len(rows), 1), dtype=torch.long)  # outcome advantages: one value per rollout
    adv, _ = get_advantage_fn(estimator)(rewards=rewards[live], group_ids=[group_ids[i] for i in rows],
                                         response_mask=one, eps=eps, gamma=gamma, lam=lam)
    out[live] = adv[:, 0].float()
    return out
