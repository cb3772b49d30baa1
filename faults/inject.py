"""Server-side fault injection: an ASGI middleware in front of the tool server.

For every ``POST /v1/call/{tool}`` it reads the attempt coordinates from the headers
(X-Reflrl-Episode/-Step/-Call/-Attempt/-Client; missing or malformed ones get 400 ``bad_header``
naming the header, see ``reflrl.faults.coords``), asks ``decide`` (a pure function of the episode's
fault seed and those coordinates) for a fault, records what it injects in the server's Ledger,
and makes the client see it exactly as a real HTTP client would:

- pre-dispatch (the tool does not run): rate_limit (429 + Retry-After; on a site with Retry-After
  windows, as on a real server, a call of that tool by that client identity before Retry-After has
  passed is refused with 429 again, with the time still to wait, recorded with cause "window"),
  server_error (500/502/503),
  ip_ban (403, then every later attempt of that client identity in the episode gets 403 too,
  recorded with cause "ban"), timeout (stall until the client's read timeout fires), connection
  (TCP reset).
- post-dispatch (the tool ran, its side effects happened): truncated (Content-Length N, fewer bytes,
  close), malformed (200 with an invalid JSON body), latency (delay, then the correct answer),
  schema_drift (one field of a 200 result renamed or dropped), invalid_file (file tools only:
  corrupt content, or 404 file_missing). schema_drift and invalid_file only apply to 200 answers; when they
  cannot apply (error answer, no dict in the result, not a file tool) nothing is injected and
  nothing is recorded, so the ledger stays exact.

API changes (``param_renamed``, ``tool_moved``; ``reflrl.faults.evolve``) come first, before dispatch and
before the per-attempt draw, from the episode's ``ChangeBook`` (sticky per episode and tool): a call of a
retired tool gets 410 Gone naming its successor; a call of the successor is served as a call of the
retired tool (the path is rewritten); a call that uses a renamed parameter's old name gets 400
``parameter_renamed`` naming both names; one that uses the new name is served as the old call (the JSON
body's arguments are rewritten back). Each refused attempt is recorded (cause "change"); a served
adapted call then meets the per-attempt draw like any call.

The same middleware sits in the fault proxy (``reflrl.envs.proxy``) in front of any HTTP API: there
``coords`` derives the coordinates from the request itself and ``envelope=None`` makes the whole
JSON body the result that schema_drift alters.

Connection-level effects go through a *net control* found in ``scope["extensions"]["reflrl.net"]``:
the uvicorn protocol in ``reflrl.envs.loopback`` provides one that really resets / closes the socket;
the in-process transport in ``reflrl.envs.client`` provides one that makes httpx raise the same
exception types without sleeping, and whose ``clock`` (the client's) is the time the Retry-After window is
kept on, so an in-process server and its client share one virtual time. Without a net control (another ASGI server) connection faults
raise ``ConnectionResetError`` in the app and truncation closes the body early.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .coords import H_ATTEMPT, H_CALL, H_EPISODE, H_STEP, CoordError, parse_coords
from .decide import FaultDecision, decide
from .evolve import PARAM_RENAMED, TOOL_MOVED, ChangeBook, rewrite_arguments
from .ledger import FaultEvent, Ledger
from .spec import FaultPlan

NET_EXTENSION = "reflrl.net"
CALL_PREFIX = "/v1/call/"


SERVER_ERROR_CODES = (500, 502, 503)
MALFORMED_BODIES = (
    b'{"result": {"status": "ok", "data": [1, 2',             # cut JSON
    b"<html><body><h1>Service Temporarily Unavailable</h1></body></html>",  # proxy page
    b'{"result": NaN, "error": undefined}',                    # JS-isms
    b"\xff\xfe{\x00\"\x00r\x00",                               # wrong encoding
)
CORRUPT_MARK = "\x00\ufffd"


class NetControl(Protocol):
    """Connection-level actions the middleware can take (see module docstring)."""

    async def reset(self, receive) -> None: ...
    async def stall(self, seconds: float, receive) -> bool: ...
    async def close(self, receive, sent: int, expected: int) -> None: ...


@dataclass
class FaultSite:
    """What the middleware needs to know about an episode for one call."""

    plan: FaultPlan
    fault_seed: int
    banned: set[str] = field(default_factory=set)
    file_tool: bool = False
    # Retry-After windows: (client identity, tool) -> the time before which calls get 429 again;
    # None = none are kept (every attempt is an independent draw of the plan)
    windows: dict[tuple[str, str], float] | None = None
    # the episode's API changes (sticky per tool); None = none
    changes: ChangeBook | None = None


Lookup = Callable[[str, str], "FaultSite | None"]


Coords = tuple[str, int, int, int, str, str]
"""(episode, step, call, attempt, client identity, tool) of one request."""


class FaultInjector:
    """ASGI middleware; ``lookup(episode_id, tool) -> FaultSite | None`` (None: no such episode,
    let the app answer), ``ledger`` receives the injected events, ``clock.sleep`` is used when
    there is no net control.

    coords:   ``coords(scope) -> Coords | None``: which requests are subject to faults and their
              coordinates; default ``call_coords`` (POST /v1/call/{tool} with X-Reflrl-* headers).
              None lets the app answer untouched.
    envelope: the key of a 200 JSON answer that holds the result schema_drift and invalid_file
              alter (``{"result": ...}`` of the tool server); None = the whole JSON body (the
              fault proxy in front of any JSON API).
    request_envelope: the key of a request's JSON body that holds the call's arguments, which a
              ``param_renamed`` change reads and rewrites (``{"arguments": ...}`` of the tool server);
              None = the whole JSON body (the fault proxy)."""

    def __init__(self, app, *, lookup: Lookup, ledger: Ledger, clock,
                 coords: Callable[[dict], Coords | None] | None = None,
                 envelope: str | None = "result", request_envelope: str | None = "arguments") -> None:
        self.app = app
        self.lookup = lookup
        self.ledger = ledger
        self.clock = clock
        self.coords = coords or call_coords
        self.envelope = envelope
        self.request_envelope = request_envelope

    async def __call__(self, scope, receive, send) -> None:
        try:
            coords = self.coords(scope) if scope["type"] == "http" else None
        except CoordError as e:  # never a silently fault-free call (reflrl.faults.coords)
            return await _send_json(send, 400, _err("bad_header", str(e)))
        if coords is None:
            return await self.app(scope, receive, send)
        episode, step, call, attempt, ident, tool = coords
        site = self.lookup(episode, tool)
        if site is None:
            return await self.app(scope, receive, send)
        net = (scope.get("extensions") or {}).get(NET_EXTENSION)

        def record(kind: str, status: int | None, detail: str, cause: str = "draw") -> None:
            self.ledger.record_injected(FaultEvent(
                episode, step, call, attempt, "injected", "env_fault", kind, tool, status,
                detail, cause))

        book = site.changes
        moved = False
        if book is not None and book.active:
            orig = book.moved_from(tool)
            if orig is not None:  # the successor of a retired tool: served as that tool
                scope, tool, moved = _with_tool(scope, tool, orig), orig, True

        if ident in site.banned:
            record("ip_ban", 403, f"standing ban of client {ident}", cause="ban")
            return await _send_json(send, 403, _err("ip_banned", f"client {ident} is banned"))
        now = getattr(net, "clock", self.clock).monotonic()
        until = site.windows.get((ident, tool)) if site.windows is not None else None
        if until is not None and now < until - 1e-9:
            ra = max(1, math.ceil(until - now - 1e-9))
            record("rate_limit", 429, f"retry_after={ra}", cause="window")
            return await _send_json(send, 429, _err("rate_limited", "too many requests"),
                                    extra=[(b"retry-after", str(ra).encode())])

        if book is not None and book.active:
            body = await _drain(receive)
            args = _arguments(body, self.request_envelope)
            ch = book.change(tool, args)
            if ch is not None and ch.kind == TOOL_MOVED and not moved:
                record(ch.kind, 410, f"{ch.tool}->{ch.new}", cause="change")
                return await _send_json(send, 410, ch.error_body())
            if ch is not None and ch.kind == PARAM_RENAMED and isinstance(args, dict):
                action, new_args = rewrite_arguments(ch, args)
                if action == "refuse":
                    record(ch.kind, 400, f"{ch.param}->{ch.new}", cause="change")
                    return await _send_json(send, 400, ch.error_body())
                if action == "rewrite":
                    body = _with_arguments(body, self.request_envelope, new_args)
            receive = replay_body(body, receive)

        d = decide(site.plan, site.fault_seed, episode, step, call, attempt)
        if d is None or (d.kind == "invalid_file" and not site.file_tool):
            return await self.app(scope, receive, send)
        k = d.kind

        # ---- pre-dispatch faults: the tool never runs --------------------------------------
        if k == "rate_limit":
            ra = max(0, math.ceil(d.param - 1e-9))
            if ra and site.windows is not None:
                site.windows[(ident, tool)] = now + ra
            record(k, 429, f"retry_after={ra}")
            return await _send_json(send, 429, _err("rate_limited", "too many requests"),
                                    extra=[(b"retry-after", str(ra).encode())])
        if k == "server_error":
            code = d.choose(SERVER_ERROR_CODES, 1)
            record(k, code, str(code))
            return await _send_json(send, code, _err("server_error", f"upstream error {code}"))
        if k == "ip_ban":
            site.banned.add(ident)
            record(k, 403, f"client {ident} banned")
            return await _send_json(send, 403, _err("ip_banned", f"client {ident} is banned"))
        if k == "connection":
            record(k, None, "reset")
            if net is None:
                raise ConnectionResetError("reflrl: injected connection reset")
            return await net.reset(receive)
        if k == "timeout":
            record(k, None, f"stall={d.param:g}s")
            if await self._stall(net, d.param, receive):
                return None
            return await _send_json(send, 504, _err("gateway_timeout", "upstream timed out"))

        # ---- post-dispatch faults: run the tool, then alter the answer ---------------------
        status, headers, body = await _capture(self.app, scope, receive)
        if k == "latency":
            record(k, status, f"delay={d.param:g}s")
            if await self._stall(net, d.param, receive):
                return None
            return await _send_raw(send, status, headers, body)
        if k == "truncated":
            n = d.sub % max(1, len(body))
            record(k, status, f"sent {n} of {len(body)} bytes")
            await send({"type": "http.response.start", "status": status,
                        "headers": _with_length(headers, len(body))})
            await send({"type": "http.response.body", "body": body[:n], "more_body": True})
            if net is None:
                return await send({"type": "http.response.body", "body": b"", "more_body": False})
            return await net.close(receive, n, len(body))
        if k == "malformed":
            bad = d.choose(MALFORMED_BODIES, 2)
            record(k, 200, f"variant {MALFORMED_BODIES.index(bad)}")
            hdrs = [(a, b) for a, b in headers if a.lower() != b"content-type"]
            hdrs.append((b"content-type", b"application/json"))
            return await _send_raw(send, 200, hdrs, bad)
        if status != 200:
            return await _send_raw(send, status, headers, body)
        env = self.envelope
        try:
            payload = json.loads(body)
            result = payload if env is None else payload[env]
        except (ValueError, KeyError, TypeError):
            return await _send_raw(send, status, headers, body)

        def wrap(new_result: Any) -> Any:
            return new_result if env is None else {env: new_result}

        if k == "schema_drift":
            drifted = drift(result, d)
            if drifted is None:
                return await _send_raw(send, status, headers, body)
            new_result, detail = drifted
            record(k, 200, detail)
            return await _send_json(send, 200, wrap(new_result))
        if k == "invalid_file":
            if d.choose(("corrupt", "missing"), 3) == "missing":
                record(k, 404, "file_missing")
                return await _send_json(send, 404, _err(
                    "file_missing", "the file's storage object is missing (try again later)"))
            record(k, 200, "corrupt")
            return await _send_json(send, 200, wrap(corrupt(result)))
        return await _send_raw(send, status, headers, body)  # pragma: no cover

    async def _stall(self, net, seconds: float, receive) -> bool:
        if net is None:
            await self.clock.sleep(seconds)
            return False
        return await net.stall(seconds, receive)


# ---- payload transformations (pure) -------------------------------------------------------
def drift(result: Any, d: FaultDecision) -> tuple[Any, str] | None:
    """Rename or drop one field of the first dict in ``result`` (the dict itself, or the first
    element of a list); None when there is no non-empty dict to alter."""
    target_path: list[Any] = []
    target = result
    if isinstance(target, list) and target and isinstance(target[0], dict):
        target_path, target = [0], target[0]
    if not isinstance(target, dict) or not target:
        return None
    key = d.choose(sorted(target, key=str), 4)
    op = d.choose(("rename", "drop"), 5)
    new = {}
    for k2, v in target.items():
        if k2 != key:
            new[k2] = v
        elif op == "rename":
            new[_renamed(str(k2), target)] = v
    if target_path:
        out = list(result)
        out[0] = new
    else:
        out = new
    detail = f"renamed {key}->{_renamed(str(key), target)}" if op == "rename" else f"dropped {key}"
    return out, detail


def _renamed(key: str, taken: dict) -> str:
    if "_" in key:
        head, *rest = key.split("_")
        cand = head + "".join(p[:1].upper() + p[1:] for p in rest)
    else:
        cand = key + "_v2"
    while cand in taken or cand == key:
        cand += "_"
    return cand


def corrupt(result: Any) -> Any:
    """Corrupt every string leaf the way a damaged file decodes: half the text, NUL, U+FFFD."""
    def walk(x):
        if isinstance(x, str):
            return x[: len(x) // 2] + CORRUPT_MARK + "\ufffd" * 3
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x
    out = walk(result)
    if out == result:  # no string leaf: the whole content is garbage
        return CORRUPT_MARK + "\ufffd" * 3
    return out


def is_corrupt(result: Any) -> bool:
    """Whether a result carries the corruption ``corrupt`` produces (NUL or U+FFFD in a string)."""
    if isinstance(result, str):
        return "\x00" in result or "\ufffd" in result
    if isinstance(result, list):
        return any(is_corrupt(v) for v in result)
    if isinstance(result, dict):
        return any(is_corrupt(v) for v in result.values())
    return False


# ---- API changes: request rewriting ------------------------------------------------------
def _with_tool(scope, name: str, orig: str) -> dict:
    """``scope`` with its path's last segment (the successor ``name``'s) turned into ``orig``'s."""
    seg_new = name[max(name.rfind("/"), name.rfind(" ")) + 1:]
    seg_old = orig[max(orig.rfind("/"), orig.rfind(" ")) + 1:]
    scope = dict(scope)
    path = scope["path"]
    if path.endswith(seg_new):
        scope["path"] = path[: len(path) - len(seg_new)] + seg_old
        raw = scope.get("raw_path")
        if raw is not None:
            from urllib.parse import quote
            scope["raw_path"] = quote(scope["path"]).encode()
    return scope


