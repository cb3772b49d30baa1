"""Tool server + client in-process (httpx over InProcessTransport, VirtualClock: no real sleeps)."""
from __future__ import annotations

import math
from pathlib import Path

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from reflrl.envs.client import (CallOutcome, RetryPolicy, ToolClient, classify_exception,
                                classify_response, parse_retry_after)
from reflrl.envs.clock import VirtualClock
from reflrl.envs.errors import (FAULTS, Banned, ConnectionReset, InvalidArguments, InvalidFile,
                                MalformedBody, PolicyError, RateLimited, SchemaDrift, ServerError,
                                ToolBug, ToolCallError, ToolClientError, ToolFault, ToolTimeout,
                                TruncatedBody, UnknownTool, retryable_faults)
from reflrl.envs.tool_server import create_app
from reflrl.envs.tools.base import ToolError, ToolSpec
from reflrl.faults import ATTEMPT_KINDS, KIND_NAMES, KINDS, FaultPlan
from reflrl.faults.ledger import Ledger

FILE_RETURNS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                   "size_bytes": {"type": "integer"}},
    "required": ["path", "content", "size_bytes"],
    "additionalProperties": False,
}


def _read_file(args, ctx):
    p = ctx.resolve_in_sandbox(args["path"])
    text = p.read_text() if p.exists() else f"default content of {args['path']}"
    return {"path": args["path"], "content": text, "size_bytes": len(text)}


def _write_file(args, ctx):
    p = ctx.resolve_in_sandbox(args["path"])
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(args["content"])
    ctx.state["writes"] = ctx.state.get("writes", 0) + 1
    return {"path": args["path"], "content": args["content"], "size_bytes": len(args["content"])}


def _weather(args, ctx):
    if args["city"] == "Atlantis":
        raise ToolError("unknown city 'Atlantis'", kind="not_found")
    return {"city": args["city"], "temp_c": 10 + ctx.seed % 7, "units": args.get("units", "metric")}


def _buggy(args, ctx):
    raise RuntimeError("handler bug")


def make_tools() -> dict[str, ToolSpec]:
    path = {"type": "string", "description": "file path"}
    return {
        "read_file": ToolSpec("read_file", "files", "Read a file.",
                              {"type": "object", "properties": {"path": path},
                               "required": ["path"]}, _read_file, returns=FILE_RETURNS),
        "write_file": ToolSpec("write_file", "files", "Write a file.",
                               {"type": "object", "properties": {"path": path,
                                                                 "content": {"type": "string"}},
                                "required": ["path", "content"]}, _write_file,
                               returns=FILE_RETURNS),
        "get_weather": ToolSpec("get_weather", "weather", "Weather for a city.",
                                {"type": "object",
                                 "properties": {"city": {"type": "string"},
                                                "units": {"type": "string",
                                                          "enum": ["metric", "imperial"]}},
                                 "required": ["city"], "additionalProperties": False},
                                _weather),
        "buggy": ToolSpec("buggy", "misc", "Always crashes.", {"type": "object"}, _buggy),
    }


@pytest.fixture
def clock():
    return VirtualClock()


@pytest.fixture
def app(tmp_path):
    return create_app(make_tools(), sandbox_root=tmp_path / "sandboxes")


@pytest.fixture
async def client(app, clock):
    c = ToolClient.in_process(app, clock=clock, timeout=1.0)
    yield c
    await c.aclose()


async def _call(c: ToolClient, ep: str, step: int, name="read_file", args=None, call_index=0
                ) -> CallOutcome:
    return await c.call(ep, step=step, call_index=call_index, name=name,
                        arguments=args if args is not None else {"path": "notes.txt"})


