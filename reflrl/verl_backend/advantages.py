"""Our GRPO advantages as verl advantage estimators (``algorithm.adv_estimator``), so verl's groups
match the CPU trainer's: rollouts whose env fault was not recovered (the agent loop gives them an
all-zero ``response_mask``) are left OUT of their group's mean and std and get advantage 0
(Tool-ReRL, Reflective Reinforcement Tool Learning sec. 3.2: env faults are never turned into a learning signal).
verl's built-in ``grpo`` would still count their reward in the group statistics.

The values are :func:`reflrl.algos.live_group_advantages` -- the same function the CPU trainer uses --
with the ``grpo`` estimator (efficiency paper, arXiv:2606.00135, eq. 2; zero-variance groups -> 0,
Bessel-corrected std, eps 1e-6) on each row's outcome score (``token_level_rewards`` summed over the
response), broadcast over the action tokens.

Registered names: ``reflrl_grpo`` and ``reflrl_dr_grpo`` (no std division, Dr.GRPO).
"""
from __future__ import annotations

from typing import Any

import torch

from reflrl.algos import live_group_advantages

DEFAULT_EPS = 1e-6


def _group_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                     estimator: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] rewards and mask, [B] prompt uids -> (advantages [B, T], returns [B, T])."""
    if index is None:
        raise ValueError("reflrl_grpo needs the prompt uid of every row (verl passes data.non_tensor_batch['uid'])")
    if token_level_rewards.shape != response_mask.shape or len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"shape mismatch: rewards {tuple(token_level_rewards.shape)}, mask "
                         f"{tuple(response_mask.shape)}, {len(index)} uids")
    scores = token_level_rewards.float().sum(dim=-1)
    live = response_mask.bool().any(dim=-1)  # an all-zero mask: an env fault the agent loop masked
    adv = live_group_advantages(scores, live, list(index), estimator=estimator, eps=eps)
    out = adv[:, None] * response_mask.to(adv.dtype)
    return out, out


def reflrl_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                config: Any = None, epsilon: float = DEFAULT_EPS, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO over the rows that count (module doc); verl's estimator calling convention."""
    return _group_advantage(token_level_rewards, response_mask, index, "grpo", epsilon)


def reflrl_dr_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                   config: Any = None, epsilon: float = DEFAULT_EPS, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (r - group mean) over the rows that count (module doc)."""
    return _group_advantage(token_level_rewards, response_mask, index, "dr_grpo", epsilon)


ESTIMATORS = {"reflrl_grpo": reflrl_grpo, "reflrl_dr_grpo": reflrl_dr_grpo}


def register_advantages() -> list[str]:
    """Register :data:`ESTIMATORS` with verl's ``register_adv_est`` (idempotent)."""
    from verl.trainer.ppo.core_algos import register_adv_est

    for name, fn in ESTIMATORS.items():
        register_adv_est(name)(fn)
    return list(ESTIMATORS)
