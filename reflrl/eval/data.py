"""Reading benchmark files with errors that name the file and the record."""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

from reflrl.errors import UserError


class DataError(UserError, ValueError):
    """A benchmark data file is missing or malformed; the message names the file (and record)."""


def stored(path: Path) -> Path | None:
    """The file holding ``path``'s content: ``path`` itself, else ``path.gz`` (the data shipped with
    reflrl is gzipped); None when neither exists."""
    path = Path(path)
    if path.is_file():
        return path
    gz = path.with_name(path.name + ".gz")
    return gz if gz.is_file() else None


def exists(path: Path) -> bool:
    """``path`` or ``path.gz`` is a file."""
    return stored(path) is not None


def read_text(path: Path) -> str:
    """UTF-8 text of ``path`` (or of ``path.gz``, decompressed); DataError names a missing or unreadable file."""
    real = stored(path)
    if real is None:
        raise DataError(f"{path}: file not found")
    try:
        if real.suffix == ".gz":
            with gzip.open(real, "rb") as f:
                return f.read().decode("utf-8")
        return real.read_text(encoding="utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{real}: cannot read: {e}") from None


def read_json(path: Path) -> Any:
    """Parse a JSON file; DataError names the file, line and column of a syntax error."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def read_jsonl(path: Path) -> list[Any]:
    """Parse a JSON-lines file (blank lines skipped); DataError names the file and line number."""
    lines = read_text(path).splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {i}: invalid JSON: {e.msg}") from None
    return out


def read_json_or_jsonl(path: Path) -> list[Any]:
    """A file holding either one JSON list or JSON lines."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        data = read_json(path)
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of records")
        return data
    return read_jsonl(path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_lengths(benchmark: str, items: list[Any], outputs: list[Any]) -> None:
    """Scorers pair items with outputs one to one: a length mismatch is an error naming both counts."""
    if len(items) != len(outputs):
        raise ValueError(f"{benchmark}: {len(items)} items but {len(outputs)} model outputs to score; "
                         "every item needs exactly one output")


def first_existing(candidates: list[Path]) -> Path | None:
    for c in candidates:
        if c.exists() or exists(c):
            return c
    return None
