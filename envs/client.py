"""The tool client: async httpx + a tenacity retry policy, with every attempt classified and billed.

    client = ToolClient.in_process(app)                 # httpx over InProcessTransport (no sockets)
    client = ToolClient.connect("http://127.0.0.1:8765")  # real loopback HTTP
    await client.open_episode("ep1", seed=0, faults="rate_limit=0.1", fault_seed=0)
    out = await client.call("ep1", step=0, call_index=0, name="get_weather", arguments={...})
    await client.close_episode("ep1"); await client.aclose()

Classification (``classify_response`` / ``classify_exception``) uses only what a real client sees:
status codes, headers, exception types and the body. It never reads the server's decision.

==========================  ===================================================================
what the client sees        triage / kind
==========================  ===================================================================
429 (+ Retry-After)         env_fault / rate_limit
500 with error type tool_bug  tool_bug (the tool's handler crashed on valid arguments: never
                            retried, counted apart from faults in the ledger)
500, 502, 503 (other 5xx)   env_fault / server_error
504, 408, httpx.TimeoutException  env_fault / timeout
httpx.ReadError, ConnectError, WriteError, OSError     env_fault / connection
httpx.RemoteProtocolError   env_fault / truncated  (body shorter than Content-Length)
200 with a non-JSON body    env_fault / malformed  (also a JSON body without "result")
403                         env_fault / ip_ban     (retried after an identity change, if enabled)
404 file_missing, or a 200 result with NUL / U+FFFD in a string  env_fault / invalid_file
200 result failing the tool's ``returns`` schema      env_fault / schema_drift
404 unknown_tool, 422 (invalid_arguments or a ToolError kind), other 4xx   policy_error
400 (bad header or body), 404 unknown_episode  ToolClientError raised (a client bug)
200 valid                   ok
==========================  ===================================================================

An answer that is not an env fault (ok, policy error, tool bug) slower than ``slow_threshold_s``
gets kind "latency" (an injected latency acts on error answers too).

schema_drift: a drifted result is detectable only when the tool declares a ``returns`` schema that
the drift violates (the client loads schemas from ``GET /v1/tools?detail=1``). Otherwise the drifted
result is returned as ok data, exactly what a real client would get; the ledger then counts that
injected drift as *undetected* (not a mismatch), so reconciliation stays exact.

Retries (``RetryPolicy``): env faults of retryable kinds are retried with capped exponential backoff
and seeded jitter; a ``Retry-After`` header sets the minimum wait; retrying stops after
``max_attempts`` or when the next wait would exceed the time ``budget_s``. Policy errors are never
retried. Each attempt is one billed tool call and one observed record in the Ledger.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from urllib.parse import quote
from email.utils import parsedate_to_datetime
from hashlib import blake2b
from typing import Any

import httpx
import jsonschema
from tenacity import AsyncRetrying, retry_if_result

from reflrl.faults import CallRecord, FaultEvent, FaultPlan, Ledger, is_corrupt
from reflrl.faults.inject import NET_EXTENSION

from .clock import SystemClock

RETRYABLE_KINDS = frozenset({"rate_limit", "server_error", "timeout", "connection", "truncated",
                             "malformed", "ip_ban", "invalid_file", "schema_drift"})


class ToolClientError(RuntimeError):
    """A client/protocol bug (unknown episode, bad request), not a tool outcome."""


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries env faults.

    max_attempts:        attempts per call including the first (>= 1).
    budget_s:            give up when elapsed time plus the next wait would exceed this.
    base_s, cap_s:       backoff before attempt n+1 is min(cap_s, base_s * 2**(n-1)).
    jitter:              fraction of that backoff drawn uniformly (0 = none, 1 = "full jitter"),
                         from a hash of (seed, episode, step, call, attempt): reproducible.
    max_retry_after_s:   a Retry-After longer than this is not waited for (give up).
    rotate_identity_on_ban: on 403 ip_ban change the client identity ("IP change") and retry;
                         otherwise ip_ban is not retried.
    retry_kinds:         env-fault kinds that are retried.
    seed:                jitter seed.
    """

    max_attempts: int = 4
    budget_s: float = 60.0
    base_s: float = 0.5
    cap_s: float = 8.0
    jitter: float = 0.5
    max_retry_after_s: float = 60.0
    rotate_identity_on_ban: bool = True
    retry_kinds: frozenset[str] = RETRYABLE_KINDS
    seed: int = 0

    @classmethod
    def no_retry(cls) -> "RetryPolicy":
        return cls(max_attempts=1)

    def backoff(self, episode: str, step: int, call: int, attempt: int) -> float:
        """Jittered capped exponential wait after failed attempt ``attempt`` (0-based)."""
        d = min(self.cap_s, self.base_s * (2.0 ** attempt))
        h = blake2b(f"{self.seed}\x1f{episode}\x1f{step}\x1f{call}\x1f{attempt}".encode(),
                    digest_size=8).digest()
        u = int.from_bytes(h, "big") / float(1 << 64)
        return d * (1.0 - self.jitter) + d * self.jitter * u


