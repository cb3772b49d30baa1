"""API evolution as faults (``param_renamed``, ``tool_moved``): sticky per (fault seed, episode, tool),
400 / 410 naming the new name, the adapted call served and scored as the gold call, the ledger, the
rule critic, and the fault proxy in front of a real upstream."""
from __future__ import annotations

import json

import gymnasium
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import reflrl.envs
from reflrl.critic.rule import RuleCritic
from reflrl.critic.base import CritiqueRequest
from reflrl.critic.format import fault_critique
from reflrl.envs.client import RetryPolicy, ToolClient
from reflrl.envs.clock import VirtualClock
from reflrl.envs.errors import ParamRenamed, ToolMoved
from reflrl.envs.loopback import ServerThread
from reflrl.envs.parsing import format_calls
from reflrl.envs.proxy import FaultProxy
from reflrl.envs.tool_server import create_app
from reflrl.envs.tools.catalog import build_catalog
from reflrl.envs.types import Task, ToolCall
from reflrl.faults import FaultPlan, FaultSpecError, KINDS, api_change, format_kinds_table
from reflrl.faults.evolve import moved_from
from reflrl.recovery.reflection import env_fault_from_info

CAT = build_catalog()
TOOLS = {n: CAT[n] for n in ("get_current_weather", "get_air_quality", "get_stock_quote")}
WEATHER = ToolCall("get_current_weather", {"city": "Paris"})


def _find(kind: str, tool: str = "get_current_weather", seed: int = 0, start: int = 0) -> str:
    """An episode id whose change of ``tool`` under ``kind=0.5`` is of ``kind`` (the draw is seeded)."""
    plan = FaultPlan.parse(f"{kind}=0.5")
    params = ["city"] if tool == "get_current_weather" else ["symbol"]
    for i in range(start, start + 500):
        ch = api_change(plan, seed, f"ep{i}", tool, params)
        if ch is not None and ch.kind == kind:
            return f"ep{i}"
    raise AssertionError("no episode with that change")


async def _client(tmp_path, **kw):
    app = create_app(dict(TOOLS), sandbox_root=tmp_path / "s")
    return ToolClient.in_process(app, clock=VirtualClock(), retry=RetryPolicy(max_attempts=3), **kw)


# ---- the decision -----------------------------------------------------------------------------
def test_a_change_is_sticky_per_episode_and_tool_and_replays_the_same():
    plan = FaultPlan.parse("param_renamed=0.3,tool_moved=0.2")
    got = [api_change(plan, 7, f"ep{i}", t, ["city", "units"]) for i in range(300) for t in ("a", "b")]
    again = [api_change(plan, 7, f"ep{i}", t, ["units", "city"]) for i in range(300) for t in ("a", "b")]
    assert got == again                                      # pure; the order of params does not matter
    assert got != [api_change(plan, 8, f"ep{i}", t, ["city", "units"]) for i in range(300) for t in ("a", "b")]
    kinds = [c.kind if c else None for c in got]
    assert 0.2 < kinds.count("param_renamed") / 600 < 0.4 and 0.12 < kinds.count("tool_moved") / 600 < 0.28
    renamed = {c.new for c in got if c and c.kind == "param_renamed"}
    successors = {c.new for c in got if c and c.kind == "tool_moved"}
    assert len(renamed) >= 5 and len(successors) >= 4      # drawn from pools: no one fixed new name
    assert all(c.new not in ("city", "units") for c in got if c and c.kind == "param_renamed")
    for i in range(300):                                     # a successor leads back to its tool
        c = api_change(plan, 7, f"ep{i}", "a", ["city"])
        assert moved_from(plan, 7, f"ep{i}", "a_v2") == ("a" if c and c.new == "a_v2" else None)
        if c and c.kind == "tool_moved":
            assert moved_from(plan, 7, f"ep{i}", c.new) == "a"
    # the API changes are apart from the per-attempt draw: their own sum <= 1
    assert FaultPlan.parse("rate_limit=0.9,param_renamed=0.6,tool_moved=0.4").total == pytest.approx(0.9)
    scaled = FaultPlan.parse("rate_limit=0.2,param_renamed=0.3").scaled(4, cap=0.5)   # each capped on its own
    assert scaled.prob("rate_limit") == pytest.approx(0.5) and scaled.prob("param_renamed") == pytest.approx(0.5)
    with pytest.raises(FaultSpecError, match="API-change"):
        FaultPlan.parse("param_renamed=0.6,tool_moved=0.5")
    assert KINDS["param_renamed"].sticky and not KINDS["param_renamed"].retryable
    assert "sticky" in format_kinds_table() and "tool_moved" in format_kinds_table()


