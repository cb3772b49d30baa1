"""The tool server: a Starlette ASGI app hosting ToolSpecs per episode, behind the fault injector.

HTTP protocol (JSON in and out; every error is ``{"error": {"type", "message"}}`` with a 4xx status,
or 500 ``tool_bug`` when a tool's handler crashed):

- ``GET  /v1/tools[?detail=1]`` -> ``{"tools": [schema, ...]}`` (detail adds "domain", "returns")
- ``POST /v1/episodes`` ``{"episode_id", "seed", "faults", "fault_seed", "tools",
  "initial_config", "enforce_retry_after"}`` (``enforce_retry_after``: true = a call made before an
  earlier 429's Retry-After has passed is refused with 429 again, as a real server does; false, the
  default, = every attempt is an independent draw of the fault plan)
  -> 201 ``{"episode_id", "tools": [names], "faults": canonical spec}``; 409 if it exists; 400 on a
  body that is not JSON; 422 on a bad field (unknown field, episode id outside the safe alphabet of
  ``reflrl.faults.coords``, bad fault spec, ...); 503 ``too_many_episodes`` past the limit.
- ``DELETE /v1/episodes/{id}``   -> 204: the episode's sandbox folder is deleted and (when the server
  owns its ledger) its ledger events are freed; 404 if unknown.
- ``GET  /v1/episodes/{id}/ledger`` (or ``GET /v1/ledger?episode=ID``) -> ``{"episode", "events":
  [injected FaultEvent dicts]}`` of an open episode; 404 otherwise (a client fetches them before
  DELETE); ``/v1/ledger`` without an episode is 400.
- ``POST /v1/call/{tool}`` headers X-Reflrl-Episode/-Step/-Call/-Attempt/-Client (missing or
  malformed: 400 ``bad_header``, see ``reflrl.faults.coords``), body ``{"arguments": {...}}`` ->
  200 ``{"result": ...}``; 404 ``unknown_tool`` / ``unknown_episode``; 422 ``invalid_arguments``
  (jsonschema, message names the argument) or the ToolError's kind; 500 ``tool_bug`` when the
  handler raised anything else (the client counts it apart from injected faults); 400
  ``bad_request`` for a body that is not JSON; or an injected fault (reflrl.faults.inject), among them
  the episode's API changes: 400 ``parameter_renamed`` / 410 ``tool_moved`` (``reflrl.faults.evolve``;
  the successor of a retired tool is served at ``/v1/call/{successor}``, a name not in the tool list).
  A parameter the tool's schema does not know is 422 ``invalid_arguments`` ("unexpected argument").
- ``GET  /v1/health`` -> ``{"ok": true, "episodes": n, "tools": n, "ledger_records": n}``

Limits (request size, slow bodies, JSON depth, message length, open episodes, per-episode disk
quota): ``reflrl.envs.limits.ServerLimits``. Arguments are validated against the tool's JSON schema
and then given to the handler with whole-number floats turned into ints where the schema says
"integer" (JSON Schema counts ``2.0`` as an integer, so handlers must get what they can use).

Handlers run inline on the event loop (they are fast, synchronous, and per-episode state is not
shared across threads). File tools get a per-episode sandbox under ``sandbox_root`` (a temporary
folder made on first use and removed at ``shutdown()``, or when the server is garbage collected
or the interpreter exits, if none is given).
"""
from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reflrl.faults import FaultInjector, FaultPlan, FaultSite, FaultSpecError, Ledger, is_file_tool
from reflrl.faults.coords import H_EPISODE, clip_repr, episode_id_problem
from reflrl.faults.evolve import ChangeBook, schema_params

from .clock import SystemClock
from .limits import BadJSON, RequestGuard, ServerLimits, clip, json_problem, parse_json_body
from .tools.base import ToolContext, ToolError, ToolSpec

EPISODE_FIELDS = ("episode_id", "seed", "faults", "fault_seed", "tools", "initial_config",
                  "enforce_retry_after")