@dataclass
class Observation:
    """The classification of one attempt (client side)."""

    triage: str                      # "ok" | "env_fault" | "policy_error" | "tool_bug"
    kind: str | None = None          # env-fault kind; "latency" for a slow answer
    status: int | None = None
    detail: str = ""
    result: Any = None
    error: str | None = None
    retry_after: float | None = None


@dataclass
class CallOutcome:
    """The result of one logical call after retries (design.md "Python API of the client")."""

    ok: bool
    result: Any
    attempts: int                    # billed tool calls
    events: list[FaultEvent]         # observed env faults (and slow answers) on its attempts
    triage: str                      # "ok" | "env_fault" | "policy_error" | "tool_bug"
    error: str | None
    fault_kind: str | None           # env_fault: the kind of the fault that ended the call
    elapsed_s: float
    status: int | None = None

    @property
    def recovered(self) -> bool:
        return self.ok and any(e.triage == "env_fault" for e in self.events)


# ---- classification -------------------------------------------------------------------------
def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: delay-seconds or an HTTP-date (RFC 9110 sec. 10.2.3)."""
    if value is None:
        return None
    v = value.strip()
    try:
        s = float(v)
        return s if math.isfinite(s) and s >= 0 else None
    except ValueError:
        pass
    try:
        import datetime as _dt
        when = parsedate_to_datetime(v)
        return max(0.0, (when - _dt.datetime.now(_dt.timezone.utc)).total_seconds())
    except (TypeError, ValueError, IndexError):
        return None


def classify_response(status: int, headers: httpx.Headers | dict, body: bytes,
                      returns: Any = None) -> Observation:
    """Classify an HTTP answer from status, headers and body only (table in the module doc).

    returns: the tool's ``returns`` JSON schema (or a jsonschema validator of it), if known."""
    if status == 429:
        ra = parse_retry_after(headers.get("retry-after"))
        return Observation("env_fault", "rate_limit", status, f"retry_after={ra}", retry_after=ra,
                           error="429 Too Many Requests")
    if status == 504 or status == 408:
        return Observation("env_fault", "timeout", status, str(status),
                           error=f"HTTP {status}: {_error_message(body)}")
    if status == 500 and _error_type(body) == "tool_bug":
        return Observation("tool_bug", None, status, "tool_bug",
                           error=f"tool bug: {_error_message(body)}")
    if status >= 500:
        return Observation("env_fault", "server_error", status, str(status),
                           error=f"HTTP {status}: {_error_message(body)}")
    if status == 403:
        return Observation("env_fault", "ip_ban", status, _error_type(body) or "403",
                           error=f"403 Forbidden: {_error_message(body)}")
    if status >= 400:
        etype = _error_type(body)
        if status == 404 and etype == "file_missing":
            return Observation("env_fault", "invalid_file", status, "file_missing",
                               error=f"404: {_error_message(body)}")
        if status == 404 and etype == "unknown_episode" or status == 400:
            raise ToolClientError(f"HTTP {status}: {_error_message(body)}")
        return Observation("policy_error", None, status, etype or str(status),
                           error=f"{etype or status}: {_error_message(body)}")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Observation("env_fault", "malformed", status, "invalid JSON body",
                           error="response body is not valid JSON")
    if not isinstance(payload, dict) or "result" not in payload:
        return Observation("env_fault", "malformed", status, "JSON without 'result'",
                           error="response JSON has no 'result'")
    result = payload["result"]
    if is_corrupt(result):
        return Observation("env_fault", "invalid_file", status, "corrupt content", result=result,
                           error="file content is corrupt (NUL / U+FFFD bytes)")
    if returns:
        validator = returns if hasattr(returns, "iter_errors") else \
            jsonschema.validators.validator_for(returns)(returns)
        try:
            err = jsonschema.exceptions.best_match(validator.iter_errors(result))
        except jsonschema.exceptions.SchemaError:
            err = None
        if err is not None:
            return Observation("env_fault", "schema_drift", status, err.message, result=result,
                               error=f"result does not match the tool's schema: {err.message}")
    return Observation("ok", None, status, "", result=result)