# ---- server and client ------------------------------------------------------------------------
async def test_old_name_gets_400_naming_the_new_one_and_the_new_name_is_served(tmp_path):
    c = await _client(tmp_path)
    clean = await _client(tmp_path / "clean")
    ep = _find("param_renamed")
    await c.open_episode(ep, seed=1, faults="param_renamed=0.5", fault_seed=0)
    await clean.open_episode(ep, seed=1)
    out = await c.call(ep, step=0, call_index=0, name="get_current_weather", arguments={"city": "Paris"})
    assert out.triage == "env_fault" and out.fault_kind == "param_renamed" and out.attempts == 1  # never retried
    assert isinstance(out.fault, ParamRenamed) and out.status == 400
    new = out.fault.new_param
    assert out.fault.param == "city" and new and new != "city"
    assert f"'city'" in out.fault.observation() and f"'{new}'" in out.fault.observation()
    again = await c.call(ep, step=1, call_index=0, name="get_current_weather", arguments={"city": "Paris"})
    assert again.fault_kind == "param_renamed" and again.fault.new_param == new   # sticky
    adapted = await c.call(ep, step=2, call_index=0, name="get_current_weather", arguments={new: "Paris"})
    want = await clean.call(ep, step=0, call_index=0, name="get_current_weather", arguments={"city": "Paris"})
    assert adapted.ok and adapted.result == want.result                      # served as the old call
    other = await c.call(ep, step=3, call_index=0, name="get_stock_quote", arguments={"symbol": "AAPL"})
    assert other.ok or other.fault_kind in (None, "param_renamed", "tool_moved")
    # the ledger records each refused attempt and reconciles with what the client saw
    rep = c.ledger.reconcile(ep)
    assert rep.exact, rep.format()
    assert rep.per_kind["param_renamed"].matched >= 2
    # the new name in an episode without the change is an unknown argument (the schema forbids it)
    plain = await clean.call(ep, step=1, call_index=0, name="get_current_weather",
                             arguments={"city": "Paris", new: "Paris"})
    assert plain.triage == "policy_error" and plain.status == 422 and f"'{new}'" in str(plain.fault)
    for x in (c, clean):
        await x.aclose()


async def test_a_retired_tool_gets_410_naming_its_successor_which_is_served(tmp_path):
    c = await _client(tmp_path)
    clean = await _client(tmp_path / "clean")
    ep = _find("tool_moved")
    await c.open_episode(ep, seed=1, faults="tool_moved=0.5", fault_seed=0)
    await clean.open_episode(ep, seed=1)
    out = await c.call(ep, step=0, call_index=0, name="get_current_weather", arguments={"city": "Paris"})
    assert isinstance(out.fault, ToolMoved) and out.status == 410 and out.attempts == 1
    succ = out.fault.successor
    assert succ and succ != "get_current_weather" and succ not in TOOLS
    assert succ in out.fault.observation() and "retired" in out.fault.observation()
    served = await c.call(ep, step=1, call_index=0, name=succ, arguments={"city": "Paris"})
    want = await clean.call(ep, step=0, call_index=0, name="get_current_weather", arguments={"city": "Paris"})
    assert served.ok and served.result == want.result
    # the successor name in an episode without the move is an unknown tool (404)
    unknown = await clean.call(ep, step=1, call_index=0, name=succ, arguments={"city": "Paris"})
    assert unknown.triage == "policy_error" and unknown.status == 404
    rep = c.ledger.reconcile(ep)
    assert rep.exact and rep.per_kind["tool_moved"].matched == 1, rep.format()
    (inj,) = c.ledger.injected(ep)
    assert (inj.kind, inj.status, inj.cause) == ("tool_moved", 410, "change")
    for x in (c, clean):
        await x.aclose()


