"""The critic prompt and answer format of Tool-ReRL, appendix C (Reflective Reinforcement Tool Learning).

- :data:`CRITIC_INSTRUCTION`: "The full critic instruction" of appendix C, verbatim (the PDF's
  line wraps inside sentences are joined; the two format lines are kept as lines).
- :data:`EVALUATION_TEMPLATE`: appendix C's "Evaluation Prompt" template, verbatim.
- :func:`render_evaluation`: fills it with the response and the ground truth.
- :func:`parse_critique`: a STRICT parser of the ``Score: ...`` / ``Analysis: ...`` answer. It never
  raises; anything that is not in the format gives ``ok=False`` and an error saying why.
- :func:`describe_env_fault`: the one-sentence analysis of an environment fault (all critics use
  it: an env fault is not the policy's error, and its description needs no model).

Parser rules (what "strict" means here):

1. An optional leading ``<think>...</think>`` block is removed (reasoning models such as
   DeepSeek-R1, the paper's "external" reasoner, emit one); nothing else is skipped.
2. The first non-empty line must be ``Score: positive`` or ``Score: negative``. The label is
   exactly ``Score:``; the value is case-insensitive (the paper's own example writes
   ``Score: Positive``) and may end with one period. Markdown (``**Score:**``), bullets or a
   preamble before the Score line make the answer unparseable.
3. The next non-empty line must start with ``Analysis:``; the analysis is the rest of that line
   plus any following lines (the paper's example wraps it), whitespace collapsed. It must be
   non-empty, contain no second ``Score:``/``Analysis:`` line, and be at most
   :data:`MAX_ANALYSIS_CHARS` characters.
4. Inputs longer than :data:`MAX_CHARS` are refused without scanning; non-strings are refused.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from reflrl.envs.types import ToolCall
from reflrl.faults.kinds import CHANGE_KINDS

from .base import EnvFault, Score

# Appendix C, "The full critic instruction is shown below".
CRITIC_INSTRUCTION = (
    "You are a critic agent tasked with assessing whether the response's reasoning process and "
    "agent response align with the ground truth. When the response involves tool usage, ensure "
    "that its final output constitutes a valid tool call. Provide a consistent and objective "
    "evaluation.\n"
    "\n"
    "Format your answer as follows:\n"
    "Score: positive or negative\n"
    "Analysis: Provide a single sentence explanation detailing why the response is effective or "
    "ineffective, avoiding bullet points. Please be concise in your reasoning."
)

# Appendix C, "Evaluation Prompt ... The critic receives the following evaluation template".
EVALUATION_TEMPLATE = (
    "Analyze this interaction:\n"
    "agent response: {response}\n"
    "the ground truths of the questions: {ground_truth}"
)

MAX_CHARS = 16 * 1024
MAX_ANALYSIS_CHARS = 2000

_THINK_RE = re.compile(r"\A\s*<think>.*?</think>", re.S)
_SCORE_RE = re.compile(r"\AScore:[ \t]*(positive|negative)\.?[ \t]*\Z", re.I)
_ANALYSIS_RE = re.compile(r"\AAnalysis:(.*)\Z", re.S)
_LABEL_RE = re.compile(r"\A\s*(Score|Analysis)\s*:", re.I)


def format_calls_for_critic(calls: list[ToolCall]) -> str:
    """Calls as appendix C writes them: ``[Market(trend_type="MARKET_INDEXES", country="us")]``.

    Values are JSON literals (strings in double quotes); names that are not identifiers are kept.
    """
    parts = []
    for c in calls:
        args = ", ".join(f"{k}={_literal(v)}" for k, v in c.arguments.items())
        parts.append(f"{c.name}({args})")
    return "[" + ", ".join(parts) + "]"


def _literal(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return repr(v)


def render_ground_truth(gold: list[ToolCall] | None, query: str = "") -> str:
    """The ``{ground_truth}`` slot: the gold calls in appendix C's notation. With no gold (model
    critics may run without it) the slot says so and gives the user request instead; with an empty
    gold list (no call is needed) it says that."""
    if gold is None:
        return f"not available; judge the response against the user request: {json.dumps(query, ensure_ascii=False)}"
    if not gold:
        return "no tool call is needed; the agent should answer in plain text"
    return format_calls_for_critic(gold)


def render_evaluation(response: str, ground_truth: str) -> str:
    """Appendix C's evaluation template filled with ``response`` and ``ground_truth``."""
    return EVALUATION_TEMPLATE.format(response=response, ground_truth=ground_truth)


