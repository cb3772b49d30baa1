"""Parse tool calls out of model text; render tool calls back into text.

Model output is data: it is parsed, never evaluated. Three formats users meet:

- ``hermes``: Hermes / Qwen JSON blocks, one call per block (a JSON list of calls in one block is
  accepted too)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  ``"parameters"`` is accepted as an alias of ``"arguments"``, and arguments given as a JSON
  *string* holding an object are decoded.
- ``pythonic``: BFCL's Python-call list ``[f(a=1, b="x"), g(c=[1, 2])]`` or a bare ``f(a=1)``.
  Parsed with :mod:`ast` (``mode="eval"``); only literal values are accepted
  (``ast.literal_eval`` on each argument node); dotted names (``math.sqrt``) keep the dots.
- ``react``: RoTBench / ToolBench style ``Thought: ...`` / ``Action: name`` /
  ``Action Input: {json}``; several Action blocks may follow each other.

Every parser returns a :class:`~reflrl.envs.types.ParseResult`:

- a message with no markup of the format is a text answer: ``ok=True, calls=[]``;
- markup that is broken (invalid JSON, unclosed block, positional arguments, non-literal values,
  a block that is not an object with a string name, ...) gives ``ok=False`` and an ``error``
  saying what is wrong, with ``calls=[]``.

:func:`parse` is the entry point: it refuses inputs longer than :data:`MAX_CHARS` without scanning
them, and converts any exception a parser might raise (``RecursionError`` on deep nesting,
``MemoryError``, ...) into a parse failure, so no exception escapes it for any input text.
``fmt="auto"`` tries hermes, then pythonic, then react.

:func:`format_calls` is the inverse (used for SFT warm-up targets and round-trip tests):
``parse(format_calls(calls, fmt), fmt).calls == calls`` for JSON-valued arguments.
"""
from __future__ import annotations

import ast
import json
import keyword
import math
import re
import warnings
from typing import Any, Callable

from .types import ParseResult, ToolCall

MAX_CHARS = 64 * 1024
"""Inputs longer than this many characters are rejected as "too long" without being scanned."""

FORMATS = ("hermes", "pythonic", "react")

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_THINK_RE = re.compile(r"\A\s*<think>.*?</think>", re.S)
_FENCE_RE = re.compile(r"\A```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*\Z", re.S)


