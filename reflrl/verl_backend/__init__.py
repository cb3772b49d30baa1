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
raise :class:`VerlMissing` (one line naming ``pip install 'reflrl[verl]'``) when it is missing. The
translation to verl's config (:mod:`.config`, ``reflrl train --backend verl --dry-run``) works without
verl. See docs/scale-out.md.
"""
from __future__ import annotations

import importlib.util

from reflrl.errors import UserError

VERL_VERSION = "0.9.1"
INSTALL = "pip install 'reflrl[verl]' (from a checkout: pip install -e '.[verl]')"


class VerlMissing(UserError, ImportError):
    """verl (or a package the verl backend needs before it) is not installed or cannot be imported;
    the message says what to install (``reflrl train`` exits 2 with it)."""


def verl_available() -> bool:
    """Whether verl is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


def require_verl():
    """Import verl, or raise :class:`VerlMissing` saying how to install it (one line)."""
    try:
        import verl  # noqa: F401
    except ImportError as e:
        if e.name == "verl" or not verl_available():
            raise VerlMissing(f"the verl backend trains with verl {VERL_VERSION}, which is not installed: {INSTALL}; "
                              "verl needs NVIDIA GPUs (--dry-run translates the config without it)") from None
        raise VerlMissing(f"verl is installed but does not import ({type(e).__name__}: {e}): {INSTALL} brings "
                          "what it needs") from None
    return verl


def require_omegaconf() -> None:
    """The verl config is an OmegaConf config: raise :class:`VerlMissing` naming the package if it is missing."""
    try:
        import omegaconf  # noqa: F401
    except ImportError as e:
        raise VerlMissing(f"reflrl's verl config needs omegaconf ({e}): pip install 'omegaconf>=2.3,<2.4' "
                          "(a dependency of reflrl: reinstalling reflrl brings it)") from None
