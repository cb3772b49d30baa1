"""Tool-call parsers: hermes / pythonic / react / auto, guards, round trips, fuzzing."""
from __future__ import annotations

import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflrl.envs.parsing import FORMATS, MAX_CHARS, PARSERS, check_format, format_calls, parse
from reflrl.envs.types import ParseResult, ToolCall

# ------------------------------------------------------------------------------------ hermes


def test_hermes_single_and_parallel_with_content():
    text = ('<think>need weather</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": [1, 2]}}\n</tool_call>\n<tool_call>{"name": "get_time", '
            '"arguments": {}}</tool_call>\nDone.')
    r = parse(text, "hermes")
    assert r.ok and r.error is None
    assert r.calls == [ToolCall("get_weather", {"city": "Paris", "days": [1, 2]}),
                       ToolCall("get_time", {})]
    assert r.content == "<think>need weather</think>\nDone."


def test_hermes_aliases_and_string_arguments():
    r = parse('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', "hermes")
    assert r.ok and r.calls == [ToolCall("f", {"a": 1})]
    r = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "hermes")
    assert r.ok and r.calls == [ToolCall("f", {"a": 2})]
    r = parse('<tool_call>{"name": "f"}</tool_call>', "hermes")
    assert r.ok and r.calls == [ToolCall("f", {})]
    r = parse('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": null}}]'
              '</tool_call>', "hermes")
    assert r.ok and [c.name for c in r.calls] == ["f", "g"]


def test_hermes_close_tag_inside_json_string_does_not_cut_block():
    r = parse('<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>', "hermes")
    assert r.ok and r.calls == [ToolCall("echo", {"s": "</tool_call>"})]


def test_hermes_plain_text_is_a_text_answer():
    r = parse("The weather in Paris is sunny.", "hermes")
    assert r == ParseResult(ok=True, calls=[], content="The weather in Paris is sunny.", error=None)


@pytest.mark.parametrize("text, needle", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "not closed"),
    ('<tool_call>{"name": "f", "argu', "not closed"),
    ("<tool_call>", "not closed"),
    ('<tool_call>["f"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "'name'"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "'name'"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "'arguments' must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "NaN"),
    ('<tool_call>{"name": "f"} extra</tool_call>', "unexpected text"),
    ('{"name": "f"}</tool_call>', "stray"),
    ("answer <tool_call", "incomplete"),
    ("<tool_call>[]</tool_call>", "empty list"),
])
def test_hermes_broken_markup_is_a_parse_failure(text, needle):
    r = parse(text, "hermes")
    assert not r.ok and r.calls == []
    assert needle in r.error


# ---------------------------------------------------------------------------------- pythonic


def test_pythonic_list_bare_and_dotted():
    r = parse('[get_weather(city="Paris", unit=\'celsius\'), math.sqrt(x=-2.5, opts={"a": (1, 2)})]',
              "pythonic")
    assert r.ok
    assert r.calls == [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"}),
                       ToolCall("math.sqrt", {"x": -2.5, "opts": {"a": [1, 2]}})]
    assert parse("f(a=True, b=None)", "pythonic").calls == [ToolCall("f", {"a": True, "b": None})]
    assert parse("```python\n[f(a=1)]\n```", "pythonic").calls == [ToolCall("f", {"a": 1})]
    r = parse("<think>hmm</think>\n[f()]", "pythonic")
    assert r.ok and r.calls == [ToolCall("f", {})] and r.content == "<think>hmm</think>"
    assert parse("[]", "pythonic") == ParseResult(ok=True, calls=[], content="", error=None)


def test_pythonic_plain_text_is_a_text_answer():
    for text in ["Paris (France) is sunny today.", "It is 3 degrees.", "(lambda: 1)()"]:
        r = parse(text, "pythonic")
        assert r.ok and r.calls == [] and r.content == text