def parse_expression(text: str) -> ast.Expression:
    """``ast.parse(text, mode="eval")`` without Python's SyntaxWarnings: text a model wrote such as
    ``f(x=1and 2)`` parses with a warning ("invalid decimal literal") that would reach the user's console
    once per answer. Raises what ``ast.parse`` raises (SyntaxError, ValueError, RecursionError, ...).
    Parsing never evaluates anything."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(text, mode="eval")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _fail(error: str, content: str = "") -> ParseResult:
    return ParseResult(ok=False, calls=[], content=content, error=error)


def _join(parts: list[str]) -> str:
    return "\n".join(p.strip() for p in parts if p.strip())


class _ParseError(ValueError):
    """Raised inside the parsers; turned into ``ok=False`` by :func:`parse`."""


# --------------------------------------------------------------------------------------------
# hermes
# --------------------------------------------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _call_from_obj(obj: Any, where: str) -> ToolCall:
    """Turn one decoded JSON object ``{"name", "arguments"|"parameters"}`` into a ToolCall."""
    if not isinstance(obj, dict):
        raise _ParseError(f"{where}: expected a JSON object with a 'name', got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _ParseError(f"{where}: 'name' must be a non-empty string, got {name!r:.80}")
    if "arguments" in obj and "parameters" in obj:
        raise _ParseError(f"{where}: both 'arguments' and 'parameters' given; use one")
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args) if args.strip() else {}
        except ValueError as e:
            raise _ParseError(f"{where}: 'arguments' is a string that is not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise _ParseError(f"{where}: 'arguments' must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args)


def parse_hermes(text: str) -> ParseResult:
    """Parse Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks (Qwen2.5 chat template format).

    Each block's JSON is decoded from the opening tag on (so a ``</tool_call>`` inside a JSON
    string does not cut the block), then the closing tag must follow. Text outside the blocks
    (thoughts, a final answer) becomes ``content``.
    """
    calls: list[ToolCall] = []
    content: list[str] = []
    i, n, block = 0, len(text), 0
    while True:
        j = text.find(_OPEN, i)
        outside = text[i:] if j < 0 else text[i:j]
        if _CLOSE in outside:
            return _fail(f"stray {_CLOSE} without a matching {_OPEN}", _join(content + [outside]))
        if j < 0:
            if "<tool_call" in outside or "</tool_call" in outside:
                return _fail("incomplete <tool_call> tag (truncated output?)", _join(content + [outside]))
            content.append(outside)
            break
        content.append(outside)
        block += 1
        where = f"<tool_call> block {block}"
        k = _skip_ws(text, j + len(_OPEN))
        if k >= n:
            return _fail(f"{where} is not closed (truncated output?)", _join(content))
        try:
            obj, end = _DECODER.raw_decode(text, k)
        except json.JSONDecodeError as e:
            if text.find(_CLOSE, k) < 0:
                return _fail(f"{where} is not closed and its JSON is incomplete: {e.msg} "
                             f"at char {e.pos - k}", _join(content))
            return _fail(f"{where} holds invalid JSON: {e.msg} at char {e.pos - k}", _join(content))
        except ValueError as e:  # NaN / Infinity / too many digits
            return _fail(f"{where} holds invalid JSON: {e}", _join(content))
        end = _skip_ws(text, end)
        if not text.startswith(_CLOSE, end):
            if text.find(_CLOSE, end) < 0:
                return _fail(f"{where} is not closed (truncated output?)", _join(content))
            return _fail(f"{where}: unexpected text after the JSON object: {text[end:end + 40]!r}",
                         _join(content))
        objs = obj if isinstance(obj, list) else [obj]
        if not objs:
            return _fail(f"{where} holds an empty list", _join(content))
        try:
            for m, o in enumerate(objs):
                calls.append(_call_from_obj(o, where if len(objs) == 1 else f"{where} item {m + 1}"))
        except _ParseError as e:
            return _fail(str(e), _join(content))
        i = end + len(_CLOSE)
    return ParseResult(ok=True, calls=calls, content=_join(content))


# --------------------------------------------------------------------------------------------
# pythonic (BFCL)
# --------------------------------------------------------------------------------------------

_LIST_RE = re.compile(r"\A\[.*\]\Z", re.S)
_BARE_RE = re.compile(r"\A[^\W\d][\w.]*\(.*\)\Z", re.S)


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise _ParseError(f"function name must be an identifier like f or math.sqrt, "
                      f"got a {type(node).__name__} expression")


def _to_json_value(v: Any, where: str) -> Any:
    """Literal -> JSON-compatible value (tuples become lists); refuses sets, bytes, complex."""
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _ParseError(f"{where}: non-finite number {v!r}")
        return v
    if isinstance(v, (list, tuple)):
        return [_to_json_value(x, where) for x in v]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _ParseError(f"{where}: dict keys must be strings, got {k!r:.40}")
            out[k] = _to_json_value(x, where)
        return out
    raise _ParseError(f"{where}: unsupported literal of type {type(v).__name__}")


def _call_from_node(node: ast.AST, index: int) -> ToolCall:
    where = f"call {index}"
    if not isinstance(node, ast.Call):
        raise _ParseError(f"{where}: expected a function call like f(a=1), got {type(node).__name__}")
    try:
        name = _dotted_name(node.func)
    except _ParseError as e:
        raise _ParseError(f"{where}: {e}") from None
    if node.args:
        raise _ParseError(f"{where} ({name}): positional arguments are not supported; "
                          f"use keyword arguments (name=value)")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _ParseError(f"{where} ({name}): **kwargs is not supported")
        if kw.arg in args:
            raise _ParseError(f"{where} ({name}): argument {kw.arg!r} given twice")
        try:
            value = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError):
            raise _ParseError(f"{where} ({name}): argument {kw.arg!r} is not a literal value") from None
        args[kw.arg] = _to_json_value(value, f"{where} ({name}) argument {kw.arg!r}")
    return ToolCall(name=name, arguments=args)


def _split_think(text: str) -> tuple[str, str]:
    """Split a leading ``<think>...</think>`` block off ``text``: (think, rest)."""
    m = _THINK_RE.match(text)
    if m:
        return m.group(0).strip(), text[m.end():]
    return "", text


def parse_pythonic(text: str) -> ParseResult:
    """Parse BFCL's Python-call list ``[f(a=1), g(b="x")]`` (or a bare ``f(a=1)``) with ``ast``.

    The message (after an optional leading ``<think>`` block and an optional code fence) must be
    the call expression and nothing else. Text that is not shaped like one (``[...]`` or
    ``name(...)``) is a text answer. Never evaluated: only ``ast.literal_eval`` on argument nodes.
    """
    think, rest = _split_think(text)
    body = rest.strip()
    fence = _FENCE_RE.match(body)
    if fence:
        body = fence.group(1).strip()
    if not (_LIST_RE.match(body) or _BARE_RE.match(body)):
        return ParseResult(ok=True, calls=[], content=text.strip())
    try:
        tree = parse_expression(body)
    except SyntaxError as e:
        return _fail(f"not a valid Python call list: {e.msg} (line {e.lineno}, col {e.offset})", think)
    expr = tree.body
    nodes = list(expr.elts) if isinstance(expr, (ast.List, ast.Tuple)) else [expr]
    try:
        calls = [_call_from_node(node, i + 1) for i, node in enumerate(nodes)]
    except _ParseError as e:
        return _fail(str(e), think)
    return ParseResult(ok=True, calls=calls, content=think)


# --------------------------------------------------------------------------------------------
# react (RoTBench / ToolBench)
# --------------------------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^[ \t]*Action[ \t]*:[ \t]*([^\n]*)$", re.M | re.I)
_INPUT_RE = re.compile(r"[ \t]*Action[ \t]+Input[ \t]*:", re.I)
_INPUT_ANY_RE = re.compile(r"^[ \t]*Action[ \t]+Input[ \t]*:", re.M | re.I)
_MARKER_RE = re.compile(r"(Thought|Action|Observation|Final[ \t]+Answer)[ \t]*:", re.I)


def parse_react(text: str) -> ParseResult:
    """Parse ReAct ``Action: name`` / ``Action Input: {json}`` blocks (RoTBench style).

    ``Thought:`` lines and any other text go to ``content``. An ``Action Input`` that is empty
    (end of message or next marker) means ``{}``. An Action without an Action Input, an Action
    Input without an Action, or an input that is not a JSON object is a parse failure.
    """
    calls: list[ToolCall] = []
    content: list[str] = []
    pos, n = 0, len(text)
    while True:
        m = _ACTION_RE.search(text, pos)
        outside = text[pos:] if m is None else text[pos:m.start()]
        if _INPUT_ANY_RE.search(outside):
            return _fail("'Action Input:' without a preceding 'Action:' line", _join(content + [outside]))
        content.append(outside)
        if m is None:
            break
        idx = len(calls) + 1
        name = m.group(1).strip()
        if not name or any(c.isspace() for c in name):
            return _fail(f"Action {idx}: tool name must be one word, got {name!r:.80}", _join(content))
        k = _skip_ws(text, m.end())
        im = _INPUT_RE.match(text, k)
        if im is None:
            return _fail(f"Action {idx} ({name}): missing 'Action Input:' line", _join(content))
        k = _skip_ws(text, im.end())
        if k >= n or _MARKER_RE.match(text, k):
            args: Any = {}
            end = k
        else:
            try:
                args, end = _DECODER.raw_decode(text, k)
            except ValueError as e:
                return _fail(f"Action {idx} ({name}): Action Input is not valid JSON: {e}", _join(content))
            if isinstance(args, str):
                try:
                    args = _DECODER.decode(args)
                except ValueError:
                    pass
            if not isinstance(args, dict):
                return _fail(f"Action {idx} ({name}): Action Input must be a JSON object, "
                             f"got {type(args).__name__}", _join(content))
        calls.append(ToolCall(name=name, arguments=args))
        pos = end
    return ParseResult(ok=True, calls=calls, content=_join(content))


# --------------------------------------------------------------------------------------------
# registry and entry point
# --------------------------------------------------------------------------------------------

PARSERS: dict[str, Callable[[str], ParseResult]] = {
    "hermes": parse_hermes,
    "pythonic": parse_pythonic,
    "react": parse_react,
}
"""Parser registry: format name -> ``parser(text) -> ParseResult`` (``"auto"`` is handled by
:func:`parse`). Parsers in here may raise; always go through :func:`parse`."""

PARSER_NAMES: tuple[str, ...] = (*PARSERS, "auto")
"""The formats :func:`parse` accepts (``env.parser``): every registered parser, and ``"auto"``."""


def _safe(parser: Callable[[str], ParseResult], text: str) -> ParseResult:
    try:
        return parser(text)
    except _ParseError as e:
        return _fail(str(e))
    except RecursionError:
        return _fail("input nested too deeply")
    except MemoryError:
        return _fail("input too large or nested too deeply to parse")
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return _fail(f"{type(e).__name__}: {e}"[:300])
    except Exception as e:  # noqa: BLE001 - model output must never crash the env
        return _fail(f"parser error {type(e).__name__}: {e}"[:300])


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it names a parser (or "auto"); else raise ValueError listing the names."""
    if fmt != "auto" and fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; choose one of "
                         f"{', '.join(['auto', *PARSERS])}")
    return fmt