# ---- protocol ---------------------------------------------------------------------------
async def test_tools_and_episode_lifecycle(client, app, tmp_path):
    tools = await client.tools()
    assert {t["name"] for t in tools} == set(make_tools())
    assert set(tools[0]) == {"name", "description", "parameters"}
    detail = await client.tools(detail=True)
    assert next(t for t in detail if t["name"] == "read_file")["returns"] == FILE_RETURNS
    info = await client.open_episode("ep", seed=3, faults="rate_limit=0.1", tools=["read_file",
                                                                                     "write_file"])
    assert info["faults"] == "rate_limit=0.1"
    with pytest.raises(ToolClientError, match="409"):
        await client.open_episode("ep")
    r = await client.http.post("/v1/episodes", json={"episode_id": "x", "faults": "rate_limt=1"})
    assert r.status_code == 422 and "did you mean 'rate_limit'" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="rate_limt"):   # FaultSpecError, before any request
        await client.open_episode("x", faults="rate_limt=1")
    out = await _call(client, "ep", 0, "write_file", {"path": "a/b.txt", "content": "hi"})
    assert out.ok and out.result["size_bytes"] == 2
    sandbox = app.server.episodes["ep"].ctx.sandbox
    assert (sandbox / "a" / "b.txt").read_text() == "hi"
    assert sandbox.parent == tmp_path / "sandboxes"
    out = await _call(client, "ep", 1, "get_weather", {"city": "Oslo"})   # not offered here
    assert out.triage == "policy_error" and out.status == 404 and "unknown_tool" in out.error
    assert type(out.fault) is UnknownTool and out.fault.detail == "unknown_tool"
    await client.close_episode("ep")
    assert not sandbox.exists() and "ep" not in app.server.episodes
    with pytest.raises(ToolClientError, match="unknown_episode|no open episode"):
        await _call(client, "ep", 2)


async def test_policy_errors_are_classified_and_never_retried(client):
    await client.open_episode("ep", seed=1)
    out = await _call(client, "ep", 0, "get_weather", {})
    assert (out.triage, out.attempts, out.status) == ("policy_error", 1, 422)
    assert type(out.fault) is InvalidArguments and out.fault_kind is None
    assert "city" in out.error and "missing required argument" in out.error
    out = await _call(client, "ep", 1, "get_weather", {"city": "Oslo", "units": "kelvin"})
    assert type(out.fault) is InvalidArguments and "units" in out.error and "kelvin" in out.error
    out = await _call(client, "ep", 2, "get_weather", {"city": "Oslo", "zip": 1})
    assert type(out.fault) is InvalidArguments and "zip" in out.error
    out = await _call(client, "ep", 3, "get_weather", {"city": "Atlantis"})   # the tool's ToolError
    assert type(out.fault) is PolicyError and out.error.startswith("not_found")
    assert out.fault.detail == "not_found"
    out = await _call(client, "ep", 4, "no_such_tool", {})
    assert type(out.fault) is UnknownTool and out.status == 404
    out = await _call(client, "ep", 5, "read_file", {"path": "../../etc/passwd"})
    assert type(out.fault) is PolicyError and "forbidden_path" in out.error
    out = await _call(client, "ep", 6, "get_weather", {"city": "Oslo"})
    assert out.ok and out.result == {"city": "Oslo", "temp_c": 11, "units": "metric"}
    assert client.ledger.reconcile("ep").exact
    assert client.ledger.totals("ep").policy_errors == 6
    # what the ledger recorded for each attempt is what the exception carried
    assert [(e.triage, e.status, e.detail) for e in client.ledger.observed("ep")][:6] == [
        ("policy_error", 422, "invalid_arguments")] * 3 + [
        ("policy_error", 422, "not_found"), ("policy_error", 404, "unknown_tool"),
        ("policy_error", 422, "forbidden_path")]


async def test_handler_bug_is_a_tool_bug_not_a_fault_and_not_retried(client):
    await client.open_episode("ep", seed=1)
    out = await client.call("ep", step=0, call_index=0, name="buggy", arguments={})
    assert (out.triage, out.fault_kind, out.status, out.attempts) == ("tool_bug", None, 500, 1)
    assert type(out.fault) is ToolBug and not out.ok and out.result is None
    assert "RuntimeError: handler bug" in out.error
    rep = client.ledger.reconcile("ep")
    assert rep.exact and rep.tool_bugs == 1
    assert client.ledger.totals("ep").tool_bugs == 1