@pytest.mark.parametrize("text, needle", [
    ("f(1)", "positional"),
    ("[f(a=1), g('x')]", "positional"),
    ("f(a=x)", "not a literal"),
    ("f(a=__import__('os').system('ls'))", "not a literal"),
    ("f(a=1, a=2)", "given twice"),
    ("f(**kw)", "**kwargs"),
    ("f(a=1j)", "complex"),
    ("f(a={1, 2})", "set"),
    ("f(a={1: 2})", "dict keys"),
    ("[f(a=1), 3]", "expected a function call"),
    ("f(a=1)(b=2)", "function name must be an identifier"),
    ("[f(a=1), g(b=]", "not a valid Python call list"),
    ("f(a=1", None),
])
def test_pythonic_errors(text, needle):
    r = parse(text, "pythonic")
    if needle is None:  # not shaped like a call: a text answer
        assert r.ok and r.calls == []
        return
    assert not r.ok and r.calls == []
    assert needle in r.error


def test_pythonic_never_evaluates(tmp_path):
    marker = tmp_path / "pwned"
    r = parse(f"[f(a=open({str(marker)!r}, 'w').write('x'))]", "pythonic")
    assert not r.ok and not marker.exists()


# ------------------------------------------------------------------------------------- react


def test_react_multiple_actions_with_thoughts():
    text = ("Thought: I need the weather.\nAction: get_weather\nAction Input: {\"city\": \"Paris\"}\n"
            "Action: get_time\nAction Input: {}\nAction: ping\nAction Input:\n")
    r = parse(text, "react")
    assert r.ok
    assert r.calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_time", {}),
                       ToolCall("ping", {})]
    assert r.content == "Thought: I need the weather."


def test_react_multiline_json_and_text_answer():
    r = parse('Action: f\nAction Input: {\n  "a": [1,\n 2]\n}\nObservation: pending', "react")
    assert r.ok and r.calls == [ToolCall("f", {"a": [1, 2]})]
    assert "Observation" in r.content
    r = parse("Final Answer: it is sunny", "react")
    assert r.ok and r.calls == [] and r.content == "Final Answer: it is sunny"


@pytest.mark.parametrize("text, needle", [
    ("Action: f\nThought: oops", "missing 'Action Input:'"),
    ("Action Input: {}", "without a preceding"),
    ('Action: f\nAction Input: {"a": 1', "not valid JSON"),
    ('Action: f\nAction Input: [1, 2]', "must be a JSON object"),
    ("Action: do something\nAction Input: {}", "one word"),
])
def test_react_errors(text, needle):
    r = parse(text, "react")
    assert not r.ok and r.calls == [] and needle in r.error


# --------------------------------------------------------------------------- auto and guards


def test_auto_picks_the_format_present():
    assert parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "auto").calls == [ToolCall("f")]
    assert parse("[f(a=1)]", "auto").calls == [ToolCall("f", {"a": 1})]
    assert parse("Action: f\nAction Input: {}", "auto").calls == [ToolCall("f")]
    r = parse("just words", "auto")
    assert r.ok and r.calls == [] and r.content == "just words"
    r = parse("<tool_call>{bad", "auto")
    assert not r.ok and r.error.startswith("hermes:")


def test_too_long_input_rejected_without_scanning():
    r = parse("x" * (MAX_CHARS + 1), "hermes")
    assert not r.ok and "too long" in r.error
    assert parse("<tool_call>" * 10, "hermes", max_chars=20).error.startswith("output too long")


@pytest.mark.parametrize("fmt", [*FORMATS, "auto"])
def test_deep_nesting_and_big_numbers_are_parse_failures(fmt):
    deep = "[" * 20000 + "]" * 20000
    for text in [f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>',
                 f"[f(a={deep})]", f"f(a={'-' * 30000}1)",
                 f"Action: f\nAction Input: {{\"a\": {deep}}}",
                 '<tool_call>{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
                 "[f(a=" + "9" * 5000 + ")]"]:
        r = parse(text, fmt)
        assert isinstance(r, ParseResult)
        if r.calls:
            pytest.fail(f"{fmt} accepted pathological input")


def test_non_str_input_and_unknown_format():
    assert not parse(None, "hermes").ok  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse("hi", "xml")
    with pytest.raises(ValueError):
        check_format("nope")
    assert set(PARSERS) == set(FORMATS)


# ------------------------------------------------------------------ round trips (property)

_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s))
_json_scalar = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
_json = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_dotted = st.lists(_ident, min_size=1, max_size=3).map(".".join)
_calls = st.lists(st.builds(ToolCall, name=_dotted,
                            arguments=st.dictionaries(_ident, _json, max_size=4)), max_size=4)


