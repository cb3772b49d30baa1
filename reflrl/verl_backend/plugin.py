"""verl plugin: registers reflrl's policy losses, advantage estimators and agent loop in every verl process.

verl 0.9.1 ``verl/__init__.py`` loads every entry point of the group ``verl.plugins`` when verl is
imported (``VERL_USE_EXTERNAL_PLUGINS``: "auto" (default) = all, "none", or a comma list of names);
pyproject.toml declares ``reflrl = "reflrl.verl_backend.plugin"``. Ray workers import verl, so the
registrations exist in the driver and in every worker. Alternative without the entry point:
``VERL_USE_EXTERNAL_MODULES=reflrl.verl_backend.plugin`` (comma list of modules to import).
verl swallows plugin import errors (debug log only), so :data:`REGISTERED` is checked by tests and
:func:`check_registered` gives a clear error at launch.
"""
from __future__ import annotations

from .advantages import register_advantages
from .losses import register_losses

REGISTERED: dict[str, list[str]] = {"policy_loss": register_losses(), "advantage": register_advantages()}

#: why the agent loop could not be registered (verl's agent-loop module needs cachetools and fastapi,
#: which verl's base requirements do not list; our ``verl`` extra adds them), or None
AGENT_LOOP_ERROR: str | None = None
try:
    from .agent_loop import AGENT_NAME, ReflrlToolAgentLoop  # noqa: E402,F401  (registers with @register)

    REGISTERED["agent_loop"] = [AGENT_NAME]
except ImportError as _e:  # the losses above stay registered
    AGENT_LOOP_ERROR = f"{type(_e).__name__}: {_e}"
    REGISTERED["agent_loop"] = []


def check_registered() -> dict[str, list[str]]:
    """Raise RuntimeError unless verl's registries hold our losses and agent loop."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    missing = [n for n in REGISTERED["policy_loss"] if n not in POLICY_LOSS_REGISTRY]
    missing += [n for n in REGISTERED["advantage"] if n not in ADV_ESTIMATOR_REGISTRY]
    missing += [n for n in REGISTERED["agent_loop"] if n not in _agent_loop_registry]
    if AGENT_LOOP_ERROR is not None:
        missing.append(f"agent loop (import failed: {AGENT_LOOP_ERROR})")
    if missing:
        raise RuntimeError(f"reflrl verl plugin: not registered in verl: {missing}")
    return REGISTERED


__all__ = ["AGENT_LOOP_ERROR", "REGISTERED", "check_registered"]
