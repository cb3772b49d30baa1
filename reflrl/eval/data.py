"""Reading benchmark files with errors that name the file and the record."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from reflrl.errors import UserError


class DataError(UserError, ValueError):
    """A benchmark data file is missing or malformed; the message names the file (and record)."""


def read_json(path: Path) -> Any:
    """Parse a JSON file; DataError names the file, line and column of a syntax error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def read_jsonl(path: Path) -> list[Any]:
    """Parse a JSON-lines file (blank lines skipped); DataError names the file and line number."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
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
    text = Path(path).read_text(encoding="utf-8") if Path(path).is_file() else None
    if text is None:
        raise DataError(f"{path}: file not found")
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
        if c.exists():
            return c
    return None