# ---- the env: scoring and attribution ---------------------------------------------------------
def _task():
    return Task("w1", "What's the weather in Paris?", [CAT["get_current_weather"].schema()], [[WEATHER]])


def _env_seed(kind: str, **kw) -> int:
    """An env seed whose first episode meets ``kind`` on get_current_weather."""
    for seed in range(300):
        env = _env(kind, **kw)
        try:
            env.reset(seed=seed)
            _o, _r, _t, _tr, info = env.step(format_calls([WEATHER], "hermes"))
            if info["api_changes"] and info["api_changes"][0]["kind"] == kind:
                return seed
        finally:
            env.close()
    raise AssertionError("no seed")


def _env(kind: str, **kw):
    kw.setdefault("fault_exposure", "policy")
    return gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=[_task()], faults=f"{kind}=0.5", **kw).unwrapped


@pytest.mark.parametrize("kind", ["param_renamed", "tool_moved"])
def test_an_adapted_call_scores_as_gold_and_an_unadapted_one_is_change_caused(kind):
    seed = _env_seed(kind)
    env = _env(kind)
    try:
        env.reset(seed=seed)
        _o, r0, term, _tr, info = env.step(format_calls([WEATHER], "hermes"))
        assert not term and r0 == 0.0 and info["env_fault_treatment"] == "to-policy"
        [ch] = info["api_changes"]
        assert set(ch) == {"kind", "tool", "param", "new", "step", "adapted"}
        assert ch["kind"] == kind and ch["tool"] == "get_current_weather" and ch["step"] == 0
        assert not ch["adapted"] and ch["param"] == ("city" if kind == "param_renamed" else None)
        [f] = info["shown_faults"]
        assert f["new"] == ch["new"] and ch["new"] in f["observation"]
        tool_msg = json.loads(info["messages"][-1]["content"])
        assert ch["new"] in tool_msg["error"]                        # the policy can read the new name
        assert info["change_caused"] is False and info["change_recoverable"] is False
        adapted = (ToolCall("get_current_weather", {ch["new"]: "Paris"}) if kind == "param_renamed"
                   else ToolCall(ch["new"], {"city": "Paris"}))
        _o, r1, term, _tr, info = env.step(format_calls([adapted], "hermes"))
        assert term and r1 == 1.0 and info["correct"] and not info["masked"]
        assert info["api_changes"][0]["adapted"] is True and not info["open_faults"]
        assert info["change_recoverable"] is True and info["change_caused"] is False
        # the same episode, unadapted: the policy stops; the answer at the change, adapted, was right
        env.reset(seed=seed)
        env.step(format_calls([WEATHER], "hermes"))
        _o, r2, term, _tr, info = env.step("The weather service is unavailable.")
        assert term and r2 == 0.0 and not info["correct"] and not info["masked"]
        assert info["change_caused"] and info["fault_caused"] and info["change_recoverable"]
        assert info["api_changes"][0]["adapted"] is False
        # the rule critic names the fix from the server's record
        ef = env_fault_from_info(info)
        assert ef is not None and ef.kind == kind and ef.new == ch["new"]
        text = RuleCritic().judge(CritiqueRequest(query="What's the weather in Paris?", tools=_task().tools,
                                                  response="...", gold=[WEATHER], env_fault=ef))[1]
        if kind == "param_renamed":
            assert f"'{ch['new']}' in place of 'city'" in text
            assert f'get_current_weather({ch["new"]}="Paris")' in text
        else:
            assert "get_current_weather was retired" in text and f'{ch["new"]}(city="Paris")' in text
        # at reveal="answer" the critique also gives the adapted call in the answer format
        told = RuleCritic(reveal="answer", parser="hermes").judge(CritiqueRequest(
            query="What's the weather in Paris?", tools=_task().tools, response="...", gold=[WEATHER], env_fault=ef))[1]
        assert told.startswith(text) and " ".join(format_calls([adapted], "hermes").split()) in told
        # a model critic is not asked about an env fault: its analysis is the same description
        assert fault_critique(ef, 0.0).analysis == text
        # a replay meets the same change
        env.reset(seed=seed)
        _o, _r, _t, _tr, info = env.step(format_calls([WEATHER], "hermes"))
        assert info["api_changes"][0]["new"] == ch["new"]
        assert env.ledger.reconcile(env.episode_id).exact
    finally:
        env.close()


