"""Faults the policy sees (``fault_exposure="policy"``): the observation each fault kind gives, the
episode that goes on, Retry-After on the env's virtual clock, and the triage (act or masked)."""
from __future__ import annotations

import json
import re

import gymnasium
import pytest

import reflrl.envs
from reflrl.envs.loopback import ServerThread
from reflrl.envs.tool_env import gold_actions
from reflrl.envs.tool_server import create_app
from reflrl.envs.tools.catalog import build_catalog
from reflrl.envs.types import Task, ToolCall
from reflrl.faults.kinds import KINDS, format_kinds_table

CAT = build_catalog()


def _schemas(*names):
    return [CAT[n].schema() for n in names]


WEATHER = Task("w1", "What's the weather in Paris?", _schemas("get_current_weather", "get_stock_quote"),
               [[ToolCall("get_current_weather", {"city": "Paris"})]])
PARALLEL = Task("p1", "Weather in Rome and in Oslo.", _schemas("get_current_weather"),
                [[ToolCall("get_current_weather", {"city": "Rome"}),
                  ToolCall("get_current_weather", {"city": "Oslo"})]], kind="parallel")
FILE = Task("f1", "Show me notes.txt.", _schemas("read_file", "list_files"),
            [[ToolCall("read_file", {"path": "notes.txt"})]])

# what the policy is shown for each kind (the error line of the tool message; module doc of tool_env)
SHOWN = {
    "rate_limit": r"HTTP 429 Too Many Requests: too many requests \(rate_limited\); Retry-After: \d+",
    "server_error": r"HTTP 50[023] [A-Za-z ]+: upstream error 50[023] \(server_error\)",
    "timeout": r"no HTTP answer: ReadTimeout: .+",
    "connection": r"no HTTP answer: ReadError: .*[Rr]eset.*",
    "truncated": r"no HTTP answer: RemoteProtocolError: .+",
    "malformed": r"HTTP 200 OK: response (body is not valid JSON|JSON has no 'result')",
    "ip_ban": r"HTTP 403 Forbidden: client \S+ is banned \(ip_banned\)",
    "invalid_file": r"(HTTP 404 Not Found: .+ \(file_missing\)|HTTP 200 OK: file content is corrupt.*)",
    "schema_drift": r"HTTP 200 OK: result does not match the tool's schema: .+",
}


def _env(task: Task, faults: str, **kw):
    kw.setdefault("fault_exposure", "policy")
    kw.setdefault("timeout", 1.0)
    return gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=[task], faults=faults, **kw).unwrapped


