"""One small registry type for everything chosen by name in a config.

Advantage estimators and policy losses (:mod:`reflrl.algos`), group samplers
(:mod:`reflrl.algos.dscl`), critics (:mod:`reflrl.recovery.critics`), rollout engines
(:mod:`reflrl.engines`) and reflection variants (:mod:`reflrl.recovery.variants`) are each a
:class:`Registry`; :mod:`reflrl.config` validates names by asking them. Registration is verl's style
(``@register_adv_est("grpo")``)::

    ADVANTAGES = Registry("advantage estimator")

    @ADVANTAGES.register("grpo")
    def grpo(...): ...

    ADVANTAGES.get("grpo")          # the function
    ADVANTAGES.get("grp")           # UnknownName: unknown advantage estimator 'grp'; did you mean 'grpo'? ...
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Generic, Iterator, TypeVar

from reflrl.errors import UserError

T = TypeVar("T")


class UnknownName(UserError, KeyError, ValueError):
    """A name no entry is registered under (a KeyError and a ValueError, with a readable message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name -> entry (a function, class or factory), with optional metadata per entry."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, entry: T | None = None, **meta: Any) -> Any:
        """``registry.register("x", fn)`` or ``@registry.register("x")``; ``meta`` is kept beside it.
        A name can be registered once (again with the same entry is a no-op)."""
        def add(e: T) -> T:
            if name in self._entries and self._entries[name] is not e:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = e
            self._meta[name] = dict(meta)
            return e

        return add(entry) if entry is not None else add

    def get(self, name: str) -> T:
        """The entry registered as ``name``; :class:`UnknownName` naming the close match and the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise self.unknown(name) from None

    def unknown(self, name: Any) -> UnknownName:
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return UnknownName(f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(self.names())})")

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)
        return dict(self._meta[name])

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def build(self, name: str, **kwargs: Any) -> Any:
        """For registries of factories: ``get(name)(**kwargs)``, a TypeError naming the entry on a bad keyword."""
        factory: Callable[..., Any] = self.get(name)  # type: ignore[assignment]
        try:
            return factory(**kwargs)
        except TypeError as e:
            raise TypeError(f"{self.kind} {name!r}: {e}") from e


# ------------------------------------------------------------------------------ the directory
# Where the names of each kind a config chooses by name are kept: "module:attribute", a Registry or a
# sequence of names, defined by the module that implements them. reflrl.config validates names through
# :func:`names`, so it imports none of those modules (they import the config; nothing imports its caller),
# and a name registered by a plugin is accepted as soon as its module is imported.
DIRECTORY: dict[str, str] = {
    "advantage": "reflrl.algos.registry:ADVANTAGES",
    "policy_loss": "reflrl.algos.registry:POLICY_LOSSES",
    "loss_agg": "reflrl.algos.masked:LOSS_AGG_MODES",
    "kl_estimator": "reflrl.algos.losses:KL_ESTIMATORS",
    "importance_level": "reflrl.algos.importance:LEVELS",
    "sampler": "reflrl.algos.dscl.samplers:SAMPLERS_REGISTRY",
    "variant": "reflrl.recovery.variants:VARIANTS",
    "critic": "reflrl.recovery.critics:CRITICS",
    "reflection_mode": "reflrl.recovery.reflection:MODES",
    "reveal": "reflrl.critic.rule:REVEAL_MODES",
    "engine": "reflrl.engines:ENGINES",
    "parser": "reflrl.envs.parsing:PARSER_NAMES",
    "prompt_style": "reflrl.envs.prompts:STYLES",
    "dtype": "reflrl.precision:DTYPE_NAMES",
}


def lookup(kind: str) -> Any:
    """The Registry (or sequence of names) that holds the names of ``kind`` (a key of :data:`DIRECTORY`),
    importing its module on first use."""
    import importlib

    try:
        where = DIRECTORY[kind]
    except KeyError:
        raise UnknownName(f"no registry of {kind!r} (known: {', '.join(sorted(DIRECTORY))})") from None
    module, attr = where.split(":")
    return getattr(importlib.import_module(module), attr)


def names(kind: str) -> list[str]:
    """The names of ``kind`` a config may choose: a registry's registered names, or the listed ones."""
    held = lookup(kind)
    return held.names() if isinstance(held, Registry) else list(held)