def test_an_episode_without_a_change_reports_none():
    env = _env("param_renamed")
    try:
        for seed in range(40):
            env.reset(seed=seed)
            _o, _r, term, _tr, info = env.step(format_calls([WEATHER], "hermes"))
            if term:
                assert info["api_changes"] == [] and info["correct"]
                assert info["change_caused"] is False and info["change_recoverable"] is False
                return
        raise AssertionError("every episode was changed")
    finally:
        env.close()


# ---- the fault proxy --------------------------------------------------------------------------
def _upstream():
    seen = []

    async def echo(request: Request):
        body = await request.json()
        seen.append((request.url.path, body))
        return JSONResponse({"path": request.url.path, "got": body})

    return Starlette(routes=[Route("/v1/weather", echo, methods=["POST"])]), seen


@pytest.mark.parametrize("kind", ["param_renamed", "tool_moved"])
def test_the_proxy_rewrites_a_json_request(kind):
    app, seen = _upstream()
    with ServerThread(app) as up:
        for seed in range(200):   # a proxy seed whose run changes POST /v1/weather by ``kind``
            ch = FaultProxy(up.url, f"{kind}=0.5", seed=seed)._lookup("x", "t").changes.change(
                "POST /v1/weather", {"city": "Paris", "units": "c"})
            if ch is not None and ch.kind == kind:
                break
        proxy = FaultProxy(up.url, f"{kind}=0.5", seed=seed)
        with ServerThread(proxy) as px, httpx.Client(base_url=px.url, timeout=5) as http:
            r = http.post("/v1/weather", json={"city": "Paris", "units": "c"})
            err = r.json()["error"]
            if kind == "param_renamed":
                assert r.status_code == 400 and err["code"] == "parameter_renamed"
                old, new = err["param"], err["new_param"]
                assert old in ("city", "units") and new not in ("city", "units")
                body = {"city": "Paris", "units": "c"}
                body[new] = body.pop(old)
                ok = http.post("/v1/weather", json=body)
                assert ok.status_code == 200 and ok.json()["got"] == {"city": "Paris", "units": "c"}
                again = http.post("/v1/weather", json={"city": "Rome", "units": "f"})
                assert again.status_code == 400 and again.json()["error"]["new_param"] == new  # sticky
            else:
                assert r.status_code == 410 and err["code"] == "tool_moved"
                succ = err["successor"]
                assert succ.startswith("POST /v1/") and succ != "POST /v1/weather"
                ok = http.post(succ.split(" ", 1)[1], json={"city": "Paris"})
                assert ok.status_code == 200 and ok.json() == {"path": "/v1/weather", "got": {"city": "Paris"}}
            assert [p for p, _ in seen] == ["/v1/weather"]           # the refused request never ran
        kinds = [e.kind for e in proxy.ledger.injected()]
        assert kinds == [kind] * (2 if kind == "param_renamed" else 1)


async def test_the_http_server_on_loopback_applies_both_changes(tmp_path):
    ep_r = _find("param_renamed")
    ep_m = _find("tool_moved", start=int(ep_r[2:]) + 1)
    with ServerThread(create_app(dict(TOOLS), sandbox_root=tmp_path / "s")) as srv:
        c = ToolClient.connect(srv.url, retry=RetryPolicy(max_attempts=3))
        try:
            await c.open_episode(ep_r, seed=1, faults="param_renamed=0.5", fault_seed=0)
            await c.open_episode(ep_m, seed=1, faults="tool_moved=0.5", fault_seed=0)
            r = await c.call(ep_r, step=0, call_index=0, name="get_current_weather", arguments={"city": "Oslo"})
            m = await c.call(ep_m, step=0, call_index=0, name="get_current_weather", arguments={"city": "Oslo"})
            assert (r.status, r.fault_kind, r.attempts) == (400, "param_renamed", 1)
            assert (m.status, m.fault_kind, m.attempts) == (410, "tool_moved", 1)
            r2 = await c.call(ep_r, step=1, call_index=0, name="get_current_weather",
                              arguments={r.fault.new_param: "Oslo"})
            m2 = await c.call(ep_m, step=1, call_index=0, name=m.fault.successor, arguments={"city": "Oslo"})
            assert r2.ok and m2.ok and r2.result == m2.result
            for ep in (ep_r, ep_m):
                await c.close_episode(ep)   # fetches the server's injected records first
                assert c.ledger.reconcile(ep).exact
            assert [e.cause for e in c.ledger.injected()] == ["change", "change"]
        finally:
            await c.aclose()