@settings(max_examples=150, deadline=None)
@given(calls=_calls, fmt=st.sampled_from(FORMATS))
def test_format_then_parse_round_trips(calls, fmt):
    text = format_calls(calls, fmt)
    r = parse(text, fmt)
    assert r.ok, r.error
    assert r.calls == calls
    if calls:
        assert parse(text, "auto").calls == calls


@settings(max_examples=80, deadline=None)
@given(calls=st.lists(st.builds(ToolCall, name=st.text(min_size=1, max_size=10).filter(str.strip),
                                arguments=st.dictionaries(st.text(max_size=8), _json, max_size=3)),
                      max_size=3))
def test_hermes_round_trip_any_names_and_keys(calls):
    r = parse(format_calls(calls, "hermes"), "hermes")
    assert r.ok and r.calls == calls


def test_format_calls_refuses_what_the_format_cannot_express():
    with pytest.raises(ValueError):
        format_calls([ToolCall("f", {"not-an-ident": 1})], "pythonic")
    with pytest.raises(ValueError):
        format_calls([ToolCall("f", {"class": 1})], "pythonic")
    with pytest.raises(ValueError):
        format_calls([ToolCall("two words", {})], "react")
    with pytest.raises(ValueError):
        format_calls([ToolCall("f", {"x": float("nan")})], "hermes")


# ------------------------------------------------------------------------------- fuzzing

_fragments = st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_call", "{", "}", "[", "]", "(", ")", '"', "'", ":", ",",
    '"name"', '"arguments"', '"parameters"', "Action:", "Action Input:", "Thought:", "\n", " ",
    "f", "get_weather", "=", "a=1", "1e999", "NaN", "\\", "<think>", "</think>", "```", "**kw",
    "null", "true", "-", "9" * 50, "é", "\u2028", "\x00",
])


def _check(r: ParseResult) -> None:
    assert isinstance(r, ParseResult)
    assert isinstance(r.ok, bool) and isinstance(r.content, str)
    if r.ok:
        assert r.error is None
        assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in r.calls)
    else:
        assert isinstance(r.error, str) and r.error and r.calls == []


@settings(max_examples=300, deadline=None)
@given(text=st.lists(_fragments, max_size=40).map("".join), fmt=st.sampled_from([*FORMATS, "auto"]))
def test_fuzz_markup_soup_never_raises(text, fmt):
    _check(parse(text, fmt))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300), fmt=st.sampled_from([*FORMATS, "auto"]))
def test_fuzz_random_unicode_never_raises(text, fmt):
    _check(parse(text, fmt))


@settings(max_examples=60, deadline=None)
@given(calls=_calls.filter(bool), fmt=st.sampled_from(FORMATS), data=st.data())
def test_fuzz_truncations_of_valid_calls(calls, fmt, data):
    text = format_calls(calls, fmt)
    cut = data.draw(st.integers(0, len(text)))
    for t in (text[:cut], text[cut:]):
        for f in (fmt, "auto"):
            _check(parse(t, f))


@pytest.mark.parametrize("text", ["[f(x=1and 2)]", "f(n=1if 1else 2)"])
def test_answers_that_python_parses_with_a_syntax_warning_print_none(text):
    """A model's answer such as ``f(x=1and 2)`` parses with a SyntaxWarning ("invalid decimal literal"); the
    pythonic parser and BFCL's decoding parse it without one reaching the console, and answer as before."""
    import ast
    import warnings

    from reflrl.eval.bfcl_decode import Unevaluated, decode_python
    from reflrl.envs.parsing import parse_expression

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = parse(text, "pythonic")
        try:
            decode_python(text, lambda call: {"call": True})
        except (Unevaluated, Exception):  # noqa: BLE001 - what it answers does not matter here
            pass
        tree = parse_expression(text)
    assert [w for w in seen if issubclass(w.category, SyntaxWarning)] == []
    assert isinstance(res, ParseResult) and tree.body is not None
    with pytest.warns(SyntaxWarning):  # what a bare ast.parse does with it
        ast.parse(text, mode="eval")