def _tool_msgs(info) -> list[dict]:
    msgs = info["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return [json.loads(m["content"]) for m in msgs[last + 1:] if m["role"] == "tool"]


@pytest.mark.parametrize("kind", sorted(SHOWN))
def test_every_fault_kind_reaches_the_policy_as_the_documented_observation(kind):
    task = FILE if KINDS[kind].applies_to == "files" else WEATHER
    env = _env(task, f"{kind}=1.0")
    try:
        _obs, info = env.reset(seed=3)
        _obs, reward, term, trunc, info = env.step(gold_actions(task)[0])
        [shown] = _tool_msgs(info)
        assert shown["name"] == task.gold[0][0].name and shown["kind"] == kind
        assert re.fullmatch(SHOWN[kind], shown["error"]), shown["error"]
        assert ("Retry-After" in shown["error"]) == (kind == "rate_limit")
        assert info["billed_calls"] == 1  # one attempt per call: the fault is the policy's to act on
        [f] = info["shown_faults"]
        assert f["kind"] == kind and f["observation"] == shown["error"] and not f["handled"]
        assert f["policy_can_act"] == KINDS[kind].policy_can_act
        assert reward == 0.0 and not info["correct"]
        if KINDS[kind].policy_can_act:   # the episode goes on: the policy may call again
            assert not term and not trunc and not info["masked"]
            assert info["env_fault_treatment"] == "to-policy"
        else:                            # no action can handle it: masked, never penalised
            assert info["masked"] and info["env_fault_treatment"] == "masked"
    finally:
        env.close()


def test_latency_reaches_the_policy_as_the_answer():
    env = _env(WEATHER, "latency=1.0:300ms")
    try:
        env.reset(seed=0)
        _obs, reward, term, _trunc, info = env.step(gold_actions(WEATHER)[0])
        assert term and reward == 1.0 and info["correct"] and not info["shown_faults"]
        assert "result" in _tool_msgs(info)[0]
    finally:
        env.close()


def _first_faulted_seed(task: Task, faults: str, **kw) -> int:
    """A seed whose first gold answer meets a fault on its first call (the fault draw is seeded)."""
    for seed in range(200):
        env = _env(task, faults, **kw)
        try:
            env.reset(seed=seed)
            _o, _r, _t, _tr, info = env.step(gold_actions(task)[0])
            if info["shown_faults"] and info["shown_faults"][0]["call_index"] == 0:
                return seed
        finally:
            env.close()
    raise AssertionError("no seed with a fault")


def test_a_call_before_retry_after_gets_429_again_and_one_after_it_is_served():
    # Retry-After 3 s; each further message costs 1 s of virtual time
    seed = _first_faulted_seed(WEATHER, "rate_limit=0.3:3s", turn_seconds=1.0)
    env = _env(WEATHER, "rate_limit=0.3:3s", turn_seconds=1.0)
    try:
        env.reset(seed=seed)
        gold = gold_actions(WEATHER)[0]
        _o, _r, _t, _tr, info = env.step(gold)
        assert info["shown_faults"][0]["retry_after_s"] == 3
        clock = env._client.clock
        t0 = clock.monotonic()
        seen = []
        for _ in range(6):
            _o, reward, term, _tr, info = env.step(gold)
            seen.append((clock.monotonic() - t0, info["shown_faults"][0]["retry_after_s"]
                         if info["shown_faults"] else None))
            if term:
                break
        # 1 s and 2 s after the 429: refused again, told the time still to wait
        assert seen[0] == (1.0, 2) and seen[1] == (2.0, 1)
        assert term and reward == 1.0 and info["correct"] and not info["masked"]
        causes = {e.step: (e.cause, e.detail) for e in env.ledger.injected(env.episode_id)}
        assert causes[1] == ("window", "retry_after=2") and causes[2] == ("window", "retry_after=1")
        assert causes.get(3, ("draw",))[0] == "draw"  # at 3 s the window is over: the plan's own draw
        assert env.ledger.reconcile(env.episode_id).exact
    finally:
        env.close()


def test_retry_after_is_kept_on_a_real_loopback_server(tmp_path):
    """Over a real socket the server's own clock keeps the window: calling again at once is refused."""
    with ServerThread(create_app(sandbox_root=tmp_path)) as srv:
        env = _env(WEATHER, "rate_limit=0.3:30s", server_url=srv.url)
        try:
            for seed in range(200):
                env.reset(seed=seed)
                _o, _r, term, _tr, info = env.step(gold_actions(WEATHER)[0])
                if info["shown_faults"]:
                    break
            [shown] = _tool_msgs(info)
            assert re.fullmatch(r"HTTP 429 Too Many Requests: .*; Retry-After: 30", shown["error"])
            _o, _r, term, _tr, info = env.step(gold_actions(WEATHER)[0])  # at once: inside the window
            [again] = _tool_msgs(info)
            assert again["kind"] == "rate_limit" and not term
            assert int(again["error"].rsplit(": ", 1)[1]) in (29, 30)
        finally:
            env.close()


def test_stopping_after_a_fault_is_the_policys_failure_and_calling_the_failed_one_again_recovers():
    seed = _first_faulted_seed(PARALLEL, "server_error=0.3")
    gold = gold_actions(PARALLEL)[0]
    env = _env(PARALLEL, "server_error=0.3")
    try:
        env.reset(seed=seed)
        _o, _r, term, _tr, info = env.step(gold)
        assert not term
        failed = [f for f in info["shown_faults"]]
        _o, reward, term, _tr, info = env.step("Sorry, the weather service is down.")
        assert term and reward == 0.0 and not info["masked"]
        assert info["fault_caused"] and [f["name"] for f in info["open_faults"]] == [f["name"] for f in failed]
        # the same episode again; this time the policy calls only the failed call(s) again
        env.reset(seed=seed)
        env.step(gold)
        from reflrl.envs.parsing import format_calls
        retry = format_calls([ToolCall(f["name"], f["arguments"]) for f in failed], "hermes")
        for _ in range(4):
            _o, reward, term, _tr, info = env.step(retry)
            if term:
                break
        assert term and reward == 1.0 and info["correct"] and not info["fault_caused"] and not info["open_faults"]
    finally:
        env.close()


def test_a_malformed_reply_to_a_fault_is_still_fault_caused():
    """A small policy often answers a fault by echoing the tool's error inside a call: it did not call
    again, and the answer would have been right had it, so the failure is the fault's (reflection's
    fault critique then targets it); the reward is still that of a wrong answer."""
    seed = _first_faulted_seed(WEATHER, "server_error=0.3")
    env = _env(WEATHER, "server_error=0.3")
    try:
        env.reset(seed=seed)
        env.step(gold_actions(WEATHER)[0])
        echo = '<tool_call>\n{"name": "get_current_weather", "error": "HTTP 503 Service Unavailable"}}\n</tool_call>'
        _o, reward, term, _tr, info = env.step(echo)
        assert term and reward == 0.0 and not info["correct"] and not info["masked"]
        assert info["fault_caused"] and [f["name"] for f in info["open_faults"]] == ["get_current_weather"]
    finally:
        env.close()


def test_a_wrong_answer_with_a_fault_is_a_policy_error_and_a_wrong_reply_to_a_fault_is_fault_caused():
    """A wrong first answer that meets a fault stays the policy's error: answering the faulted call would
    not have made it right. A right first answer whose call met a fault, followed by a wrong call instead
    of calling again, is fault-caused (the answer given when the fault came, completed by the faulted
    call, is right); its reward is still that of a wrong answer."""
    from reflrl.envs.parsing import format_calls
    wrong = format_calls([ToolCall("get_stock_quote", {"symbol": "X"})])
    seed = _first_faulted_seed(WEATHER, "server_error=0.3")
    env = _env(WEATHER, "server_error=0.3")
    try:
        env.reset(seed=seed)
        _o, _r, term, _tr, info = env.step(wrong)  # the first call of this seed meets the fault
        assert not term and info["shown_faults"]
        _o, reward, term, _tr, info = env.step("Done.")
        assert term and reward == 0.0 and not info["masked"] and not info["fault_caused"]
        env.reset(seed=seed)
        env.step(gold_actions(WEATHER)[0])
        _o, reward, term, _tr, info = env.step(wrong)
        if not term:  # the wrong call met a fault too: stop
            _o, reward, term, _tr, info = env.step("Done.")
        assert term and reward == 0.0 and not info["masked"] and info["fault_caused"]
    finally:
        env.close()


def test_ip_ban_no_action_can_handle_stays_masked_and_a_fault_on_the_last_message_too():
    gold = gold_actions(WEATHER)[0]
    env = _env(WEATHER, "ip_ban=1.0", max_steps=3)
    try:
        env.reset(seed=0)
        _o, reward, _term, _tr, info = env.step(gold)
        assert info["masked"] and reward == 0.0
        _o, reward, _term, _tr, info = env.step(gold)   # the ban holds: the client keeps its identity
        assert info["masked"] and _tool_msgs(info)[0]["kind"] == "ip_ban"
    finally:
        env.close()
    env = _env(WEATHER, "server_error=1.0", max_steps=2)
    try:
        env.reset(seed=0)
        _o, _r, term, trunc, info = env.step(gold)
        assert not term and not trunc and not info["masked"]
        _o, reward, term, trunc, info = env.step(gold)  # the last allowed message meets a fault too
        assert trunc and info["masked"] and not info["fault_caused"]
    finally:
        env.close()


def test_without_triage_no_fault_is_masked_and_the_unhandleable_one_leaves_the_answer_wrong():
    """env.triage=false (the 'naive' baseline): an ip_ban no action can handle is not masked, the episode
    ends wrong; under client exposure a fault the retries gave up on is not masked either."""
    gold = gold_actions(WEATHER)[0]
    env = _env(WEATHER, "ip_ban=1.0", max_steps=2, triage=False)
    try:
        env.reset(seed=0)
        _o, reward, _term, _tr, info = env.step(gold)
        assert not info["masked"] and info["env_fault_treatment"] == "to-policy"
        _o, reward, term, trunc, info = env.step(gold)
        assert (term or trunc) and not info["masked"] and reward == 0.0 and not info["correct"]
    finally:
        env.close()
    env = _env(WEATHER, "rate_limit=1.0", fault_exposure="client", triage=False)
    try:
        env.reset(seed=0)
        _o, reward, term, _tr, info = env.step(gold)
        assert term and not info["masked"] and info["env_fault_treatment"] == "unexcused" and reward == 0.0
    finally:
        env.close()


def test_client_exposure_is_unchanged_and_bad_names_are_refused():
    env = _env(WEATHER, "rate_limit=1.0", fault_exposure="client")
    try:
        env.reset(seed=0)
        _o, _r, term, _tr, info = env.step(gold_actions(WEATHER)[0])
        assert term and info["masked"] and "shown_faults" not in info and info["billed_calls"] > 1
    finally:
        env.close()
    with pytest.raises(ValueError, match="fault_exposure"):
        _env(WEATHER, "", fault_exposure="model")


def test_faults_list_states_each_kinds_rule():
    table = format_kinds_table()
    for k in KINDS.values():
        assert k.policy_rule and k.policy_rule.split(":")[0] in ("act", "masked", "nothing to act on")
        assert k.name in table
    assert "masked: the ban holds" in table and "refused with 429 again" in table


# ------------------------------------------------------------------ the critic knows the fault
def test_rule_critic_names_the_fault_kind_and_what_would_have_worked():
    from reflrl.critic import CritiqueRequest, RuleCritic
    from reflrl.recovery.reflection import env_fault_from_info

    seed = _first_faulted_seed(WEATHER, "rate_limit=0.3:2s")
    env = _env(WEATHER, "rate_limit=0.3:2s")
    try:
        env.reset(seed=seed)
        env.step(gold_actions(WEATHER)[0])
        _o, reward, term, _tr, info = env.step("The weather service refused; please try later.")
    finally:
        env.close()
    assert term and reward == 0.0 and info["fault_caused"]
    fault = env_fault_from_info(info)
    assert fault.visible and fault.kind == "rate_limit" and fault.status == 429 and fault.retry_after_s == 2
    c = RuleCritic().critique(CritiqueRequest(query=WEATHER.query, tools=WEATHER.tools,
                                              response="The weather service refused; please try later.",
                                              gold=list(WEATHER.gold[0]), env_fault=fault))
    assert c.score == "negative"
    assert c.analysis == ('Your call was right; the tool answered 429 (rate_limit) with Retry-After 2 s to '
                          'get_current_weather(city="Paris"); call it again with the same arguments.')


def test_a_wrong_call_that_met_a_fault_is_critiqued_as_the_policy_error_it_is():
    """A fault shown to the policy on a call that was wrong anyway, at the step that ends the episode,
    is not the failure's cause (not fault_caused): the critic compares the answer with the gold call,
    not 'your call was right'. At a step that does not end it, the fault is still the one to answer."""
    from reflrl.critic import CritiqueRequest, RuleCritic
    from reflrl.envs.parsing import format_calls
    from reflrl.envs.types import ToolCall
    from reflrl.recovery.reflection import env_fault_from_info

    wrong = format_calls([ToolCall("get_current_weather", {"city": "London"})], "hermes")
    infos = {}
    for max_steps in (1, 2):
        seed = _first_faulted_seed(WEATHER, "rate_limit=0.3:2s", max_steps=max_steps)
        env = _env(WEATHER, "rate_limit=0.3:2s", max_steps=max_steps)
        try:
            env.reset(seed=seed)
            _o, reward, term, trunc, infos[max_steps] = env.step(wrong)
        finally:
            env.close()
        assert infos[max_steps]["shown_faults"][0]["kind"] == "rate_limit"
    end, mid = infos[1], infos[2]
    assert end["turn_ended"] and not end["fault_caused"] and end["open_faults"] and reward == 0.0
    assert env_fault_from_info(end) is None
    assert not mid["turn_ended"] and env_fault_from_info(mid).kind == "rate_limit"
    c = RuleCritic(reveal="call").critique(CritiqueRequest(
        query=WEATHER.query, tools=WEATHER.tools, response=wrong, gold=list(WEATHER.gold[0]),
        env_fault=env_fault_from_info(end)))
    assert c.score == "negative" and "London" in c.analysis and 'get_current_weather(city="Paris")' in c.analysis


def _scripted_policy_faults(tmp_path, tasks, answer, n_envs, *overrides):
    """The tiny recipe under policy-visible server errors at 0.5 with tool_rerl and the rule critic, a scripted
    engine answering ``answer``, ``n_envs`` envs over ``tasks`` and a rollout spec: (cfg, engine, envs, spec, tok)."""
    from pathlib import Path

    from reflrl import config as C
    from reflrl import rollout as R
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine

    tok = load_tokenizer("tiny-random")
    root = Path(__file__).resolve().parent.parent
    cfg = C.load_config(root / "configs" / "tiny.yaml", [
        f"train.out_dir={tmp_path}", "env.fault_exposure=policy", "env.faults=server_error=0.5",
        "reflection.variant=tool_rerl", "reflection.critic=rule", *overrides])
    envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults="server_error=0.5", seed=k,
                           fault_exposure="policy").unwrapped for k in range(n_envs)]
    return cfg, ScriptedEngine(tok, answer), envs, R.RolloutSpec(max_new_tokens=96), tok