# ---- each kind, as the client sees it ---------------------------------------------------
RAW = {"x-reflrl-step": "0", "x-reflrl-call": "0", "x-reflrl-attempt": "0"}


async def test_raw_symptoms_match_a_real_client(client):
    """With the bare httpx client: the exception types / statuses a socket would give."""
    async def raw(kind: str, name="read_file"):
        ep = f"raw-{kind}"
        await client.open_episode(ep, faults=f"{kind}=1", fault_seed=5)
        return await client.http.post(f"/v1/call/{name}", json={"arguments": {"path": "x"}},
                                      headers={**RAW, "x-reflrl-episode": ep}, timeout=1.0)
    with pytest.raises(httpx.ReadError):
        await raw("connection")
    with pytest.raises(httpx.ReadTimeout):
        await raw("timeout")
    with pytest.raises(httpx.RemoteProtocolError):
        await raw("truncated")
    r = await raw("rate_limit")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert (await raw("server_error")).status_code in (500, 502, 503)
    r = await raw("malformed")
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()
    r = await raw("ip_ban")
    assert r.status_code == 403 and r.json()["error"]["type"] == "ip_banned"
    r = await raw("schema_drift")
    assert r.status_code == 200 and set(r.json()["result"]) != {"path", "content", "size_bytes"}
    t0 = client.clock.monotonic()
    r = await raw("latency")
    assert r.status_code == 200 and client.clock.monotonic() - t0 == pytest.approx(0.5)


@pytest.mark.parametrize("kind", KIND_NAMES)
async def test_each_kind_is_observed_as_itself(client, kind):
    await client.open_episode("ep", faults=f"{kind}=1", fault_seed=11)
    client.retry = RetryPolicy.no_retry()
    out = await _call(client, "ep", 0)
    if kind == "latency":
        assert out.ok and [e.kind for e in out.events] == ["latency"]
        assert out.elapsed_s == pytest.approx(0.5)
    else:
        assert (out.triage, out.fault_kind, out.attempts) == ("env_fault", kind, 1)
        assert type(out.fault) is FAULTS[kind] and out.fault.kind == kind
        assert out.fault.__traceback__ is None        # a record, keeping no frames alive
        (ev,) = client.ledger.observed("ep")          # the ledger recorded what it carried
        assert (ev.triage, ev.kind, ev.status, ev.detail) == (
            "env_fault", kind, out.fault.status, out.fault.detail)
    rep = client.ledger.reconcile("ep")
    assert rep.exact and rep.per_kind[kind].matched == 1, rep.format()


async def test_file_only_and_undetectable_kinds(client):
    # invalid_file does not touch a non-file tool; nothing injected, nothing recorded
    await client.open_episode("a", faults="invalid_file=1")
    out = await _call(client, "a", 0, "get_weather", {"city": "Oslo"})
    assert out.ok and not client.ledger.injected("a")
    # drift on a tool without a returns schema: delivered as ok data, counted undetected
    await client.open_episode("b", faults="schema_drift=1")
    out = await _call(client, "b", 0, "get_weather", {"city": "Oslo"})
    assert out.ok and set(out.result) != {"city", "temp_c", "units"}
    rep = client.ledger.reconcile("b")
    assert rep.exact and rep.per_kind["schema_drift"].undetected == 1
    # a client that skips returns-validation sees the drift as ok too
    client.validate_returns = False
    client._returns = None
    await client.open_episode("c", faults="schema_drift=1")
    assert (await _call(client, "c", 0)).ok
    assert client.ledger.reconcile("c").per_kind["schema_drift"].undetected == 1


async def test_post_dispatch_faults_ran_the_tool(client, app):
    await client.open_episode("ep", faults="truncated=1")
    client.retry = RetryPolicy.no_retry()
    out = await _call(client, "ep", 0, "write_file", {"path": "f.txt", "content": "x"})
    assert out.fault_kind == "truncated"
    assert app.server.episodes["ep"].ctx.state["writes"] == 1   # the side effect happened