@pytest.mark.parametrize("kind", ["param_renamed", "tool_moved"])
def test_repeating_the_old_call_to_the_step_limit_is_change_caused_not_masked(kind):
    # the policy met the change, had messages left to adapt in, and sent the old call until the step budget
    # ran out: its failure (a wrong answer, change_caused), not a fault it had no message left to act on
    seed = _env_seed(kind, max_steps=3)
    env = _env(kind, max_steps=3)
    try:
        env.reset(seed=seed)
        for _ in range(3):
            _o, r, term, trunc, info = env.step(format_calls([WEATHER], "hermes"))
        assert trunc and not term and r == 0.0
        assert not info["masked"] and info["env_fault_treatment"] == "to-policy"
        assert info["change_caused"] and info["fault_caused"] and info["change_recoverable"]
    finally:
        env.close()
    # met for the first time on the last message: no message was left to act on, so it is masked
    env = _env(kind, max_steps=1)
    try:
        env.reset(seed=seed)
        _o, r, term, trunc, info = env.step(format_calls([WEATHER], "hermes"))
        assert info["masked"] and not info["change_caused"] and not info["change_recoverable"]
    finally:
        env.close()


@pytest.mark.parametrize("kind", ["param_renamed", "tool_moved"])
def test_an_episode_ended_by_the_caller_gets_its_final_attribution(kind):
    import asyncio
    seed = _env_seed(kind)
    env = _env(kind)
    try:
        # the old call twice, then the rollout's token budget ends it: the change was met at an earlier message
        env.reset(seed=seed)
        env.step(format_calls([WEATHER], "hermes"))
        env.step(format_calls([WEATHER], "hermes"))
        reward, info = asyncio.run(env.aend_episode())
        assert reward == 0.0 and info["ended_by"] == "caller" and not info["correct"]
        assert not info["masked"] and info["change_caused"] and info["change_recoverable"]
        assert (reward, info) == asyncio.run(env.aend_episode())                       # idempotent
        with pytest.raises(RuntimeError):
            env.step(format_calls([WEATHER], "hermes"))                      # the episode is over
        # ended right after the change was first met: no message was left to act on, masked
        env.reset(seed=seed)
        env.step(format_calls([WEATHER], "hermes"))
        reward, info = asyncio.run(env.aend_episode())
        assert info["masked"] and info["env_fault_treatment"] == "masked"
        assert not info["change_caused"] and not info["change_recoverable"]
    finally:
        env.close()


# ---- reflection on a change the policy did not adapt to ---------------------------------------------
def _rollout_and_recover(tmp_path, env, answer, met, critic, seeds=range(300), pooled=False):
    """A greedy scripted policy (``answer(prompt, j)``) rolled out on ``env`` from the first of ``seeds``
    whose rollout satisfies ``met``, then its recovery with ``critic``: (rollouts before recovery, after,
    the result)."""
    import asyncio
    import dataclasses

    from doubles import PooledScriptedEngine, ScriptedEngine, tiny_cfg
    from reflrl import rollout as R
    from reflrl.models import load_tokenizer
    from reflrl.envs.prompts import build_messages
    from reflrl.recovery.recover import arecover

    tok = load_tokenizer("tiny-random")
    cfg = tiny_cfg(tmp_path, **{"env.fault_exposure": "policy", "reflection.variant": "tool_rerl",
                                "reflection.critic": "rule", "reflection.group": "add"})
    spec = dataclasses.replace(R.RolloutSpec.from_config(cfg, fmt="hermes", think=False), temperature=0.0)
    engine = (PooledScriptedEngine if pooled else ScriptedEngine)(tok, answer)
    assert R.pooled(engine, spec) == pooled

    async def main():
        for s in seeds:
            trajs = await R.arollout(engine, tok, [env], [_task()], 1, spec, seed=s)
            if met(trajs[0]):
                break
        else:
            raise AssertionError("no rollout seed meets the change")
        before = list(trajs)
        res = await arecover(trajs, cfg=cfg, engine=engine, tokenizer=tok, envs=[env],
                             critic=critic, messages_of=build_messages, rollout_cfg=spec, seed=0)
        return before, trajs, res

    return asyncio.run(main())


