"""Chat messages for a Task: the system prompt with the tool list, the user query, tool results.

Tools are shown in the system prompt (the "context template" of the efficiency paper (arXiv:2606.00135) sec. 3, which works
for any chat model, including ones whose chat template has no tool support):

- ``style="json"``: every tool's full JSON schema inside ``<tools></tools>``, one per line, in the
  Qwen2.5 / Hermes layout (``{"type": "function", "function": {...}}``).
- ``style="compact"``: one short signature line per tool, e.g.
  ``get_weather(city: str, unit: "celsius"|"fahrenheit" = "celsius") - Current weather for a city``.
  Prompt length drives training cost (a 135M model on a CPU), so this is the cheap option.

The instruction that follows says how to write calls in the chosen parser format (``fmt``:
"hermes" | "pythonic" | "react"), with an example rendered by
:func:`reflrl.envs.parsing.format_calls`, so prompt and parser never disagree.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .parsing import check_format, format_calls
from .types import Task, ToolCall

STYLES = ("json", "compact")

_PY_TYPES = {
    "string": "str", "integer": "int", "number": "float", "float": "float", "boolean": "bool",
    "array": "list", "tuple": "list", "object": "dict", "dict": "dict", "null": "None", "any": "any",
}


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """Normalise one tool description to ``{"name", "description", "parameters"}``.

    Accepts the OpenAI wrapper ``{"type": "function", "function": {...}}`` too. Raises ValueError
    naming the problem when there is no string ``name``.
    """
    if not isinstance(tool, dict):
        raise ValueError(f"tool schema must be a dict, got {type(tool).__name__}")
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool schema has no name: {json.dumps(tool, default=str)[:120]}")
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"name": name, "description": str(tool.get("description") or ""), "parameters": params}


def _type_str(schema: Any) -> str:
    """A short Python-like type for a JSON-schema fragment (enums as "a"|"b")."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "|".join(dict.fromkeys(_type_str(s) for s in schema[key]))
    t = schema.get("type", "any")
    if isinstance(t, list):
        return "|".join(dict.fromkeys(_PY_TYPES.get(str(x), str(x)) for x in t))
    base = _PY_TYPES.get(str(t), str(t))
    if base == "list" and isinstance(schema.get("items"), dict):
        return f"list[{_type_str(schema['items'])}]"
    return base


def _short(text: str, limit: int) -> str:
    """First sentence of ``text``, whitespace collapsed, cut to ``limit`` characters."""
    text = " ".join(text.split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    if m:
        text = m.group(1)
    text = text.rstrip(".")
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def compact_signature(tool: dict[str, Any], desc_chars: int = 80) -> str:
    """One line: ``name(req: type, opt: type = default, opt2?: type) - short description``.

    Required arguments come first, in schema order; optional ones show their default, or ``?``
    when there is none.
    """
    t = tool_schema(tool)
    params = t["parameters"] if isinstance(t["parameters"], dict) else {}
    props = params.get("properties") or {}
    required = [r for r in (params.get("required") or []) if r in props]
    args = []
    for name in required + [p for p in props if p not in required]:
        ty = _type_str(props[name])
        if name in required:
            args.append(f"{name}: {ty}")
        elif isinstance(props[name], dict) and "default" in props[name]:
            args.append(f"{name}: {ty} = {json.dumps(props[name]['default'], ensure_ascii=False)}")
        else:
            args.append(f"{name}?: {ty}")
    line = f"{t['name']}({', '.join(args)})"
    desc = _short(t["description"], desc_chars)
    return f"{line} - {desc}" if desc else line


_EXAMPLE = [ToolCall("function_name", {"arg": "value"})]

_FORMAT_HELP = {
    "hermes": ("To call a function, write a JSON object with its name and arguments inside "
               "<tool_call></tool_call> tags, one block per call:"),
    "pythonic": "To call functions, write a Python list of calls with keyword arguments:",
    "react": "To call a function, write one Action line and one Action Input line (JSON) per call:",
}


def system_prompt(tools: list[dict[str, Any]], style: str = "json", fmt: str = "hermes",
                  *, think: bool = False) -> str:
    """The system prompt: tool list (``style``) and how to call tools in format ``fmt``.

    ``think=True`` asks for a ``<think>...</think>`` block before the calls (Tool-N1's format,
    used by the ``binary_think`` reward).
    """
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; choose one of {', '.join(STYLES)}")
    fmt = "hermes" if check_format(fmt) == "auto" else fmt
    schemas = [tool_schema(t) for t in tools]
    if style == "json":
        listing = "\n".join(json.dumps({"type": "function", "function": s}, ensure_ascii=False)
                            for s in schemas)
        head = ("You are a helpful assistant that can call functions. The functions are given "
                "as JSON schemas inside <tools></tools>:\n<tools>\n" + listing + "\n</tools>")
    else:
        head = "You can call these functions:\n" + "\n".join(compact_signature(s) for s in schemas)
    lines = [head, "", _FORMAT_HELP[fmt], format_calls(_EXAMPLE, fmt)]
    if think:
        lines.append("First think step by step inside <think></think>, then write the calls.")
    lines.append("Use only the functions listed. When no call is needed, answer in plain text.")
    return "\n".join(lines)


def build_messages(task: Task, style: str = "json", fmt: str = "hermes", *,
                   think: bool = False) -> list[dict[str, str]]:
    """Chat messages that start an episode of ``task``: system prompt, then the user query.

    Returns ``[{"role": "system", "content": ...}, {"role": "user", "content": task.query}]``;
    later turns (assistant messages, tool results, ``task.turns``) are appended by the env.
    """
    return [
        {"role": "system", "content": system_prompt(task.tools, style=style, fmt=fmt, think=think)},
        {"role": "user", "content": task.query},
    ]


def _clip(text: str, max_chars: int) -> str:
    if max_chars > 0 and len(text) > max_chars:
        return text[:max_chars] + f"...[truncated {len(text) - max_chars} chars]"
    return text


def render_tool_result(name: str, result: Any, max_chars: int = 2000) -> str:
    """Content of a tool observation message (role "tool"): ``{"name": ..., "result": ...}`` as
    compact JSON, cut to ``max_chars`` characters (0 = no limit) to bound prompt growth."""
    body = json.dumps({"name": name, "result": result}, ensure_ascii=False, default=str)
    return _clip(body, max_chars)


def render_tool_error(name: str, message: str, kind: str | None = None, max_chars: int = 2000) -> str:
    """Content of a tool observation that failed: ``{"name": ..., "error": ..., "kind": ...}``."""
    d: dict[str, Any] = {"name": name, "error": message}
    if kind:
        d["kind"] = kind
    return _clip(json.dumps(d, ensure_ascii=False, default=str), max_chars)


__all__ = ["STYLES", "system_prompt", "build_messages", "render_tool_result", "render_tool_error",
           "compact_signature", "tool_schema"]
