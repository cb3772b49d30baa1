"""The tool server under hostile input (issue 18): a real uvicorn server on 127.0.0.1 and raw HTTP.

Each case is a request a careless or hostile client could send. The rules checked:
- a call whose coordinate headers are missing or malformed is refused (400 naming the header),
  never run fault-free; nothing is recorded for it;
- every malformed request gets a 4xx JSON error (never a 500 or a plain-text page);
- request size, slow bodies, error-message length, per-episode disk and ledger memory are bounded;
- a tool's own crash is a ``tool_bug`` the client does not retry and the ledger counts apart;
- whole-number floats are accepted where the schema says integer (JSON Schema counts 2.0 as one).
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from reflrl.envs.client import RetryPolicy, ToolClient
from reflrl.envs.errors import PolicyError, ToolBug
from reflrl.envs.limits import ServerLimits
from reflrl.envs.loopback import ServerThread
from reflrl.envs.tool_server import create_app
from reflrl.envs.tools.base import ToolSpec
from reflrl.envs.tools.catalog import build_catalog

LIMITS = ServerLimits(max_body_bytes=64 << 10, body_timeout_s=0.5, sandbox_bytes=64 << 10,
                      sandbox_files=24, max_open_episodes=50)


def _crash(args, ctx):
    raise ZeroDivisionError("a tool bug")


def _tools() -> dict[str, ToolSpec]:
    tools = build_catalog()
    tools["crash"] = ToolSpec("crash", "misc", "Always crashes.", {"type": "object"}, _crash)
    return tools


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    app = create_app(_tools(), sandbox_root=tmp_path_factory.mktemp("sb"), limits=LIMITS)
    with ServerThread(app) as s:
        s.tool_server = app.server
        yield s


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=5.0) as h:
        yield h


_n = [0]


def _episode(http, faults: str = "", **extra) -> str:
    _n[0] += 1
    eid = f"rel-{_n[0]}"
    r = http.post("/v1/episodes", json={"episode_id": eid, "faults": faults, "fault_seed": 1, **extra})
    assert r.status_code == 201, r.text
    return eid


def _coords(eid: str, step="0", call="0", attempt="0") -> dict[str, str]:
    return {"x-reflrl-episode": eid, "x-reflrl-step": step, "x-reflrl-call": call,
            "x-reflrl-attempt": attempt, "x-reflrl-client": "t"}


def _is_json_error(r: httpx.Response, status: int | None = None) -> dict:
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:200])
    err = r.json()["error"]
    assert isinstance(err["type"], str) and isinstance(err["message"], str)
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:300])
    assert len(r.content) < 1000, "error answers quote a short prefix, not the whole value"
    return err


WEATHER = {"arguments": {"city": "Paris"}}


# ---- 1. coordinate headers ------------------------------------------------------------------
BAD_COORDS = [
    ("x-reflrl-step", "abc"), ("x-reflrl-step", ""), ("x-reflrl-attempt", "1e3"),
    ("x-reflrl-step", "9" * 5000), ("x-reflrl-call", "-1"), ("x-reflrl-step", "1 2"),
    ("x-reflrl-step", "+1"), ("x-reflrl-attempt", "1_0"), ("x-reflrl-step", "\u0661"),
    ("x-reflrl-client", "a b"), ("x-reflrl-episode", "a/b"),
]


@pytest.mark.parametrize("header,value", BAD_COORDS)
def test_a_malformed_coordinate_header_is_refused_not_run_fault_free(srv, http, header, value):
    eid = _episode(http, "rate_limit=1")
    h = _coords(eid)
    h[header] = value
    r = http.post("/v1/call/get_current_weather", json=WEATHER,
                  headers={k: v.encode("utf-8") for k, v in h.items()})
    err = _is_json_error(r, 400)
    assert err["type"] == "bad_header"
    assert err["message"].lower().startswith(header), err["message"]
    assert srv.tool_server.ledger.injected(eid) == []   # nothing recorded, the tool never ran
    # the same call with good headers gets its fault
    assert http.post("/v1/call/get_current_weather", json=WEATHER,
                     headers=_coords(eid)).status_code == 429


@pytest.mark.parametrize("missing", ["x-reflrl-episode", "x-reflrl-step", "x-reflrl-call",
                                     "x-reflrl-attempt", "all"])
def test_a_missing_coordinate_header_is_refused(srv, http, missing):
    eid = _episode(http, "rate_limit=1")
    h = {} if missing == "all" else {k: v for k, v in _coords(eid).items() if k != missing}
    r = http.post("/v1/call/get_current_weather", json=WEATHER, headers=h)
    err = _is_json_error(r, 400)
    assert err["type"] == "bad_header" and "missing" in err["message"]
    assert srv.tool_server.ledger.injected(eid) == []


def test_a_duplicated_coordinate_header_is_refused(http):
    eid = _episode(http, "rate_limit=1")
    headers = list(_coords(eid).items()) + [("x-reflrl-step", "1")]
    r = http.post("/v1/call/get_current_weather", json=WEATHER, headers=headers)
    assert _is_json_error(r, 400)["type"] == "bad_header"


# ---- 3. every malformed request: a 4xx JSON error ------------------------------------------
DEEP = b"[" * 5000 + b"]" * 5000
MALFORMED = [  # (method, path, body bytes, expected status)
    ("POST", "/v1/call/get_current_weather", b'{"arguments": ' + DEEP + b"}", 400),
    ("POST", "/v1/call/get_current_weather", b"{not json", 400),
    ("POST", "/v1/call/get_current_weather", b'{"arguments": {"city": NaN}}', 400),
    ("POST", "/v1/call/get_current_weather", b'\xff\xfe{"arguments": {}}', 400),
    ("POST", "/v1/call/get_current_weather", b'{"arguments": [1]}', 422),
    ("POST", "/v1/call/get_current_weather",
     b'{"arguments": {"city": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}}", 422),
    ("POST", "/v1/call/get_current_weather", b'{"arguments": {"city": "\\ud800"}}', 422),
    ("POST", "/v1/call/no_such_tool", b'{"arguments": {}}', 404),
    ("POST", "/v1/episodes", DEEP, 400),
    ("POST", "/v1/episodes", b'{"episode_id": "m1", "tools": [["x"]]}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m2", "tools": "get_forecast"}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m3", "seed": true}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m4", "seed": 1.5}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m5", "seed": ' + b"9" * 30 + b"}", 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m6", "faults": 3}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m7", "fault": "rate_limit=1"}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "m8", "initial_config": [1]}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "a/b"}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": ".."}', 422),
    ("POST", "/v1/episodes", b'{"episode_id": "' + b"x" * 200 + b'"}', 422),
    ("POST", "/v1/episodes", b"[]", 422),
    ("POST", "/v1/episodes", b"", 400),
    ("GET", "/v1/ledger", b"", 400),
    ("GET", "/v1/nowhere", b"", 404),
    ("PUT", "/v1/tools", b"", 405),
    ("GET", "/v1/call/get_current_weather", b"", 404),
    ("DELETE", "/v1/episodes/never-opened", b"", 404),
]


@pytest.mark.parametrize("method,path,body,status", MALFORMED,
                         ids=[f"{m} {p} {b[:24]!r}" for m, p, b, _ in MALFORMED])
def test_every_malformed_request_gets_a_4xx_json_error(http, method, path, body, status):
    eid = _episode(http)
    r = http.request(method, path, content=body, headers={**_coords(eid),
                                                         "content-type": "application/json"})
    _is_json_error(r, status)


def test_a_huge_value_is_quoted_short_in_the_error(http):
    eid = _episode(http)
    city = "x" * 60_000
    r = http.post("/v1/call/get_current_weather", json={"arguments": {"city": city}},
                  headers=_coords(eid))
    err = _is_json_error(r, 422)
    assert err["message"].startswith("get_current_weather: unknown city 'xxxx")


# ---- 2. bounded resources -------------------------------------------------------------------
def _raw_exchange(srv, head: bytes, parts=()) -> tuple[bytes, bytes, float]:
    """Send ``head`` then each of ``parts`` on a raw socket, read until the server closes:
    (status line and headers, body, seconds from the last byte sent to the close)."""
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.sendall(head)
        for part in parts:
            s.sendall(part)
        t0 = time.monotonic()
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        took = time.monotonic() - t0
    status, _, body = data.partition(b"\r\n\r\n")
    return status, body, took


def test_a_body_over_the_limit_is_413_whether_announced_or_chunked(srv, http):
    eid = _episode(http)
    coords = "".join(f"{k}: {v}\r\n" for k, v in _coords(eid).items())
    head = f"POST /v1/call/get_current_weather HTTP/1.1\r\nHost: x\r\n{coords}"
    # announced: answered from the headers alone, the body is never read
    status, body, _ = _raw_exchange(srv, f"{head}Content-Length: {10 << 20}\r\n\r\n".encode())
    assert status.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["type"] == "body_too_large"
    # chunked (no Content-Length): cut off once the limit is passed
    chunk = b"%x\r\n" % 8192 + b"x" * 8192 + b"\r\n"
    n = LIMITS.max_body_bytes // 8192 + 1
    status, body, _ = _raw_exchange(srv, f"{head}Transfer-Encoding: chunked\r\n\r\n".encode(),
                                    [chunk] * n)
    assert status.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["type"] == "body_too_large"


@pytest.mark.parametrize("target, needle", [
    (b"http://127.0.0.1:9/v1/health", "absolute form"),  # a client told this server is its forward proxy
    (b"*", "asterisk form"),
])
def test_a_request_target_that_is_not_a_path_gets_400_naming_it(srv, http, target, needle):
    status, body, _ = _raw_exchange(srv, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400"), status
    err = json.loads(body)["error"]
    assert err["type"] == "bad_request_target" and needle in err["message"]
    assert http.get("/v1/health").status_code == 200  # and the server goes on serving


def test_a_client_that_announces_a_body_and_never_sends_it_gets_408(srv):
    """The guard waits ``body_timeout_s`` for the body, answers 408 and closes the connection."""
    status, body, took = _raw_exchange(
        srv, b"POST /v1/episodes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"episode_id\"")
    assert status.startswith(b"HTTP/1.1 408"), status
    assert json.loads(body)["error"]["type"] == "body_timeout"
    assert LIMITS.body_timeout_s <= took < LIMITS.body_timeout_s + 8  # (a busy machine is slow)


def test_file_tools_stop_at_the_episode_disk_quota_with_a_tool_error(srv, http):
    eid = _episode(http)
    content = "y" * 15_000
    statuses, kinds = [], []
    for i in range(8):
        r = http.post("/v1/call/write_file", json={"arguments": {"path": f"f{i}.txt",
                                                                  "content": content}},
                      headers=_coords(eid, step=str(i)))
        statuses.append(r.status_code)
        kinds.append(r.json().get("error", {}).get("type"))
    assert statuses[:3] == [200, 200, 200]
    assert 422 in statuses and kinds[statuses.index(422)] == "quota_exceeded"
    sandbox = srv.tool_server.episodes[eid].ctx.sandbox
    assert sum(p.stat().st_size for p in sandbox.rglob("*") if p.is_file()) <= LIMITS.sandbox_bytes
    for i in range(30):  # the file-count quota too
        r = http.post("/v1/call/write_file", json={"arguments": {"path": f"d/{i}", "content": ""}},
                      headers=_coords(eid, step=str(100 + i)))
        if r.status_code != 200:
            break
    assert r.json()["error"]["type"] == "quota_exceeded"
    assert len(list(sandbox.rglob("*"))) <= LIMITS.sandbox_files


def test_ledger_events_are_freed_with_their_episode_and_scoped_to_it(srv, http):
    server = srv.tool_server
    a, b = _episode(http, "server_error=1"), _episode(http, "rate_limit=1")
    for eid in (a, b):
        for step in range(3):
            http.post("/v1/call/get_current_weather", json=WEATHER, headers=_coords(eid, str(step)))
    ev_a = http.get(f"/v1/episodes/{a}/ledger").json()["events"]
    assert len(ev_a) == 3 and {e["episode"] for e in ev_a} == {a}   # only its own episode
    assert http.get("/v1/ledger", params={"episode": b}).json()["events"][0]["kind"] == "rate_limit"
    for eid in (a, b):
        assert http.delete(f"/v1/episodes/{eid}").status_code == 204
        _is_json_error(http.get(f"/v1/episodes/{eid}/ledger"), 404)
        _is_json_error(http.get("/v1/ledger", params={"episode": eid}), 404)
        assert server.ledger.injected(eid) == []


def test_open_episodes_are_capped(tmp_path):
    app = create_app(_tools(), sandbox_root=tmp_path, limits=ServerLimits(max_open_episodes=2))
    with ServerThread(app) as s, httpx.Client(base_url=s.url) as h:
        for i in range(2):
            assert h.post("/v1/episodes", json={"episode_id": f"c{i}"}).status_code == 201
        r = h.post("/v1/episodes", json={"episode_id": "c2"})
        assert _is_json_error(r, 503)["type"] == "too_many_episodes"
        assert h.delete("/v1/episodes/c0").status_code == 204
        assert h.post("/v1/episodes", json={"episode_id": "c2"}).status_code == 201


# ---- 4. tool bugs and whole-number floats ---------------------------------------------------
@pytest.mark.parametrize("tool,args,key", [("get_forecast", {"city": "Paris", "days": 2}, "days"),
                                          ("list_messages", {"limit": 3}, "limit")])
async def test_whole_number_floats_are_accepted_for_integer_arguments(srv, tool, args, key):
    """JSON Schema counts 2.0 as an integer: the tool answers it as it answers 2."""
    async with ToolClient.connect(srv.url, retry=RetryPolicy(max_attempts=4)) as c:
        await c.open_episode("floats", seed=4)
        as_int = await c.call("floats", step=0, call_index=0, name=tool, arguments=args)
        as_float = await c.call("floats", step=1, call_index=0, name=tool,
                                arguments={**args, key: float(args[key])})
        await c.close_episode("floats")
    assert as_int.ok and as_float.ok, as_float.error
    assert as_float.result == as_int.result and as_float.attempts == 1
    assert c.ledger.reconcile("floats").exact


async def test_a_tool_crash_is_a_tool_bug_not_an_injected_fault(srv):
    async with ToolClient.connect(srv.url, retry=RetryPolicy(max_attempts=4)) as c:
        await c.open_episode("bug", seed=1, faults="rate_limit=0.2", fault_seed=3)
        outs = [await c.call("bug", step=s, call_index=0, name="crash", arguments={})
                for s in range(10)]
        await c.close_episode("bug")
    bugs = [o for o in outs if o.triage == "tool_bug"]
    assert bugs and all(type(o.fault) is ToolBug and o.status == 500 and o.fault_kind is None
                        for o in bugs)
    assert all("ZeroDivisionError" in o.error for o in bugs)
    assert all(o.attempts == 1 for o in bugs if not o.events)   # never retried for itself
    rep = c.ledger.reconcile("bug")
    assert rep.exact, rep.format()
    assert rep.tool_bugs == len(bugs) and c.ledger.totals("bug").tool_bugs == len(bugs)


# ---- 5. episode ids -------------------------------------------------------------------------
def test_every_valid_episode_id_round_trips_through_delete(srv, http):
    for eid in ("A.b_c~d-1", "x" * 128, "9"):
        assert http.post("/v1/episodes", json={"episode_id": eid}).status_code == 201
        assert http.delete(f"/v1/episodes/{eid}").status_code == 204
        assert eid not in srv.tool_server.episodes


async def test_a_latency_fault_on_an_error_answer_reconciles(tmp_path):
    """Post-dispatch faults act on 4xx and tool-bug answers too: a delayed policy error or tool bug
    is observed as ``latency`` (it was a mismatch: injected latency, observed policy_error)."""
    from reflrl.envs.clock import VirtualClock

    clock = VirtualClock()
    app = create_app(_tools(), sandbox_root=tmp_path, clock=clock)
    async with ToolClient.in_process(app, clock=clock) as c:
        await c.open_episode("slow", faults="latency=1:2s")
        bad = await c.call("slow", step=0, call_index=0, name="get_current_weather",
                           arguments={"city": "Atlantis"})
        bug = await c.call("slow", step=1, call_index=0, name="crash", arguments={})
        rep = c.ledger.reconcile("slow")
    assert (bad.triage, bug.triage) == ("policy_error", "tool_bug")
    assert isinstance(bad.fault, PolicyError) and type(bug.fault) is ToolBug
    assert rep.exact, rep.format()
    assert rep.per_kind["latency"].matched == 2


def test_a_deep_body_is_rejected_whatever_the_recursion_limit():
    """Some libraries raise sys.getrecursionlimit(); a 5000-deep body must still be a 400 (the
    verdict came from json's RecursionError before, so it depended on what was imported)."""
    import sys

    from reflrl.envs.limits import BadJSON, parse_json_body
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        with pytest.raises(BadJSON, match="nests deeper"):
            parse_json_body(b'{"arguments": ' + DEEP + b"}")
    finally:
        sys.setrecursionlimit(old)
    # brackets inside strings are text, not nesting
    assert parse_json_body(b'{"a": "' + b"[" * 1000 + b'\\""}') == {"a": "[" * 1000 + '"'}