def test_fault_caused_failures_reach_reflection_and_the_repair_keeps_the_earlier_step(tmp_path):
    """A policy that gives up after a fault: reflection replays the episode and retries its last answer
    under q* (the critique names the fault); the repair keeps step 1 and trains on the original prompt."""
    import asyncio

    from reflrl import rollout as R
    from reflrl.critic import RuleCritic
    from reflrl.envs.datasets import synthetic_splits
    from reflrl.envs.prompts import build_messages
    from reflrl.recovery import arecover
    from reflrl.recovery.recover import _last_action_start
    from reflrl.recovery.reflection import RETRY_HEADER

    from doubles import gold_text

    tasks = synthetic_splits(n_train=6, n_val=0, n_test=0, seed=3, kinds=("single",))["train"]

    def answer(text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in text)
        if RETRY_HEADER in text:
            return gold_text(task)                      # acting on the critique: call it again
        if '"kind": "server_error"' in text:
            return "The tool is down, sorry."           # gives up after the fault
        return gold_text(task)

    cfg, eng, envs, spec, tok = _scripted_policy_faults(tmp_path, tasks, answer, 12, "reflection.max_attempts=2")
    loop = asyncio.new_event_loop()
    trajs = loop.run_until_complete(R.arollout(eng, tok, envs, tasks[:6], 2, spec, seed=7))
    caused = [k for k, t in enumerate(trajs) if t.last.info.get("fault_caused")]
    assert caused and all(not trajs[k].correct and not trajs[k].masked for k in caused)
    before = {k: trajs[k] for k in caused}
    res = loop.run_until_complete(arecover(trajs, cfg=cfg, engine=eng, tokenizer=tok, envs=envs,
                                           critic=RuleCritic(), messages_of=lambda t: build_messages(t),
                                           rollout_cfg=spec, seed=11))
    assert res.counts["reflected_env_fault"] == len(caused)
    assert res.counts["recovered_env_fault"] >= 1
    repaired = [t for t in trajs if t.repaired]
    assert repaired
    for t in repaired:
        rec = t.repair
        assert rec.cause == "env_fault"
        assert rec.critiques[0].analysis.startswith("Your call was right; the tool answered 50")
        assert "(server_error)" in rec.critiques[0].analysis
        # q* shows the call that met the fault (it was right), not the reply that gave up
        from reflrl.envs.parsing import format_calls
        ef = rec.first_feedback.env_fault
        shown = format_calls([ToolCall(f.tool, dict(f.arguments)) for f in (ef, *ef.also)])
        assert rec.attempts[0].action == shown and "The tool is down" not in rec.augmented_messages[1]["content"]
        assert shown in rec.augmented_messages[1]["content"]
        old = t.original
        assert old is before[next(k for k, v in before.items() if v is old)]
        # the earlier step (answer + the tool's error) is kept; the last answer is the retry, with its
        # behaviour log-probs under q*; the prompt is the original one (eq. 2)
        cut = _last_action_start(old)
        assert 0 < cut and t.response_ids[:cut] == old.response_ids[:cut] and t.loss_mask[:cut] == old.loss_mask[:cut]
        # (a retry that met a fault again went on: the tool's answer, then the answer after it)
        cont = rec.final_feedback.continuation
        tail = list(rec.response_ids) + [x for obs, g in cont for x in (*obs, *g.token_ids)]
        n = len(rec.response_ids)
        assert t.response_ids[cut:] == tail and t.old_logprobs[cut:cut + n] == rec.behaviour_logprobs
        assert t.prompt_ids == old.prompt_ids and len(t.steps) == len(old.steps) + len(cont)
        assert t.correct and t.reward == 1.0
    loop.close()