# ---- retry policy -----------------------------------------------------------------------
async def test_retry_after_is_honoured_on_the_virtual_clock(client, clock):
    client.retry = RetryPolicy(max_attempts=3, base_s=0.1, jitter=0.0)
    await client.open_episode("ep", faults="rate_limit=1:2s")
    out = await _call(client, "ep", 0)
    assert (out.triage, out.fault_kind, out.attempts) == ("env_fault", "rate_limit", 3)
    assert clock.sleeps == [2.0, 2.0]
    assert out.elapsed_s == pytest.approx(4.0)
    # Retry-After is whole seconds: 300ms is announced as 1 s
    clock.sleeps.clear()
    await client.open_episode("ep2", faults="rate_limit=1:300ms")
    await _call(client, "ep2", 0)
    assert clock.sleeps == [1.0, 1.0]
    # a time budget stops the retries before a wait that would overrun it
    clock.sleeps.clear()
    client.retry = RetryPolicy(max_attempts=10, base_s=0.1, jitter=0.0, budget_s=3.0)
    await client.open_episode("ep3", faults="rate_limit=1:2s")
    out = await _call(client, "ep3", 0)
    assert out.attempts == 2 and clock.sleeps == [2.0]
    # a Retry-After beyond max_retry_after_s is not waited for
    clock.sleeps.clear()
    client.retry = RetryPolicy(max_attempts=10, max_retry_after_s=5)
    await client.open_episode("ep4", faults="rate_limit=1:10s")
    out = await _call(client, "ep4", 0)
    assert out.attempts == 1 and clock.sleeps == []


async def test_backoff_is_capped_exponential(client, clock):
    client.retry = RetryPolicy(max_attempts=6, base_s=0.5, cap_s=2.0, jitter=0.0)
    await client.open_episode("ep", faults="server_error=1")
    out = await _call(client, "ep", 0)
    assert out.attempts == 6 and type(out.fault) is ServerError and out.fault.status >= 500
    assert clock.sleeps == [0.5, 1.0, 2.0, 2.0, 2.0]


# ---- the composed tenacity policy, driven by scripted attempts (no server) ------------------
async def _drive(policy: RetryPolicy, faults: list, *, clock=None, attempt_s: float = 0.0,
                 key=("ep", 0, 0)):
    """Run ``policy.retrying`` over attempts that raise ``faults`` in turn (then return "ok"),
    each taking ``attempt_s`` on the clock: (result or the exception raised, attempts, sleeps)."""
    clock = clock or VirtualClock()
    todo, n = list(faults), 0

    async def attempt():
        nonlocal n
        n += 1
        clock.advance(attempt_s)
        if todo:
            raise todo.pop(0)
        return "ok"

    try:
        res = await policy.retrying(clock, start=clock.monotonic(), key=key)(attempt)
    except Exception as e:  # noqa: BLE001 - the test looks at what came out
        res = e
    return res, n, clock.sleeps


def _one_of_each() -> list[ToolCallError]:
    return [cls(f"a {cls.__name__}") for cls in (*FAULTS.values(), PolicyError, UnknownTool,
                                                  InvalidArguments, ToolBug)]


@pytest.mark.parametrize("rotate", [True, False])
async def test_retry_is_decided_by_exception_type(rotate):
    pol = RetryPolicy(max_attempts=3, base_s=0.0, rotate_identity_on_ban=rotate)
    for fault in _one_of_each():
        res, n, _ = await _drive(pol, [fault])
        retried = (isinstance(fault, ToolFault) and KINDS[fault.kind].retryable
                   and (rotate or not isinstance(fault, Banned)))
        assert (res, n) == (("ok", 2) if retried else (fault, 1)), type(fault).__name__
    # the retryable kinds are the fault kinds' own (defined once, in reflrl.faults.kinds)
    assert {c.kind for c in retryable_faults()} == {k for k, v in KINDS.items() if v.retryable}
    # not a tool outcome: a client bug goes straight to the caller
    bug = ToolClientError("HTTP 400: bad header")
    assert await _drive(pol, [bug]) == (bug, 1, [])


