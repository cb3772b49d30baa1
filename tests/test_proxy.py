"""reflrl faults proxy: real loopback HTTP, a small real upstream (Starlette under uvicorn), plain
httpx clients. Every fault kind is checked as a client sees it; same seed, same faults; injected
and observed reconcile; an over-limit body gets 413."""
from __future__ import annotations

import json
import socket
import time

import gymnasium
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reflrl.envs.client import RetryPolicy, classify_exception, classify_response
from reflrl.envs.errors import ConnectionReset, ToolCallError, ToolTimeout, TruncatedBody
from reflrl.envs.http_tools import HttpTool, http_tool_client
from reflrl.envs.proxy import FaultProxy, ProxyError, request_identity
from reflrl.envs.loopback import ServerThread
from reflrl.envs.types import Task, ToolCall
from reflrl.faults import FaultEvent, FaultPlan, FaultSpecError, Ledger, decide

WEATHER = {"city": "Paris", "temp_c": 12.5, "condition": "cloudy", "humidity": 71}


def _upstream():
    hits = []

    async def weather(request: Request):
        hits.append(("GET", request.url.path))
        return JSONResponse(dict(WEATHER, city=request.query_params.get("city", "Paris")))

    async def echo(request: Request):
        body = await request.body()
        hits.append(("POST", len(body)))
        if request.query_params.get("bad"):
            return JSONResponse({"error": "bad city"}, status_code=400)
        return JSONResponse({"got": len(body)})

    app = Starlette(routes=[Route("/weather", weather), Route("/echo", echo, methods=["POST"])])
    return app, hits


@pytest.fixture(scope="module")
def upstream():
    app, hits = _upstream()
    with ServerThread(app) as srv:
        yield srv.url, hits


def _proxy(upstream_url, faults, seed=0, **kw):
    proxy = FaultProxy(upstream_url, faults, seed=seed, **kw)
    return proxy, ServerThread(proxy)


def _observe(client: httpx.Client, method: str, url: str, **kw):
    """(the ToolCallError reflrl's client makes of one request, or None for a valid answer;
    the response or None). A JSON body is the result itself here, not the tool server's
    {"result": ...}."""
    try:
        r = client.request(method, url, **kw)
    except httpx.TransportError as e:
        return classify_exception(e), None
    body = r.content
    try:
        body = json.dumps({"result": json.loads(body)}).encode()
    except ValueError:
        pass
    try:
        classify_response(r.status_code, r.headers, body)
    except ToolCallError as fault:
        return fault, r
    return None, r


def test_every_fault_kind_as_a_plain_httpx_client_sees_it(upstream):
    url, hits = upstream
    cases = ["rate_limit=1:2s", "server_error=1", "timeout=1:5s", "connection=1", "truncated=1",
             "malformed=1", "ip_ban=1", "latency=1:300ms", "schema_drift=1"]
    for spec in cases:
        kind = spec.split("=")[0]
        proxy, srv = _proxy(url, spec)
        n_hits = len(hits)
        with srv, httpx.Client(base_url=srv.url, timeout=1.0) as c:
            t0 = time.monotonic()
            fault, r = _observe(c, "GET", "/weather", params={"city": "Paris"})
            took = time.monotonic() - t0
            if kind == "rate_limit":
                assert r.status_code == 429 and r.headers["retry-after"] == "2"
            elif kind == "server_error":
                assert r.status_code in (500, 502, 503) and r.json()["error"]["type"]
            elif kind == "timeout":
                assert r is None and type(fault) is ToolTimeout and took < 4.0
                assert fault.detail == "ReadTimeout"
            elif kind == "connection":
                assert r is None and type(fault) is ConnectionReset
            elif kind == "truncated":
                assert r is None and type(fault) is TruncatedBody
                assert fault.detail == "RemoteProtocolError"
            elif kind == "malformed":
                assert r.status_code == 200 and r.headers["content-type"] == "application/json"
                with pytest.raises(ValueError):
                    json.loads(r.content)
            elif kind == "ip_ban":
                assert r.status_code == 403
                again = c.get("/weather", params={"city": "Paris"})  # the retry stays banned
                assert again.status_code == 403
                other = c.get("/weather", params={"city": "Paris"},
                              headers={"x-reflrl-client": "new-ip"})
                assert other.status_code == 403  # banned by its own draw (probability 1)
            elif kind == "latency":
                assert r.status_code == 200 and r.json() == WEATHER and took >= 0.3
            elif kind == "schema_drift":
                got = r.json()
                assert r.status_code == 200 and got != WEATHER
                assert len(set(got) ^ set(WEATHER)) in (1, 2)  # one field dropped or renamed
                assert all(got[k] == v for k, v in WEATHER.items() if k in got)
            if kind != "latency" and kind != "schema_drift":
                assert fault.kind == kind, (spec, fault)
            else:
                assert fault is None, (spec, fault)   # a valid answer (no returns schema here)
            injected = proxy.ledger.injected()
            assert [e.kind for e in injected][:1] == [kind]
            assert injected[0].tool == "GET /weather"
        pre = kind in ("rate_limit", "server_error", "timeout", "connection", "ip_ban")
        assert len(hits) == n_hits + (0 if pre else 1), spec  # pre-dispatch faults never reach it