def critic_messages(response: str, gold: list[ToolCall] | None, query: str = "",
                    instruction: str = CRITIC_INSTRUCTION) -> list[dict[str, str]]:
    """Chat messages for a model critic: the instruction as the system message, the filled
    evaluation template as the user message (appendix C)."""
    return [
        {"role": "system", "content": instruction},
        {"role": "user", "content": render_evaluation(response, render_ground_truth(gold, query))},
    ]


@dataclass(frozen=True)
class ParsedCritique:
    """Result of :func:`parse_critique`: ``ok`` with score and analysis, or ``error``."""

    ok: bool
    score: Score = "negative"
    analysis: str = ""
    error: str | None = None


def _bad(error: str) -> ParsedCritique:
    return ParsedCritique(False, "negative", "", error)


def parse_critique(text: Any) -> ParsedCritique:
    """Parse a critic answer in the Score/Analysis format (appendix C); see the module doc for
    the exact rules. Never raises: a bad answer gives ``ok=False``, score "negative", analysis ""
    and an ``error``."""
    try:
        return _parse(text)
    except Exception as e:  # noqa: BLE001 - the contract is "never raises" for any input
        return _bad(f"parser error: {type(e).__name__}")


def _parse(text: Any) -> ParsedCritique:
    if not isinstance(text, str):
        return _bad(f"critic answer is {type(text).__name__}, not text")
    if len(text) > MAX_CHARS:
        return _bad(f"critic answer is {len(text)} characters (limit {MAX_CHARS})")
    body = _THINK_RE.sub("", text, count=1)
    lines = [ln.strip() for ln in body.splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return _bad("empty critic answer")
    m = _SCORE_RE.match(lines[0])
    if m is None:
        return _bad(f"first line is not 'Score: positive|negative': {lines[0][:80]!r}")
    score: Score = "positive" if m.group(1).lower() == "positive" else "negative"
    if len(lines) < 2:
        return _bad("no 'Analysis:' line after the Score line")
    a = _ANALYSIS_RE.match(lines[1])
    if a is None:
        return _bad(f"second line does not start with 'Analysis:': {lines[1][:80]!r}")
    rest = lines[2:]
    for ln in rest:
        if _LABEL_RE.match(ln):
            return _bad(f"more than one Score/Analysis line: {ln[:80]!r}")
    analysis = " ".join(" ".join([a.group(1)] + rest).split())
    if not analysis:
        return _bad("empty analysis")
    if len(analysis) > MAX_ANALYSIS_CHARS:
        return _bad(f"analysis is {len(analysis)} characters (limit {MAX_ANALYSIS_CHARS})")
    return ParsedCritique(True, score, analysis, None)


def format_critique(score: str, analysis: str) -> str:
    """Render a verdict in the format :func:`parse_critique` accepts (the inverse)."""
    if score not in ("positive", "negative"):
        raise ValueError(f"score must be 'positive' or 'negative', got {score!r}")
    return f"Score: {score}\nAnalysis: {' '.join(analysis.split())}"


# ----------------------------------------------------------------------------------------------
# environment faults (sec. 3.2: failures from "API limits, network disruptions, tool instability")


def _secs(s: float) -> str:
    if not math.isfinite(s):
        return "a while"
    if abs(s - round(s)) < 1e-9:
        return f"{int(round(s))} s"
    return f"{s:.1f} s"


def _fault_answer(f: EnvFault) -> str:
    """What the tool answered, e.g. ``429 (rate_limit) with Retry-After 2 s``, ``no answer (timeout)``."""
    head = f"{f.status}" if f.status else "no answer"
    ra = f" with Retry-After {_secs(f.retry_after_s)}" if f.retry_after_s is not None else ""
    return f"{head} ({f.kind}){ra}"


def _call_text(f: EnvFault) -> str:
    import json

    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in (f.arguments or {}).items())
    return f"{f.tool}({args})" if f.arguments is not None else f"`{f.tool}`"