async def test_giving_up_re_raises_the_last_fault():
    last = ServerError("HTTP 503: third", status=503, detail="503")
    res, n, sleeps = await _drive(RetryPolicy(max_attempts=3, base_s=0.5, jitter=0.0),
                                  [ServerError("first"), ToolTimeout("second"), last])
    assert (res, n, sleeps) == (last, 3, [0.5, 1.0])


async def test_retry_after_is_a_minimum_and_too_long_gives_up():
    pol = RetryPolicy(max_attempts=4, base_s=0.5, jitter=0.0, max_retry_after_s=5.0)
    res, n, sleeps = await _drive(pol, [RateLimited("429", retry_after=2.0),
                                        RateLimited("429", retry_after=0.1), ServerError("x")])
    assert (res, n, sleeps) == ("ok", 4, [2.0, 1.0, 2.0])  # max(Retry-After, backoff)
    assert (await _drive(pol, [RateLimited("429", retry_after=5.0)]))[1:] == (2, [5.0])
    too_long = RateLimited("429", retry_after=5.01)
    assert await _drive(pol, [too_long]) == (too_long, 1, [])   # not waited for: given up
    # ... even when the time budget is unlimited
    assert await _drive(RetryPolicy(budget_s=math.inf, max_retry_after_s=5.0),
                        [too_long]) == (too_long, 1, [])


async def test_time_budget_is_on_the_injected_clock():
    """Elapsed time includes the attempts themselves (1 s each here, on a VirtualClock: no real
    wait); retrying stops before a wait that would end past the budget."""
    pol = RetryPolicy(max_attempts=10, base_s=0.5, jitter=0.0, budget_s=3.0)
    faults = [ToolTimeout("t")] * 5
    res, n, sleeps = await _drive(pol, faults, attempt_s=1.0)
    # 1 s attempt, 0.5 s wait (1.5 <= 3), 1 s attempt, then 2.5 + 1.0 > 3: stop
    assert (type(res), n, sleeps) == (ToolTimeout, 2, [0.5])
    clock = VirtualClock(start=1000.0)            # only elapsed time on the clock counts
    assert (await _drive(pol, faults, attempt_s=1.0, clock=clock))[1:] == (2, [0.5])
    # a wait that ends exactly at the budget is still made (1 s attempt + 1 s wait = 2 s)
    assert (await _drive(RetryPolicy(max_attempts=10, base_s=1.0, jitter=0.0, budget_s=2.0),
                         faults, attempt_s=1.0))[1:] == (2, [1.0])


async def test_jitter_is_seeded_by_policy_seed_and_call_coordinates():
    faults = [ServerError("x")] * 4
    pol = RetryPolicy(max_attempts=5, jitter=1.0, seed=3, cap_s=8.0, base_s=0.5)
    _, _, waits = await _drive(pol, faults)
    assert len(waits) == 4 and len(set(waits)) == 4
    assert (await _drive(pol, faults))[2] == waits                     # a replay waits the same
    assert all(0 <= w <= min(8.0, 0.5 * 2 ** a) for a, w in enumerate(waits))
    other_seed = RetryPolicy(max_attempts=5, jitter=1.0, seed=4, cap_s=8.0, base_s=0.5)
    assert (await _drive(other_seed, faults))[2] != waits
    assert (await _drive(pol, faults, key=("ep", 1, 0)))[2] != waits    # another step
    half = RetryPolicy(max_attempts=5, jitter=0.5, seed=3, cap_s=8.0, base_s=0.5)
    assert all(0.5 * d <= w <= d for d, w in zip([0.5, 1.0, 2.0, 4.0],
                                                 (await _drive(half, faults))[2]))