def test_same_seed_replays_the_same_faults_and_injected_equals_observed(upstream):
    url, _ = upstream
    spec = ("rate_limit=0.15:0s,server_error=0.1,connection=0.1,truncated=0.1,malformed=0.1,"
            "timeout=0.05:3s,latency=0.05:10ms")
    runs = {}
    for seed in (7, 7, 8):
        proxy, srv = _proxy(url, spec, seed=seed)
        seen = []
        observed = Ledger()
        # the read timeout sits well below the injected 3 s stall and well above the 10 ms latency, so a
        # loaded machine (the proxy answers on wall time) does not turn a slow answer into a timeout
        with srv, httpx.Client(base_url=srv.url, timeout=1.5) as c:
            for i in range(20):  # each request retried until it succeeds, at most 4 attempts
                params = {"city": f"city{i}"}
                ident = request_identity("GET", b"/weather", f"city=city{i}".encode(), b"")
                for attempt in range(4):
                    fault, _ = _observe(c, "GET", "/weather", params=params)
                    kind = fault.kind if fault is not None else None
                    seen.append((i, attempt, kind))
                    observed.record_observed(FaultEvent(ident, 0, 0, attempt, "observed",
                                                        fault.triage if fault else "ok", kind,
                                                        "GET /weather"))
                    if fault is None:
                        break
        observed.merge_injected(proxy.ledger.injected())
        report = observed.reconcile()
        assert report.exact, report.format()
        injected = {k: c.injected for k, c in report.per_kind.items() if c.injected}
        observed_n = {k: c.matched + c.undetected for k, c in report.per_kind.items() if c.injected}
        assert injected == observed_n and sum(injected.values()) >= 10
        runs.setdefault(seed, []).append(seen)
    assert runs[7][0] == runs[7][1]  # same seed, same traffic: the same faults at the same attempts
    assert runs[8][0] != runs[7][0]


def test_header_coordinates_decide_exactly_like_the_tool_server(upstream):
    url, _ = upstream
    plan = FaultPlan.parse("rate_limit=0.3,server_error=0.3")
    proxy, srv = _proxy(url, plan, seed=5)
    with srv, httpx.Client(base_url=srv.url, timeout=2.0) as c:
        for call in range(12):
            h = {"x-reflrl-episode": "ep-a", "x-reflrl-step": "1", "x-reflrl-call": str(call),
                 "x-reflrl-attempt": "0"}
            r = c.get("/weather", params={"city": "Oslo"}, headers=h)
            d = decide(plan, 5, "ep-a", 1, call, 0)
            kind = d.kind if d is not None else None
            assert (r.status_code == 429) == (kind == "rate_limit")
            assert (r.status_code in (500, 502, 503)) == (kind == "server_error")
            assert (r.status_code == 200) == (kind is None)
        first = [e.kind for e in sorted(proxy.ledger.injected("ep-a"), key=lambda e: e.call)]
        for call in range(12):  # the episode replayed: the same faults, recorded afresh
            h = {"x-reflrl-episode": "ep-a", "x-reflrl-step": "1", "x-reflrl-call": str(call),
                 "x-reflrl-attempt": "0"}
            c.get("/weather", params={"city": "Oslo"}, headers=h)
    again = [e.kind for e in sorted(proxy.ledger.injected("ep-a"), key=lambda e: e.call)]
    assert again == first and len(first) == sum(
        decide(plan, 5, "ep-a", 1, call, 0) is not None for call in range(12))


def test_request_body_over_the_limit_is_413_and_never_forwarded(upstream):
    url, hits = upstream
    proxy, srv = _proxy(url, "none", max_body_bytes=1024)
    with srv, httpx.Client(base_url=srv.url, timeout=5.0) as c:
        n = len(hits)
        r = c.post("/echo", content=b"x" * 2048)
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"

        def chunks():  # no Content-Length: the proxy counts while it reads
            for _ in range(64):
                yield b"y" * 256

        r = c.post("/echo", content=chunks())
        assert r.status_code == 413
        assert len(hits) == n
        r = c.post("/echo", content=b"z" * 1000)
        assert r.status_code == 200 and r.json() == {"got": 1000}
    assert proxy.stats["too_large"] == 2 and proxy.ledger.injected() == []


def test_unreachable_upstream_is_a_real_502_not_an_injected_fault():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    proxy, srv = _proxy(dead, "rate_limit=0")
    with srv, httpx.Client(base_url=srv.url, timeout=5.0) as c:
        r = c.get("/weather")
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        health = c.get("/_reflrl/health").json()
        assert health["stats"]["upstream_error"] == 1
    assert proxy.ledger.injected() == []


