"""The Gymnasium tool-calling envs: registration, check_env, replay, fault masking, multi-turn."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import reflrl.envs
from reflrl.envs.tool_env import ChatText, ToolCallEnv, ToolCallMultiTurnEnv, gold_actions
from reflrl.envs.tools.catalog import build_catalog
from reflrl.envs.types import Task, ToolCall
from reflrl.faults import FaultSpecError

CAT = build_catalog()
MIXED = "rate_limit=0.2,server_error=0.15,timeout=0.1,connection=0.1,malformed=0.1"


def _schemas(*names):
    return [CAT[n].schema() for n in names]


def _single_tasks() -> list[Task]:
    return [
        Task("w1", "What's the weather in Paris?", _schemas("get_current_weather", "get_stock_quote"),
             [[ToolCall("get_current_weather", {"city": "Paris"})]]),
        Task("s1", "Quote for AAPL please.", _schemas("get_current_weather", "get_stock_quote"),
             [[ToolCall("get_stock_quote", {"symbol": "AAPL"})]]),
        Task("p1", "Weather in Rome and in Oslo.", _schemas("get_current_weather"),
             [[ToolCall("get_current_weather", {"city": "Rome"}),
               ToolCall("get_current_weather", {"city": "Oslo"})]], kind="parallel"),
    ]


def _file_task() -> Task:
    """A two-turn task against the stateful file sandbox: write, then read back."""
    return Task("mt-files", "Write 'hello' into memo.txt.", _schemas("write_file", "read_file", "list_files"),
                [[ToolCall("write_file", {"path": "memo.txt", "content": "hello"})],
                 [ToolCall("read_file", {"path": "memo.txt"})]],
                kind="multi_turn", turns=["Now read memo.txt back to me."])


def _make(env_id=reflrl.envs.SINGLE_TURN_ID, **kw):
    kw.setdefault("dataset", _single_tasks() if env_id == reflrl.envs.SINGLE_TURN_ID
                  else _single_tasks() + [_file_task()])
    return gymnasium.make(env_id, **kw)


def _play(env, seed, task_index=None, actions=None):
    """Reset with ``seed`` and play the gold script; returns the list of (obs, reward, info)."""
    opts = {"task_index": task_index} if task_index is not None else None
    obs, info = env.reset(seed=seed, options=opts)
    out = [(obs, 0.0, info)]
    u = env.unwrapped
    for a in actions or gold_actions(info["task"], multi_turn=u.multi_turn):
        obs, r, term, trunc, info = env.step(a)
        out.append((obs, r, info))
        if term or trunc:
            break
    return out


# ------------------------------------------------------------------ registration and check_env
@pytest.mark.parametrize("env_id", reflrl.envs.ENV_IDS)
def test_make_and_check_env(env_id):
    env = _make(env_id, faults="rate_limit=0.2,server_error=0.1", seed=0)
    try:
        assert env.spec.id == env_id
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
            check_env(env)  # through gymnasium.make's wrappers too
        # no checker complaint about spaces, determinism or data reuse
        bad = [str(w.message) for w in caught if "not within" in str(w.message)
               or "deterministic" in str(w.message)]
        assert not bad, bad
    finally:
        env.close()
        env.close()  # idempotent


@pytest.mark.parametrize("env_id", reflrl.envs.ENV_IDS)
def test_make_with_default_synthetic_dataset(env_id):
    env = gymnasium.make(env_id, faults="rate_limit=0.1", seed=0)
    try:
        obs, info = env.reset(seed=1)
        assert isinstance(obs, str) and obs in env.observation_space
        assert info["messages"][0]["role"] == "system" and info["messages"][-1]["role"] == "user"
        if env_id == reflrl.envs.SINGLE_TURN_ID:
            assert info["task"].kind in ("single", "parallel")
        obs, r, term, trunc, info = env.step(gold_actions(info["task"], multi_turn=env.unwrapped.multi_turn)[0])
        assert info["parse_ok"]
    finally:
        env.close()


def test_chattext_accepts_any_unicode_and_samples_within_bounds():
    space = ChatText(50, seed=0)
    assert "<tool_call>\n{\"a\": \"é😀\\u0000\"}\n\t中文" in space
    assert "x" * 51 not in space and 3 not in space
    for _ in range(20):
        assert space.sample() in space


def test_bad_fault_spec_names_the_entry():
    with pytest.raises(FaultSpecError, match="ratelimit"):
        _make(faults="ratelimit=0.1")


def test_bad_parser_reward_and_style_names():
    with pytest.raises(ValueError, match="format"):
        _make(parser="xml")
    with pytest.raises(ValueError, match="reward"):
        _make(reward="nope")
    with pytest.raises(ValueError, match="prompt_style"):
        _make(prompt_style="fancy")


def test_import_and_episode_do_not_load_torch():
    code = ("import sys, gymnasium, reflrl.envs\n"
            "e = gymnasium.make('reflrl/ToolCall-v0', seed=0); e.reset(); e.close()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_render_ansi_returns_the_conversation():
    env = _make(seed=0, render_mode="ansi")
    try:
        obs, _ = env.reset(seed=0, options={"task_index": 0})
        assert env.render() == obs and "<|user|>" in obs and "Paris" in obs
    finally:
        env.close()


# ------------------------------------------------------------------ single-turn behaviour
def test_single_turn_gold_gets_reward_and_info():
    env = _make(seed=0)
    try:
        obs, info = env.reset(seed=0, options={"task_index": 2})
        assert info["task"].id == "p1"
        obs, r, term, trunc, info = env.step(gold_actions(info["task"])[0])
        assert (r, term, trunc) == (1.0, True, False)
        assert info["correct"] and info["parse_ok"] and info["triage"] == ["ok", "ok"]
        assert [c["arguments"]["city"] for c in info["calls"]] == ["Rome", "Oslo"]
        assert all(res["ok"] and res["result"]["city"] in ("Rome", "Oslo") for res in info["tool_results"])
        assert info["billed_calls"] == 2 and info["env_fault_treatment"] == "none"
        assert info["messages"][-1]["role"] == "tool" and "Oslo" in obs
        with pytest.raises(RuntimeError, match="reset"):
            env.step("again")
    finally:
        env.close()


def test_policy_error_is_triaged_not_masked():
    env = _make(seed=0)
    try:
        env.reset(seed=0, options={"task_index": 0})
        bad = '<tool_call>\n{"name": "get_current_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
        _, r, _, _, info = env.step(bad)
        assert info["triage"] == ["policy_error"] and not info["masked"]
        assert r == 0.0 and not info["correct"]
        env.reset(seed=0, options={"task_index": 0})
        _, r, _, _, info = env.step("I think it is sunny.")
        assert info["calls"] == [] and info["tool_results"] == [] and r == 0.0
        env.reset(seed=0, options={"task_index": 0})
        _, r, _, _, info = env.step("<tool_call>{not json</tool_call>")
        assert not info["parse_ok"] and info["parse_error"] and r == 0.0
    finally:
        env.close()


@pytest.mark.parametrize("faults", ["server_error=1", "rate_limit=1", "connection=1", "timeout=1"])
def test_faults_at_100_percent_mask_and_never_penalise(faults):
    env = _make(faults=faults, seed=0)
    try:
        for k, task in enumerate(_single_tasks()):
            obs, info = env.reset(seed=k, options={"task": task})
            _, r, term, _, info = env.step(gold_actions(task)[0])
            # the gold answer keeps its full reward; the rollout is masked for the trainer
            assert r == 1.0 and info["correct"] and term
            assert info["masked"] and info["env_fault_treatment"] == "masked"
            assert set(info["triage"]) == {"env_fault"}
            assert info["billed_calls"] > len(task.gold[0])  # retries were billed
            assert all(ev["kind"] == faults.split("=")[0] and not ev["recovered"]
                       for ev in info["fault_events"])
            # a wrong answer stays wrong for what the policy did, not for the fault
            env.reset(seed=k, options={"task": task})
            _, r_bad, _, _, info_bad = env.step("no idea")
            assert r_bad == 0.0 and not info_bad["masked"]
    finally:
        env.close()


def test_multi_turn_faults_at_100_percent_mask_and_keep_gold_reward():
    task = _file_task()
    env = _make(reflrl.envs.MULTI_TURN_ID, faults="server_error=1", seed=0)
    try:
        env.reset(seed=0, options={"task": task})
        for a in gold_actions(task, multi_turn=True):
            _, r, term, trunc, info = env.step(a)
        assert term and r == 1.0 and info["correct"] and info["masked"]
        assert info["turn_rewards"] == [1.0, 1.0]
        assert env.unwrapped.ledger.totals().given_up == 2
    finally:
        env.close()


def test_partial_faults_are_retried_and_recovered():
    env = _make(faults="rate_limit=0.5", seed=0)
    try:
        treatments = set()
        for seed in range(12):
            steps = _play(env, seed, task_index=0)
            _, r, info = steps[-1]
            assert r == 1.0
            treatments.add(info["env_fault_treatment"])
            if info["env_fault_treatment"] == "retried-recovered":
                assert not info["masked"] and info["triage"] == ["ok"]
                assert info["fault_events"][0]["retried"] and info["fault_events"][0]["recovered"]
        assert "retried-recovered" in treatments and "none" in treatments
        totals = env.unwrapped.ledger.totals()
        assert totals.recovered >= 1 and totals.attempts > totals.calls
        assert env.unwrapped.ledger.reconcile().exact
    finally:
        env.close()


# ------------------------------------------------------------------ replay determinism
def _episodes(seed, n=6, faults=MIXED, env_id=reflrl.envs.SINGLE_TURN_ID):
    env = _make(env_id, faults=faults, seed=seed)
    try:
        out = []
        for k in range(n):
            obs, info = env.reset(seed=seed if k == 0 else None)
            task = info["task"]
            steps = [(obs, None, None)]
            for a in gold_actions(task, multi_turn=env.unwrapped.multi_turn):
                obs, r, term, trunc, info = env.step(a)
                steps.append((obs, r, info["fault_events"]))
                if term or trunc:
                    break
            assert info["task_id"] == task.id
            out.append((task.id, steps))
        return out
    finally:
        env.close()


@pytest.mark.parametrize("env_id", reflrl.envs.ENV_IDS)
def test_replay_same_seed_identical_different_seed_differs(env_id):
    a, b, c = _episodes(7, env_id=env_id), _episodes(7, env_id=env_id), _episodes(8, env_id=env_id)
    assert a == b
    faults_a = [s[2] for _, steps in a for s in steps]
    assert any(faults_a), "the mixed plan should inject some faults"
    assert faults_a != [s[2] for _, steps in c for s in steps]


def test_fault_seed_fixes_faults_across_env_seeds():
    def events(seed):
        env = _make(faults=MIXED, seed=seed, fault_seed=99)
        try:
            out = []
            for k in range(5):
                _, info = env.reset(seed=seed if k == 0 else None, options={"task_index": 0})
                _, _, _, _, info = env.step(gold_actions(info["task"])[0])
                out.append([(e["attempt"], e["kind"]) for e in info["fault_events"]])
            return out
        finally:
            env.close()

    assert events(1) == events(2)


# ------------------------------------------------------------------ multi-turn
def test_multi_turn_scripted_gold_synthetic_file_task():
    env = _make(reflrl.envs.MULTI_TURN_ID, seed=0)
    try:
        task = _file_task()
        obs, info = env.reset(seed=0, options={"task": task})
        assert info["n_user_turns"] == 2
        rewards, term = [], False
        for a in gold_actions(task, multi_turn=True):
            obs, r, term, trunc, info = env.step(a)
            rewards.append(r)
            assert not trunc
        assert term and info["correct"] and rewards[-1] == 1.0 and sum(rewards[:-1]) == 0.0
        assert info["turn_rewards"] == [1.0, 1.0]
        # the second turn read back what the first wrote (stateful sandbox)
        tool_msgs = [m for m in info["messages"] if m["role"] == "tool"]
        assert "hello" in tool_msgs[-1]["content"]
        users = [m["content"] for m in info["messages"] if m["role"] == "user"]
        assert users == [task.query, task.turns[0]]
    finally:
        env.close()


def test_multi_turn_scripted_gold_generated_synthetic_tasks():
    from reflrl.envs.datasets import generate_synthetic

    tasks = generate_synthetic(4, seed=3, kinds=("multi_turn",))
    env = gymnasium.make(reflrl.envs.MULTI_TURN_ID, dataset=tasks, seed=0)
    try:
        for i, task in enumerate(tasks):
            assert task.turns, "a generated multi-turn task has follow-up user turns"
            steps = _play(env, i, task_index=i)
            _, r, info = steps[-1]
            assert r == 1.0 and info["correct"] and info["turn_rewards"] == [1.0] * (1 + len(task.turns))
    finally:
        env.close()


def test_multi_turn_wrong_turn_and_truncation():
    task = _file_task()
    env = _make(reflrl.envs.MULTI_TURN_ID, seed=0, max_steps=3)
    try:
        env.reset(seed=0, options={"task": task})
        script = gold_actions(task, multi_turn=True)
        _, r, term, trunc, info = env.step(script[0])      # turn 1: the write
        assert (r, term, trunc) == (0.0, False, False) and not info["turn_ended"]
        _, r, term, trunc, info = env.step("Done.")         # turn 1 ends, turn 2 starts
        assert info["turn_ended"] and info["messages"][-1] == {"role": "user", "content": task.turns[0]}
        _, r, term, trunc, info = env.step(script[0])       # a wrong call in turn 2, step budget hit
        assert trunc and not term and not info["correct"]
        assert r == pytest.approx(0.5)                      # mean of turn scores [1, 0]
    finally:
        env.close()


def test_multi_turn_scripted_gold_bfcl_task():
    from reflrl.envs.tools.bfcl_backends import load_bfcl_multi_turn

    task = load_bfcl_multi_turn("multi_turn_base", limit=1)[0]
    env = gymnasium.make(reflrl.envs.MULTI_TURN_ID, dataset=[task], seed=0, parser="pythonic")
    try:
        obs, info = env.reset(seed=0)
        assert info["task"].id == task.id and info["n_user_turns"] == 1 + len(task.turns)
        for a in gold_actions(task, "pythonic", multi_turn=True):
            obs, r, term, trunc, info = env.step(a)
            if term or trunc:
                break
        assert term and not trunc and r == 1.0 and info["correct"]
        assert all(t == "ok" or t == "policy_error" for t in info["triage"])
    finally:
        env.close()


# ------------------------------------------------------------------ async API
async def test_async_api_runs_many_envs_concurrently():
    envs = [ToolCallEnv(dataset=_single_tasks(), faults="rate_limit=0.3", seed=i) for i in range(6)]
    try:
        resets = await asyncio.gather(*(e.areset(seed=i) for i, e in enumerate(envs)))
        steps = await asyncio.gather(*(e.astep(gold_actions(info["task"])[0])
                                       for e, (_, info) in zip(envs, resets)))
        assert all(r == 1.0 and term for _, r, term, _, _ in steps)
    finally:
        for e in envs:
            await e.aclose()


async def test_sync_api_works_inside_a_running_loop():
    env = _make(seed=0)
    try:
        obs, info = env.reset(seed=0, options={"task_index": 0})
        _, r, _, _, _ = env.step(gold_actions(info["task"])[0])
        assert r == 1.0
    finally:
        env.close()


async def test_env_bound_to_one_loop_says_so():
    env = ToolCallMultiTurnEnv(dataset=_single_tasks(), seed=0)
    try:
        await env.areset(seed=0)
        with pytest.raises(RuntimeError, match="event loop"):
            env.reset(seed=0)  # the sync API uses the env's private loop: refused with a reason
    finally:
        await env.aclose()


def test_shared_app_replays_and_reconciles_after_close():
    """The trainer's set-up: one in-process app shared by envs with their own episode prefixes."""
    from reflrl.envs.tool_server import create_app

    app = create_app()
    envs = [_make(faults="rate_limit=0.5", seed=0, app=app, episode_prefix=f"w{k}") for k in range(2)]
    try:
        runs = []
        for env in envs:
            for seed in (5, 5, 6):  # the replay of seed 5 reuses its episode id
                runs.append([(e["attempt"], e["kind"]) for e in _play(env, seed, task_index=1)[-1][2]["fault_events"]])
        assert runs[0] == runs[1] and runs[3] == runs[4]  # same seed (and prefix): same faults
    finally:
        for env in envs:
            env.close()
    for env in envs:  # injected events were fetched from the shared server when episodes closed
        rep = env.unwrapped.ledger.reconcile()
        assert rep.exact and rep.attempts > 0