def test_reflection_repairs_a_change_right_after_the_call_that_met_it(tmp_path):
    """A policy that repeats the old call after the 400/410 fails by the change; reflection is asked
    where the change was first met (q* holds the call at the change and the critique naming the new
    call, not the policy's repetitions), and the repair keeps that call and the tool's error, then the
    adapted call: what the policy learns on the original prompt is to read the error."""
    import re

    from reflrl.models import load_tokenizer
    from reflrl.recovery.recover import change_point

    tok = load_tokenizer("tiny-random")
    env = _env("param_renamed")
    old = format_calls([WEATHER], "hermes")

    def answer(prompt: str, _j: int) -> str:
        if "Your previous attempt had issues" in prompt:   # under q*: follow the critique's call
            m = re.search(r"call get_current_weather\((\w+)=", prompt)
            return format_calls([ToolCall("get_current_weather", {m.group(1): "Paris"})], "hermes") if m else old
        return old                                           # the policy does not read the tool's error

    try:
        [t], trajs, res = _rollout_and_recover(tmp_path, env, answer, lambda t: t.last.info.get("change_caused"),
                                               RuleCritic(reveal="call"))
        assert len(t.steps) > 2 and change_point(t) == 0      # the old call, again and again
        assert res.counts["reflected_env_fault"] == 1 and res.counts["recovered_env_fault"] == 1
        [rec] = res.records
        new = rec.final_feedback.info["api_changes"][0]["new"]
        # q* is the request's retry prompt: the call at the change and the critique naming the new call
        assert [m["role"] for m in rec.augmented_messages] == ["system", "user"]
        assert rec.attempts[0].action.strip() == old.strip()
        assert f"'{new}' in place of 'city'" in rec.attempts[0].feedback
        # tau*: the call that met the change, the tool's error, the adapted call
        repaired = trajs[-1]
        assert repaired.added and repaired.correct and repaired.repair is rec
        assert repaired.texts == [t.texts[0], rec.response_text] and new in rec.response_text
        assert repaired.steps[0] is t.steps[0] and len(repaired.steps) == 2
        start = [i for i in range(1, len(t.loss_mask)) if t.loss_mask[i] and not t.loss_mask[i - 1]][0]
        assert repaired.response_ids[:start] == t.response_ids[:start]      # call, error: as in the rollout
        assert repaired.response_ids[start:] == rec.response_ids and sum(repaired.loss_mask[:start]) > 0
        assert new in tok.decode(t.response_ids[:start])                     # the error names the new name
    finally:
        env.close()


@pytest.mark.parametrize("kind", ["param_renamed", "tool_moved"])
def test_a_policy_error_after_a_change_is_critiqued_with_the_call_the_changed_tool_takes(tmp_path, kind):
    """A wrong call (the wrong city) that met an API change is a policy error, not change-caused: the
    adapted call would be wrong too. The rule critic's expected answer is the gold call as the changed
    tool takes it, with the change named; a policy that copies the critique's answer is repaired. With
    the gold call as written in the task (the old name), the copy would meet the change again."""
    import re

    from reflrl.envs.parsing import parse

    env = _env(kind, max_steps=3)   # the recipe's: the call, and two more after the tool's error
    wrong = format_calls([ToolCall("get_current_weather", {"city": "London"})], "hermes")

    def answer(prompt: str, _j: int) -> str:
        if "Your previous attempt had issues" in prompt:   # under q*: copy the critique's expected answer
            m = re.search(r"The expected answer is: (<tool_call>.*?</tool_call>)", prompt, re.S)
            return m.group(1) if m else wrong
        return wrong

    def met(t) -> bool:
        return any(ch["kind"] == kind for ch in t.last.info.get("api_changes") or [])

    try:
        [t], trajs, res = _rollout_and_recover(tmp_path, env, answer, met, RuleCritic(reveal="answer"))
        assert not t.correct and not t.last.info.get("change_caused")
        assert res.counts["reflected_policy_error"] == 1 and res.counts["recovered_policy_error"] == 1
        [rec] = res.records
        [ch] = rec.first_feedback.info["api_changes"]
        feedback = rec.attempts[0].feedback
        assert "The API changed" in feedback and ch["new"] in feedback
        [made] = parse(rec.response_text, "hermes").calls
        if kind == "param_renamed":
            assert made == ToolCall("get_current_weather", {ch["new"]: "Paris"})
        else:
            assert made == ToolCall(ch["new"], {"city": "Paris"})
        assert trajs[-1].added and trajs[-1].correct
    finally:
        env.close()