MAX_SEED = 1 << 63


def default_tools() -> dict[str, ToolSpec]:
    """The synthetic catalogue (``tools.catalog.build_catalog``) plus the bfcl-eval multi-turn
    backends (``tools.bfcl_backends.bfcl_tools``); a part whose module is missing is left out."""
    tools: dict[str, ToolSpec] = {}
    try:
        from .tools.catalog import build_catalog
    except ImportError:
        build_catalog = None
    if build_catalog is not None:
        tools.update(build_catalog())
    try:
        from .tools.bfcl_backends import bfcl_tools
    except ImportError:
        bfcl_tools = None
    if bfcl_tools is not None:
        for name, spec in bfcl_tools().items():
            if name in tools:
                raise ValueError(f"tool name {name!r} is both in the catalogue and in bfcl-eval's "
                                 "backends; rename one")
            tools[name] = spec
    return tools


@dataclass
class Episode:
    episode_id: str
    seed: int
    plan: FaultPlan
    fault_seed: int
    tools: frozenset[str]
    ctx: ToolContext
    banned: set[str] = field(default_factory=set)  # client identities banned (ip_ban)
    enforce_retry_after: bool = False               # refuse calls inside a Retry-After window
    windows: dict = field(default_factory=dict)     # (identity, tool) -> end of its Retry-After
    changes: ChangeBook | None = None               # API changes (param_renamed, tool_moved)


