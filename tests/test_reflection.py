"""Reflection-guided retries (Tool-ReRL sec. 3.2, Definition 1, appendix C retry prompt)."""
from __future__ import annotations

import pytest

from reflrl.critic import CriticStats, Critique, CritiqueRequest, EnvFault, RuleCritic
from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.rewards import binary_reward
from reflrl.envs.types import Task, ToolCall
from reflrl.recovery.reflection import (
    Attempt,
    EnvFeedback,
    Generation,
    augmented_messages,
    build_retry_prompt,
    reflect_and_retry,
    split_response,
)

QUERY = "I'm considering investing. Could you get me the top market trends in the US?"
GOLD = [ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us", "language": "en"})]
TASK = Task(id="t1", query=QUERY, tools=[{"name": "Market", "parameters": {"type": "object", "properties": {}}}],
            gold=[GOLD])
MSGS = [{"role": "system", "content": "SYS"}, {"role": "user", "content": QUERY}]


def test_retry_prompt_matches_appendix_c():
    p = build_retry_prompt(QUERY, [Attempt("", '[Market(trend_type="MARKET_INDEXES", country="us")]',
                                           "Missing optional parameter 'language', which this endpoint expects.")])
    assert p == (
        "Your previous attempt had issues. History:\n"
        'Attempt 1: [Market(trend_type="MARKET_INDEXES", country="us")]\n'
        "Feedback: Missing optional parameter 'language', which this endpoint expects.\n"
        "\n"
        f'Original request: "{QUERY}"\n'
        "Please try again."
    )


def test_retry_prompt_history_order_and_thought():
    p = build_retry_prompt("q", [Attempt("I should call A", "A()", "wrong tool"), Attempt("", "", "empty")])
    lines = p.splitlines()
    assert lines[0] == "Your previous attempt had issues. History:"
    assert lines[1:4] == ["Attempt 1: Thought: I should call A", "Action: A()", "Feedback: wrong tool"]
    assert lines[5:7] == ["Attempt 2: (empty response)", "Feedback: empty"]
    assert lines[-2:] == ['Original request: "q"', "Please try again."]
    assert p.index("Attempt 1") < p.index("Attempt 2") < p.index("Original request")
    with pytest.raises(ValueError):
        build_retry_prompt("q", [])


def test_split_response():
    assert split_response("<think> check\n args </think>\n<tool_call>x</tool_call>") == ("check args", "<tool_call>x</tool_call>")
    assert split_response("  [f(a=1)] ") == ("", "[f(a=1)]")


def test_augmented_messages_replace_and_append():
    att = [Attempt("t", "a", "rfl")]
    q_star = augmented_messages(MSGS, att)
    assert q_star[0] == MSGS[0] and len(q_star) == 2
    assert q_star[1] == {"role": "user", "content": build_retry_prompt(QUERY, att)}
    assert MSGS[1]["content"] == QUERY  # input untouched
    app = augmented_messages(MSGS, att, mode="append")
    assert app[:2] == MSGS
    assert app[2] == {"role": "assistant", "content": "<think>t</think>\na"}
    assert app[3] == {"role": "user", "content": build_retry_prompt(QUERY, att)}
    # multi-step: later messages of the turn are kept after the rewritten user message
    steps = MSGS + [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "obs"}]
    q2 = augmented_messages(steps, att)
    assert [m["role"] for m in q2] == ["system", "user", "assistant", "tool"]
    assert q2[1]["content"].startswith("Your previous attempt had issues.")
    with pytest.raises(ValueError, match="no user message"):
        augmented_messages([{"role": "system", "content": "s"}], att)
    with pytest.raises(ValueError, match="mode"):
        augmented_messages(MSGS, att, mode="prepend")


def hermes(args: dict) -> str:
    return format_calls([ToolCall("Market", args)], "hermes")


WRONG1 = hermes({"trend_type": "MARKET_INDEXES", "country": "us"})
WRONG2 = hermes({"trend_type": "MARKET_INDEXES", "country": "uk", "language": "en"})
RIGHT = "<think>add language</think>\n" + hermes(GOLD[0].arguments)


class Policy:
    """Scripted policy: returns the next response; records the prompts it was given."""

    def __init__(self, texts):
        self.texts = list(texts)
        self.prompts = []

    async def __call__(self, messages):
        self.prompts.append(messages)
        i = len(self.prompts)
        return Generation(self.texts.pop(0), token_ids=[100 + i, 2], logprobs=[-0.5 * i, -0.1])


class Env:
    def __init__(self):
        self.calls = []

    def __call__(self, text):
        self.calls.append(text)
        pr = parse(text, "hermes")
        r = binary_reward(pr, GOLD)
        return EnvFeedback(parse=pr, reward=r.total, correct=r.correct, tool_calls=len(pr.calls))


def first_feedback(text):
    return Env()(text)