def test_adapt_calls_is_the_inverse_of_canonical_call():
    from reflrl.critic.format import adapt_calls, describe_changes
    from reflrl.envs.tool_env import canonical_call

    changes = [{"kind": "param_renamed", "tool": "get_current_weather", "param": "city", "new": "location"},
               {"kind": "tool_moved", "tool": "get_stock_quote", "param": None, "new": "get_stock_quote_v2"}]
    stock = ToolCall("get_stock_quote", {"symbol": "AAPL"})
    other = ToolCall("get_air_quality", {"city": "Paris"})
    adapted = adapt_calls([WEATHER, stock, other], changes)
    assert adapted == [ToolCall("get_current_weather", {"location": "Paris"}),
                       ToolCall("get_stock_quote_v2", {"symbol": "AAPL"}), other]
    assert [canonical_call(changes, c) for c in adapted] == [WEATHER, stock, other]
    assert describe_changes([WEATHER], changes) == \
        "The API changed: get_current_weather now takes 'location' in place of 'city'."
    assert "retired for get_stock_quote_v2" in describe_changes([stock], changes)
    assert describe_changes([other], changes) == "" and adapt_calls([other], None) == [other]


def test_model_critics_are_shown_the_ground_truth_as_the_changed_tool_takes_it():
    from reflrl.critic.llm import LLMCritic
    from reflrl.critic.policy import PolicyCritic

    changes = [{"kind": "param_renamed", "tool": "get_current_weather", "param": "city", "new": "location"}]
    req = CritiqueRequest(query="What's the weather in Paris?", response="x", gold=[WEATHER], api_changes=changes)
    llm = LLMCritic(base_url="http://127.0.0.1:9/v1", model="m")
    shown = llm.messages(req)[-1]["content"]
    assert 'location' in shown and '"city"' not in shown and "city=" not in shown
    pol = PolicyCritic(lambda p: "Score: positive\nAnalysis: fine.", as_messages=False)
    assert "location" in pol.prompt(req)
    plain = llm.messages(CritiqueRequest(query=req.query, response="x", gold=[WEATHER]))[-1]["content"]
    assert "city" in plain and "location" not in plain


def _holds_a_change(seed: int) -> bool:
    """Whether the episode of env seed ``seed`` (``_env("param_renamed")``) has changed its tool: the gold
    call meets the change."""
    probe = _env("param_renamed", max_steps=3)
    try:
        probe.reset(seed=seed)
        return bool(probe.step(format_calls([WEATHER], "hermes"))[4]["api_changes"])
    finally:
        probe.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["fixed-batches", "continuous-batching"])
def test_the_retry_of_a_single_step_rollout_replays_its_episode_with_the_same_api_changes(tmp_path, pooled):
    """A one-step rollout's policy error is retried in its own episode again (its env seed), not in another
    episode of the task: the retry meets the API changes the failed episode had and the critique was
    written for. Here the failed episode's tool did not change, while a fresh episode of the task (the
    seed an earlier version derived from (episode seed, attempt)) would have met a change: the retry
    that copies the critique's call is right at once."""
    import re

    from reflrl.envs.seeding import derive_seed

    env = _env("param_renamed", max_steps=3)
    wrong = format_calls([ToolCall("get_current_weather", {"zzz": "Paris"})], "hermes")

    def answer(prompt: str, _j: int) -> str:
        m = re.search(r"The expected answer is: (<tool_call>.*?</tool_call>)", prompt, re.S)
        return m.group(1) if "Your previous attempt had issues" in prompt and m else wrong

    def unchanged_but_a_fresh_episode_changed(t) -> bool:
        return not _holds_a_change(t.seed) and _holds_a_change(derive_seed(t.seed, 1, bits=31))

    try:
        [t], trajs, res = _rollout_and_recover(tmp_path, env, answer, unchanged_but_a_fresh_episode_changed,
                                               RuleCritic(reveal="answer"), pooled=pooled)
        assert not t.correct and len(t.steps) == 1
        assert res.counts["reflected_policy_error"] == 1 and res.counts["recovered_policy_error"] == 1
        [rec] = res.records
        fb = rec.final_feedback
        assert fb.correct and not fb.info["api_changes"] and not fb.continuation
        assert trajs[-1].added and trajs[-1].texts == [rec.response_text]
    finally:
        env.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["fixed-batches", "continuous-batching"])