def classify_exception(exc: BaseException) -> Observation:
    """Classify a transport exception (httpx or OSError)."""
    name = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return Observation("env_fault", "timeout", None, name, error=f"{name}: {exc}")
    if isinstance(exc, httpx.RemoteProtocolError):
        return Observation("env_fault", "truncated", None, name, error=f"{name}: {exc}")
    if isinstance(exc, (httpx.NetworkError, OSError)):
        return Observation("env_fault", "connection", None, name, error=f"{name}: {exc}")
    if isinstance(exc, httpx.DecodingError):
        return Observation("env_fault", "malformed", None, name, error=f"{name}: {exc}")
    raise exc


def _error_obj(body: bytes) -> dict:
    try:
        d = json.loads(body)
        e = d.get("error") if isinstance(d, dict) else None
        return e if isinstance(e, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _error_type(body: bytes) -> str | None:
    t = _error_obj(body).get("type")
    return t if isinstance(t, str) else None


def _error_message(body: bytes) -> str:
    e = _error_obj(body)
    if e:
        return str(e.get("message", e.get("type", "")))
    return body[:200].decode("utf-8", "replace")


# ---- in-process transport -----------------------------------------------------------------
class _InProcessNet:
    """Net control for the in-process transport: remembers what the server did to the 'socket'."""

    def __init__(self, clock, read_timeout: float | None) -> None:
        self.clock = clock
        self.read_timeout = read_timeout
        self.action: str | None = None
        self.detail = ""

    async def reset(self, receive) -> None:
        self.action = "reset"

    async def stall(self, seconds: float, receive) -> bool:
        if self.read_timeout is None or seconds < self.read_timeout:
            await self.clock.sleep(seconds)
            return False
        await self.clock.sleep(self.read_timeout)
        self.action = "timeout"
        return True

    async def close(self, receive, sent: int, expected: int) -> None:
        self.action = "truncated"
        self.detail = f"received {sent} bytes, expected {expected}"


class InProcessTransport(httpx.AsyncBaseTransport):
    """httpx transport that calls an ASGI app directly and turns the server's connection-level
    faults into the exceptions a socket would give: reset -> httpx.ReadError, stall past the read
    timeout -> httpx.ReadTimeout (the clock advances by the timeout; nothing sleeps for real with
    a VirtualClock), short body -> httpx.RemoteProtocolError."""

    def __init__(self, app, clock=None) -> None:
        self.app = app
        self.clock = clock or SystemClock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout") or {}
        net = _InProcessNet(self.clock, timeouts.get("read"))
        inner = self.app

        async def app(scope, receive, send):
            scope = dict(scope)
            ext = dict(scope.get("extensions") or {})
            ext[NET_EXTENSION] = net
            scope["extensions"] = ext
            state = {"started": False, "done": False}

            async def send2(msg):
                if msg["type"] == "http.response.start":
                    state["started"] = True
                elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                    state["done"] = True
                await send(msg)

            await inner(scope, receive, send2)
            if net.action is not None and not state["done"]:  # finish the fake wire cleanly
                if not state["started"]:
                    await send({"type": "http.response.start", "status": 599, "headers": []})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        response = await httpx.ASGITransport(app=app).handle_async_request(request)
        if net.action == "reset":
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        if net.action == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if net.action == "truncated":
            raise httpx.RemoteProtocolError(
                f"peer closed connection without sending complete message body ({net.detail})",
                request=request)
        return response


# ---- the client -----------------------------------------------------------------------------
class ToolClient:
    """Async client of the tool server (see module docstring).

    http: an httpx.AsyncClient whose base_url points at the server; retry: RetryPolicy;
    clock: for waits, budgets and elapsed times; ledger: receives observed attempts and call
    records (in-process the server's ledger is shared, so injected and observed meet there);
    timeout: read timeout per tool-call attempt in seconds; control_timeout: for the
    episode/ledger/tools requests (never fault-injected); identity: X-Reflrl-Client base;
    slow_threshold_s: an ok answer slower than this is recorded with kind "latency";
    validate_returns: check results against the tools' ``returns`` schemas (schema_drift).
    """

    def __init__(self, http: httpx.AsyncClient, *, retry: RetryPolicy | None = None, clock=None,
                 ledger: Ledger | None = None, timeout: float = 10.0, identity: str = "client",
                 slow_threshold_s: float | None = 0.25, validate_returns: bool = True,
                 shared_ledger: bool = False, control_timeout: float = 30.0) -> None:
        self.http = http
        self.retry = retry or RetryPolicy()
        self.clock = clock or SystemClock()
        self.ledger = ledger if ledger is not None else Ledger()
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.identity = identity
        self.slow_threshold_s = slow_threshold_s
        self.validate_returns = validate_returns
        self._shared_ledger = shared_ledger
        self._returns: dict[str, Any] | None = None  # name -> validator
        self._identity_n: dict[str, int] = {}

    @classmethod
    def in_process(cls, app, *, clock=None, ledger: Ledger | None = None, **kw) -> "ToolClient":
        """A client calling ``app`` in-process. Defaults to the app's server ledger (shared)."""
        clock = clock or SystemClock()
        server = getattr(app, "server", None)
        shared = False
        if ledger is None and server is not None:
            ledger, shared = server.share_ledger(), True
        elif server is not None and ledger is server.ledger:
            server.share_ledger()
            shared = True
        http = httpx.AsyncClient(transport=InProcessTransport(app, clock),
                                 base_url="http://reflrl.local")
        return cls(http, clock=clock, ledger=ledger, shared_ledger=shared, **kw)

    @classmethod
    def connect(cls, base_url: str, **kw) -> "ToolClient":
        """A client of a server over real HTTP (e.g. ``reflrl tools serve`` on loopback)."""
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        return cls(httpx.AsyncClient(base_url=base_url, limits=limits), **kw)

    async def __aenter__(self) -> "ToolClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    # ---- episodes --------------------------------------------------------------------------
    async def tools(self, detail: bool = False) -> list[dict]:
        r = await self.http.get("/v1/tools", params={"detail": "1"} if detail else None,
                                timeout=self.control_timeout)
        r.raise_for_status()
        return r.json()["tools"]

    async def open_episode(self, episode_id: str, *, seed: int = 0,
                           faults: FaultPlan | str | None = None, fault_seed: int | None = None,
                           tools: list[str] | None = None,
                           initial_config: dict | None = None) -> dict:
        plan = FaultPlan.coerce(faults)
        body = {"episode_id": episode_id, "seed": seed, "faults": str(plan),
                "fault_seed": seed if fault_seed is None else fault_seed, "tools": tools,
                "initial_config": initial_config}
        r = await self.http.post("/v1/episodes", json=body, timeout=self.control_timeout)
        if r.status_code != 201:
            raise ToolClientError(f"open_episode {episode_id!r}: HTTP {r.status_code}: "
                                  f"{_error_message(r.content)}")
        return r.json()

    async def close_episode(self, episode_id: str, *, fetch_ledger: bool = True) -> None:
        """Fetch the server's injected events for the episode (remote servers) and close it
        (the server then frees them)."""
        if fetch_ledger and not self._shared_ledger:
            await self.fetch_injected(episode_id)
        r = await self.http.delete(f"/v1/episodes/{quote(episode_id, safe='')}",
                                   timeout=self.control_timeout)
        if r.status_code not in (204, 404):
            raise ToolClientError(f"close_episode {episode_id!r}: HTTP {r.status_code}")
        self._identity_n.pop(episode_id, None)

    async def fetch_injected(self, episode_id: str) -> list[FaultEvent]:
        """GET /v1/episodes/{id}/ledger and merge the injected events into this client's ledger
        (none when the episode is not open)."""
        r = await self.http.get(f"/v1/episodes/{quote(episode_id, safe='')}/ledger",
                                timeout=self.control_timeout)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        events = [FaultEvent.from_dict(d) for d in r.json()["events"]]
        self.ledger.merge_injected(events)
        return events

    def current_identity(self, episode_id: str) -> str:
        n = self._identity_n.get(episode_id, 0)
        return self.identity if n == 0 else f"{self.identity}~ip{n}"

    async def _returns_schema(self, name: str):
        if not self.validate_returns:
            return None
        if self._returns is None:
            try:
                tools = await self.tools(detail=True)
            except (httpx.HTTPError, KeyError, ValueError):
                return None  # try again next call
            self._returns = {}
            for t in tools:
                schema = t.get("returns")
                if schema:
                    try:
                        cls = jsonschema.validators.validator_for(schema)
                        cls.check_schema(schema)
                        self._returns[t["name"]] = cls(schema)
                    except jsonschema.exceptions.SchemaError:
                        pass  # an invalid returns schema cannot detect anything
        return self._returns.get(name)

    # ---- calls -----------------------------------------------------------------------------
    async def call(self, episode_id: str, *, step: int, call_index: int, name: str,
                   arguments: dict[str, Any] | None = None) -> CallOutcome:
        """Call tool ``name`` with retries; every attempt is recorded in the ledger."""
        pol = self.retry
        clock = self.clock
        t0 = clock.monotonic()
        returns = await self._returns_schema(name)
        events: list[FaultEvent] = []
        kinds: list[str] = []
        n_attempts = 0
        body = {"arguments": arguments or {}}

        async def attempt() -> Observation:
            nonlocal n_attempts
            a = n_attempts
            n_attempts += 1
            headers = {"x-reflrl-episode": episode_id, "x-reflrl-step": str(step),
                       "x-reflrl-call": str(call_index), "x-reflrl-attempt": str(a),
                       "x-reflrl-client": self.current_identity(episode_id)}
            ts = clock.monotonic()
            try:
                r = await self.http.post(f"/v1/call/{name}", json=body, headers=headers,
                                         timeout=self.timeout)
                obs = classify_response(r.status_code, r.headers, r.content, returns)
            except ToolClientError:
                raise
            except (httpx.TransportError, OSError) as e:
                obs = classify_exception(e)
            took = clock.monotonic() - ts
            if (obs.triage != "env_fault" and self.slow_threshold_s is not None
                    and took >= self.slow_threshold_s):
                obs.kind, obs.detail = "latency", f"{took:.3f}s"
            ev = FaultEvent(episode_id, step, call_index, a, "observed", obs.triage, obs.kind,
                            name, obs.status, obs.detail)
            self.ledger.record_observed(ev)
            if obs.triage == "env_fault" or obs.kind == "latency":
                events.append(ev)
            if obs.triage == "env_fault":
                kinds.append(obs.kind or "")
                if obs.kind == "ip_ban" and pol.rotate_identity_on_ban:
                    self._identity_n[episode_id] = self._identity_n.get(episode_id, 0) + 1
            return obs

        def should_retry(obs: Observation) -> bool:
            if obs.triage != "env_fault" or obs.kind not in pol.retry_kinds:
                return False
            return obs.kind != "ip_ban" or pol.rotate_identity_on_ban

        def wait(rs) -> float:
            obs: Observation = rs.outcome.result()
            w = pol.backoff(episode_id, step, call_index, rs.attempt_number - 1)
            if obs.retry_after is not None:
                w = max(w, obs.retry_after)
            return w

        def stop(rs) -> bool:
            if rs.attempt_number >= pol.max_attempts:
                return True
            obs: Observation = rs.outcome.result()
            if obs.retry_after is not None and obs.retry_after > pol.max_retry_after_s:
                return True
            return clock.monotonic() - t0 + rs.upcoming_sleep > pol.budget_s

        # The first attempt runs outside tenacity (the common no-fault case stays cheap); when it
        # must be retried, tenacity replays it as its attempt 1 and drives the rest, so its
        # attempt numbers, waits and stop rules line up with ours exactly.
        obs = await attempt()
        if should_retry(obs) and pol.max_attempts > 1:
            replay = [obs]

            async def next_attempt() -> Observation:
                return replay.pop() if replay else await attempt()

            retrying = AsyncRetrying(stop=stop, wait=wait, retry=retry_if_result(should_retry),
                                     sleep=clock.sleep, reraise=True,
                                     retry_error_callback=lambda rs: rs.outcome.result())
            obs = await retrying(next_attempt)
        elapsed = clock.monotonic() - t0
        self.ledger.record_call(CallRecord(episode_id, step, call_index, name, n_attempts,
                                           obs.triage, tuple(kinds)))
        return CallOutcome(ok=obs.triage == "ok", result=obs.result if obs.triage == "ok" else None,
                           attempts=n_attempts, events=events, triage=obs.triage, error=obs.error,
                           fault_kind=obs.kind if obs.triage == "env_fault" else None,
                           elapsed_s=elapsed, status=obs.status)
