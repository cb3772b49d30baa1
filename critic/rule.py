"""The rule-based critic: compares a response with the ground truth, no model needed.

The embedded default critic of Tool-ReRL runs (Tool-ReRL, sec. 3.2 and
appendix C). Like the paper's frozen critic it sees the ground truth and answers in the
Score/Analysis format, saying precisely what is wrong, in this order of checks:

1. env fault (the request carries one): the fault kind, status, Retry-After
   (:func:`reflrl.critic.format.describe_env_fault`);
2. unparseable format: the parser's error;
3. plain-text answer where a call is needed / a call where none is needed;
4. wrong tool (both named), missing call, extra call;
5. missing argument (named), wrong value or wrong type (argument and the value given), extra
   argument (named). When several things are wrong, one sentence names each of the first
   ``max_issues`` (3) and the rest are counted: a parallel call's repair needs all of them.

How much of the gold value the analysis reveals (``reveal``) -- a design decision:
appendix C's example feedback names the missing parameter ("Missing optional parameter
'language', which this endpoint expects") but does not spell out its value. A reflection that
gives the answer makes the repair trivial: tau* then has a high probability under q* and a very
low one under q, the importance weight pi(tau*|q)/pi(tau*|q*) of eq. 2 collapses, and little is
learned. So the default ``reveal="query"`` names the argument and the wrong value the policy gave,
and points to the *span of the user request* that holds the expected value when the value occurs
in the request verbatim -- information the policy already had in q, so tau* stays reachable from
q (the spirit of Assumption 1). ``reveal="none"`` never quotes the request;
``reveal="value"`` states the expected value (and a missing or wrong tool's expected arguments), as
an LLM critic that sees the ground truth may; ``reveal="call"`` adds the whole expected answer
("The expected call is get_air_quality(city=\"Chicago\")."); ``reveal="answer"`` states the same whole
expected answer in the policy's own answer format (the ``parser``'s, e.g. hermes ``<tool_call>`` blocks),
so acting on the critique is a copy -- the most a ground-truth critic can say, in the form a small
policy can use. At that level a fault the policy was shown also gets the call that would have worked in
the answer format (the same call again; for an API change, the adapted call). At the ``call`` and
``answer`` levels a policy error in an episode that met an API change (``CritiqueRequest.api_changes``, the
server's record) gets the expected call as the tool now takes it, and a sentence naming the change: the
call the ground truth names would meet the change again.
Which level a run uses is measured, not assumed: see the recipe's ``reflection.reveal`` comment.
Tool names are always named (the paper's critic names endpoints and parameters).
"""
from __future__ import annotations

import json
import re
import time
from typing import Any

from reflrl.envs.parsing import format_calls, parse as parse_response
from reflrl.envs.rewards import calls_match, normalize_value
from reflrl.envs.types import ParseResult, ToolCall

from .base import Critique, CritiqueRequest, SyncCritic
from .format import adapt_calls, describe_changes, describe_env_fault, fault_fix_calls, format_critique

REVEAL_MODES = ("none", "query", "value", "call", "answer")
VALUE_LEVELS = ("value", "call", "answer")  # the levels whose analysis states expected values

POSITIVE_ANALYSIS = "The tool call is well-formed and matches the expected call with the right arguments."


def _q(v: Any, limit: int = 60) -> str:
    """A value as it would appear in JSON, cut to ``limit`` characters."""
    try:
        s = json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _args_text(c: ToolCall) -> str:
    """``k="v", n=2``: a call's arguments as keyword arguments with JSON values."""
    return ", ".join(f"{k}={_q(v)}" for k, v in dict(c.arguments).items())


def _call_text(c: ToolCall) -> str:
    """``name(k="v", n=2)``: a whole call, as the ``call`` reveal level states it."""
    return f"{c.name}({_args_text(c)})"


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _same_kind(a: Any, b: Any) -> bool:
    na, nb = _type_name(a), _type_name(b)
    return na == nb or {na, nb} == {"integer", "number"}


