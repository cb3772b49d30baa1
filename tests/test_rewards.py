"""Rewards: eq. 8 (the efficiency paper (arXiv:2606.00135) appendix E) and DSCL eqs. 1-7 (DSCL), hand-computed and
property-tested."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.rewards import (DSCL_STAGE_LAMBDAS, REWARD_RANGES, REWARDS, RewardResult,
                                 calls_match, fine_parts, fine_reward, get_reward, map_range,
                                 register_reward)
from reflrl.envs.types import ParseResult, ToolCall

TC = ToolCall


def ok(*calls: ToolCall, content: str = "") -> ParseResult:
    return ParseResult(ok=True, calls=list(calls), content=content)


BAD = ParseResult(ok=False, calls=[], content="", error="invalid JSON")

# ------------------------------------------------------------------------ eq. 8 (binary)


def test_binary_exact_match_with_normalisation():
    gold = [TC("f", {"a": 1, "s": "Paris", "l": [1, 2.0], "d": {"x": 3}})]
    pred = ok(TC("f", {"s": " Paris ", "a": 1.0, "l": [1.0, 2], "d": {"x": 3.0}}))
    r = get_reward("binary")(pred, gold)
    assert r == RewardResult(total=1.0, parts={"format": 1.0, "match": 1.0}, correct=True)


@pytest.mark.parametrize("pred_args", [
    {"a": True},        # bool is not the number 1
    {"a": "1"},         # a string is not a number
    {"a": 1.5},
    {"a": 1, "b": 2},   # extra argument
    {},                 # missing argument
])
def test_binary_mismatch(pred_args):
    r = get_reward("binary")(ok(TC("f", pred_args)), [TC("f", {"a": 1})])
    assert r.total == 0.0 and not r.correct and r.parts["format"] == 1.0


def test_binary_parallel_calls_are_an_order_insensitive_multiset():
    gold = [TC("f", {"a": 1}), TC("g", {}), TC("f", {"a": 2})]
    assert get_reward("binary")(ok(gold[2], gold[1], gold[0]), gold).total == 1.0
    assert get_reward("binary")(ok(gold[0], gold[1]), gold).total == 0.0
    assert get_reward("binary")(ok(gold[0], gold[0], gold[1]), gold).total == 0.0
    assert not calls_match([TC("f")], [TC("g")])


def test_binary_format_failure_and_text_answers():
    assert get_reward("binary")(BAD, [TC("f")]).total == 0.0
    # a text answer when no call is expected is correct; a format failure never is
    assert get_reward("binary")(ok(content="It is sunny."), []).correct
    r = get_reward("binary")(BAD, [])
    assert r.total == 0.0 and not r.correct


def test_binary_think_and_match_variants():
    gold = [TC("f", {"a": 1})]
    with_think = ok(TC("f", {"a": 1}), content="<think>call f</think>")
    without = ok(TC("f", {"a": 1}))
    think = get_reward("binary_think")
    assert think(with_think, gold).total == 1.0
    r = think(without, gold)
    assert r.total == 0.0 and r.correct and r.parts == {"format": 0.0, "match": 1.0}
    assert think(ok(TC("f", {"a": 1}), content="<think>unclosed"), gold).total == 0.0
    # multi-turn setting of appendix E: tool-call correctness only
    assert get_reward("binary_match")(without, gold).total == 1.0
    assert get_reward("binary_match")(BAD, gold).total == 0.0


def test_binary_think_through_the_parser():
    text = "<think>weather needs a call</think>\n" + format_calls([TC("w", {"c": "x"})], "hermes")
    assert get_reward("binary_think")(parse(text, "hermes"), [TC("w", {"c": "x"})]).total == 1.0


# ------------------------------------------------------------------------- DSCL eqs. 1-7


def test_eq6_mapping():
    assert map_range(0, 0, 6, -3, 3) == -3
    assert map_range(6, 0, 6, -3, 3) == 3
    assert map_range(2, 0, 8, -3, 3) == pytest.approx(-1.5)


def test_fine_hand_computed_partial_match():
    gold = [TC("get_weather", {"city": "Paris", "unit": "celsius"}), TC("get_time", {"tz": "UTC"})]
    pred = ok(TC("get_weather", {"city": "Paris", "unit": "fahrenheit", "days": 3}))
    p = fine_parts(pred, gold)
    assert p["format"] == 1.0                      # eq. 1
    assert p["name"] == pytest.approx(1 / 2)       # eq. 2: {get_weather} vs {get_weather, get_time}
    assert p["key"] == pytest.approx(2 / 3)        # eq. 3: {city,unit,days} vs {city,unit}; get_time: 0
    assert p["value"] == 1.0                       # eq. 4: city right, unit wrong
    assert p["max_name_key"] == 3.0 and p["max_value"] == 3.0
    # eq. 5/6: R = 1 + M_{-3}^{3}(13/6) with Max = 1 + |Y| + sum|K| = 6 -> 1 + (6*(13/6)/6 - 3)
    r = get_reward("fine")(pred, gold)
    assert r.total == pytest.approx(1 / 6) and not r.correct
    assert r.parts["correctness"] == pytest.approx(13 / 6)
    assert r.parts["correctness_mapped"] == pytest.approx(-5 / 6)
    # eq. 7, stage 2 (l1, l2, l3) = (.5, 1.5, .5): corr = 1.5*(7/6) + .5*1 = 2.25, Max = 1.5*3 + .5*3 = 6
    # R = .5 + (3.5 + 3) * 2.25 / 6 - 3 = -0.0625
    assert get_reward("fine_stage2")(pred, gold).total == pytest.approx(-0.0625)


def test_fine_parallel_same_name_and_best_match():
    gold = [TC("f", {"a": 1}), TC("f", {"a": 2})]
    assert get_reward("fine")(ok(TC("f", {"a": 2}), TC("f", {"a": 1})), gold).total == pytest.approx(4.0)
    # one of two parallel calls: name 1/2 (multiset), key 1, value 1 -> 2.5 of 5 -> mapped 0 -> R = 1
    r = get_reward("fine")(ok(TC("f", {"a": 1})), gold)
    assert (r.parts["name"], r.parts["key"], r.parts["value"]) == (0.5, 1.0, 1.0)
    assert r.total == pytest.approx(1.0)
    # f(y_i) picks the best-matching prediction: f(a=1,b=2) over f(a=1)
    r = get_reward("fine")(ok(TC("f", {"a": 1}), TC("f", {"a": 1, "b": 2})), [TC("f", {"a": 1, "b": 2})])
    assert (r.parts["name"], r.parts["key"], r.parts["value"]) == (0.5, 1.0, 2.0)
    assert r.total == pytest.approx(1 + 6 * 3.5 / 4 - 3)


def test_fine_format_failure_and_no_call_cases():
    gold = [TC("f", {"a": 1})]
    assert get_reward("fine")(BAD, gold).total == -3.0
    assert get_reward("fine")(ok(content="sunny"), []).total == 4.0
    # a call where a text answer was expected: the required field (the answer) is missing,
    # format 0; name 0 of Max 1 -> -3
    r = get_reward("fine")(ok(TC("f")), [])
    assert r.parts["format"] == 0.0 and r.total == -3.0
    # a plain-text reply where a call was needed: well formed, but the tool-call field is missing
    r = get_reward("fine")(ok(content="I cannot look that up."), gold)
    assert r.parts["format"] == 0.0 and r.total == -3.0
    # right name, no arguments given, wrong everything else
    r = get_reward("fine")(ok(TC("f")), gold)
    assert r.parts["key"] == 0.0 and r.total == pytest.approx(1 + 6 * 1 / 3 - 3)


def test_stage_lambdas_are_the_papers():
    assert DSCL_STAGE_LAMBDAS == {1: (2.5, .5, .5), 2: (.5, 1.5, .5), 3: (.5, .5, 2.5)}
    gold = [TC("f", {"a": 1})]
    for s in (1, 2, 3):
        assert get_reward(f"fine_stage{s}")(ok(*gold), gold).total == pytest.approx(4.0)
        assert get_reward(f"fine_stage{s}")(BAD, gold).total == pytest.approx(-3.0)
    # eq. 7 with all lambdas 1 is eq. 5
    pred = ok(TC("f", {"a": 2}))
    assert fine_reward(pred, gold, lambdas=(1, 1, 1)).total == get_reward("fine")(pred, gold).total


def test_registry():
    assert {"binary", "fine", "binary_think", "binary_match"} <= set(REWARDS)
    assert set(REWARDS) == set(REWARD_RANGES)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("binary", REWARDS["binary"])


# ------------------------------------------------------------------------------ properties

_names = st.sampled_from(["f", "g", "h"])
_vals = st.one_of(st.integers(-2, 2), st.sampled_from([1.0, 0.0, " a", "a", "b", True, None]),
                  st.lists(st.integers(0, 2), max_size=2))
_call = st.builds(TC, name=_names, arguments=st.dictionaries(st.sampled_from("abcd"), _vals, max_size=3))
_calls = st.lists(_call, max_size=4)


@settings(max_examples=300, deadline=None)
@given(pred=_calls, gold=_calls, good=st.booleans(), name=st.sampled_from(sorted(REWARDS)))
def test_reward_bounds_and_correct_flag(pred, gold, good, name):
    pr = ParseResult(ok=True, calls=pred) if good else BAD
    r = get_reward(name)(pr, gold)
    lo, hi = REWARD_RANGES[name]
    assert lo - 1e-9 <= r.total <= hi + 1e-9
    assert all(math.isfinite(v) for v in r.parts.values())
    assert r.correct == (good and calls_match(pred, gold))


@settings(max_examples=200, deadline=None)
@given(gold=_calls, data=st.data())
def test_exact_gold_in_any_order_gets_the_max(gold, data):
    pred = data.draw(st.permutations(gold))
    for name in REWARDS:
        r = get_reward(name)(ok(*pred, content="<think>x</think>"), gold)
        assert r.correct
        assert r.total == pytest.approx(REWARD_RANGES[name][1]), name


@settings(max_examples=300, deadline=None)
@given(pred=_calls, gold=_calls)
def test_fine_max_iff_exact(pred, gold):
    r = get_reward("fine")(ok(*pred), gold)
    assert (r.total == pytest.approx(4.0)) == r.correct
    # the binary reward is permutation-invariant in the prediction
    assert get_reward("binary")(ok(*reversed(pred)), gold).total == get_reward("binary")(ok(*pred), gold).total
