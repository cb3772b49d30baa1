"""Your own HTTP service as reflrl tools: point the environments at it (through the fault proxy).

    tools = [HttpTool("get_weather", "Current weather in a city.",
                      {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}, method="GET", path="/weather")]
    # reflrl faults proxy --upstream http://127.0.0.1:9000 --faults rate_limit=0.1 --port 8078
    client = http_tool_client("http://127.0.0.1:8078", tools)
    env = gymnasium.make("reflrl/ToolCall-v0", dataset=my_tasks, client=client)
    # or: ToolEnvironmentFactory(tools=["get_weather"], tasks=my_tasks, client=client)  (TRL)

``HttpToolTransport`` is an httpx transport that speaks the tool server's protocol to reflrl's
``ToolClient`` (``GET /v1/tools``, ``POST/DELETE /v1/episodes``, ``POST /v1/call/{tool}``,
``GET /v1/episodes/{id}/ledger``) and plain HTTP to the service: a call becomes ``METHOD path`` with the
arguments filling ``{name}`` placeholders of the path, the rest in the query string (GET, DELETE)
or as a JSON body (POST, PUT, PATCH); the X-Reflrl-* coordinate headers go along, so the fault
proxy decides each attempt at the client's own coordinates. A 2xx JSON answer is the call's result
(wrapped as ``{"result": ...}``); everything else (status, Retry-After, an invalid body, a reset,
a short body, a timeout) reaches the client unchanged, so the client classifies, retries and
records it as it does with reflrl's own tool server. A 400 from the service becomes 422
``invalid_arguments`` (the policy's error, not a protocol bug). ``GET /v1/episodes/{id}/ledger`` reads the
proxy's ``/_reflrl/ledger``, so ``ledger.reconcile()`` pairs injected and observed faults; against
a service without the proxy it is empty.

With the proxy, its ``--faults`` and ``--seed`` decide the faults: the fault plan an environment
sends when it opens an episode is not used.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import quote, unquote

import httpx

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class HttpTool:
    """One endpoint of a service as a tool: name/description/parameters are what the model sees
    (``parameters`` is a JSON schema); ``method`` and ``path`` (``{arg}`` placeholders allowed)
    where the call goes; ``returns`` an optional JSON schema of the answer (detects schema
    drift)."""

    name: str
    description: str
    parameters: dict[str, Any]
    method: str = "GET"
    path: str = ""
    returns: dict[str, Any] | None = None
    domain: str = "http"

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def request(self, base_url: str, arguments: dict[str, Any]) -> tuple[str, str, dict, Any]:
        """(method, url, query params, JSON body or None) of a call with ``arguments``."""
        args = dict(arguments)
        path = self.path or f"/{self.name}"
        for key in list(args):
            mark = "{" + key + "}"
            if mark in path:
                path = path.replace(mark, quote(str(args.pop(key)), safe=""))
        method = self.method.upper()
        if method in BODY_METHODS:
            return method, base_url + path, {}, args
        return method, base_url + path, {k: _query_value(v) for k, v in args.items()}, None


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return v if isinstance(v, str) else json.dumps(v)


class HttpToolTransport(httpx.AsyncBaseTransport):
    """The tool server's protocol on the client side, plain HTTP to ``base_url`` (see module doc).

    inner: the transport to the service (default real HTTP)."""

    def __init__(self, base_url: str, tools: Sequence[HttpTool], *,
                 inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")
        self.inner = inner or httpx.AsyncHTTPTransport()
        self._episodes: set[str] = set()
        self._lock = threading.Lock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if path.startswith("/v1/call/") and method == "POST":
            return await self._call(request, path[len("/v1/call/"):])
        if path == "/v1/tools" and method == "GET":
            detail = request.url.params.get("detail") in ("1", "true", "yes")
            tools = [dict(t.schema(), **({"domain": t.domain, "returns": t.returns} if detail else {}))
                     for t in self.tools.values()]
            return _json(request, 200, {"tools": tools})
        if path == "/v1/episodes" and method == "POST":
            body = json.loads(await request.aread() or b"{}")
            eid = body.get("episode_id")
            with self._lock:
                if eid in self._episodes:
                    return _error(request, 409, "episode_exists", f"episode {eid!r} is already open")
                self._episodes.add(eid)
            return _json(request, 201, {"episode_id": eid, "tools": list(self.tools),
                                        "faults": body.get("faults") or ""})
        if path.startswith("/v1/episodes/") and method == "DELETE":
            with self._lock:
                known = path[len("/v1/episodes/"):] in self._episodes
                self._episodes.discard(path[len("/v1/episodes/"):])
            return httpx.Response(204 if known else 404, request=request)
        if path.startswith("/v1/episodes/") and path.endswith("/ledger") and method == "GET":
            eid = unquote(path[len("/v1/episodes/"):-len("/ledger")])
            with self._lock:
                known = eid in self._episodes
            if not known:
                return _error(request, 404, "unknown_episode", f"no open episode {eid!r}")
            return await self._ledger(request, eid)
        return _error(request, 404, "not_found", f"{method} {path} is not part of the protocol")

    async def _call(self, request: httpx.Request, name: str) -> httpx.Response:
        tool = self.tools.get(name)
        if tool is None:
            return _error(request, 404, "unknown_tool", f"no tool named {name!r}")
        try:
            body = json.loads(await request.aread())
            args = body.get("arguments", {}) if isinstance(body, dict) else None
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return _error(request, 422, "invalid_arguments", "arguments must be a JSON object")
        method, url, params, payload = tool.request(self.base_url, args)
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-reflrl-")}
        if payload is not None:
            headers["content-type"] = "application/json"
        out = httpx.Request(method, httpx.URL(url, params=params), headers=headers,
                            content=None if payload is None else json.dumps(payload).encode(),
                            extensions=request.extensions)
        resp = await self.inner.handle_async_request(out)
        try:
            data = await resp.aread()  # a reset, a short body or a timeout raises here
        finally:
            await resp.aclose()
        if 200 <= resp.status_code < 300:
            try:
                result = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                return httpx.Response(200, headers=_plain(resp.headers), content=data,
                                      request=request)  # the client sees an invalid body
            return _json(request, 200, {"result": result})
        if resp.status_code == 400:
            return _error(request, 422, "invalid_arguments",
                          f"{name}: the service rejected the arguments: {data[:200]!r}")
        return httpx.Response(resp.status_code, headers=_plain(resp.headers), content=data,
                              request=request)

    async def _ledger(self, request: httpx.Request, episode: str) -> httpx.Response:
        url = httpx.URL(self.base_url + "/_reflrl/ledger", params={"episode": episode})
        resp = await self.inner.handle_async_request(httpx.Request("GET", url,
                                                                   extensions=request.extensions))
        data = await resp.aread()
        await resp.aclose()
        if resp.status_code == 404:  # no proxy in front of the service: nothing was injected
            return _json(request, 200, {"episode": episode, "events": []})
        return httpx.Response(resp.status_code, headers=_plain(resp.headers), content=data,
                              request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _plain(headers: httpx.Headers) -> list[tuple[str, str]]:
    drop = {"content-length", "transfer-encoding", "connection", "content-encoding"}
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in drop]


def _json(request: httpx.Request, status: int, payload: Any) -> httpx.Response:
    return httpx.Response(status, json=payload, request=request)


def _error(request: httpx.Request, status: int, kind: str, message: str) -> httpx.Response:
    return _json(request, status, {"error": {"type": kind, "message": message}})


def http_tool_client(base_url: str, tools: Sequence[HttpTool], *,
                     inner: httpx.AsyncBaseTransport | None = None, **kwargs: Any):
    """A ``ToolClient`` whose tools are ``tools`` of the service at ``base_url`` (usually the
    fault proxy's URL); ``kwargs`` go to ``ToolClient`` (retry, ledger, clock, timeout, ...)."""
    from .client import ToolClient

    transport = HttpToolTransport(base_url, tools, inner=inner)
    return ToolClient(httpx.AsyncClient(transport=transport, base_url="http://reflrl.tools"),
                      **kwargs)