def test_a_retry_that_meets_a_change_goes_on_and_the_answer_after_the_error_follows_its_critique(tmp_path, pooled):
    """A policy error that never met its episode's change (a wrong argument name: 422) is retried in a
    replay of that episode, whose tool has changed: the retry copies the critique's call (the old name)
    and meets the 400.
    The episode goes on: the answer after the tool's error is sampled under the critique of that error
    (q*': the request, the call that met the change, the analysis naming the new call), as a repair at a
    change is. tau* is the retry, the tool's error and the adapted call, each answer with the log-probs it
    was sampled with; the error is not trained on. A policy that does not read the tool's error on its own
    (this one) is repaired all the same."""
    import re

    from reflrl.envs.parsing import parse

    env = _env("param_renamed", max_steps=3)
    wrong = format_calls([ToolCall("get_current_weather", {"zzz": "Paris"})], "hermes")
    asked: list[str] = []

    def answer(prompt: str, _j: int) -> str:
        asked.append(prompt)
        if "Your previous attempt had issues" in prompt:   # under q*: copy the critique's expected answer
            m = re.search(r"The expected answer is: (<tool_call>.*?</tool_call>)", prompt, re.S)
            return m.group(1) if m else wrong
        return wrong                                       # it never reads the tool's error

    try:
        [t], trajs, res = _rollout_and_recover(
            tmp_path, env, answer, lambda t: not t.last.info["api_changes"] and _holds_a_change(t.seed),
            RuleCritic(reveal="answer"), pooled=pooled)
        assert not t.correct and len(t.steps) == 1 and "change" not in " ".join(t.texts)
        assert res.counts["reflected_policy_error"] == 1 and res.counts["recovered_policy_error"] == 1
        [rec] = res.records
        fb = rec.final_feedback
        assert fb.correct and len(fb.continuation) == 1 and len(fb.steps) == 2
        [ch] = fb.info["api_changes"]
        assert parse(rec.response_text, "hermes").calls == [WEATHER]          # the retry: the old name
        obs, later = fb.continuation[0]
        assert parse(later.text, "hermes").calls == [ToolCall("get_current_weather", {ch["new"]: "Paris"})]
        tok = __import__("reflrl.models", fromlist=["load_tokenizer"]).load_tokenizer("tiny-random")
        assert f"now takes '{ch['new']}'" in tok.decode(obs)                  # the tool's error, as tokens
        # the answer after the error was asked under q*': the call that met the change and its critique
        under = [p for p in asked if f"in place of 'city'" in p]
        assert under and "Your previous attempt had issues" in under[-1] and '"city": "Paris"' in under[-1]
        repaired = trajs[-1]
        assert repaired.added and repaired.correct and repaired.repair is rec and repaired.reward == 1.0
        assert repaired.texts == [rec.response_text, later.text] and len(repaired.steps) == 2
        n_retry, n_obs = len(rec.response_ids), len(obs)
        assert repaired.response_ids == rec.response_ids + obs + later.token_ids
        assert repaired.loss_mask == [1] * n_retry + [0] * n_obs + [1] * len(later.token_ids)
        assert repaired.old_logprobs[n_retry + n_obs:] == later.logprobs
        # the later answer was sampled after the original prompt's tokens, the retry and the error
        assert "Your previous attempt" not in tok.decode(t.prompt_ids + repaired.response_ids)
    finally:
        env.close()
