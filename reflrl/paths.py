"""Where reflrl keeps what it computes once per machine: converted models, tokenizers, the precision
verdict, BFCL's checker files."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$REFLRL_CACHE`` or ``~/.cache/reflrl`` (a location only: it changes where, never what)."""
    env = os.environ.get("REFLRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "reflrl"