async def test_recovery_is_counted(client):
    client.retry = RetryPolicy(max_attempts=8, jitter=0.0)
    await client.open_episode("ep", faults="server_error=0.5", fault_seed=2)
    outs = [await _call(client, "ep", s) for s in range(40)]
    t = client.ledger.totals("ep")
    assert t.calls == 40 and t.attempts == sum(o.attempts for o in outs)
    assert t.retries == t.attempts - t.calls > 0
    assert t.recovered == sum(o.recovered for o in outs) > 0
    assert t.given_up == sum(o.triage == "env_fault" for o in outs)
    assert client.ledger.reconcile("ep").exact


async def test_ip_ban_persists_until_the_identity_changes(client):
    client.retry = RetryPolicy(max_attempts=3, rotate_identity_on_ban=False)
    await client.open_episode("ep", faults="ip_ban=1", fault_seed=0)
    out = await _call(client, "ep", 0)
    assert out.fault_kind == "ip_ban" and out.attempts == 1   # not retried without an IP change
    await client.open_episode("ep-b", faults="ip_ban=0.2", fault_seed=0)
    outs = [await _call(client, "ep-b", s) for s in range(30)]
    first = next(i for i, o in enumerate(outs) if not o.ok)
    assert all(o.fault_kind == "ip_ban" for o in outs[first:])     # banned for the episode
    causes = [e.cause for e in client.ledger.injected("ep-b")]
    assert causes[0] == "draw" and set(causes[1:]) == {"ban"}
    assert client.ledger.reconcile("ep-b").exact
    # with identity rotation the ban is lifted by retrying from a new identity
    client.retry = RetryPolicy(max_attempts=3, rotate_identity_on_ban=True)
    await client.open_episode("ep-c", faults="ip_ban=0.2", fault_seed=0)
    outs = [await _call(client, "ep-c", s) for s in range(30)]
    assert sum(o.ok for o in outs) >= 28 and any(o.recovered for o in outs)
    assert client.current_identity("ep-c") != client.identity


# ---- determinism ------------------------------------------------------------------------
async def _run_episode(seed: int, tmp_path: Path) -> list[tuple]:
    clock = VirtualClock()
    app = create_app(make_tools(), sandbox_root=tmp_path / f"s{seed}")
    c = ToolClient.in_process(app, clock=clock, timeout=1.0)
    await c.open_episode("ep", seed=1, faults=",".join(f"{k}=0.08" for k in KIND_NAMES),
                         fault_seed=seed)
    outs = [await _call(c, "ep", s) for s in range(30)]
    await c.aclose()
    inj = [(e.key, e.kind, e.status, e.detail) for e in c.ledger.injected("ep")]
    obs = [(e.key, e.triage, e.kind, e.status, e.detail) for e in c.ledger.observed("ep")]
    res = [(o.triage, o.attempts, repr(o.result)) for o in outs]
    return [inj, obs, res, clock.now]


async def test_same_seed_replays_identically(tmp_path):
    a = await _run_episode(4, tmp_path)
    b = await _run_episode(4, tmp_path)
    c = await _run_episode(5, tmp_path)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]


# ---- the acceptance run -----------------------------------------------------------------
async def test_ten_thousand_calls_frequencies_and_exact_reconciliation(tmp_path):
    """Every per-attempt kind at 5%, 10,000 single-attempt calls over 100 episodes: each kind's observed
    frequency is within 3 standard errors of 5% and the ledger reconciles exactly (the API changes,
    sticky per episode and tool, have their own test: tests/test_api_changes.py)."""
    clock = VirtualClock()
    app = create_app(make_tools(), sandbox_root=tmp_path / "s")
    c = ToolClient.in_process(app, clock=clock, timeout=1.0, retry=RetryPolicy.no_retry())
    spec = ",".join(f"{k}=0.05" for k in ATTEMPT_KINDS)
    n_eps, per_ep = 100, 100
    for e in range(n_eps):
        ep = f"ep{e}"
        await c.open_episode(ep, seed=e, faults=spec, fault_seed=1000 + e)
        for s in range(per_ep):
            await _call(c, ep, s)
        await c.close_episode(ep)
    n = n_eps * per_ep
    rep = c.ledger.reconcile()
    assert rep.exact, rep.format()
    assert rep.attempts == n
    se = math.sqrt(0.05 * 0.95 / n)
    for kind in ATTEMPT_KINDS:
        k = rep.per_kind[kind]
        assert k.injected == k.matched == k.observed, (kind, k)
        assert abs(k.observed / n - 0.05) < 3 * se, (kind, k.observed)
    t = c.ledger.totals()
    assert t.calls == n and t.attempts == n and t.retries == 0
    assert sum(t.faults_by_kind.values()) == sum(rep.per_kind[k].observed for k in ATTEMPT_KINDS
                                                 if k != "latency")


