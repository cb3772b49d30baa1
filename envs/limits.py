"""The tool server's resource limits, and the ASGI guard that enforces the request-level ones.

A tool server is long-lived and its clients are programs driven by model output, so everything a
request can make it hold is bounded (README, "The tool server's limits"):

==========================  ========================================================  ===========
limit                       what happens when exceeded                                default
==========================  ========================================================  ===========
max_body_bytes              413 ``body_too_large`` (Content-Length checked before      1 MiB
                            reading; a chunked body is cut off at the limit)
body_timeout_s              408 ``body_timeout``: the body did not arrive in time      10 s
                            (a client announced a body and stalled); connection closed
max_json_depth              400 ``bad_request`` (the request body nests deeper);       64
                            422 ``invalid_arguments`` when a call's arguments do
max_message_chars           error messages quote at most this much of a value         200
max_open_episodes           503 ``too_many_episodes`` on ``POST /v1/episodes``         4096
sandbox_bytes               a file tool's write fails with ToolError                   4 MiB
                            ``quota_exceeded`` (per episode, on disk)
sandbox_files               same, for the number of files and folders                 512
==========================  ========================================================  ===========

Ledger events are freed with their episode (``DELETE /v1/episodes/{id}``) by a server that owns its
ledger, so a server's memory follows its open episodes, not its age.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from reflrl.faults.coords import clip_repr


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one tool server (table in the module docstring). None = unlimited."""

    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0
    max_json_depth: int = 64
    max_message_chars: int = 200
    max_open_episodes: int | None = 4096
    sandbox_bytes: int | None = 4 << 20
    sandbox_files: int | None = 512

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.body_timeout_s <= 0 or self.max_json_depth < 2 \
                or self.max_message_chars < 20:
            raise ValueError(f"ServerLimits out of range: {self}")


def clip(message: str, limit: int) -> str:
    """``message`` cut to ``limit`` characters, saying how long it was."""
    if len(message) <= limit:
        return message
    return message[:limit] + f"... [{len(message)} chars, cut]"


def json_problem(value: Any, max_depth: int) -> str | None:
    """Why a parsed JSON value is not acceptable, or None: it nests deeper than ``max_depth``, or
    a string or key holds a lone UTF-16 surrogate (``"\\ud800"`` parses, but is not text).
    Iterative: no recursion, whatever the depth."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                return f"string {clip_repr(v)} holds a lone surrogate (not valid Unicode)"
            continue
        if isinstance(v, dict):
            for k in v:
                if not _is_text(k):
                    return f"key {clip_repr(k)} holds a lone surrogate (not valid Unicode)"
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > max_depth:
            return f"nests deeper than {max_depth} levels"
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list, str)))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class BadJSON(ValueError):
    """A request body that is not acceptable JSON; the message says why (short)."""


def parse_json_body(raw: bytes, max_depth: int | None = None) -> Any:
    """json.loads with the server's rules: no NaN/Infinity, never a RecursionError, and (when
    ``max_depth`` is given) see ``json_problem``. Raises BadJSON with a short reason."""
    if _bracket_depth(raw) > PARSE_DEPTH:  # the same verdict whatever sys.getrecursionlimit() is
        raise BadJSON(f"body nests deeper than {PARSE_DEPTH} levels")
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadJSON("body nests too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadJSON(f"body is not valid JSON ({clip(str(e), 80)})") from None
    if max_depth is not None:
        problem = json_problem(value, max_depth)
        if problem is not None:
            raise BadJSON(f"body {problem}")
    return value


PARSE_DEPTH = 256
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _bracket_depth(raw: bytes | str) -> int:
    """Deepest nesting of ``[``/``{`` outside strings (a bound checked before parsing, so a deep
    body is rejected the same way whether or not some library raised the recursion limit)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b"", raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_error(status: int, kind: str, message: str) -> tuple[int, list, bytes]:
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    return status, [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())], body


def target_problem(scope) -> str | None:
    """Why a request's target is not one this server answers, or None. Served: origin form
    (``/path?query``). Refused: absolute form (``GET http://host/x``, what a client sends to a server
    it was told is its forward proxy) and asterisk form (``OPTIONS *``)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
    if raw.startswith(b"/"):
        return None
    if raw == b"*":
        return "request target '*' (asterisk form): this server answers requests for a path, e.g. GET /x"
    return (f"request target {clip_repr(raw.decode('latin-1'))} is in absolute form, as a client sends it to a "
            "forward proxy; this server answers origin-form targets (a path, e.g. GET /x)")


class RequestGuard:
    """ASGI middleware: reads each request body in full before the app sees it, within
    ``max_body_bytes`` (413) and ``body_timeout_s`` (408), then replays it to the app. Later
    ``receive`` calls (the fault injector waiting for a disconnect) go to the real connection."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = target_problem(scope)
        if problem is not None:
            return await _reply(send, *json_error(400, "bad_request_target", problem))
        lim = self.limits
        declared = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                if not v.isdigit() or declared is not None:
                    return await _reply(send, *json_error(
                        400, "bad_request", f"Content-Length {clip_repr(v.decode('latin-1'))} is "
                        "not a single whole number"))
                declared = int(v)
        if declared is not None and declared > lim.max_body_bytes:
            return await _reply(send, *json_error(
                413, "body_too_large", f"request body of {declared} bytes exceeds the limit of "
                f"{lim.max_body_bytes} bytes"), close=True)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(lim.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return None  # the client went away
                    body = msg.get("body", b"")
                    size += len(body)
                    if size > lim.max_body_bytes:
                        return await _reply(send, *json_error(
                            413, "body_too_large", f"request body exceeds the limit of "
                            f"{lim.max_body_bytes} bytes"), close=True)
                    chunks.append(body)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            return await _reply(send, *json_error(
                408, "body_timeout", f"the request body did not arrive within "
                f"{lim.body_timeout_s:g}s ({size} of {declared if declared is not None else '?'} "
                "bytes)"), close=True)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replay_receive, send)


async def _reply(send, status: int, headers: list, body: bytes, close: bool = False) -> None:
    if close:  # the rest of the body was never read: this connection cannot serve another request
        headers = [*headers, (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
