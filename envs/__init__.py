"""reflrl.envs: fault-injecting tool environments (Gymnasium), tool server, parsers, rewards, datasets.

Importing this package registers the Gymnasium ids (the env classes themselves load lazily)::

    import gymnasium, reflrl.envs
    env = gymnasium.make("reflrl/ToolCall-v0", faults="rate_limit=0.1", seed=0)
    env = gymnasium.make("reflrl/ToolCallMultiTurn-v0", dataset="synthetic", seed=0)
    # without importing first: gymnasium.make("reflrl.envs:reflrl/ToolCall-v0", ...)

Kept light on purpose: no torch, and the server/client/datasets modules import on first use.
"""
from __future__ import annotations

import gymnasium as _gym

SINGLE_TURN_ID = "reflrl/ToolCall-v0"
MULTI_TURN_ID = "reflrl/ToolCallMultiTurn-v0"
ENV_IDS = (SINGLE_TURN_ID, MULTI_TURN_ID)

_ENTRY_POINTS = {
    SINGLE_TURN_ID: "reflrl.envs.tool_env:ToolCallEnv",
    MULTI_TURN_ID: "reflrl.envs.tool_env:ToolCallMultiTurnEnv",
}


def register_envs() -> None:
    """Register both env ids with Gymnasium (idempotent)."""
    for env_id, entry_point in _ENTRY_POINTS.items():
        if env_id not in _gym.registry:
            _gym.register(id=env_id, entry_point=entry_point, nondeterministic=False)


register_envs()


def __getattr__(name: str):
    # lazy access to the env classes: ``from reflrl.envs import ToolCallEnv``
    if name in ("ToolCallEnv", "ToolCallMultiTurnEnv", "ChatText"):
        from . import tool_env

        return getattr(tool_env, name)
    raise AttributeError(f"module 'reflrl.envs' has no attribute {name!r}")