async def test_mixed_plan_with_retries_reconciles(tmp_path):
    clock = VirtualClock()
    app = create_app(make_tools(), sandbox_root=tmp_path / "s")
    c = ToolClient.in_process(app, clock=clock, timeout=1.0, retry=RetryPolicy(max_attempts=4))
    await c.open_episode("ep", faults=",".join(f"{k}=0.05" for k in KIND_NAMES), fault_seed=9)
    outs = [await _call(c, "ep", s, call_index=s % 3) for s in range(600)]
    rep = c.ledger.reconcile()
    assert rep.exact, rep.format()
    t = c.ledger.totals()
    assert t.attempts == sum(o.attempts for o in outs) > 600
    assert t.recovered > 0 and t.recovered + t.given_up <= t.calls
    assert sum(o.ok for o in outs) + t.given_up == 600


# ---- classification: the table in the client's docstring ----------------------------------
def _err(etype: str) -> bytes:
    return b'{"error": {"type": "%s", "message": "m"}}' % etype.encode()


RETURNS = {"type": "object", "required": ["a"]}
RESPONSES = [  # (status, headers, body, the exception raised, its status and detail)
    (429, {"retry-after": "2"}, b"", RateLimited, 429, "retry_after=2.0"),
    (500, {}, _err("tool_bug"), ToolBug, 500, "tool_bug"),
    (500, {}, _err("internal_error"), ServerError, 500, "500"),
    (502, {}, b"<html>", ServerError, 502, "502"),
    (503, {}, b"", ServerError, 503, "503"),
    (504, {}, b"", ToolTimeout, 504, "504"),
    (408, {}, b"", ToolTimeout, 408, "408"),
    (200, {}, b"{not json", MalformedBody, 200, "invalid JSON body"),
    (200, {}, b'{"other": 1}', MalformedBody, 200, "JSON without 'result'"),
    (403, {}, _err("ip_banned"), Banned, 403, "ip_banned"),
    (404, {}, _err("file_missing"), InvalidFile, 404, "file_missing"),
    (200, {}, b'{"result": "a\\u0000b"}', InvalidFile, 200, "corrupt content"),
    (200, {}, b'{"result": {"b": 1}}', SchemaDrift, 200, "'a' is a required property"),
    (404, {}, _err("unknown_tool"), UnknownTool, 404, "unknown_tool"),
    (422, {}, _err("invalid_arguments"), InvalidArguments, 422, "invalid_arguments"),
    (422, {}, _err("not_found"), PolicyError, 422, "not_found"),
    (409, {}, b"", PolicyError, 409, "409"),
]


@pytest.mark.parametrize("status,headers,body,cls,st_,detail", RESPONSES)
def test_each_response_raises_its_exception(status, headers, body, cls, st_, detail):
    with pytest.raises(ToolCallError) as ei:
        classify_response(status, headers, body, RETURNS)
    e = ei.value
    assert (type(e), e.status, e.detail) == (cls, st_, detail)
    assert e.triage == {ToolFault: "env_fault", PolicyError: "policy_error",
                        ToolBug: "tool_bug"}[next(b for b in cls.__mro__
                                                  if b in (ToolFault, PolicyError, ToolBug))]
    assert e.retry_after == (2.0 if cls is RateLimited else None)