class ToolServer:
    """State behind the app: catalogue, episodes, sandboxes, ledger. ``app`` is the ASGI app.

    ledger: where injected faults are recorded. A server that makes its own ledger (the default,
    e.g. ``reflrl tools serve``) frees an episode's events when it is deleted; a ledger passed in
    (in-process, shared with the client that reconciles against it) belongs to its owner.
    """

    def __init__(self, tools: dict[str, ToolSpec] | None = None, *, clock=None,
                 sandbox_root: str | Path | None = None, ledger: Ledger | None = None,
                 default_seed: int = 0, limits: ServerLimits | None = None) -> None:
        self.tools = default_tools() if tools is None else dict(tools)
        self.clock = clock or SystemClock()
        self.limits = limits or ServerLimits()
        self._own_ledger = ledger is None
        self.ledger = ledger if ledger is not None else Ledger()
        self.default_seed = default_seed
        self._own_root = sandbox_root is None
        self._root: Path | None = Path(sandbox_root) if sandbox_root is not None else None
        self._root_finalizer: weakref.finalize | None = None
        self.episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._validators = {}
        for name, spec in self.tools.items():
            cls = jsonschema.validators.validator_for(spec.parameters or {})
            self._validators[name] = cls(spec.parameters or {"type": "object"})
        self._schemas = {n: s.schema() for n, s in self.tools.items()}
        self._file_tools = {n for n, s in self.tools.items() if is_file_tool(s.domain)}
        routes = [
            Route("/v1/tools", self._guard(self.list_tools), methods=["GET"]),
            Route("/v1/episodes", self._guard(self.open_episode), methods=["POST"]),
            Route("/v1/episodes/{episode_id}", self._guard(self.close_episode), methods=["DELETE"]),
            Route("/v1/episodes/{episode_id}/ledger", self._guard(self.get_ledger),
                  methods=["GET"]),
            Route("/v1/ledger", self._guard(self.get_ledger), methods=["GET"]),
            Route("/v1/health", self._guard(self.health), methods=["GET"]),
        ]
        self.starlette = Starlette(routes=routes, lifespan=self._lifespan,
                                   exception_handlers={HTTPException: self._http_exception})
        self.injector = FaultInjector(self._asgi, lookup=self._lookup, ledger=self.ledger,
                                      clock=self.clock)
        self.app = RequestGuard(self.injector, self.limits)
        self.app.server = self  # type: ignore[attr-defined]  (handy for tests and serve.py)

    def share_ledger(self) -> Ledger:
        """The ledger, handed to a client that records into it too (in-process): from now on its
        records belong to that client, and DELETE no longer frees them."""
        self._own_ledger = False
        return self.ledger

    @property
    def sandbox_root(self) -> Path:
        """The folder holding the episodes' sandboxes (a temporary one is made on first use)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="reflrl-sandboxes-"))
            # removed by shutdown(), or when this server is collected or the interpreter exits
            self._root_finalizer = weakref.finalize(self, shutil.rmtree, str(self._root), True)
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    async def _asgi(self, scope, receive, send) -> None:
        """POST /v1/call/{tool} goes straight to ``_call`` (the hot path); the rest to Starlette."""
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].startswith("/v1/call/")):
            name = scope["path"][len("/v1/call/"):]
            eid = None
            for k, v in scope["headers"]:
                if k == H_EPISODE:
                    eid = v.decode("latin-1")
                    break
            chunks = []
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return None  # client went away
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
            resp = self._call(name, eid, b"".join(chunks))
            return await resp(scope, receive, send)
        return await self.starlette(scope, receive, send)

    # ---- fault-site lookup for the injector ---------------------------------------------
    def _lookup(self, episode_id: str, tool: str) -> FaultSite | None:
        ep = self.episodes.get(episode_id)
        if ep is None:
            return None
        return FaultSite(ep.plan, ep.fault_seed, ep.banned, tool in self._file_tools,
                         ep.windows if ep.enforce_retry_after else None, ep.changes)

    # ---- errors -----------------------------------------------------------------------------
    def _error(self, status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"type": kind,
                                       "message": clip(message, self.limits.max_message_chars)}},
                            status_code=status)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        detail = exc.detail
        if exc.status_code == 404:
            detail = f"no route {clip_repr(request.url.path)}"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {clip_repr(request.url.path)}"
        return self._error(exc.status_code, kind, str(detail))

    def _guard(self, endpoint):
        """A route that answers 500 ``internal_error`` (JSON) instead of raising."""
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            try:
                return await endpoint(request)
            except Exception as e:  # noqa: BLE001  a server bug: say so as JSON, keep serving
                return self._error(500, "internal_error", f"{type(e).__name__}: {e}")
        return guarded

    # ---- routes ---------------------------------------------------------------------------
    async def list_tools(self, request: Request) -> Response:
        detail = request.query_params.get("detail") in ("1", "true", "yes")
        out = []
        for name, spec in self.tools.items():
            s = dict(self._schemas[name])
            if detail:
                s["domain"] = spec.domain
                s["returns"] = spec.returns
            out.append(s)
        return JSONResponse({"tools": out})

    async def open_episode(self, request: Request) -> Response:
        try:
            body = parse_json_body(await request.body(), self.limits.max_json_depth)
        except BadJSON as e:
            return self._error(400, "bad_request", str(e))
        if not isinstance(body, dict):
            return self._error(422, "bad_episode", "the body must be a JSON object with an "
                               "episode_id")
        unknown = [k for k in body if k not in EPISODE_FIELDS]
        if unknown:
            return self._error(422, "bad_episode", f"unknown field(s) {clip_repr(unknown)} "
                               f"(known: {', '.join(EPISODE_FIELDS)})")
        eid = body.get("episode_id")
        problem = episode_id_problem(eid)
        if problem is not None:
            return self._error(422, "bad_episode", problem)
        faults = body.get("faults")
        if faults is not None and not isinstance(faults, str):
            return self._error(422, "bad_fault_spec", "faults must be a spec string or null")
        try:
            plan = FaultPlan.coerce(faults or None)
        except FaultSpecError as e:
            return self._error(422, "bad_fault_spec", str(e))
        seed = body.get("seed", self.default_seed)
        fault_seed = body.get("fault_seed", seed)
        for key, v in (("seed", seed), ("fault_seed", fault_seed)):
            if type(v) is not int or not -MAX_SEED <= v < MAX_SEED:
                return self._error(422, "bad_episode", f"{key} must be an integer in [-2**63, "
                                   f"2**63), got {clip_repr(v)}")
        names = body.get("tools")
        if names is None:
            names = list(self.tools)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return self._error(422, "bad_episode", "tools must be a list of tool names or null")
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            return self._error(422, "unknown_tool", f"{len(unknown)} tool(s) unknown to this "
                               f"server: {clip_repr(unknown)}")
        initial_config = body.get("initial_config")
        if initial_config is not None and not isinstance(initial_config, dict):
            return self._error(422, "bad_episode", "initial_config must be a JSON object or null")
        enforce = body.get("enforce_retry_after", False)
        if not isinstance(enforce, bool):
            return self._error(422, "bad_episode", "enforce_retry_after must be true or false")
        lim = self.limits
        with self._lock:
            if eid in self.episodes:
                return self._error(409, "episode_exists", f"episode {eid!r} is already open")
            if lim.max_open_episodes is not None and len(self.episodes) >= lim.max_open_episodes:
                return self._error(503, "too_many_episodes", f"{len(self.episodes)} episodes are "
                                   "open, the limit; DELETE finished ones first")
            # Re-opening an id (a replay with the same seed) starts its injected record afresh,
            # so the replay's faults are not refused as recorded twice.
            self.ledger.forget_injected(eid)
            sandbox = Path(tempfile.mkdtemp(prefix="ep-", dir=self.sandbox_root))
            ctx = ToolContext(seed=seed, episode_id=eid, sandbox=sandbox,
                              sandbox_bytes=lim.sandbox_bytes, sandbox_files=lim.sandbox_files)
            if initial_config is not None:
                ctx.state["initial_config"] = initial_config
            tool_set = frozenset(names)
            changes = None
            if plan.change_total > 0:  # the episode's API changes, sticky (reflrl.faults.evolve)
                changes = ChangeBook(plan, fault_seed, eid,
                                     params=lambda t: schema_params(self.tools[t].parameters),
                                     known=tool_set.__contains__, taken_tools=tuple(self.tools))
            self.episodes[eid] = Episode(eid, seed, plan, fault_seed, tool_set, ctx,
                                         enforce_retry_after=enforce, changes=changes)
        return JSONResponse({"episode_id": eid, "tools": list(names), "faults": str(plan)},
                            status_code=201)

    async def close_episode(self, request: Request) -> Response:
        eid = request.path_params["episode_id"]
        with self._lock:
            ep = self.episodes.pop(eid, None)
        if ep is None:
            return self._error(404, "unknown_episode", f"no open episode {clip_repr(eid)}")
        if self._own_ledger:  # the client fetched them before DELETE (ToolClient.close_episode)
            self.ledger.forget_episode(eid)
        shutil.rmtree(ep.ctx.sandbox, ignore_errors=True)
        return Response(status_code=204)

    def _call(self, name: str, eid: str | None, raw: bytes) -> Response:
        """Validate and dispatch one tool call (no fault logic here: that is the injector's)."""
        ep = self.episodes.get(eid) if eid else None
        if ep is None:
            return self._error(404, "unknown_episode", f"no open episode {clip_repr(eid)} "
                               "(set X-Reflrl-Episode after POST /v1/episodes)")
        spec = self.tools.get(name)
        if spec is None or name not in ep.tools:
            return self._error(404, "unknown_tool", f"no tool named {clip_repr(name)} in this "
                               "episode")
        try:
            body = parse_json_body(raw)
        except BadJSON as e:
            return self._error(400, "bad_request", str(e))
        args = body.get("arguments", {}) if isinstance(body, dict) else None
        if not isinstance(args, dict):
            return self._error(422, "invalid_arguments", "arguments must be a JSON object")
        problem = json_problem(args, self.limits.max_json_depth)
        if problem is not None:
            return self._error(422, "invalid_arguments", f"{name}: the arguments: {problem}")
        err = jsonschema.exceptions.best_match(self._validators[name].iter_errors(args))
        if err is not None:
            return self._error(422, "invalid_arguments", f"{name}: {_describe(err)}")
        args = coerce_integers(spec.parameters, args)
        try:
            result = spec.handler(args, ep.ctx)
        except ToolError as e:
            return self._error(422, e.kind, f"{name}: {e}")
        except Exception as e:  # noqa: BLE001  the tool's own bug: not an injected fault
            return self._error(500, "tool_bug", f"{name}: {type(e).__name__}: {e}")
        try:
            return JSONResponse({"result": result})
        except (TypeError, ValueError) as e:
            return self._error(500, "tool_bug", f"{name}: result is not JSON: {e}")

    async def get_ledger(self, request: Request) -> Response:
        eid = request.path_params.get("episode_id", request.query_params.get("episode"))
        if eid is None:
            return self._error(400, "bad_request", "which episode? GET /v1/episodes/{id}/ledger "
                               "(or /v1/ledger?episode=ID)")
        if eid not in self.episodes:
            return self._error(404, "unknown_episode", f"no open episode {clip_repr(eid)} (its "
                               "events are freed when it is deleted)")
        return JSONResponse({"episode": eid,
                             "events": [e.to_dict() for e in self.ledger.injected(eid)]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "episodes": len(self.episodes), "tools": len(self.tools),
                             "ledger_records": self.ledger.size()})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.shutdown()

    def shutdown(self) -> None:
        """Delete every sandbox (and the root if this server created it); free owned ledger
        records. Idempotent."""
        with self._lock:
            eps = list(self.episodes.values())
            self.episodes.clear()
        for ep in eps:
            if self._own_ledger:
                self.ledger.forget_episode(ep.episode_id)
            shutil.rmtree(ep.ctx.sandbox, ignore_errors=True)
        if self._own_root and self._root_finalizer is not None:
            self._root_finalizer()  # rmtree(root) once
            self._root_finalizer, self._root = None, None


def create_app(tools: dict[str, ToolSpec] | None = None, *, clock=None,
               sandbox_root: str | Path | None = None, ledger: Ledger | None = None,
               default_seed: int = 0, limits: ServerLimits | None = None):
    """The tool server's ASGI app (request guard -> fault injector -> the routes).

    tools: name -> ToolSpec (default: ``default_tools()``); clock: for latency/timeout stalls
    without a net control (default SystemClock); ledger: receives injected faults (default a new
    Ledger, reachable as ``app.server.ledger``); default_seed: seed of episodes that give none;
    limits: ``ServerLimits`` (default: the documented defaults).
    """
    return ToolServer(tools, clock=clock, sandbox_root=sandbox_root, ledger=ledger,
                      default_seed=default_seed, limits=limits).app


def _describe(err: jsonschema.ValidationError) -> str:
    """A jsonschema error as one short sentence naming the argument (the value is quoted short)."""
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "required":
        return f"missing required argument: {err.message}"
    if err.validator == "additionalProperties":
        return f"unexpected argument: {err.message}"
    msg = err.message
    if len(msg) > 150 and isinstance(err.instance, (str, int, float)):
        msg = msg.replace(repr(err.instance), clip_repr(err.instance))
    if len(msg) > 150:
        msg = (f"{clip_repr(err.instance)} fails {err.validator!r} "
               f"{clip_repr(err.validator_value)}")
    return f"argument {path!r}: {msg}" if path else msg


def coerce_integers(schema: Any, value: Any) -> Any:
    """``value`` with every whole-number float turned into an int where ``schema`` says
    "integer" (and not "number"): JSON Schema counts 2.0 as an integer, Python's range() does not."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, float):
        t = schema.get("type")
        types = t if isinstance(t, list) else [t]
        if "integer" in types and "number" not in types and value.is_integer():
            return int(value)
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {k: coerce_integers(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            return [coerce_integers(items, v) for v in value]
    return value