def test_evaluation_reflection_takes_every_fault_caused_failure_and_caps_policy_errors(tmp_path):
    """max_policy_errors (the held-out evaluation's reflection.eval_policy_errors) caps the policy errors
    reflected on; fault-caused failures are all reflected on."""
    import asyncio

    from reflrl import rollout as R
    from reflrl.critic import RuleCritic
    from reflrl.envs.datasets import synthetic_splits
    from reflrl.envs.prompts import build_messages
    from reflrl.recovery import arecover

    from doubles import gold_text

    tasks = synthetic_splits(n_train=8, n_val=0, n_test=0, seed=3, kinds=("single",))["train"]
    wrong = {t.id for t in tasks[::2]}  # these tasks get a wrong answer: policy errors

    def answer(text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in text)
        if task.id in wrong:
            return "I cannot help with that."
        if '"kind": "server_error"' in text:
            return "The tool is down, sorry."           # gives up after the fault: fault-caused
        return gold_text(task)

    cfg, eng, envs, spec, tok = _scripted_policy_faults(tmp_path, tasks, answer, 16, "reflection.max_per_step=0")
    loop = asyncio.new_event_loop()
    try:
        for cap in (1, None):
            trajs = loop.run_until_complete(R.arollout(eng, tok, envs, tasks, 2, spec, seed=7))
            caused = sum(bool(t.last.info.get("fault_caused")) for t in trajs)
            errors = sum(t.task.id in wrong for t in trajs)
            assert caused >= 1 and errors == 8
            res = loop.run_until_complete(arecover(trajs, cfg=cfg, engine=eng, tokenizer=tok, envs=envs,
                                                   critic=RuleCritic(), messages_of=lambda t: build_messages(t),
                                                   rollout_cfg=spec, seed=11, max_policy_errors=cap))
            assert res.counts["reflected_env_fault"] == caused
            assert res.counts["reflected_policy_error"] == (1 if cap == 1 else errors)
    finally:
        loop.close()