def _raw(url: str, request: bytes) -> tuple[int, dict]:
    """Send one raw HTTP/1.1 request; (status, JSON body)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("request_bytes, status, kind, needle", [
    # absolute form: what a client sends when it is configured to use the proxy as a forward proxy
    (b"GET http://127.0.0.1:9/x HTTP/1.1\r\nHost: 127.0.0.1:9\r\n", 400, "bad_request_target", "absolute form"),
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n", 400, "bad_request_target", "asterisk form"),
    (b"GET /weather HTTP/1.1\r\nHost: x\r\nX-Reflrl-Episode: e\r\nX-Reflrl-Step: abc\r\n", 400, "bad_header",
     "X-Reflrl-Step"),
])
def test_a_malformed_request_gets_a_4xx_naming_the_problem_never_a_500(upstream, request_bytes, status, kind,
                                                                       needle):
    url, hits = upstream
    proxy, thread = _proxy(url, "none")
    before = len(hits)
    with thread as srv:
        got, body = _raw(srv.url, request_bytes + b"Connection: close\r\n\r\n")
        assert (got, body["error"]["type"]) == (status, kind) and needle in body["error"]["message"]
        if kind == "bad_request_target":
            assert url in body["error"]["message"]  # says what it is a reverse proxy of
        assert len(hits) == before  # nothing was forwarded
        with httpx.Client(base_url=srv.url, timeout=10) as client:  # and it goes on serving
            assert client.get("/weather").json() == WEATHER
    assert proxy.stats["bad_request"] == 1 and proxy.ledger.injected() == []


def test_bad_settings_are_refused_with_a_clear_error():
    with pytest.raises(ProxyError, match="not an http"):
        FaultProxy("ftp://example", "none")
    with pytest.raises(FaultSpecError, match="invalid_file"):
        FaultProxy("http://127.0.0.1:1", "invalid_file=0.1")


def test_env_points_its_tools_at_a_proxied_real_service(upstream):
    """ToolCall-v0 with the service's endpoint as its tool, through the proxy: the client retries
    the proxy's faults, the env's ledger gets the injected faults from /_reflrl/ledger and
    reconciles them exactly with what it observed."""
    url, hits = upstream
    tool = HttpTool("get_weather", "Current weather in a city.",
                    {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}, method="GET", path="/weather",
                    returns={"type": "object", "required": ["city", "temp_c", "condition",
                                                            "humidity"]})
    tasks = [Task(id=f"w{i}", query=f"Weather in city{i}?", tools=[tool.schema()],
                  gold=[[ToolCall("get_weather", {"city": f"city{i}"})]]) for i in range(12)]
    proxy, srv = _proxy(url, "rate_limit=0.2:0s,server_error=0.15,schema_drift=0.15", seed=3)
    with srv:
        client = http_tool_client(srv.url, [tool], retry=RetryPolicy(max_attempts=4, base_s=0.0,
                                                                     jitter=0.0))
        env = gymnasium.make("reflrl/ToolCall-v0", dataset=tasks, client=client, seed=0).unwrapped
        try:
            rewards, retried = [], 0
            for i in range(12):
                env.reset(options={"task_index": i})
                call = f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "city{i}"}}}}</tool_call>'
                _, reward, _, _, info = env.step(call)
                rewards.append(reward)
                retried += sum(r["attempts"] - 1 for r in info["tool_results"])
                if info["tool_results"][0]["ok"]:
                    assert info["tool_results"][0]["result"]["city"] == f"city{i}"
        finally:
            env.close()  # closes the last episode: its injected faults arrive in the ledger
        report = env.ledger.reconcile()
        totals = env.ledger.totals()
    assert all(r == 1.0 for r in rewards)  # env faults never lower the reward
    assert retried > 0 and sum(totals.injected_by_kind.values()) >= 3
    assert report.exact, report.format()
    assert report.per_kind["schema_drift"].matched == report.per_kind["schema_drift"].injected


def test_trl_environment_factory_calls_a_proxied_service(upstream):
    """The TRL environment's tool methods reach the user's service through the proxy."""
    from reflrl.integrations.trl import ToolEnvironmentFactory

    url, _ = upstream
    tool = HttpTool("get_weather", "Current weather in a city.",
                    {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}, path="/weather")
    tasks = [Task(id="w", query="Weather in Oslo?", tools=[tool.schema()],
                  gold=[[ToolCall("get_weather", {"city": "Oslo"})]])]
    proxy, srv = _proxy(url, "rate_limit=0.5:0s", seed=2)
    with srv:
        client = http_tool_client(srv.url, [tool], retry=RetryPolicy(max_attempts=6, base_s=0.0))
        factory = ToolEnvironmentFactory(tools=["get_weather"], tasks=tasks, client=client, seed=0)
        try:
            env = factory()
            env.reset(task_index=0)
            answers = [json.loads(env.get_weather(city="Oslo")) for _ in range(6)]
            factory.flush()
            report = factory.ledger.reconcile()
        finally:
            factory.close()
    assert all(a["result"]["city"] == "Oslo" for a in answers)
    assert sum(o.attempts for o in env.outcomes) > 6  # some calls were retried
    assert report.exact and report.per_kind["rate_limit"].matched > 0