def describe_visible_fault(fault: EnvFault) -> str:
    """For a failure caused by a fault the policy was shown and did not act on: the call was right, what
    the tool answered (status, kind, Retry-After) and what would have worked, e.g. ``"Your call was right;
    the tool answered 429 (rate_limit) with Retry-After 2 s to get_weather(city="Paris"); call it again
    with the same arguments."`` A parallel answer's failed calls are each named (the others got answers)."""
    faults = (fault, *fault.also)
    if any(f.kind in CHANGE_KINDS for f in faults):
        return " ".join(describe_api_change(f) if f.kind in CHANGE_KINDS else
                        f"The tool answered {_fault_answer(f)} to {_call_text(f)}; call it again with the same arguments."
                        for f in faults)
    if len(faults) == 1:
        return (f"Your call was right; the tool answered {_fault_answer(fault)} to {_call_text(fault)}; "
                "call it again with the same arguments.")
    told = "; ".join(f"{_fault_answer(f)} to {_call_text(f)}" for f in faults)
    return (f"Your calls were right; the tool answered {told}; call each of these again with the same "
            "arguments.")


def fault_fix_calls(fault: EnvFault) -> list[ToolCall]:
    """The calls that would have worked in place of a shown fault's calls (``fault`` and ``fault.also``;
    one per distinct call): the same call again, or for an API change the adapted call (the new
    parameter name, the successor tool). [] when a fault does not carry its call's arguments."""
    out: list[ToolCall] = []
    for f in (fault, *fault.also):
        if f.arguments is None or not f.tool:
            continue
        args, name = dict(f.arguments), f.tool
        if f.kind == "param_renamed" and f.param and f.new:
            args = {(f.new if k == f.param else k): v for k, v in args.items()}
        elif f.kind == "tool_moved" and f.new:
            name = f.new
        c = ToolCall(name, args)
        if all((c.name, c.arguments) != (o.name, o.arguments) for o in out):
            out.append(c)
    return out


def adapt_calls(calls: list[ToolCall], changes: list[dict[str, Any]] | None) -> list[ToolCall]:
    """``calls`` as the changed API takes them: a moved tool's call goes to its successor, a renamed
    parameter gets its new name. ``changes``: the server's record of the episode's API changes (dicts
    with ``kind``, ``tool``, ``param``, ``new``; ``ToolCallEnv``'s ``info["api_changes"]``). The inverse of
    ``reflrl.envs.tool_env.canonical_call``; a call no change concerns is returned as it is."""
    out = []
    for c in calls:
        name, args = c.name, dict(c.arguments)
        for ch in changes or []:
            if ch.get("tool") != c.name or not ch.get("new"):
                continue
            if ch.get("kind") == "param_renamed" and ch.get("param") in args and ch["new"] not in args:
                args = {(ch["new"] if k == ch["param"] else k): v for k, v in args.items()}
            elif ch.get("kind") == "tool_moved":
                name = str(ch["new"])
        out.append(ToolCall(name, args) if (name, args) != (c.name, dict(c.arguments)) else c)
    return out


def describe_changes(calls: list[ToolCall], changes: list[dict[str, Any]] | None) -> str:
    """One sentence per API change that concerns ``calls`` (see :func:`adapt_calls`): ``"The API changed:
    get_air_quality now takes 'location' in place of 'city'."`` / ``"The API changed: get_air_quality was
    retired for get_air_quality_v2, which takes the same arguments."``; "" when none does."""
    said: list[str] = []
    for ch in changes or []:
        if not ch.get("new") or not any(c.name == ch.get("tool") for c in calls):
            continue
        if ch.get("kind") == "param_renamed" and any(ch.get("param") in c.arguments for c in calls
                                                   if c.name == ch.get("tool")):
            s = f"The API changed: {ch['tool']} now takes '{ch['new']}' in place of '{ch['param']}'."
        elif ch.get("kind") == "tool_moved":
            s = f"The API changed: {ch['tool']} was retired for {ch['new']}, which takes the same arguments."
        else:
            continue
        if s not in said:
            said.append(s)
    return " ".join(said)