def query_span(query: str, value: Any, width: int = 80) -> str | None:
    """The clause of ``query`` that contains ``value`` (case-insensitive), or None.

    Only strings and numbers are searched (str(value), at least 2 characters, or any number);
    the clause is cut at sentence punctuation and to ``width`` characters around the value.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and value == int(value):
        value = int(value)
    if not isinstance(value, (str, int, float)):
        return None
    needle = str(value).strip()
    if not needle or (isinstance(value, str) and len(needle) < 2):
        return None
    m = re.search(r"(?<!\w)" + re.escape(needle) + r"(?!\w)", query, re.I)
    if m is None:
        return None
    i = m.start()
    start = max(0, max(query.rfind(p, 0, i) for p in ".?!;\n") + 1)
    ends = [j for j in (query.find(p, i + len(needle)) for p in ".?!;\n") if j >= 0]
    end = min(ends) if ends else len(query)
    span = query[start:end].strip()
    if len(span) > width:
        lo = max(0, i - start - (width - len(needle)) // 2)
        span = span[lo: lo + width].strip()
    return " ".join(span.split()) or None


class RuleCritic(SyncCritic):
    """Deterministic critic comparing the response with the gold calls (module doc).

    Args:
        reveal: "query" (default) | "none" | "value" | "call" | "answer": how much of an expected
            value the analysis gives away (module doc).
        parser: format used when a request has no ParseResult ("auto": hermes, pythonic, react).
        max_issues: how many problems the analysis names, one sentence each (the rest are counted):
            a repair needs every problem of a parallel call, not only the first.
    """

    name = "rule"

    def __init__(self, reveal: str = "query", parser: str = "auto", max_issues: int = 3) -> None:
        if reveal not in REVEAL_MODES:
            raise ValueError(f"reveal={reveal!r}: expected one of {', '.join(REVEAL_MODES)}")
        if max_issues < 1:
            raise ValueError(f"max_issues={max_issues}: must be >= 1")
        self.reveal = reveal
        self.parser = parser
        self.max_issues = int(max_issues)

    def critique(self, request: CritiqueRequest) -> Critique:
        """Score one attempt (module doc). Raises ValueError when the request has no gold calls
        and no env fault: the rule critic judges against the ground truth only."""
        t0 = time.perf_counter()
        score, analysis = self.judge(request)
        return Critique(score, analysis, raw=format_critique(score, analysis), parsed=True,
                        latency_s=time.perf_counter() - t0)

    def judge(self, request: CritiqueRequest) -> tuple[str, str]:
        """(score, analysis) for ``request``; see :meth:`critique`."""
        if request.env_fault is not None:
            text = describe_env_fault(request.env_fault)
            fix = fault_fix_calls(request.env_fault) if request.env_fault.visible else []
            if self.reveal == "answer" and fix:  # the call to make, in the answer format
                try:
                    text += " The expected answer is: " + " ".join(format_calls(fix, self.parser).split())
                except ValueError:  # a call this format cannot write: the description alone
                    pass
            return "negative", text
        if request.gold is None:
            raise ValueError("the rule critic needs the gold calls (CritiqueRequest.gold); "
                             "use an LLM or policy critic for tasks without ground truth")
        pr = request.parse if request.parse is not None else parse_response(request.response, self.parser)
        gold = list(request.gold)
        problem = self._problem(pr, gold, request.query)
        if problem is None:
            return "positive", POSITIVE_ANALYSIS
        if self.reveal in ("call", "answer") and gold:
            # the call to make is the gold as the tool now takes it: an API change the episode met (the
            # server's record) renames a parameter or moves the tool, and the critique says so
            changed = describe_changes(gold, request.api_changes)
            if changed:
                problem += " " + changed
                gold = adapt_calls(gold, request.api_changes)
        if self.reveal == "call" and gold:  # the whole expected answer, after what is wrong
            calls = "; ".join(_call_text(g) for g in gold)
            problem += f" The expected {'calls are' if len(gold) > 1 else 'call is'} {calls}."
        elif self.reveal == "answer" and gold:  # the same, written as the policy should answer
            # one line, as every analysis (reflrl.critic.format): the blocks' JSON verbatim
            problem += " The expected answer is: " + " ".join(format_calls(gold, self.parser).split())
        return "negative", problem

    # ---- comparison ------------------------------------------------------------------------

    def _problem(self, pr: ParseResult, gold: list[ToolCall], query: str) -> str | None:
        if not pr.ok:
            err = " ".join(str(pr.error or "unknown parse error").split())
            if len(err) > 200:
                err = err[:197] + "..."
            return f"The response is not a valid tool call in the expected format: {err.rstrip('.')}."
        pred = list(pr.calls)
        if calls_match(pred, gold):
            return None
        if not pred:
            names = ", ".join(f"`{g.name}`" for g in gold)
            return f"The response answers in plain text instead of calling a tool; the request needs a call to {names}."
        if not gold:
            names = ", ".join(f"`{c.name}`" for c in pred)
            return f"The response calls {names}, but the request needs no tool call and should be answered in plain text."
        # drop exact matches, then pair the rest by name (order-insensitive, like calls_match)
        g_left = list(gold)
        p_left: list[ToolCall] = []
        for c in pred:
            key = (c.name, normalize_value(dict(c.arguments)))
            hit = next((j for j, g in enumerate(g_left)
                        if (g.name, normalize_value(dict(g.arguments))) == key), None)
            if hit is None:
                p_left.append(c)
            else:
                g_left.pop(hit)
        pairs: list[tuple[ToolCall, ToolCall]] = []
        for c in list(p_left):
            j = next((j for j, g in enumerate(g_left) if g.name == c.name), None)
            if j is not None:
                pairs.append((c, g_left.pop(j)))
                p_left.remove(c)
        issues: list[str] = []
        if len(p_left) == 1 and len(g_left) == 1:
            issues.append(f"The response calls `{p_left[0].name}` but the request needs `{g_left[0].name}`"
                          + self._with_args(g_left[0]))
        else:
            for g in g_left:
                issues.append(f"The response is missing a call to `{g.name}`{self._with_args(g)}")
            for c in p_left:
                issues.append(f"The response makes an extra call to `{c.name}` that the request does not need")
        for c, g in pairs:
            issues.extend(self._arg_issues(c, g, query))
        if not issues:  # e.g. duplicate calls that pair up differently
            return "The tool calls do not match the expected calls."
        shown = issues[: self.max_issues]
        more = len(issues) - len(shown)
        text = " ".join(f"{i}." for i in shown)
        if more:
            text = text[:-1] + f", and {more} other issue{'s' if more > 1 else ''} remain{'' if more > 1 else 's'}."
        return text

    def _with_args(self, g: ToolCall) -> str:
        """A needed call's arguments, at the value-revealing levels (where the analysis states values)."""
        if self.reveal in VALUE_LEVELS and g.arguments:
            return f" with {_args_text(g)}"
        return ""

    def _hint(self, value: Any, query: str) -> str:
        if self.reveal in VALUE_LEVELS:
            return f"; the expected value is {_q(value)}"
        if self.reveal == "query":
            span = query_span(query, value)
            if span:
                return f"; the request says \"{span}\""
        return ""

    def _arg_issues(self, c: ToolCall, g: ToolCall, query: str) -> list[str]:
        out: list[str] = []
        pa, ga = dict(c.arguments), dict(g.arguments)
        call = f"The call to `{g.name}`"
        for k in ga:
            if k not in pa:
                out.append(f"{call} is missing the argument '{k}'{self._hint(ga[k], query)}")
        for k in ga:
            if k in pa and normalize_value(pa[k]) != normalize_value(ga[k]):
                if not _same_kind(pa[k], ga[k]):
                    out.append(f"{call} gives '{k}' as {_a(_type_name(pa[k]))} ({_q(pa[k])}) but it "
                               f"should be {_a(_type_name(ga[k]))}{self._hint(ga[k], query)}")
                else:
                    out.append(f"{call} has the wrong value {_q(pa[k])} for '{k}'{self._hint(ga[k], query)}")
        for k in pa:
            if k not in ga:
                out.append(f"{call} passes the argument '{k}', which the expected call does not use")
        return out

