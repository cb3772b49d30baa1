"""The fault proxy: seeded, replayable faults and their ledger in front of any HTTP API.

    reflrl faults proxy --upstream http://127.0.0.1:9000 --faults rate_limit=0.1,timeout=0.05:2s \\
        --seed 0 --port 8078
    # clients now talk to http://127.0.0.1:8078/... instead of http://127.0.0.1:9000/...

A reverse proxy (an ASGI app served by uvicorn with the tool server's socket-level protocol,
``reflrl.envs.loopback``) that forwards every request to ``upstream`` and, through the same
``FaultInjector`` as the tool server, makes a client see the faults of the plan exactly as a real
client of a misbehaving API would: 429 with Retry-After, 5xx, 403 bans, stalls until the client's
read timeout, TCP resets, bodies cut short, invalid JSON, slow answers, a renamed or dropped field
of a JSON object. Every injected fault is recorded in the proxy's ``Ledger``.

Decisions: ``reflrl.faults.decide(plan, seed, episode, step, call, attempt)``, a pure function.

- A request with the X-Reflrl-Episode/-Step/-Call/-Attempt headers (reflrl's ``ToolClient``, e.g.
  through ``reflrl.envs.http_tools``) is decided at those coordinates, as the tool server decides.
- Any other request is identified by a hash of (method, path, query, body): ``episode`` is
  ``req-<16 hex digits>``, step and call are 0, and ``attempt`` counts how often the proxy has seen
  that identity before, so a client's retry of the same request is its next attempt. The same seed
  and the same sequence of requests give the same faults (concurrent identical requests are
  numbered in their arrival order).
- The client identity that an ``ip_ban`` bans is X-Reflrl-Client (else "anonymous"); the ban holds
  for that identity's later attempts of the same episode (request identity).
- ``invalid_file`` applies to reflrl's file tools only and is refused in a proxy plan.
- API changes (``param_renamed``, ``tool_moved``; ``reflrl.faults.evolve``) act on the route's last path
  segment (``POST /v1/weather`` is retired for ``POST /v1/weather_v2``, which is forwarded as the old
  route) and on a JSON-object request body (a renamed key: the old one gets 400, the new one is forwarded
  under the old). The proxy knows no schema, so the renamed key is picked among the keys of the first
  JSON-object body it sees for that (episode, route), and kept. They are sticky per episode: the
  X-Reflrl-Episode of a request that carries one, else the proxy's whole run (a request's own identity
  changes with its body, so it cannot be the episode of a change).

Limits: a request body over ``max_body_bytes`` is answered 413 (a Content-Length over the limit
before reading anything; a chunked body as soon as it passes the limit), never buffered without
bound; an upstream answer over ``max_response_bytes`` is answered 502. An unreachable upstream
gives 502 and an upstream slower than ``upstream_timeout`` gives 504: those are real faults, not
injected ones, so they are not in the ledger (and a client ledger reconciles them as mismatches).

Control endpoints (never forwarded, never faulted): ``GET /_reflrl/ledger[?episode=ID]`` (the
injected events, as the tool server's ``/v1/ledger``) and ``GET /_reflrl/health``.
"""
from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from hashlib import blake2b
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx

from reflrl.faults import FaultInjector, FaultPlan, FaultSite, FaultSpecError, Ledger
from reflrl.faults.inject import replay_body
from reflrl.faults.coords import CoordError
from reflrl.faults.evolve import ChangeBook
from reflrl.faults.inject import Coords, _drain, _err, _send_json, header_coords

from .clock import SystemClock
from .limits import target_problem

CONTROL_PREFIX = "/_reflrl/"
DEFAULT_PORT = 8078
DEFAULT_MAX_BODY = 1 << 20          # 1 MiB of request body
DEFAULT_MAX_RESPONSE = 32 << 20     # 32 MiB of upstream answer
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                        b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host",
                        b"content-length"})
_REQUEST = "reflrl.proxy.request"   # scope extension: the buffered body and coordinates


class ProxyError(ValueError):
    """A bad proxy setting (upstream URL, fault plan)."""


def request_identity(method: str, path: bytes, query: bytes, body: bytes) -> str:
    """``req-<16 hex>``: a hash of what makes two requests the same request."""
    h = blake2b(digest_size=8)
    for part in (method.encode(), path, query, body):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return "req-" + h.hexdigest()


