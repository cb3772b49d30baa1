"""The tool client: async httpx + a tenacity retry policy, with every attempt classified and billed.

    client = ToolClient.in_process(app)                 # httpx over InProcessTransport (no sockets)
    client = ToolClient.connect("http://127.0.0.1:8765")  # real loopback HTTP
    await client.open_episode("ep1", seed=0, faults="rate_limit=0.1", fault_seed=0)
    out = await client.call("ep1", step=0, call_index=0, name="get_weather", arguments={...})
    await client.close_episode("ep1"); await client.aclose()

Classification (``classify_response`` / ``classify_exception``) uses only what a real client sees:
status codes, headers, exception types and the body. It never reads the server's decision. Each
non-answer is an exception of reflrl.envs.errors, whose tree is the taxonomy; the observed
``FaultEvent`` of an attempt takes its ``triage``, ``kind``, ``status`` and ``detail``.

==========================================  ===========================  ==========================
what the client sees                        raised (reflrl.envs.errors)  triage / kind
==========================================  ===========================  ==========================
429 (+ Retry-After)                         RateLimited(retry_after)     env_fault / rate_limit
500 with error type tool_bug                ToolBug                      tool_bug (never retried)
500, 502, 503 (other 5xx)                   ServerError                  env_fault / server_error
504, 408, httpx.TimeoutException            ToolTimeout                  env_fault / timeout
httpx.NetworkError (ReadError,              ConnectionReset              env_fault / connection
ConnectError, WriteError), OSError
httpx.RemoteProtocolError (a body shorter   TruncatedBody                env_fault / truncated
than its Content-Length)
2xx whose body is not JSON or has no        MalformedBody                env_fault / malformed
"result"; httpx.DecodingError
403                                         Banned                       env_fault / ip_ban
404 file_missing; a result with NUL or      InvalidFile                  env_fault / invalid_file
U+FFFD in a string
a result failing the tool's ``returns``     SchemaDrift                  env_fault / schema_drift
schema
400 with code parameter_renamed             ParamRenamed (never retried) env_fault / param_renamed
410 with code tool_moved                    ToolMoved (never retried)    env_fault / tool_moved
404 unknown_tool                            UnknownTool (a PolicyError)  policy_error
422 invalid_arguments                       InvalidArguments (a          policy_error
                                            PolicyError)
other 4xx (e.g. 422 with a ToolError kind)  PolicyError                  policy_error
400 (bad header or body), 404               ToolClientError              raised to the caller (a
unknown_episode                                                          client bug; not recorded)
2xx with a valid result                     (the result is returned)     ok
==========================================  ===========================  ==========================

An answer that is not an env fault (ok, policy error, tool bug) slower than ``slow_threshold_s``
is recorded with kind "latency" (an injected latency acts on error answers too).

schema_drift: a drifted result is detectable only when the tool declares a ``returns`` schema that
the drift violates (the client loads schemas from ``GET /v1/tools?detail=1``). Otherwise the drifted
result is returned as ok data, exactly what a real client would get; the ledger then counts that
injected drift as *undetected* (not a mismatch), so reconciliation stays exact.

Retries (``RetryPolicy``, reflrl.envs.retry): decided by the exception's type (the retryable
``ToolFault`` classes; kinds marked ``retryable`` in reflrl.faults.kinds), composed from tenacity's
strategies: capped exponential backoff with seeded jitter, a ``Retry-After`` as the minimum wait,
stop after ``max_attempts`` or before a wait that would overrun the time ``budget_s`` on the
client's clock. Policy errors and tool bugs are never retried. Each attempt is one billed tool call
and one observed record in the Ledger.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from urllib.parse import quote
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import jsonschema

from reflrl.faults import CallRecord, FaultEvent, FaultPlan, Ledger, is_corrupt
from reflrl.faults.inject import NET_EXTENSION

from .clock import SystemClock
from .errors import (Banned, ConnectionReset, InvalidArguments, InvalidFile, MalformedBody,
                     ParamRenamed, PolicyError, RateLimited, SchemaDrift, ServerError, ToolBug,
                     ToolCallError, ToolClientError, ToolFault, ToolMoved, ToolTimeout, TruncatedBody,
                     UnknownTool)
from .retry import RetryPolicy

__all__ = ["CallOutcome", "InProcessTransport", "RetryPolicy", "ToolClient", "ToolClientError",
           "classify_exception", "classify_response", "parse_retry_after"]


@dataclass
class CallOutcome:
    """The result of one logical call after retries.

    fault: the ToolCallError that ended the call (None when it gave a valid result); ``triage``,
    ``fault_kind`` and ``error`` are read from it."""

    result: Any                      # the tool's result (None unless ok)
    attempts: int                    # billed tool calls
    events: list[FaultEvent]         # observed env faults (and slow answers) on its attempts
    fault: ToolCallError | None
    elapsed_s: float
    status: int | None = None        # HTTP status of the last attempt (None: transport error)

    @property
    def ok(self) -> bool:
        return self.fault is None

    @property
    def triage(self) -> str:
        """"ok" | "env_fault" | "policy_error" | "tool_bug"."""
        return "ok" if self.fault is None else self.fault.triage

    @property
    def fault_kind(self) -> str | None:
        """The kind of the env fault that ended the call (None otherwise)."""
        return self.fault.kind if isinstance(self.fault, ToolFault) else None

    @property
    def error(self) -> str | None:
        return None if self.fault is None else str(self.fault)

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


_POLICY_ERRORS: dict[str, type[PolicyError]] = {"unknown_tool": UnknownTool,
                                                "invalid_arguments": InvalidArguments}


def classify_response(status: int, headers: httpx.Headers | dict, body: bytes,
                      returns: Any = None) -> Any:
    """The result of an HTTP answer, judged from status, headers and body only: returns the
    result of a valid answer, raises the ToolCallError it is (table in the module doc), or
    ToolClientError for a client bug.

    returns: the tool's ``returns`` JSON schema (or a jsonschema validator of it), if known."""
    said = {"code": _error_code(body), "server_message": _error_message(body)} if status >= 400 else {}
    if status in (400, 410):  # an API change (reflrl.faults.evolve): its body names the new name
        cls = {(400, "parameter_renamed"): ParamRenamed, (410, "tool_moved"): ToolMoved}.get(
            (status, _error_code(body)))
        if cls is not None:
            raise cls(f"HTTP {status}: {_error_message(body)}", status=status, detail=said["code"],
                      error_fields=_error_fields(body), **said)
    if status == 429:
        ra = parse_retry_after(headers.get("retry-after"))
        raise RateLimited("429 Too Many Requests", status=status, detail=f"retry_after={ra}",
                          retry_after=ra, **said)
    if status == 504 or status == 408:
        raise ToolTimeout(f"HTTP {status}: {_error_message(body)}", status=status,
                          detail=str(status), **said)
    if status == 500 and _error_type(body) == "tool_bug":
        raise ToolBug(f"tool bug: {_error_message(body)}", status=status, detail="tool_bug", **said)
    if status >= 500:
        raise ServerError(f"HTTP {status}: {_error_message(body)}", status=status,
                          detail=str(status), **said)
    if status == 403:
        raise Banned(f"403 Forbidden: {_error_message(body)}", status=status,
                     detail=_error_type(body) or "403", **said)
    if status >= 400:
        etype = _error_type(body)
        if status == 404 and etype == "file_missing":
            raise InvalidFile(f"404: {_error_message(body)}", status=status, detail="file_missing",
                              **said)
        if status == 404 and etype == "unknown_episode" or status == 400:
            raise ToolClientError(f"HTTP {status}: {_error_message(body)}")
        raise _POLICY_ERRORS.get(etype, PolicyError)(
            f"{etype or status}: {_error_message(body)}", status=status,
            detail=etype or str(status))
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise MalformedBody("response body is not valid JSON", status=status,
                            detail="invalid JSON body") from None
    if not isinstance(payload, dict) or "result" not in payload:
        raise MalformedBody("response JSON has no 'result'", status=status,
                            detail="JSON without 'result'")
    result = payload["result"]
    if is_corrupt(result):
        raise InvalidFile("file content is corrupt (NUL / U+FFFD bytes)", status=status,
                          detail="corrupt content")
    if returns:
        validator = returns if hasattr(returns, "iter_errors") else \
            jsonschema.validators.validator_for(returns)(returns)
        try:
            err = jsonschema.exceptions.best_match(validator.iter_errors(result))
        except jsonschema.exceptions.SchemaError:
            err = None
        if err is not None:
            raise SchemaDrift(f"result does not match the tool's schema: {err.message}",
                              status=status, detail=err.message)
    return result


