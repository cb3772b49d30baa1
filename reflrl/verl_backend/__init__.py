"""reflrl on verl (0.9.1) and Ray: multi-GPU / multi-node training with our algorithms and envs.

- :mod:`.plugin`     -- loaded by verl itself in every process (entry point group ``verl.plugins``):
                        registers our policy losses and our agent loop.
- :mod:`.losses`     -- Tool-ReRL eq. 2 as a verl policy loss (why not verl's rollout_is alone).
- :mod:`.agent_loop` -- ``reflrl_tool_agent``: our env with faults + the reflection loop.
- :mod:`.episode`    -- per-episode settings and task rows of the agent loop.
- :mod:`.data`       -- our tasks as verl parquet rows.
- :mod:`.reward`     -- our rewards as ``reward.custom_reward_function``.
- :mod:`.config`     -- our Config -> a verl config, validated by verl's own dataclasses.
- :mod:`.launch`     -- ``reflrl train --backend verl --config configs/verl/X.yaml``.

Importing this package does not import verl; the submodules that need it import it lazily and
raise a clear error naming ``pip install -e '.[verl]'`` when it is missing. See docs/scale-out.md.
"""

VERL_VERSION = "0.9.1"


def require_verl():
    """Import verl, or raise ImportError explaining how to install the extra."""
    try:
        import verl  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"the verl backend needs verl=={VERL_VERSION}: pip install -e '.[verl]' "
            f"(base install, no extras; it keeps the CPU torch) -- {e}") from e
    return verl