class FaultProxy:
    """The proxy's ASGI app (see the module docstring); ``ledger`` holds the injected faults.

    transport: an httpx transport for the upstream (default real HTTP); clock: stalls without a
    net control (an ASGI server other than ``reflrl.envs.loopback``)."""

    def __init__(self, upstream: str, faults: Any = None, *, seed: int = 0,
                 ledger: Ledger | None = None, clock=None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE, upstream_timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ProxyError(f"upstream {upstream!r} is not an http:// or https:// URL")
        if parts.query or parts.fragment:
            raise ProxyError(f"upstream {upstream!r}: give a base URL without query or fragment")
        self.plan = FaultPlan.coerce(faults)
        if self.plan.prob("invalid_file") > 0:
            raise FaultSpecError("invalid_file applies to reflrl's file tools only; the proxy "
                                 "cannot inject it (leave it out of the proxy's --faults)")
        if max_body_bytes < 0 or max_response_bytes < 0:
            raise ProxyError("body limits must be >= 0")
        self.upstream = upstream.rstrip("/")
        self.seed = int(seed)
        self.ledger = ledger if ledger is not None else Ledger()
        self.max_body_bytes = int(max_body_bytes)
        self.max_response_bytes = int(max_response_bytes)
        self.upstream_timeout = float(upstream_timeout)
        self.stats: Counter[str] = Counter()
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}             # request identity -> requests seen
        self._keys: set[tuple[str, int, int, int]] = set()  # header coordinates seen
        self._banned: dict[str, set[str]] = {}      # episode -> banned client identities
        self._header_eps: set[str] = set()          # episodes named by X-Reflrl-Episode
        self._books: dict[str, ChangeBook] = {}     # API changes per episode ("*": the whole run)
        self.injector = FaultInjector(self._forward, lookup=self._lookup, ledger=self.ledger,
                                      clock=clock or SystemClock(), coords=_scope_coords,
                                      envelope=None, request_envelope=None)

    # ---- ASGI entry ---------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None  # websockets are not proxied
        problem = target_problem(scope)
        if problem is not None:  # e.g. a client that uses this reverse proxy as its forward proxy
            self.stats["bad_request"] += 1
            return await _send_json(send, 400, _err("bad_request_target", (
                f"{problem}. This is a reverse proxy in front of {self.upstream}: send it the path "
                "(GET /x), not a full URL")))
        if scope["path"].startswith(CONTROL_PREFIX):
            return await self._control(scope, send)
        self.stats["requests"] += 1
        body = await _read_body(scope, receive, self.max_body_bytes)
        if body is None:
            self.stats["too_large"] += 1
            return await _send_json(send, 413, _err(
                "payload_too_large", f"request body over the proxy's limit of "
                                     f"{self.max_body_bytes} bytes"),
                                    extra=[(b"connection", b"close")])
        try:
            coords = self._coords(scope, body)
        except CoordError as e:  # a malformed X-Reflrl-* header: named, as the tool server names it
            self.stats["bad_request"] += 1
            return await _send_json(send, 400, _err("bad_header", str(e)))
        scope = dict(scope)
        ext = dict(scope.get("extensions") or {})
        ext[_REQUEST] = {"body": body, "coords": coords}
        scope["extensions"] = ext
        return await self.injector(scope, replay_body(body, receive), send)

    def _coords(self, scope, body: bytes) -> Coords:
        method, path = scope["method"], scope["path"]
        tool = f"{method} {path}"
        c = header_coords(scope)
        with self._lock:
            if c is not None:
                key = c[:4]
                if key in self._keys:  # the same episode replayed: it supersedes its records
                    self._forget(c[0])
                self._keys.add(key)
                self._header_eps.add(c[0])
                return (*c, tool)
            raw = scope.get("raw_path") or quote(path).encode()
            ident = request_identity(method, raw, scope.get("query_string", b""), body)
            attempt = self._seen.get(ident, 0)
            self._seen[ident] = attempt + 1
        client = "anonymous"
        for k, v in scope["headers"]:
            if k == b"x-reflrl-client":
                client = v.decode("latin-1")
        return (ident, 0, 0, attempt, client, tool)

    def _forget(self, episode: str) -> None:
        self.ledger.forget_injected(episode)
        self._banned.pop(episode, None)
        self._books.pop(episode, None)
        self._keys = {k for k in self._keys if k[0] != episode}

    def _lookup(self, episode: str, tool: str) -> FaultSite:
        with self._lock:
            banned = self._banned.setdefault(episode, set())
            book = None
            if self.plan.change_total > 0:
                where = episode if episode in self._header_eps else "*"
                book = self._books.get(where)
                if book is None:
                    book = self._books[where] = ChangeBook(self.plan, self.seed, where)
        return FaultSite(self.plan, self.seed, banned, file_tool=False, changes=book)

    # ---- forwarding (the app behind the injector) ---------------------------------------------
    async def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(transport=self._transport, timeout=self.upstream_timeout,
                                           follow_redirects=False)
        return self._http

    async def _forward(self, scope, receive, send) -> None:
        body = await _drain(receive)  # the buffered body, as the injector passes it on (API changes)
        raw = scope.get("raw_path") or quote(scope["path"]).encode()
        url = self.upstream + raw.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"]
                   if k.lower() not in HOP_BY_HOP and k.lower() != b"accept-encoding"]
        http = await self._client()
        try:
            req = http.build_request(scope["method"], url, headers=headers, content=body)
        except httpx.InvalidURL as e:  # a path httpx will not send on, named instead of a 500
            self.stats["bad_request"] += 1
            return await _send_json(send, 400, _err("bad_request_target", f"cannot forward {url!r}: {e}"))
        try:
            resp = await http.send(req, stream=True)
            try:
                parts, n = [], 0
                async for chunk in resp.aiter_raw():
                    n += len(chunk)
                    if n > self.max_response_bytes:
                        self.stats["upstream_too_large"] += 1
                        return await _send_json(send, 502, _err(
                            "upstream_too_large", f"upstream answer over the proxy's limit of "
                                                  f"{self.max_response_bytes} bytes"))
                    parts.append(chunk)
            finally:
                await resp.aclose()
        except httpx.TimeoutException as e:
            self.stats["upstream_timeout"] += 1
            return await _send_json(send, 504, _err("upstream_timeout", f"upstream: {e!r}"))
        except httpx.HTTPError as e:
            self.stats["upstream_error"] += 1
            return await _send_json(send, 502, _err("upstream_error", f"upstream: {e!r}"))
        self.stats["forwarded"] += 1
        out = [(k.lower(), v) for k, v in resp.headers.raw if k.lower() not in HOP_BY_HOP]
        data = b"".join(parts)
        out.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    # ---- control endpoints and lifespan --------------------------------------------------------
    async def _control(self, scope, send) -> None:
        name = scope["path"][len(CONTROL_PREFIX):]
        if scope["method"] != "GET":
            return await _send_json(send, 405, _err("method_not_allowed", "GET only"))
        if name == "ledger":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            episode = query.get("episode", [None])[0]
            events = [e.to_dict() for e in self.ledger.injected(episode)]
            return await _send_json(send, 200, {"episode": episode, "events": events})
        if name == "health":
            return await _send_json(send, 200, {
                "ok": True, "upstream": self.upstream, "faults": str(self.plan) or "none",
                "seed": self.seed, "stats": dict(self.stats)})
        return await _send_json(send, 404, _err("not_found", f"no control endpoint {name!r}"))

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        """Close the upstream client (idempotent)."""
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()

    def summary(self) -> str:
        """Requests, answers and injected faults by kind, one line each."""
        inj = Counter(e.kind for e in self.ledger.injected())
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(inj.items())) or "none"
        stats = ", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())) or "no requests"
        return f"reflrl fault proxy: {stats}\ninjected faults: {kinds} (total {sum(inj.values())})"