# ------------------------------------------------------------- demonstrations, held-out numbers
def test_shows_fault_tells_a_demonstration_with_a_fault_apart():
    from reflrl.envs.prompts import build_messages, render_tool_error
    from reflrl.sft import shows_fault

    clean = build_messages(WEATHER)
    assert not shows_fault(clean)
    faulted = clean + [{"role": "assistant", "content": "x"},
                       {"role": "tool", "content": render_tool_error("get_current_weather", "HTTP 503", "server_error")}]
    assert shows_fault(faulted)


def test_a_run_under_policy_faults_reports_the_three_accuracies_and_clean_demonstrations(tmp_path):
    """Tiny model, scripted answers (gold, then giving up after a fault), warm-up on, reflection on:
    summary.json holds overall / no-fault / recovery-under-faults accuracy per evaluation, reflection's
    rate by cause, and the warm-up's count of demonstrations that showed a fault (0)."""
    from reflrl import train as T
    from reflrl.recovery.reflection import RETRY_HEADER

    from doubles import gold_text, scripted, tiny_cfg

    def make_answer(tasks):
        def answer(text: str, j: int) -> str:
            task = next(t for t in tasks if t.query in text)
            if '"error"' in text and RETRY_HEADER not in text:
                return "Sorry, the tool failed."
            return gold_text(task)
        return answer

    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.save_every": 0, "env.faults": "server_error=0.3",
                                "data.n_val": 2, "train.eval_every": 1,
                                "env.fault_exposure": "policy", "warmup.enabled": "true", "warmup.steps": 1,
                                "warmup.eval_after": "true", "reflection.variant": "tool_rerl",
                                "reflection.critic": "rule", "env.eval_fault_seed": 5,
                                "reflection.max_attempts": 4, "rollout.max_total_tokens": 2048,
                                "env.train_fault_scale": "1.5"})
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, engine=scripted(cfg, make_answer))
    try:
        tr.run()
        again = tr.evaluate_episodes("test")  # the fixed evaluation fault seed: the same faults again
        # the RL rollouts meet 1.5x the rate (env.train_fault_scale), the evaluations the rate given
        assert {str(e.fault_plan) for e in tr.envs} == {"server_error=0.45"}
        assert {str(e.fault_plan) for e in tr._eval_envs} == {"server_error=0.3"}
    finally:
        tr.close()
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["warmup"]["demonstrations"] > 0 and s["warmup"]["demonstrations_with_fault"] == 0
    assert s["fault_exposure"] == "policy" and s["train_faults"] == "server_error=0.45"
    for stage in ("before", "after_warmup", "after"):
        h = s["heldout"][stage]
        for key in ("accuracy", "clean_accuracy", "recovery_under_faults", "reflection_ratio_env_fault",
                    "reflection_ratio_policy_error"):
            assert key in h
        assert h["n_clean"] + h["n_faulted"] == h["n"] == 4 and h["eval_fault_seed"] == 5
        assert h["clean_accuracy"] == 1.0                       # gold whenever no fault is met
        if h["n_faulted"]:
            assert h["recovery_under_faults"] == 0.0            # it gives up after every fault
            assert h["reflected_env_fault"] == h["n_faulted"] - h["masked"]
            # the critique says "call it again"; a retry can meet a fault again, but each attempt meets
            # fresh fault draws, so some repair gets through within 4 attempts
            assert h["recovered_env_fault"] >= 1
            assert h["reflection_ratio_env_fault"] == h["recovered_env_fault"] / h["reflected_env_fault"]
    assert s["heldout"]["after"]["n_faulted"] == again["n_faulted"] > 0
    assert s["heldout"]["before"]["n_faulted"] == again["n_faulted"]
    _check_fault_metrics_report_and_printout(tmp_path / "run", s)