def _arguments(body: bytes, envelope: str | None) -> Any:
    """A request's arguments: ``body[envelope]`` (the whole JSON body when None); None when the body
    is not JSON or has none."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if envelope is None:
        return payload
    return payload.get(envelope) if isinstance(payload, dict) else None


def _with_arguments(body: bytes, envelope: str | None, args: dict) -> bytes:
    if envelope is None:
        return json.dumps(args).encode()
    payload = json.loads(body)
    payload[envelope] = args
    return json.dumps(payload).encode()


async def _drain(receive) -> bytes:
    """The whole request body from ``receive`` (what arrived, if the client went away)."""
    parts = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


def replay_body(body: bytes, receive):
    """A receive callable that yields the buffered ``body`` once, then the client's own events (so a stalled
    answer still learns that the client hung up); for a middleware that read the body before passing it on."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# ---- ASGI helpers -------------------------------------------------------------------------
def header_coords(scope) -> tuple[str, int, int, int, str] | None:
    """(episode, step, call, attempt, client) from the X-Reflrl-* headers; None when the request carries
    no coordinate header at all (the fault proxy then derives them from the request itself); CoordError
    naming the header when they are there but missing a part or malformed."""
    present = {name for name, _ in scope["headers"]}
    if not present & {H_EPISODE, H_STEP, H_CALL, H_ATTEMPT}:
        return None
    c = parse_coords(scope["headers"])
    return (c.episode, c.step, c.call, c.attempt, c.client)


def call_coords(scope) -> Coords | None:
    """The tool server's requests: POST /v1/call/{tool}, whose X-Reflrl-* coordinate headers are
    required (CoordError, answered 400, when missing or malformed)."""
    if scope["method"] != "POST" or not scope["path"].startswith(CALL_PREFIX):
        return None
    c = parse_coords(scope["headers"])
    return (c.episode, c.step, c.call, c.attempt, c.client, scope["path"][len(CALL_PREFIX):])


def _err(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message}}


async def _send_json(send, status: int, payload: dict, extra=()) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), *extra]
    await _send_raw(send, status, headers, body)


async def _send_raw(send, status: int, headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": _with_length(headers, len(body))})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _with_length(headers, n: int) -> list[tuple[bytes, bytes]]:
    out = [(a, b) for a, b in headers if a.lower() != b"content-length"]
    out.append((b"content-length", str(n).encode()))
    return out


async def _capture(app, scope, receive) -> tuple[int, list, bytes]:
    """Run the inner app and buffer its whole response."""
    status = 500
    headers: list = []
    parts: list[bytes] = []

    async def send(message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(parts)
