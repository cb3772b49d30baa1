"""The contract between a tool implementation and the tool server.

A tool is a ToolSpec: a JSON schema (what the model sees) and a handler (what the server runs).
Handlers are plain functions of validated arguments and a per-episode ToolContext. They raise
ToolError for a policy-caused failure (bad value, missing file the model named, ...): the server
answers it as a 4xx the client classifies as ``policy_error``. Anything else a handler raises is
a server bug (500, and NOT counted as an injected fault).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class ToolError(Exception):
    """A failure caused by the caller's arguments; ``kind`` is a short machine-readable tag."""

    def __init__(self, message: str, kind: str = "invalid_value"):
        super().__init__(message)
        self.kind = kind


@dataclass
class ToolContext:
    """Per-episode context handed to every handler.

    seed:       the episode's data seed: the same (seed, tool, arguments) gives the same answer.
    episode_id: the episode this call belongs to.
    sandbox:    a folder owned by this episode; file tools must resolve every path inside it
                (use ``resolve_in_sandbox``) and never touch anything else.
    state:      mutable per-episode state (e.g. bfcl-eval backend instances).
    sandbox_bytes, sandbox_files: the episode's disk quota (None = unlimited); file tools call
                ``check_quota`` before they write.
    """

    seed: int
    episode_id: str
    sandbox: Path
    state: dict[str, Any] = field(default_factory=dict)
    sandbox_bytes: int | None = None
    sandbox_files: int | None = None

    def check_quota(self, target: Path, new_bytes: int) -> None:
        """Raise ToolError ``quota_exceeded`` if writing ``new_bytes`` to ``target`` (replacing
        it if it exists; creating its missing parent folders) would exceed the episode's quota."""
        if self.sandbox_bytes is None and self.sandbox_files is None:
            return
        used = entries = 0
        root = self.sandbox.resolve()
        for p in root.rglob("*"):
            entries += 1
            if p.is_file() and not p.is_symlink() and p != target:
                used += p.stat().st_size
        created = 0 if target.exists() else 1
        parent = target.parent
        while parent != root and root in parent.parents and not parent.exists():
            created += 1
            parent = parent.parent
        if self.sandbox_bytes is not None and used + new_bytes > self.sandbox_bytes:
            raise ToolError(f"writing {new_bytes} bytes would put the episode's files at "
                            f"{used + new_bytes} bytes; the quota is {self.sandbox_bytes} bytes "
                            "(delete files first)", kind="quota_exceeded")
        if self.sandbox_files is not None and entries + created > self.sandbox_files:
            raise ToolError(f"the episode's sandbox holds {entries} files and folders; the quota is "
                            f"{self.sandbox_files} (delete files first)", kind="quota_exceeded")

    def resolve_in_sandbox(self, path: str) -> Path:
        """Resolve a model-given relative path inside the sandbox, refusing escapes."""
        root = self.sandbox.resolve()
        p = (root / path.lstrip("/")).resolve()
        if p != root and root not in p.parents:
            raise ToolError(f"path {path!r} leaves the sandbox", kind="forbidden_path")
        return p


@dataclass(frozen=True)
class ToolSpec:
    """name/description/parameters are what the model sees; domain groups tools
    ("weather", "finance", "travel", "files", "messaging", ... or "bfcl:<Class>")."""

    name: str
    domain: str
    description: str
    parameters: dict[str, Any]
    handler: Callable[[dict[str, Any], ToolContext], Any]
    returns: dict[str, Any] | None = None  # optional JSON schema of the result

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}