def parse(text: str, fmt: str = "hermes", *, max_chars: int = MAX_CHARS) -> ParseResult:
    """Parse one assistant message in format ``fmt`` ("hermes" | "pythonic" | "react" | "auto").

    Never raises for any ``text`` (an unknown ``fmt`` is a configuration error: ValueError).
    Texts longer than ``max_chars`` are refused unscanned. ``"auto"`` returns the first of
    hermes, pythonic, react that finds calls or reports broken markup of its own format; if none
    does, the message is a text answer.
    """
    check_format(fmt)
    if not isinstance(text, str):
        return _fail(f"expected model text (str), got {type(text).__name__}")
    if len(text) > max_chars:
        return _fail(f"output too long: {len(text)} chars > limit {max_chars}")
    if fmt != "auto":
        return _safe(PARSERS[fmt], text)
    first: ParseResult | None = None
    for name in FORMATS:
        r = _safe(PARSERS[name], text)
        if r.calls or not r.ok:
            if r.error:
                r.error = f"{name}: {r.error}"
            return r
        first = first or r
    assert first is not None
    return first


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def _py_literal(v: Any) -> str:
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot render non-finite number {v!r}")
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_py_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_py_literal(str(k))}: {_py_literal(x)}" for k, x in v.items()) + "}"
    raise ValueError(f"cannot render value of type {type(v).__name__} as a Python literal")


