"""The tool server: a Starlette ASGI app hosting ToolSpecs per episode, behind the fault injector.

HTTP protocol (see /work/design.md; JSON in and out):

- ``GET  /v1/tools[?detail=1]`` -> ``{"tools": [schema, ...]}`` (detail adds "domain", "returns")
- ``POST /v1/episodes`` ``{"episode_id", "seed", "faults", "fault_seed", "tools",
  "initial_config"}``
  -> 201 ``{"episode_id", "tools": [names], "faults": canonical spec}``; 409 if it exists; 422 on a
  bad body (e.g. a bad fault spec, message from FaultSpecError).
- ``DELETE /v1/episodes/{id}``   -> 204 and the episode's sandbox folder is deleted; 404 if unknown.
- ``POST /v1/call/{tool}`` headers X-Reflrl-Episode/-Step/-Call/-Attempt/-Client, body
  ``{"arguments": {...}}`` -> 200 ``{"result": ...}``; 404 ``unknown_tool`` (not in the catalogue or
  not offered in this episode); 422 ``invalid_arguments`` (jsonschema, message names the argument)
  or the ToolError's kind; 500 ``internal_error`` for a handler bug; 400 ``bad_request`` /
  404 ``unknown_episode`` for client bugs; or an injected fault (reflrl.faults.inject).
- ``GET  /v1/ledger?episode=ID`` -> ``{"episode", "events": [injected FaultEvent dicts]}``
- ``GET  /v1/health`` -> ``{"ok": true, "episodes": n}``

Handlers run inline on the event loop (they are fast, synchronous, and per-episode state is not
shared across threads). File tools get a per-episode sandbox under ``sandbox_root``.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reflrl.faults import FaultInjector, FaultPlan, FaultSite, FaultSpecError, Ledger, is_file_tool

from .clock import SystemClock
from .tools.base import ToolContext, ToolError, ToolSpec


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


class ToolServer:
    """State behind the app: catalogue, episodes, sandboxes, ledger. ``app`` is the ASGI app."""

    def __init__(self, tools: dict[str, ToolSpec] | None = None, *, clock=None,
                 sandbox_root: str | Path | None = None, ledger: Ledger | None = None,
                 default_seed: int = 0) -> None:
        self.tools = default_tools() if tools is None else dict(tools)
        self.clock = clock or SystemClock()
        self.ledger = ledger if ledger is not None else Ledger()
        self.default_seed = default_seed
        self._own_root = sandbox_root is None
        self.sandbox_root = Path(sandbox_root) if sandbox_root is not None else Path(
            tempfile.mkdtemp(prefix="reflrl-sandboxes-"))
        self.sandbox_root.mkdir(parents=True, exist_ok=True)
        self.episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._validators = {}
        for name, spec in self.tools.items():
            cls = jsonschema.validators.validator_for(spec.parameters or {})
            self._validators[name] = cls(spec.parameters or {"type": "object"})
        self._schemas = {n: s.schema() for n, s in self.tools.items()}
        self._file_tools = {n for n, s in self.tools.items() if is_file_tool(s.domain)}
        routes = [
            Route("/v1/tools", self.list_tools, methods=["GET"]),
            Route("/v1/episodes", self.open_episode, methods=["POST"]),
            Route("/v1/episodes/{episode_id}", self.close_episode, methods=["DELETE"]),
            Route("/v1/ledger", self.get_ledger, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
        ]
        self.starlette = Starlette(routes=routes, lifespan=self._lifespan)
        self.app = FaultInjector(self._asgi, lookup=self._lookup, ledger=self.ledger,
                                 clock=self.clock)
        self.app.server = self  # type: ignore[attr-defined]  (handy for tests and serve.py)

    async def _asgi(self, scope, receive, send) -> None:
        """POST /v1/call/{tool} goes straight to ``_call`` (the hot path); the rest to Starlette."""
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].startswith("/v1/call/")):
            name = scope["path"][len("/v1/call/"):]
            eid = None
            for k, v in scope["headers"]:
                if k == b"x-reflrl-episode":
                    eid = v.decode("utf-8", "replace")
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
        return FaultSite(ep.plan, ep.fault_seed, ep.banned, tool in self._file_tools)

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
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "bad_request", "body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("episode_id"), str) \
                or not body["episode_id"]:
            return _error(422, "bad_episode", "episode_id (non-empty string) is required")
        eid = body["episode_id"]
        try:
            plan = FaultPlan.coerce(body.get("faults") or None)
        except FaultSpecError as e:
            return _error(422, "bad_fault_spec", str(e))
        seed = body.get("seed", self.default_seed)
        fault_seed = body.get("fault_seed", seed)
        if not isinstance(seed, int) or not isinstance(fault_seed, int):
            return _error(422, "bad_episode", "seed and fault_seed must be integers")
        names = body.get("tools")
        if names is None:
            names = list(self.tools)
        unknown = [n for n in names if n not in self.tools] if isinstance(names, list) else None
        if unknown is None:
            return _error(422, "bad_episode", "tools must be a list of tool names or null")
        if unknown:
            return _error(422, "unknown_tool", f"unknown tools for this server: {unknown}")
        with self._lock:
            if eid in self.episodes:
                return _error(409, "episode_exists", f"episode {eid!r} is already open")
            # Re-opening an id (a replay with the same seed) starts its injected record afresh,
            # so the replay's faults are not refused as recorded twice.
            self.ledger.forget_injected(eid)
            sandbox = Path(tempfile.mkdtemp(prefix="ep-", dir=self.sandbox_root))
            ctx = ToolContext(seed=seed, episode_id=eid, sandbox=sandbox)
            if body.get("initial_config") is not None:
                ctx.state["initial_config"] = body["initial_config"]
            self.episodes[eid] = Episode(eid, seed, plan, fault_seed, frozenset(names), ctx)
        return JSONResponse({"episode_id": eid, "tools": list(names), "faults": str(plan)},
                            status_code=201)

    async def close_episode(self, request: Request) -> Response:
        eid = request.path_params["episode_id"]
        with self._lock:
            ep = self.episodes.pop(eid, None)
        if ep is None:
            return _error(404, "unknown_episode", f"no open episode {eid!r}")
        shutil.rmtree(ep.ctx.sandbox, ignore_errors=True)
        return Response(status_code=204)

    def _call(self, name: str, eid: str | None, raw: bytes) -> Response:
        """Validate and dispatch one tool call (no fault logic here: that is the injector's)."""
        ep = self.episodes.get(eid) if eid else None
        if ep is None:
            return _error(404, "unknown_episode", f"no open episode {eid!r} "
                          "(set X-Reflrl-Episode after POST /v1/episodes)")
        spec = self.tools.get(name)
        if spec is None or name not in ep.tools:
            return _error(404, "unknown_tool", f"no tool named {name!r} in this episode")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "bad_request", "body is not valid JSON")
        args = body.get("arguments", {}) if isinstance(body, dict) else None
        if not isinstance(args, dict):
            return _error(422, "invalid_arguments", "arguments must be a JSON object")
        err = jsonschema.exceptions.best_match(self._validators[name].iter_errors(args))
        if err is not None:
            return _error(422, "invalid_arguments", f"{name}: {_describe(err)}")
        try:
            result = spec.handler(args, ep.ctx)
        except ToolError as e:
            return _error(422, e.kind, f"{name}: {e}")
        except Exception as e:  # a server bug, not an injected fault: 500 and not in the ledger
            return _error(500, "internal_error", f"{name}: {type(e).__name__}: {e}")
        try:
            return JSONResponse({"result": result})
        except (TypeError, ValueError) as e:
            return _error(500, "internal_error", f"{name}: result is not JSON: {e}")

    async def get_ledger(self, request: Request) -> Response:
        eid = request.query_params.get("episode")
        return JSONResponse({"episode": eid,
                             "events": [e.to_dict() for e in self.ledger.injected(eid)]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "episodes": len(self.episodes), "tools": len(self.tools)})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.shutdown()

    def shutdown(self) -> None:
        """Delete every sandbox (and the root if this server created it)."""
        with self._lock:
            eps = list(self.episodes.values())
            self.episodes.clear()
        for ep in eps:
            shutil.rmtree(ep.ctx.sandbox, ignore_errors=True)
        if self._own_root:
            shutil.rmtree(self.sandbox_root, ignore_errors=True)


def create_app(tools: dict[str, ToolSpec] | None = None, *, clock=None,
               sandbox_root: str | Path | None = None, ledger: Ledger | None = None,
               default_seed: int = 0):
    """The tool server's ASGI app (the fault injector wrapping the Starlette routes).

    tools: name -> ToolSpec (default: ``default_tools()``); clock: for latency/timeout stalls
    without a net control (default SystemClock); ledger: receives injected faults (default a new
    Ledger, reachable as ``app.server.ledger``); default_seed: seed of episodes that give none.
    """
    return ToolServer(tools, clock=clock, sandbox_root=sandbox_root, ledger=ledger,
                      default_seed=default_seed).app


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


def _describe(err: jsonschema.ValidationError) -> str:
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "required":
        return f"missing required argument: {err.message}"
    if err.validator == "additionalProperties":
        return f"unexpected argument: {err.message}"
    return f"argument {path!r}: {err.message}" if path else err.message