def classify_exception(exc: BaseException) -> ToolFault:
    """The ToolFault a transport exception (httpx or OSError) is, with ``exc`` as its cause
    (raise it); anything else is re-raised."""
    name = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        cls = ToolTimeout
    elif isinstance(exc, httpx.RemoteProtocolError):
        cls = TruncatedBody
    elif isinstance(exc, (httpx.NetworkError, OSError)):
        cls = ConnectionReset
    elif isinstance(exc, httpx.DecodingError):
        cls = MalformedBody
    else:
        raise exc
    fault = cls(f"{name}: {exc}", detail=name)
    fault.__cause__ = exc
    return fault


def _error_obj(body: bytes) -> dict:
    try:
        d = json.loads(body)
        e = d.get("error") if isinstance(d, dict) else None
        return e if isinstance(e, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _error_code(body: bytes) -> str | None:
    """The error body's ``code`` (Stripe style), else its ``type``."""
    e = _error_obj(body)
    c = e.get("code")
    return c if isinstance(c, str) else _error_type(body)


def _error_fields(body: bytes, limit: int = 200) -> dict[str, str]:
    """The error body's other short string fields (``param``, ``new_param``, ``successor`` ...)."""
    return {k: v for k, v in _error_obj(body).items()
            if isinstance(k, str) and isinstance(v, str) and k not in ("message",) and len(v) <= limit}


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
                           initial_config: dict | None = None,
                           enforce_retry_after: bool = False) -> dict:
        """Open an episode on the server. ``enforce_retry_after``: the server refuses a call made
        before an earlier 429's Retry-After has passed with 429 again, as a real server does (off:
        every attempt is an independent draw of the fault plan)."""
        plan = FaultPlan.coerce(faults)
        body = {"episode_id": episode_id, "seed": seed, "faults": str(plan),
                "fault_seed": seed if fault_seed is None else fault_seed, "tools": tools,
                "initial_config": initial_config}
        if enforce_retry_after:
            body["enforce_retry_after"] = True
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
        """Call tool ``name`` under the retry policy; every attempt is recorded in the ledger.
        The outcome holds the result, or the ToolCallError that ended the call (``fault``);
        a client bug (ToolClientError) is raised."""
        t0 = self.clock.monotonic()
        c = _Call(episode_id, step, call_index, name, {"arguments": arguments or {}},
                  await self._returns_schema(name))
        try:
            result, fault = await self._attempt(c), None
        except ToolCallError as first:
            result, fault = await self._retried(c, first, t0)
        if fault is not None:  # a record from here on: keep no frames (and responses) alive
            fault.__traceback__ = fault.__context__ = None
        fault_kinds = tuple(e.kind for e in c.events if e.triage == "env_fault")
        self.ledger.record_call(CallRecord(episode_id, step, call_index, name, c.attempts,
                                           "ok" if fault is None else fault.triage, fault_kinds))
        return CallOutcome(result=result, attempts=c.attempts, events=c.events, fault=fault,
                           elapsed_s=self.clock.monotonic() - t0, status=c.status)

    async def _retried(self, c: "_Call", first: ToolCallError, t0: float
                       ) -> tuple[Any, ToolCallError | None]:
        """(result, None) or (None, the fault that ended it) of a call whose first attempt raised
        ``first``, under the retry policy. tenacity decides as if it had run that attempt itself:
        it is handed over as tenacity's attempt 1 (most calls never get here, and tenacity costs
        about a fifth of an in-process call)."""
        handed_over = [first]

        async def attempt() -> Any:
            if handed_over:
                raise handed_over.pop()
            return await self._attempt(c)

        retrying = self.retry.retrying(self.clock, start=t0, key=(c.episode, c.step, c.index))
        try:
            return await retrying(attempt), None
        except ToolCallError as fault:
            return None, fault

    async def _attempt(self, c: "_Call") -> Any:
        """One billed attempt: its result, or the ToolCallError it raised; recorded either way."""
        attempt = c.attempts
        c.attempts += 1
        headers = {"x-reflrl-episode": c.episode, "x-reflrl-step": str(c.step),
                   "x-reflrl-call": str(c.index), "x-reflrl-attempt": str(attempt),
                   "x-reflrl-client": self.current_identity(c.episode)}
        ts = self.clock.monotonic()
        result, fault, c.status = None, None, None
        try:
            r = await self.http.post(f"/v1/call/{c.name}", json=c.body, headers=headers,
                                     timeout=self.timeout)
        except (httpx.TransportError, httpx.DecodingError, OSError) as e:
            fault = classify_exception(e)
        else:
            c.status = r.status_code
            try:
                result = classify_response(r.status_code, r.headers, r.content, c.returns)
            except ToolCallError as e:
                fault = e
        took = self.clock.monotonic() - ts
        slow = (not isinstance(fault, ToolFault) and self.slow_threshold_s is not None
                and took >= self.slow_threshold_s)
        triage, kind, detail = ("ok", None, "") if fault is None else \
            (fault.triage, fault.kind, fault.detail)
        if slow:
            kind, detail = "latency", f"{took:.3f}s"
        ev = FaultEvent(c.episode, c.step, c.index, attempt, "observed", triage, kind, c.name,
                        c.status, detail)
        self.ledger.record_observed(ev)
        if slow or isinstance(fault, ToolFault):
            c.events.append(ev)
        if isinstance(fault, Banned) and self.retry.rotate_identity_on_ban:
            self._identity_n[c.episode] = self._identity_n.get(c.episode, 0) + 1
        if fault is not None:
            raise fault
        return result


@dataclass
class _Call:
    """One logical call: its coordinates, request body, the tool's ``returns`` validator, and what
    its attempts saw so far (count, last HTTP status, observed faults and slow answers)."""

    episode: str
    step: int
    index: int
    name: str
    body: dict[str, Any]
    returns: Any
    attempts: int = 0
    status: int | None = None
    events: list[FaultEvent] = field(default_factory=list)
