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

import difflib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AdvantageEntry:
    """A registered advantage estimator: the function and whether it needs a critic (values)."""

    name: str
    fn: Callable
    needs_critic: bool


_ADVANTAGES: dict[str, AdvantageEntry] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _unknown(kind: str, name: str, known: dict) -> KeyError:
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return KeyError(f"unknown {kind} {name!r}{hint} (registered: {', '.join(names)})")


def register_advantage(name: str, *, needs_critic: bool = False) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name`` (see module docstring)."""

    def deco(fn: Callable) -> Callable:
        if name in _ADVANTAGES and _ADVANTAGES[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = AdvantageEntry(name, fn, needs_critic)
        return fn

    return deco


def get_advantage_fn(name: str) -> Callable:
    """The advantage estimator registered as ``name``; KeyError (with suggestions) otherwise."""
    if name not in _ADVANTAGES:
        raise _unknown("advantage estimator", name, _ADVANTAGES)
    return _ADVANTAGES[name].fn


def advantage_needs_critic(name: str) -> bool:
    """True when the estimator needs critic values (e.g. "gae"), so the trainer builds a value head."""
    if name not in _ADVANTAGES:
        raise _unknown("advantage estimator", name, _ADVANTAGES)
    return _ADVANTAGES[name].needs_critic


def list_advantages() -> list[str]:
    """Names of all registered advantage estimators, sorted."""
    return sorted(_ADVANTAGES)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name`` (see module docstring)."""

    def deco(fn: Callable) -> Callable:
        if name in _POLICY_LOSSES and _POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as ``name``; KeyError (with suggestions) otherwise."""
    if name not in _POLICY_LOSSES:
        raise _unknown("policy loss", name, _POLICY_LOSSES)
    return _POLICY_LOSSES[name]


def list_policy_losses() -> list[str]:
    """Names of all registered policy losses, sorted."""
    return sorted(_POLICY_LOSSES)