def _check_fault_metrics_report_and_printout(run_dir, s):
    """The per-step numbers in metrics.jsonl, the report's held-out table and learning curves, the printed
    three-point lines and the time split, against the run's own numbers."""
    from reflrl.report import build_report, load_run
    from reflrl.report import derive as D
    from reflrl.train.summary import format_summary

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # the scripted policy answers gold unless it was shown a fault, then it gives up
        assert r["rollout_clean_accuracy"] in (1.0, None) and r["rollout_recovery_under_faults"] in (0.0, None)
        assert r["rollout_n_clean"] + r["rollout_n_faulted"] == r["reflect/rollouts"]
        of = r["reflect/reflected_env_fault"]
        assert r["reflection_ratio_env_fault"] == (r["reflect/recovered_env_fault"] / of if of else None)
    vals = [r for r in rows if r["phase"] == "eval" and "val_accuracy" in r]
    assert [r["step"] for r in vals] == [1, 2] and all(r["val_clean_accuracy"] in (1.0, None) for r in vals)
    # one evaluation per stage: the episodes under faults give every number, no separate plain evaluation
    for key in ("eval_before", "eval_after_warmup", "eval_after"):
        ev = s[key]
        assert ev["n"] == 4 and "format_rate" in ev and sum(b[1] for b in ev["by_gold_calls"].values()) == 4
        assert sum(b[0] for b in ev["by_gold_calls"].values()) == round(ev["accuracy"] * 4)
    # time split: load, evaluations, warm-up, RL, the rest add up to the run's wall time
    t = s["time_split"]
    assert abs(sum(t[k] for k in ("load_s", "eval_s", "warmup_s", "rl_s", "other_s")) - t["total_s"]) < 0.5
    assert t["rl_s"] == s["rl_seconds"] and abs(t["rl_share"] * t["total_s"] - t["rl_s"]) < 0.11  # seconds rounded to 0.1

    rep = build_report(run_dir)
    assert (run_dir / "plots" / "learning_curves.png").stat().st_size > 8000
    run = load_run(run_dir)
    curves = {c.key: c for c in D.learning_curves(run)}
    assert curves["recovery_under_faults"].rollout_steps == [r["step"] for r in train
                                                             if r["rollout_recovery_under_faults"] is not None]
    assert curves["accuracy"].val_steps == [1, 2] and curves["accuracy"].val == [r["val_accuracy"] for r in vals]
    assert curves["clean_accuracy"].val_steps == [r["step"] for r in vals if r["val_clean_accuracy"] is not None]
    for key, _label in D.HELDOUT_METRICS:
        pts = {name: v for name, _step, v in curves[key].points}
        for stage, name in D.HELDOUT_STAGES:
            assert pts.get(name) == s["heldout"][stage][key]
    md = rep.markdown.read_text()
    assert "## Held-out: base, after warm-up, after RL" in md
    h = s["heldout"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    line = next(x for x in md.splitlines() if x.startswith("| recovery under faults |"))
    for stage in ("before", "after_warmup", "after"):
        assert pct(h[stage]["recovery_under_faults"]) in line
    assert "recovery under faults" in rep.html.read_text() and "learning_curves" in rep.html.read_text()
    text = format_summary(s)
    assert re.search(r"recovery under faults: base \S+ \(of \d+\) -> after warm-up \S+ \(of \d+\) -> after RL", text)
    assert "no fault met: base 100.0%" in text and "time split: load" in text and "% of the run" in text
    zero = sum(v >= 1.0 for v in s["zero_var_ratio_per_step"])
    assert (f"steps without signal (every group's rewards equal): {zero} of {len(s['zero_var_ratio_per_step'])}"
            in text)


# ------------------------------------------------- fresh fault draws per attempt, counting, multi-turn
def test_each_reflection_attempt_meets_fresh_fault_draws_and_the_earlier_steps_replay_the_same():
    """Reset option fault_draw=(1, d): step 0 meets the seed's own faults whatever d is, step 1 meets
    draw d's faults, the same for the same (seed, d) and different across attempts."""
    env = _env(PARALLEL, "server_error=0.5")
    gold = gold_actions(PARALLEL)[0]

    def faults(seed: int, draw: int):
        env.reset(seed=seed, options={"task": PARALLEL, "fault_draw": (1, draw)})
        _o, _r, term, _t, i0 = env.step(gold)
        if term:
            return None
        _o, _r, _term, _t, i1 = env.step(gold)
        return [f["call_index"] for f in i0["shown_faults"]], [f["call_index"] for f in i1["shown_faults"]]

    seed = next(s for s in range(50) if faults(s, 0) is not None)  # a seed whose first step meets a fault
    runs = {d: faults(seed, d) for d in range(8)}
    assert len({tuple(r[0]) for r in runs.values()}) == 1          # the replayed step: the same faults
    assert len({tuple(r[1]) for r in runs.values()}) > 1           # the new try: each draw its own
    assert faults(seed, 3) == runs[3]                              # deterministic
    with pytest.raises(ValueError, match="fault_draw"):
        env.reset(seed=0, options={"task": PARALLEL, "fault_draw": "x"})
    env.close()


def test_a_policy_that_calls_again_after_a_fault_is_counted_recovered_by_policy():
    import asyncio

    from reflrl import rollout as R
    from reflrl.models import load_tokenizer
    from reflrl.recovery import count_rollouts, triage

    from doubles import ScriptedEngine, gold_text

    tok = load_tokenizer("tiny-random")
    tasks = [WEATHER, FILE]
    eng = ScriptedEngine(tok, lambda text, j: gold_text(next(t for t in tasks if t.query in text)))
    envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults="server_error=0.4", seed=k,
                           fault_exposure="policy", timeout=1.0).unwrapped for k in range(16)]
    trajs = asyncio.run(R.arollout(eng, tok, envs, tasks, 8, R.RolloutSpec(max_new_tokens=96), seed=3))
    again = [t for t in trajs if t.recovered_by_policy]
    assert again  # it met a fault, was shown it, called again and ended right
    for t in again:
        assert t.correct and not t.masked and t.met_fault and len(t.steps) >= 2
        assert triage(t) == "recovered_by_policy"
    assert count_rollouts(trajs)["recovered_by_policy"] == len(again)
    out = R.fault_outcomes(trajs)
    hit = [t for t in trajs if t.met_fault]
    assert out["n_faulted"] == len(hit) and out["n_clean"] == len(trajs) - len(hit)
    assert out["recovery_under_faults"] == sum(t.correct and not t.masked for t in hit) / len(hit)
    assert out["recovered_by_policy"] == len(again)
    stats = R.rollout_stats(trajs)
    assert stats["rollout_recovery_under_faults"] == out["recovery_under_faults"]
    assert stats["rollout_clean_accuracy"] == 1.0  # gold whenever no fault is met
    for e in envs:
        e.close()


