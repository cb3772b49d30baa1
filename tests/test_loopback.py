"""Faults through a real socket: uvicorn on 127.0.0.1 (a thread, and `python -m reflrl.envs.loopback`
in a subprocess) and a real httpx client. The client's read timeout is kept small (0.3 s)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from reflrl.envs.client import RetryPolicy, ToolClient
from reflrl.envs.errors import ToolFault
from reflrl.envs.loopback import ServerThread
from reflrl.envs.tool_server import create_app
from reflrl.envs.tools.base import ToolSpec

READ_TIMEOUT = 0.3


def _lookup(args, ctx):
    return {"key": args["key"], "value": f"v-{args['key']}-{ctx.seed}", "hits": 3}


TOOLS = {"lookup": ToolSpec(
    "lookup", "misc", "Look a key up.",
    {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}, _lookup,
    returns={"type": "object", "required": ["key", "value", "hits"],
             "properties": {"key": {"type": "string"}, "value": {"type": "string"},
                            "hits": {"type": "integer"}}, "additionalProperties": False})}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(create_app(TOOLS, sandbox_root=tmp_path_factory.mktemp("sb"))) as srv:
        yield srv


def _headers(ep: str, step: int = 0) -> dict[str, str]:
    return {"x-reflrl-episode": ep, "x-reflrl-step": str(step), "x-reflrl-call": "0",
            "x-reflrl-attempt": "0", "x-reflrl-client": "test"}


async def _raw(http: httpx.AsyncClient, ep: str, spec: str) -> httpx.Response:
    r = await http.post("/v1/episodes", json={"episode_id": ep, "faults": spec, "fault_seed": 1})
    assert r.status_code == 201, r.text
    return await http.post("/v1/call/lookup", json={"arguments": {"key": "k"}},
                           headers=_headers(ep), timeout=READ_TIMEOUT)


async def test_reset_timeout_and_truncation_through_a_real_socket(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.get("/v1/tools")
        assert r.status_code == 200 and r.json()["tools"][0]["name"] == "lookup"
        with pytest.raises(httpx.ReadError) as ei:          # TCP RST from SO_LINGER 0 + abort
            await _raw(http, "lb-reset", "connection=1")
        assert "reset" in str(ei.value).lower() or ei.value.__cause__ is not None
        with pytest.raises(httpx.ReadTimeout):
            await _raw(http, "lb-timeout", "timeout=1")
        with pytest.raises(httpx.RemoteProtocolError):
            await _raw(http, "lb-trunc", "truncated=1")
        r = await _raw(http, "lb-429", "rate_limit=1:2s")
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        r = await _raw(http, "lb-ok", "none")
        assert r.status_code == 200 and r.json()["result"]["value"] == "v-k-0"
        # the server's ledger lists what it injected, for reconciliation over the wire
        r = await http.get("/v1/ledger", params={"episode": "lb-reset"})
        assert [e["kind"] for e in r.json()["events"]] == ["connection"]


async def test_client_retries_and_reconciles_over_loopback(server):
    client = ToolClient.connect(server.url, timeout=0.5,  # a loaded CPU must not add timeouts
                                retry=RetryPolicy(max_attempts=3, base_s=0.001, cap_s=0.002))
    async with client:
        spec = ("connection=0.15,timeout=0.08:5s,truncated=0.1,malformed=0.1,server_error=0.1,"
                "schema_drift=0.1,ip_ban=0.05")
        await client.open_episode("lb-mixed", seed=2, faults=spec, fault_seed=3)
        outs = [await client.call("lb-mixed", step=s, call_index=0, name="lookup",
                                  arguments={"key": str(s)}) for s in range(24)]
        await client.close_episode("lb-mixed")            # fetches GET /v1/ledger first
    kinds = {e.kind for o in outs for e in o.events}
    assert {"connection", "timeout"} <= kinds, kinds
    given_up = [o for o in outs if not o.ok]
    assert given_up and all(isinstance(o.fault, ToolFault) for o in given_up)
    # the fault that ended a call is the one its last attempt observed
    assert all(o.fault.kind == o.events[-1].kind and o.attempts == o.events[-1].attempt + 1
               for o in given_up)
    rep = client.ledger.reconcile("lb-mixed")
    assert rep.exact, rep.format()
    t = client.ledger.totals("lb-mixed")
    assert t.attempts == sum(o.attempts for o in outs) and t.retries > 0 and t.recovered > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_module_in_a_subprocess(tmp_path):
    """`python -m reflrl.envs.loopback --port P --seed S` (what `reflrl tools serve` runs)."""
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflrl.envs.loopback", "--port", str(port), "--seed", "3",
         "--sandbox-root", str(tmp_path / "sb"), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    r = await http.get("/v1/health", timeout=1.0)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
            r = await http.post("/v1/episodes", json={"episode_id": "sp", "faults": "connection=1"})
            assert r.status_code == 201
            with pytest.raises(httpx.ReadError):
                await http.post("/v1/call/any_tool", json={"arguments": {}},
                                headers=_headers("sp"), timeout=READ_TIMEOUT)
            r = await http.post("/v1/episodes", json={"episode_id": "st", "faults": "timeout=1"})
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/call/any_tool", json={"arguments": {}},
                                headers=_headers("st"), timeout=READ_TIMEOUT)
            events = [e for ep in ("sp", "st")
                      for e in (await http.get(f"/v1/episodes/{ep}/ledger")).json()["events"]]
            assert sorted(e["kind"] for e in events) == ["connection", "timeout"]
            assert (await http.delete("/v1/episodes/sp")).status_code == 204
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=15)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0].decode()
    assert f"http://127.0.0.1:{port}" in out
    assert not (tmp_path / "sb").exists() or not any((tmp_path / "sb").iterdir())