# ---- helpers ------------------------------------------------------------------------------------
def _scope_coords(scope) -> Coords | None:
    info = (scope.get("extensions") or {}).get(_REQUEST)
    return None if info is None else info["coords"]


async def _read_body(scope, receive, limit: int) -> bytes | None:
    """The whole request body, or None once it is over ``limit`` bytes (reading stops there)."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                if int(v) > limit:
                    return None
            except ValueError:
                return None
    parts, n = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(parts)  # the client went away; nothing will be sent anyway
        chunk = msg.get("body", b"")
        n += len(chunk)
        if n > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def serve_proxy(upstream: str, faults: Any = None, *, seed: int = 0, host: str = "127.0.0.1",
                port: int = DEFAULT_PORT, max_body_bytes: int = DEFAULT_MAX_BODY,
                upstream_timeout: float = 60.0, log_level: str = "warning", announce=print) -> FaultProxy:
    """Run the proxy on ``host:port`` until interrupted (blocking); returns it (ledger, stats).

    ``announce`` gets a line with the URL once the socket is bound, and the summary at the end."""
    import uvicorn

    from .loopback import _bind, make_config

    proxy = FaultProxy(upstream, faults, seed=seed, max_body_bytes=max_body_bytes,
                       upstream_timeout=upstream_timeout)
    sock = _bind(host, port)
    real_port = sock.getsockname()[1]
    if announce is not None:
        announce(f"reflrl fault proxy: http://{host}:{real_port} -> {proxy.upstream} "
                 f"(faults {str(proxy.plan) or 'none'}, seed {proxy.seed}); Ctrl-C stops it")
        sys.stdout.flush()
    try:
        uvicorn.Server(make_config(proxy, host, real_port, log_level)).run(sockets=[sock])
    finally:
        if announce is not None:
            announce(proxy.summary())
    return proxy