def _check_ident(s: str, what: str, dotted: bool = False) -> None:
    parts = s.split(".") if dotted else [s]
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ValueError(f"{what} {s!r} cannot be written as a Python call")


def format_calls(calls: list[ToolCall], fmt: str = "hermes") -> str:
    """Render ``calls`` as an assistant message in ``fmt`` (the inverse of :func:`parse`).

    hermes: one ``<tool_call>`` block per call, newline-separated (Qwen2.5 template layout);
    pythonic: ``[f(a=1), g(b='x')]``; react: ``Action: f`` / ``Action Input: {...}`` pairs.
    Raises ValueError when a call cannot be written in ``fmt`` (e.g. a pythonic argument name that
    is not an identifier, a non-finite number).
    """
    if fmt == "auto":
        fmt = "hermes"
    check_format(fmt)
    if fmt == "hermes":
        return "\n".join(
            f"{_OPEN}\n" + json.dumps({"name": c.name, "arguments": c.arguments},
                                       ensure_ascii=False, allow_nan=False) + f"\n{_CLOSE}"
            for c in calls)
    if fmt == "pythonic":
        out = []
        for c in calls:
            _check_ident(c.name, "tool name", dotted=True)
            for k in c.arguments:
                _check_ident(k, "argument name")
            out.append(f"{c.name}(" + ", ".join(f"{k}={_py_literal(v)}" for k, v in c.arguments.items()) + ")")
        return "[" + ", ".join(out) + "]"
    out = []
    for c in calls:
        if not c.name.strip() or any(ch.isspace() for ch in c.name):
            raise ValueError(f"tool name {c.name!r} cannot be written as a ReAct Action")
        out.append(f"Action: {c.name}\nAction Input: "
                   + json.dumps(c.arguments, ensure_ascii=False, allow_nan=False))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# when an answer is complete (generation may stop)
# --------------------------------------------------------------------------------------------


def answer_complete(text: str, fmt: str = "hermes") -> bool:
    """Is a partial answer's tool-call part finished, so generation can stop here?

    hermes: True once a ``</tool_call>`` closes a block and the model has gone on with something
    other than whitespace or the start of another ``<tool_call>`` block: the calls are complete and
    what follows is trailing text, which no call can come out of (a complete answer is the end of
    the turn or the end of its tool-call block(s)). Scoring the text up to this point scores the
    calls exactly; a plain-text answer is complete only at the end of the turn. Other formats
    (pythonic, react): False (their answers end with the turn).
    """
    if fmt not in ("hermes", "auto"):
        return False
    k = text.rfind(_CLOSE)
    if k < 0:
        return False
    tail = text[k + len(_CLOSE):].lstrip()
    if not tail:
        return False
    return not _OPEN.startswith(tail[: len(_OPEN)])


__all__ = ["MAX_CHARS", "FORMATS", "PARSERS", "parse", "parse_hermes", "parse_pythonic",
           "parse_react", "format_calls", "check_format", "answer_complete"]
