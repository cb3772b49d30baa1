"""Plain data types shared by the environments, parsers, rewards, datasets and trainer.

Nothing here imports torch or the trainer: envs never import the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed or gold tool call: a name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ToolCall":
        return cls(name=str(d["name"]), arguments=dict(d.get("arguments") or {}))


@dataclass
class ParseResult:
    """What a parser made of one assistant message.

    ok:       the message was well-formed in the parser's format (format reward).
    calls:    the tool calls found, in order (empty when ok is False or the model answered in text).
    content:  text outside the tool-call markup (a final answer, a thought).
    error:    why parsing failed, for the critic and the logs; None when ok.
    """

    ok: bool
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    error: str | None = None


@dataclass
class Task:
    """One tool-calling task.

    id:             stable, unique inside its dataset.
    query:          the first user message.
    tools:          the tool schemas offered, OpenAI/BFCL function style
                    ({"name", "description", "parameters": JSON schema}).
    gold:           the gold calls per assistant turn that calls tools; a single-turn task has
                    exactly one entry (several calls in it = parallel calls, order-insensitive).
    kind:           "single" | "parallel" | "multi_turn".
    turns:          further user messages of a multi-turn task (BFCL style), in order.
    initial_config: per-episode state for stateful backends (bfcl-eval's multi-turn classes).
    meta:           anything else (source file, line, domain).
    """

    id: str
    query: str
    tools: list[dict[str, Any]]
    gold: list[list[ToolCall]]
    kind: str = "single"
    turns: list[str] = field(default_factory=list)
    initial_config: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