def test_transport_exceptions_and_client_bugs():
    req = httpx.Request("POST", "http://x/v1/call/t")
    for exc, cls in [(httpx.ReadTimeout("t", request=req), ToolTimeout),
                     (httpx.ConnectTimeout("t", request=req), ToolTimeout),
                     (httpx.ReadError("reset", request=req), ConnectionReset),
                     (httpx.ConnectError("refused", request=req), ConnectionReset),
                     (ConnectionResetError(104, "reset"), ConnectionReset),
                     (httpx.RemoteProtocolError("short", request=req), TruncatedBody),
                     (httpx.DecodingError("gzip", request=req), MalformedBody)]:
        fault = classify_exception(exc)
        assert type(fault) is cls and fault.__cause__ is exc and fault.status is None
        assert fault.detail == type(exc).__name__
    with pytest.raises(KeyError):                   # not a transport error: re-raised as is
        classify_exception(KeyError("x"))
    for status, body in [(400, _err("bad_request")), (404, _err("unknown_episode"))]:
        with pytest.raises(ToolClientError, match=str(status)):
            classify_response(status, {}, body)
    assert classify_response(200, {}, b'{"result": {"a": 1}}', RETURNS) == {"a": 1}
    assert classify_response(200, {}, b'{"result": {"b": 1}}') == {"b": 1}   # no schema known


def test_the_taxonomy_covers_every_fault_kind_once():
    assert set(FAULTS) == set(KIND_NAMES) - {"latency"}   # a slow answer is an answer
    assert all(issubclass(c, ToolFault) and c.triage == "env_fault" for c in FAULTS.values())
    assert issubclass(TruncatedBody, ToolCallError) and not issubclass(ToolClientError,
                                                                         ToolCallError)
    assert (PolicyError.kind, ToolBug.kind) == (None, None)
    for kind in ("rate_limit", "rate_limt"):    # one class per kind, and only real kinds
        with pytest.raises(TypeError, match=kind):
            type("Again", (ToolFault,), {}, kind=kind)


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0 and parse_retry_after("x") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after("-1") is None and parse_retry_after("nan") is None
    assert FaultPlan.parse(str(FaultPlan.parse("latency=1:2s"))).entry("latency").param == 2.0


@settings(max_examples=300, deadline=None)
@given(status=st.integers(100, 599), body=st.binary(max_size=80) | st.sampled_from(
    [b'{"result": {"a": 1}}', b'{"error": {"type": "unknown_episode"}}', b'{"result": "\\u0000"}',
     b'{"error": "x"}', b"[]", b"null", b'{"error": {"type": "tool_bug"}}']),
       retry_after=st.none() | st.text(max_size=12))
def test_fuzz_classification_never_crashes(status, body, retry_after):
    headers = {} if retry_after is None else {"retry-after": retry_after}
    try:
        classify_response(status, headers, body)
    except ToolClientError:
        assert status in (400, 404)
    except ToolCallError as e:
        assert e.triage in ("env_fault", "policy_error", "tool_bug")
        assert (e.kind in KIND_NAMES) == isinstance(e, ToolFault) == (e.triage == "env_fault")
        assert e.status == status
    else:
        assert status < 400


async def test_reopening_an_episode_id_on_one_server_replays_its_faults(tmp_path):
    """A replay re-opens the same episode id on the same (long-lived) server: the server starts
    that episode's injected record afresh instead of refusing the faults as recorded twice."""
    app = create_app(make_tools(), sandbox_root=tmp_path / "s")
    runs = []
    for _ in range(2):
        # its own client ledger, as a client of a remote server has
        c = ToolClient.in_process(app, clock=VirtualClock(), timeout=1.0, ledger=Ledger())
        await c.open_episode("ep", seed=1, faults="rate_limit=0.3,server_error=0.3", fault_seed=7)
        outs = [await _call(c, "ep", s) for s in range(12)]
        await c.close_episode("ep")
        await c.aclose()
        runs.append(([(o.triage, o.attempts) for o in outs],
                     [(e.key, e.kind) for e in c.ledger.injected("ep")]))  # fetched before DELETE
        assert not app.server.ledger.injected("ep")  # the server freed them with the episode
    assert runs[0] == runs[1]
    assert runs[0][1], "the plan injected faults"
