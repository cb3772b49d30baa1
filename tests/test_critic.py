"""Critics (Tool-ReRL appendix C): rule critic sentences, strict Score/Analysis parser, registry."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflrl.critic import (
    CRITIC_INSTRUCTION,
    EVALUATION_TEMPLATE,
    CriticStats,
    CritiqueRequest,
    EnvFault,
    RuleCritic,
    critic_messages,
    describe_env_fault,
    format_critique,
    parse_critique,
    render_ground_truth,
)
from reflrl.critic.format import MAX_CHARS
from reflrl.critic.policy import PolicyCritic
from reflrl.recovery.critics import CRITICS, get_critic
from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.rewards import calls_match
from reflrl.envs.types import ParseResult, ToolCall

Q = "I'm considering investing. Could you get me the top market trends in the US? Answer in English."
GOLD = [ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us", "language": "en"})]


def judge(pred, gold=GOLD, query=Q, **kw):
    c = RuleCritic(**kw).critique(CritiqueRequest(query=query, response="", parse=pred, gold=gold))
    assert c.parsed and c.error is None
    # every analysis is one sentence, and the raw text round-trips through the strict parser
    assert "\n" not in c.analysis and c.analysis.endswith((".", "</tool_call>"))  # the answer level ends on its last block
    p = parse_critique(c.raw)
    assert p.ok and p.score == c.score and p.analysis == c.analysis
    return c


def ok(*calls):
    return ParseResult(True, list(calls))


# ---- rule critic: one sentence per error class ---------------------------------------------------

def test_rule_positive_on_exact_match_order_insensitive():
    g = [ToolCall("a", {"x": 1}), ToolCall("b", {"y": "z"})]
    c = judge(ok(ToolCall("b", {"y": "z"}), ToolCall("a", {"x": 1.0})), gold=g)
    assert c.positive and c.reflection is None


def test_rule_unparseable_format_quotes_parser_error():
    c = judge(ParseResult(False, error="invalid JSON in <tool_call> block 1: Expecting value"))
    assert c.score == "negative"
    assert "not a valid tool call" in c.analysis and "invalid JSON in <tool_call> block 1" in c.analysis
    assert c.reflection == c.analysis


def test_rule_wrong_tool_names_both():
    c = judge(ok(ToolCall("Stocks", {"country": "us"})))
    assert c.analysis == "The response calls `Stocks` but the request needs `Market`."


def test_rule_missing_argument_named_without_leaking_value():
    c = judge(ok(ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us"})), reveal="none")
    assert "missing the argument 'language'" in c.analysis
    assert '"en"' not in c.analysis and "expected value" not in c.analysis


def test_rule_reveal_modes_for_wrong_value():
    pred = ok(ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "uk", "language": "en"}))
    none = judge(pred, reveal="none").analysis
    assert none == "The call to `Market` has the wrong value \"uk\" for 'country'."
    value = judge(pred, reveal="value").analysis
    assert value.endswith("; the expected value is \"us\".")
    query = judge(pred, reveal="query").analysis  # default: point at the request span holding "us"
    assert 'the request says "Could you get me the top market trends in the US"' in query
    assert RuleCritic().reveal == "query"


def test_rule_query_span_needs_a_whole_word():
    # "en" occurs inside "trends" but not as a word in this query: no span is quoted
    pred = ok(ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us"}))
    a = judge(pred, query="Top market trends in the US, please").analysis
    assert a == "The call to `Market` is missing the argument 'language'."


def test_rule_extra_argument_and_count_of_other_issues():
    pred = ok(ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us", "language": "en", "limit": 5}))
    assert judge(pred).analysis == ("The call to `Market` passes the argument 'limit', which the "
                                    "expected call does not use.")
    pred2 = ok(ToolCall("Market", {"trend_type": "X", "country": "us", "limit": 5}))
    a = judge(pred2, reveal="none").analysis  # every problem named, one sentence each
    assert a == ("The call to `Market` is missing the argument 'language'. The call to `Market` has the wrong "
                 "value \"X\" for 'trend_type'. The call to `Market` passes the argument 'limit', which the "
                 "expected call does not use.")
    one = RuleCritic(reveal="none", max_issues=1).critique(CritiqueRequest(query=Q, parse=pred2, gold=GOLD)).analysis
    assert one.startswith("The call to `Market` is missing the argument 'language'")
    assert one.endswith(", and 2 other issues remain.")


def test_rule_wrong_type_is_named():
    g = [ToolCall("f", {"n": 5})]
    a = judge(ok(ToolCall("f", {"n": "5"})), gold=g, reveal="none").analysis
    assert a == "The call to `f` gives 'n' as a string (\"5\") but it should be an integer."


def test_rule_plain_text_and_unneeded_call():
    assert "answers in plain text" in judge(ok()).analysis
    a = judge(ok(ToolCall("Market", {})), gold=[]).analysis
    assert "needs no tool call" in a and "`Market`" in a
    assert judge(ok(), gold=[]).positive


def test_rule_missing_and_extra_parallel_calls():
    g = [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert judge(ok(ToolCall("a", {"x": 1})), gold=g).analysis == "The response is missing a call to `b`."
    a = judge(ok(ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {})), gold=g).analysis
    assert a == "The response makes an extra call to `c` that the request does not need."


def test_rule_value_levels_give_a_needed_calls_arguments_and_call_gives_the_whole_answer():
    g = [ToolCall("get_air_quality", {"city": "Chicago"}), ToolCall("add_to_cart", {"product_id": "P-1", "quantity": 2})]
    pred = ok(ToolCall("add_to_cart", {"product_id": "P-1"}))
    query_level = judge(pred, gold=g, reveal="query").analysis
    assert query_level.startswith("The response is missing a call to `get_air_quality`.")
    value = judge(pred, gold=g, reveal="value").analysis
    assert value.startswith('The response is missing a call to `get_air_quality` with city="Chicago".')
    assert "missing the argument 'quantity'; the expected value is 2." in value
    call = judge(pred, gold=g, reveal="call").analysis
    assert call.startswith(value[:-1])  # everything the value level says, then the whole answer
    assert call.endswith('The expected calls are get_air_quality(city="Chicago"); '
                         'add_to_cart(product_id="P-1", quantity=2).')
    # 'answer': the same problems, then the expected answer as the policy writes it (hermes blocks, one line)
    answer = judge(pred, gold=g, reveal="answer", parser="hermes").analysis
    assert answer.startswith(value[:-1])
    blocks = answer.split("The expected answer is: ", 1)[1]
    assert blocks == " ".join(format_calls(g, "hermes").split())
    assert parse(blocks, "hermes").ok and calls_match(list(parse(blocks, "hermes").calls), g)  # a copy is right
    # a wrong tool: the needed tool's arguments at the value levels only
    wrong = ok(ToolCall("Stocks", {"country": "us"}))
    assert judge(wrong, reveal="query").analysis == "The response calls `Stocks` but the request needs `Market`."
    assert judge(wrong, reveal="value").analysis == ('The response calls `Stocks` but the request needs `Market` '
                                                     'with trend_type="MARKET_INDEXES", country="us", language="en".')
    # an unparseable answer at the call level still gets the expected call
    bad = judge(ParseResult(False, [], error="block 1 holds invalid JSON"), reveal="call").analysis
    assert bad.startswith("The response is not a valid tool call") and 'Market(trend_type="MARKET_INDEXES"' in bad
    with pytest.raises(ValueError, match="reveal='everything'"):
        RuleCritic(reveal="everything")


@pytest.mark.parametrize("fault, expected", [
    (EnvFault("rate_limit", "Market", 429, 2.0), "The tool `Market` answered 429 rate limit; retry after 2 s."),
    (EnvFault("rate_limit", "", None, None), "The tool answered 429 rate limit; retry later."),
    (EnvFault("server_error", "Market", 503, attempts=3), "answered HTTP 503 server error after 3 attempts"),
    (EnvFault("timeout", "Market"), "did not answer in time (timeout)"),
    (EnvFault("connection", "Market"), "The connection to tool `Market` was reset"),
    (EnvFault("ip_ban", "Market", 403), "IP banned"),
    (EnvFault("weird_new_kind", "Market", 418), "environment fault (weird_new_kind, HTTP 418)"),
])
def test_rule_env_fault_names_kind(fault, expected):
    c = RuleCritic().critique(CritiqueRequest(query=Q, env_fault=fault))  # no gold needed
    assert c.score == "negative" and expected in c.analysis
    assert c.analysis == describe_env_fault(fault)
    assert parse_critique(c.raw).ok


def test_rule_parses_response_itself_when_no_parse_result():
    text = format_calls([ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us"})], "hermes")
    c = RuleCritic().critique(CritiqueRequest(query=Q, response=text, gold=GOLD))
    assert "missing the argument 'language'" in c.analysis


def test_rule_requires_gold_and_valid_reveal():
    with pytest.raises(ValueError, match="gold"):
        RuleCritic().critique(CritiqueRequest(query=Q, response="x", parse=ok()))
    with pytest.raises(ValueError, match="reveal"):
        RuleCritic(reveal="all")


async def test_rule_acritique_matches_critique():
    req = CritiqueRequest(query=Q, parse=ok(ToolCall("Stocks", {})), gold=GOLD)
    a, b = RuleCritic().critique(req), await RuleCritic().acritique(req)
    assert (a.score, a.analysis) == (b.score, b.analysis)


# ---- appendix C text and the strict parser -------------------------------------------------------

def test_instruction_and_template_follow_appendix_c():
    assert CRITIC_INSTRUCTION.startswith("You are a critic agent tasked with assessing whether the response's "
                                         "reasoning process and agent response align with the ground truth.")
    assert "\nScore: positive or negative\nAnalysis: Provide a single sentence explanation" in CRITIC_INSTRUCTION
    assert EVALUATION_TEMPLATE == ("Analyze this interaction:\nagent response: {response}\n"
                                   "the ground truths of the questions: {ground_truth}")
    msgs = critic_messages("RESP", GOLD, Q)
    assert msgs[0] == {"role": "system", "content": CRITIC_INSTRUCTION}
    assert msgs[1]["content"] == ('Analyze this interaction:\nagent response: RESP\nthe ground truths of the '
                                  'questions: [Market(trend_type="MARKET_INDEXES", country="us", language="en")]')
    assert "not available" in render_ground_truth(None, Q) and Q in render_ground_truth(None, Q)
    assert "no tool call is needed" in render_ground_truth([], Q)


def test_parser_accepts_the_papers_examples():
    p = parse_critique("Score: Positive\nAnalysis: The tool call is well-formed and\nuses supported parameters.")
    assert p.ok and p.score == "positive" and p.analysis == "The tool call is well-formed and uses supported parameters."
    p = parse_critique("  Score: negative.\n\nAnalysis: Missing 'language'.\n")
    assert p.ok and p.score == "negative" and p.analysis == "Missing 'language'."
    p = parse_critique("<think>let me check the call</think>\nScore: negative\nAnalysis: Wrong tool.")
    assert p.ok and p.analysis == "Wrong tool."


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("The call is fine.\nScore: positive\nAnalysis: ok", "first line"),
    ("**Score:** positive\nAnalysis: ok", "first line"),
    ("Score: neutral\nAnalysis: ok", "first line"),
    ("Score: positive", "no 'Analysis:'"),
    ("Score: positive\nReason: ok", "second line"),
    ("Score: positive\nAnalysis:   ", "empty analysis"),
    ("Score: positive\nAnalysis: ok\nScore: negative", "more than one"),
    ("Score: positive\nAnalysis: ok\nAnalysis: again", "more than one"),
    ("Score: positive\nAnalysis: " + "x" * 3000, "limit"),
    ("x" * (MAX_CHARS + 1), "limit"),
    (None, "not text"),
    (b"Score: positive\nAnalysis: ok", "not text"),
])
def test_parser_is_strict(text, why):
    p = parse_critique(text)
    assert not p.ok and p.score == "negative" and p.analysis == "" and why in p.error


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_parser_never_raises(text):
    p = parse_critique(text)
    assert p.score in ("positive", "negative")
    assert p.ok == (p.error is None)
    if not p.ok:
        assert p.analysis == "" and p.score == "negative"
    else:
        assert p.analysis and "\n" not in p.analysis


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["positive", "negative"]), st.text(min_size=1, max_size=200).filter(lambda s: s.strip()))
def test_format_critique_round_trips(score, analysis):
    p = parse_critique(format_critique(score, analysis))
    assert p.ok and p.score == score and p.analysis == " ".join(analysis.split())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["Score:", "Analysis:", "positive", "negative", "<think>", "</think>",
                                 "\n", " ", ".", "x", "**"]), max_size=30))
def test_parser_never_raises_on_format_like_noise(parts):
    p = parse_critique("".join(parts))
    assert p.ok == (p.error is None)


# ---- stats, registry, policy critic --------------------------------------------------------------

def test_stats_count_unparseable_and_errors():
    from reflrl.critic import Critique, unparsed
    s = CriticStats()
    s.record(Critique("positive", "fine", latency_s=0.5))
    s.record(unparsed("garbage", 1.0))
    s.record(unparsed("", 0.1, error="HTTP 503 after 4 attempts"))
    m = s.as_metrics()
    assert (s.calls, s.positive, s.negative, s.unparseable, s.errors) == (3, 1, 2, 1, 1)
    assert m["critic/latency_max_s"] == 1.0 and abs(m["critic/latency_mean_s"] - 1.6 / 3) < 1e-9


def test_registry():
    assert {"rule", "llm", "policy"} <= set(CRITICS.names())
    assert isinstance(get_critic("rule", reveal="none"), RuleCritic)
    with pytest.raises(KeyError, match="did you mean 'rule'"):
        get_critic("rules")
    with pytest.raises(TypeError, match="critic 'rule'"):
        get_critic("rule", nonsense=1)


def test_policy_critic_garbage_is_negative_without_reflection():
    seen = []

    def gen(prompt):
        seen.append(prompt)
        return "vania executeppm underworld Gods"

    c = get_critic("policy", generate=gen).critique(CritiqueRequest(query=Q, response="R", gold=GOLD))
    assert not c.parsed and c.score == "negative" and c.analysis == "" and c.reflection is None
    assert c.raw == "vania executeppm underworld Gods"
    assert seen[0].startswith(CRITIC_INSTRUCTION + "\n\nAnalyze this interaction:\nagent response: R\n")


async def test_policy_critic_parses_and_supports_async_and_messages():
    async def agen(msgs):
        assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
        await asyncio.sleep(0)
        return "Score: negative\nAnalysis: Missing 'language'."

    pc = PolicyCritic(agen, as_messages=True)
    c = await pc.acritique(CritiqueRequest(query=Q, response="R", gold=GOLD))
    assert c.parsed and c.reflection == "Missing 'language'."
    with pytest.raises(TypeError, match="acritique"):
        pc.critique(CritiqueRequest(query=Q, response="R", gold=GOLD))
    # env faults are described without asking the model
    c2 = await pc.acritique(CritiqueRequest(query=Q, env_fault=EnvFault("timeout", "Market")))
    assert "timeout" in c2.analysis