async def test_definition1_stops_at_first_positive():
    pol, env, stats = Policy([WRONG2, RIGHT, WRONG1]), Env(), CriticStats()
    rec = await reflect_and_retry(pol, RuleCritic(), env, TASK, Generation(WRONG1, [1, 2], [-1.0, -2.0]), 5,
                                  first_feedback=first_feedback(WRONG1), messages=MSGS, stats=stats)
    assert rec.recovered and rec.repaired and rec.stop_reason == "positive"
    assert rec.retries == 2 and len(pol.prompts) == 2 and len(env.calls) == 2  # stopped at the first positive
    assert rec.response_text == RIGHT and rec.response_ids == [102, 2] and rec.behaviour_logprobs == [-1.0, -0.1]
    assert rec.final_feedback.correct and not rec.first_feedback.correct
    assert rec.cause == "policy_error" and rec.first.text == WRONG1
    assert rec.prompt_messages == MSGS and rec.augmented_messages == pol.prompts[-1]
    # the second retry's q* holds both failed attempts with the rule critic's feedback
    q_star = rec.augmented_messages[1]["content"]
    assert "Attempt 1: " + WRONG1 in q_star and "Attempt 2: " + WRONG2 in q_star
    assert "missing the argument 'language'" in q_star and "wrong value \"uk\" for 'country'" in q_star
    assert [a.feedback for a in rec.attempts] == [c.analysis for c in rec.critiques[:2]]
    assert stats.calls == 3 and stats.positive == 1 and rec.tool_calls == 2


async def test_max_attempts_bounds_the_retries():
    pol, env = Policy([WRONG2] * 10), Env()
    rec = await reflect_and_retry(pol, RuleCritic(), env, TASK, Generation(WRONG1), 3,
                                  first_feedback=first_feedback(WRONG1), messages=MSGS)
    assert rec.stop_reason == "max_attempts" and not rec.recovered and not rec.repaired
    assert rec.retries == 3 and len(pol.prompts) == 3 and len(rec.critiques) == 4
    assert len(rec.attempts) == 4  # the first response and the three retries, all failed
    rec0 = await reflect_and_retry(Policy([]), RuleCritic(), env, TASK, Generation(WRONG1), 0,
                                   first_feedback=first_feedback(WRONG1), messages=MSGS)
    assert rec0.retries == 0 and rec0.stop_reason == "max_attempts"
    with pytest.raises(ValueError):
        await reflect_and_retry(pol, RuleCritic(), env, TASK, Generation(WRONG1), -1)


async def test_first_positive_needs_no_retry_and_default_messages():
    pol = Policy([])
    rec = await reflect_and_retry(pol, RuleCritic(), Env(), TASK, Generation(RIGHT), 3)
    assert rec.stop_reason == "first_positive" and rec.retries == 0 and pol.prompts == []
    assert rec.prompt_messages[-1] == {"role": "user", "content": QUERY}  # built from the task


class Garbage:
    name = "garbage"

    def critique(self, request: CritiqueRequest) -> Critique:
        return Critique("negative", "", raw="vania executeppm", parsed=False)

    async def acritique(self, request: CritiqueRequest) -> Critique:
        return self.critique(request)


async def test_unparseable_critic_stops_without_reflection():
    pol = Policy([RIGHT])
    rec = await reflect_and_retry(pol, Garbage(), Env(), TASK, Generation(WRONG1), 3,
                                  first_feedback=first_feedback(WRONG1), messages=MSGS)
    assert rec.stop_reason == "critic_unparsed" and pol.prompts == [] and not rec.recovered


async def test_env_fault_reflects_with_the_fault_description():
    fb = EnvFeedback(parse=parse(hermes(GOLD[0].arguments), "hermes"),
                     env_fault=EnvFault("rate_limit", "Market", 429, 2.0, attempts=3), tool_calls=3)
    pol = Policy([RIGHT])
    rec = await reflect_and_retry(pol, RuleCritic(), Env(), TASK, Generation(hermes(GOLD[0].arguments)), 2,
                                  first_feedback=fb, messages=MSGS)
    assert rec.cause == "env_fault" and rec.recovered and rec.retries == 1
    assert "Feedback: The tool `Market` answered 429 rate limit after 3 attempts; retry after 2 s." in \
        pol.prompts[0][1]["content"]


def test_feedback_from_env_step_info():
    from reflrl.recovery.reflection import env_fault_from_info, feedback_from_step

    info = {
        "calls": [{"name": "Market", "arguments": {"country": "us"}}], "parse_ok": True, "parse_error": None,
        "tool_results": [{"call_index": 0, "name": "Market", "ok": False, "triage": "env_fault",
                          "fault_kind": "rate_limit", "attempts": 4, "error": "429"}],
        "fault_events": [{"call_index": 0, "tool": "Market", "attempt": a, "kind": "rate_limit", "status": 429,
                          "detail": "retry_after=2.0", "triage": "env_fault"} for a in range(4)],
        "correct": False, "billed_calls": 4,
    }
    fb = feedback_from_step(info, 0.0)
    assert fb.env_fault == EnvFault("rate_limit", "Market", 429, 2.0, attempts=4, detail="retry_after=2.0")
    assert fb.parse.ok and fb.parse.calls == [ToolCall("Market", {"country": "us"})] and fb.tool_calls == 4
    c = RuleCritic().critique(CritiqueRequest(query=QUERY, env_fault=fb.env_fault))
    assert c.analysis == "The tool `Market` answered 429 rate limit after 4 attempts; retry after 2 s."
    ok_info = dict(info, tool_results=[dict(info["tool_results"][0], triage="ok", ok=True)], fault_events=[])
    assert env_fault_from_info(ok_info) is None
    bad = feedback_from_step({"calls": [], "parse_ok": False, "parse_error": "invalid JSON"}, 0.0)
    assert not bad.parse.ok and bad.parse.error == "invalid JSON" and bad.env_fault is None