def describe_api_change(fault: EnvFault) -> str:
    """The fix an API change asks for, from the server's record of it (``fault.param`` / ``fault.new``;
    else its message in ``fault.detail``), with the call to make: ``"Your call was right but the API
    changed: get_current_weather now takes 'location' in place of 'city': call
    get_current_weather(location="Paris")."`` / ``"get_air_quality was retired; call get_air_quality_v2
    with the same arguments: get_air_quality_v2(city="Paris")."``"""
    import json

    args = dict(fault.arguments or {})
    if fault.kind == "param_renamed" and fault.param and fault.new:
        new_args = {(fault.new if k == fault.param else k): v for k, v in args.items()}
        call = f"{fault.tool}({', '.join(f'{k}={json.dumps(v, ensure_ascii=False, default=str)}' for k, v in new_args.items())})"
        return (f"Your call was right but the API changed: the tool {fault.tool} now takes '{fault.new}' in place "
                f"of '{fault.param}': call {call}.")
    if fault.kind == "tool_moved" and fault.new:
        call = _call_text(EnvFault(fault.kind, fault.new, arguments=args))
        return (f"Your call was right but the API changed: {fault.tool} was retired; call {fault.new} with the "
                f"same arguments: {call}.")
    said = f": {fault.detail}" if fault.detail else ""
    return (f"Your call was right but the API changed ({fault.kind}){said}; make the call the way the "
            "tool's answer says.")


def describe_env_fault(fault: EnvFault) -> str:
    """One sentence saying what the environment did and what to do, e.g.
    ``"The tool `get_weather` answered 429 rate limit; retry after 2 s."``

    Used by every critic for env faults: the failure is not the policy's, so the reflection
    names the fault kind (and status, Retry-After, attempts already spent) rather than judging
    the call. A fault the policy was shown and did not act on (``fault.visible``):
    :func:`describe_visible_fault`.
    """
    if fault.visible:
        return describe_visible_fault(fault)
    if fault.kind in CHANGE_KINDS:
        return describe_api_change(fault)
    tool = f"The tool `{fault.tool}`" if fault.tool else "The tool"
    st = f"HTTP {fault.status}" if fault.status else None
    tried = f" after {fault.attempts} attempts" if fault.attempts and fault.attempts > 1 else ""
    k = fault.kind
    if k == "rate_limit":
        code = str(fault.status or 429)
        wait = f"; retry after {_secs(fault.retry_after_s)}" if fault.retry_after_s is not None else "; retry later"
        return f"{tool} answered {code} rate limit{tried}{wait}."
    if k == "server_error":
        return (f"{tool} answered {st or 'a 5xx'} server error{tried}; the call may be correct, "
                "so retry the same call.")
    if k == "timeout":
        return f"{tool} did not answer in time (timeout{tried}); retry the same call."
    if k == "connection":
        return f"The connection to {tool[4:] if fault.tool else 'the tool'} was reset before it answered{tried}; retry the same call."
    if k == "truncated":
        return f"{tool} answer was cut off (truncated response{tried}); the call ran, so retry it."
    if k == "malformed":
        return f"{tool} returned a malformed, non-JSON answer{tried}; retry the same call."
    if k == "ip_ban":
        return (f"{tool} refused this client ({st or 'HTTP 403'}, IP banned{tried}); the call is "
                "not at fault, so retry from another client or later.")
    if k == "invalid_file":
        return f"{tool} returned a corrupt or missing file{tried}; retry or check the file path."
    if k == "latency":
        return f"{tool} answered too slowly{tried}; retry the same call."
    if k == "schema_drift":
        return (f"{tool} returned a result whose fields do not match its schema{tried}; retry "
                "the call and read the result carefully.")
    extra = f", {st}" if st else ""
    return f"{tool} failed with an environment fault ({k}{extra}{tried}); the call itself was not at fault, so retry it."


def critique_from_text(raw: Any, t0: float) -> "Critique":
    """A model critic's answer text -> Critique, parsed strictly (unparseable: counted negative with
    no reflection, never an exception); ``t0`` is the ``time.perf_counter()`` at the request."""
    from .base import Critique, unparsed

    lat = time.perf_counter() - t0
    text = raw if isinstance(raw, str) else ""
    p = parse_critique(text)
    if not p.ok:
        return unparsed(text, lat)
    return Critique(p.score, p.analysis, raw=text, parsed=True, latency_s=lat)


def fault_critique(fault: EnvFault, t0: float) -> "Critique":
    """An env fault needs no model: a negative critique whose analysis describes the fault."""
    from .base import Critique

    a = describe_env_fault(fault)
    return Critique("negative", a, raw=format_critique("negative", a), parsed=True,
                    latency_s=time.perf_counter() - t0)