def test_multi_turn_failure_with_an_open_fault_is_fault_caused():
    """The multi-turn env attributes a wrong turn to a fault as the single-turn env does: right had the
    turn's open faults' calls been answered (fault_caused, open_faults); a wrong call is the policy's."""
    gold = gold_actions(WEATHER)[0]

    def episode(seed: int, after_fault: list[str]):
        env = gymnasium.make(reflrl.envs.MULTI_TURN_ID, dataset=[WEATHER], faults="server_error=0.5",
                             fault_exposure="policy", timeout=1.0).unwrapped
        env.reset(seed=seed, options={"task": WEATHER})
        _o, _r, term, _tr, info = env.step(gold)
        if not info["shown_faults"]:
            env.close()
            return None
        for text in after_fault:
            _o, _r, term, trunc, info = env.step(text)
        env.close()
        return term, info

    seed = next(s for s in range(50) if episode(s, []) is not None)
    term, info = episode(seed, ["The tool failed, sorry."])
    assert term and not info["correct"] and not info["masked"]
    assert info["fault_caused"] and [f["name"] for f in info["open_faults"]] == ["get_current_weather"]
    wrong = '<tool_call>\n{"name": "get_stock_quote", "arguments": {"symbol": "X"}}\n</tool_call>'
    term, info = episode(seed, [wrong, "Done."])
    assert term and not info["correct"] and not info["fault_caused"]


