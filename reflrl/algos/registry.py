"""Name -> function registries for advantage estimators and policy losses.

Backends (the CPU trainer today, vLLM/verl later) pick algorithms by the names in
the config (`algo.advantage`, `algo.policy_loss`), in the style of verl's
`register_adv_est` / `register_policy_loss` (verl/trainer/ppo/core_algos.py).

Calling conventions
-------------------
Advantage estimators (``get_advantage_fn(name)``) are called with keyword arguments
only and ignore the ones they do not need::

    advantages, returns = fn(
        rewards=...,          # [B] outcome reward per response (or None)
        token_rewards=...,    # [B, T] per-token reward (or None)
        response_mask=...,    # [B, T] 1 on trained (action) tokens, 0 on observation/padding
        group_ids=...,        # [B] prompt id of each response (GRPO-family)
        values=...,           # [B, T] critic values (GAE only)
        gamma=1.0, lam=1.0, eps=1e-6,
    )                         # -> ([B, T], [B, T])

Policy losses (``get_policy_loss_fn(name)``)::

    loss, metrics = fn(log_prob, old_log_prob, advantages, response_mask,
                       clip_low=..., clip_high=..., dual_clip_c=None,
                       loss_agg_mode="token-mean", importance_weights=None)
"""

from __future__ import annotations

from typing import Callable

from reflrl.registry import Registry

ADVANTAGES: Registry[Callable] = Registry("advantage estimator")  # meta: needs_critic
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")


def register_advantage(name: str, *, needs_critic: bool = False) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name`` (see module docstring)."""
    return ADVANTAGES.register(name, needs_critic=needs_critic)


def get_advantage_fn(name: str) -> Callable:
    """The advantage estimator registered as ``name`` (UnknownName, a KeyError, with a suggestion)."""
    return ADVANTAGES.get(name)


def advantage_needs_critic(name: str) -> bool:
    """True when the estimator needs critic values (e.g. "gae"), so the trainer builds a value head."""
    return bool(ADVANTAGES.meta(name).get("needs_critic"))


def list_advantages() -> list[str]:
    return ADVANTAGES.names()


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name`` (see module docstring)."""
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as ``name`` (UnknownName, a KeyError, with a suggestion)."""
    return POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    return POLICY_LOSSES.names()
