"""Critics by name: ``get_critic("rule" | "llm" | "policy", **kwargs)``.

"rule" is the embedded default (no model); "llm" talks to an OpenAI-compatible endpoint;
"policy" asks the policy model itself (Table 2's "Internal" ablation, Tool-ReRL
sec. 4.3). Model critics are imported lazily, so ``get_critic("rule")`` never imports ``openai``.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable

from .base import Critic

_FACTORIES: dict[str, Callable[..., Critic]] = {}


def register_critic(name: str, factory: Callable[..., Critic]) -> None:
    """Register ``factory(**kwargs) -> Critic`` under ``name`` (ValueError if taken)."""
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"critic {name!r} is already registered")
    _FACTORIES[name] = factory


def _rule(**kw: Any) -> Critic:
    from .rule import RuleCritic
    return RuleCritic(**kw)


def _llm(**kw: Any) -> Critic:
    try:
        from .llm import LLMCritic
    except ModuleNotFoundError as e:
        if e.name in ("openai", "tenacity"):
            raise ModuleNotFoundError(f"the 'llm' critic needs the {e.name!r} package: pip install {e.name}",
                                      name=e.name) from e
        raise
    return LLMCritic(**kw)


def _policy(**kw: Any) -> Critic:
    from .policy import PolicyCritic
    return PolicyCritic(**kw)


register_critic("rule", _rule)
register_critic("llm", _llm)
register_critic("policy", _policy)


def list_critics() -> list[str]:
    """Registered critic names, sorted."""
    return sorted(_FACTORIES)


def get_critic(name: str, **kwargs: Any) -> Critic:
    """Build the critic registered as ``name`` with ``kwargs``; KeyError with a suggestion for
    an unknown name, TypeError naming the bad keyword for a wrong argument."""
    if name not in _FACTORIES:
        close = difflib.get_close_matches(name, list(_FACTORIES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown critic {name!r}{hint} (registered: {', '.join(list_critics())})")
    try:
        return _FACTORIES[name](**kwargs)
    except TypeError as e:
        raise TypeError(f"critic {name!r}: {e}") from e