def test_the_held_out_evaluation_under_faults_is_one_batched_episode_evaluation():
    """Every task's first answer in one engine call, the continuing episodes batched turn by turn; without
    faults the episodes give the plain evaluation's numbers."""
    import asyncio

    from reflrl import rollout as R
    from reflrl.envs.datasets import synthetic_splits
    from reflrl.envs.parsing import format_calls
    from reflrl.envs.prompts import build_messages
    from reflrl.heldout import aevaluate_episodes, evaluate
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine, gold_text

    tok = load_tokenizer("tiny-random")
    tasks = synthetic_splits(n_train=0, n_val=0, n_test=10, seed=4, kinds=("single", "parallel"))["test"]
    spec = R.RolloutSpec(max_new_tokens=160, temperature=0.0)

    def answer(text: str, j: int) -> str:  # gold, but a parallel task is answered with its first call only
        task = next(t for t in tasks if t.query in text)
        if '"error"' in text:
            return gold_text(task)  # calls again after a fault
        return gold_text(task) if len(task.gold[0]) == 1 else format_calls([task.gold[0][0]], "hermes")

    def run(faults):
        envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults=faults, fault_exposure="policy",
                               timeout=1.0).unwrapped for _ in tasks]
        eng = ScriptedEngine(tok, answer)
        out = asyncio.run(aevaluate_episodes(eng, tok, envs, tasks, spec, seed=9))
        for e in envs:
            e.close()
        return out, eng.calls

    out, calls = run("server_error=0.3")
    assert calls[0] == len(tasks)  # all first answers in one engine call
    assert 1 < len(calls) <= 8 and all(c < len(tasks) for c in calls[1:])  # then the continuing ones, batched
    assert out["n"] == out["n_clean"] + out["n_faulted"] == len(tasks) and out["n_faulted"] > 0
    assert out["recovered_by_policy"] > 0 and out["format_rate"] == 1.0
    assert sum(b[0] for b in out["by_gold_calls"].values()) == round(out["accuracy"] * len(tasks))
    clean, _ = run(None)
    plain = evaluate(ScriptedEngine(tok, answer), tok, tasks, build_messages, spec).to_dict()
    for key in ("accuracy", "format_rate", "n", "stderr", "by_gold_calls", "new_tokens", "capped"):
        assert clean[key] == plain[key], key
    assert clean["first_answer_accuracy"] == plain["accuracy"] and clean["n_faulted"] == 0


def test_recoverable_under_faults_counts_the_right_answers_that_met_a_fault():
    """A policy whose first answers are gold but which never calls again after a fault: recovery under
    faults is 0, and every faulted episode is recoverable (its answer at the fault was right), so the
    ceiling recoverable_under_faults is 1; a policy that always answers wrong has a ceiling of 0."""
    import asyncio

    from reflrl import rollout as R
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine, gold_text

    tok = load_tokenizer("tiny-random")
    tasks = [WEATHER, FILE]

    def gives_up(text, j):
        return "I cannot help." if "<|im_start|>tool" in text else gold_text(next(t for t in tasks if t.query in text))

    def run(answer):
        envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults="server_error=0.4", seed=k,
                               fault_exposure="policy", timeout=1.0).unwrapped for k in range(16)]
        try:
            trajs = asyncio.run(R.arollout(ScriptedEngine(tok, answer), tok, envs, tasks, 8,
                                           R.RolloutSpec(max_new_tokens=96), seed=3))
        finally:
            for e in envs:
                e.close()
        return R.fault_outcomes(trajs)

    out = run(gives_up)
    assert out["n_faulted"] > 0 and out["recovery_under_faults"] == 0.0
    assert out["recoverable_under_faults"] == 1.0
    wrong = run(lambda text, j: '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert wrong["n_faulted"] > 0 and wrong["recoverable_under_faults"] == 0.0


def test_a_long_episode_in_the_batch_does_not_cut_the_other_episodes_turn_after_a_fault():
    """The turn after a fault gets the room its OWN context leaves under max_total_tokens: one long episode
    in the same batch must not shorten the others' answers (it once cut every retry in a 240-task
    evaluation to a dozen tokens, so no episode could recover)."""
    import asyncio

    from reflrl import rollout as R
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine, gold_text

    tok = load_tokenizer("tiny-random")
    tasks = [WEATHER, FILE]
    filler = "Let me think about which file to read and why. " * 30

    def answer(text, _j):
        task = next(t for t in tasks if t.query in text)
        return (filler if task is FILE else "") + gold_text(task)

    faults = "server_error=0.5"
    base = next(s for s in range(300)  # both first calls meet a fault
                if all(_faulted_at(t, faults, s + k) for k, t in enumerate(tasks)))

    class Recording(ScriptedEngine):
        def generate(self, prompts, n=1, max_new_tokens=256, **kw):
            self.lengths.append([len(p) for p in prompts])
            return super().generate(prompts, n=n, max_new_tokens=max_new_tokens, **kw)

    def run(max_total):
        eng = Recording(tok, answer, row_as_sample=True)
        eng.lengths = []
        envs = [_env(t, faults) for t in tasks]
        try:
            spec = R.RolloutSpec(max_new_tokens=400, max_total_tokens=max_total)
            return asyncio.run(R.arollout(eng, tok, envs, tasks, 1, spec, seed=base)), eng.lengths
        finally:
            for e in envs:
                e.close()

    trajs, lengths = run(4096)
    assert len(lengths) >= 2 and len(lengths[1]) == 2  # the turn after the faults: both episodes, one batch
    short, long = lengths[1]
    assert long - short > 100
    # room enough for the long episode to go on, but a dozen tokens less than the weather call needs
    trajs, _ = run(long + 9 + 12)
    weather = trajs[0]
    assert len(weather.texts) >= 2 and weather.met_fault
    assert weather.texts[1].strip() == gold_text(WEATHER).strip()  # called again in full
    assert not weather.truncated


def _faulted_at(task: Task, faults: str, seed: int) -> bool:
    env = _env(task, faults)
    try:
        env.reset(seed=seed)
        _o, _r, _t, _tr, info = env.step(gold_actions(task)[0])
        return bool(info["shown_faults"]) and info["shown_faults"][0]["call_index"] == 0
    finally:
        env.close()
