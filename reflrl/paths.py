"""Where reflrl keeps what it computes once per machine: converted models, tokenizers, the precision
verdict, BFCL's checker files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$REFLRL_CACHE`` or ``~/.cache/reflrl`` (a location only: it changes where, never what)."""
    env = os.environ.get("REFLRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "reflrl"


def read_cache_entry(path: Path, key: str) -> Any:
    """The value under ``key`` of a JSON cache file, or None (no file, no key, unreadable)."""
    import json

    try:
        data = json.loads(path.read_text())
        return data.get(key) if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def write_cache_entry(path: Path, key: str, value: Any) -> None:
    """Set ``key`` in a JSON cache file, written whole through a per-process temporary file; best effort:
    a read-only cache folder only costs the next run a new measurement."""
    import json

    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass
