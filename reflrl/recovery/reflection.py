"""Reflection-guided retries: the retry prompt, the augmented query q*, and the repair driver.

Tool-ReRL (Reflective Reinforcement Tool Learning):

- sec. 3.2: for a failed trajectory, a reflection module writes a reflection ``rfl`` and the
  augmented query ``q* = [q, t, a, rfl]`` (query, the model's thought, its failed action, the
  reflection) guides the policy to a revised trajectory ``tau*``;
- sec. 3.3, Definition 1 (ii): "tau* is obtained via iterative sampling with early stopping: at
  each round, the model generates a candidate under q*, and the process stops once a valid
  trajectory is found or a maximum number of attempts is reached";
- appendix C, Step 3: the failure history and the critic's analysis are embedded in the retry
  prompt ``Your previous attempt had issues. History: Attempt 1: ... Feedback: ... Original
  request: "..." Please try again.``; "The model retries until a Positive score is obtained or a
  maximum retry limit is reached".
- Assumption 1: the behaviour policy of tau* is approximated by pi_theta(tau* | q*), so the
  per-token log-probs of tau* under q* AT SAMPLING TIME are recorded (``RepairRecord``) for the
  importance weight of eq. 2 (:mod:`reflrl.algos.importance`).

Pure: no torch, no trainer imports. The rollout passes its own ``generate`` and ``step_env``
callables to :func:`reflect_and_retry`.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

from reflrl.critic.base import Critic, CriticStats, Critique, CritiqueRequest, EnvFault
from reflrl.envs.types import ParseResult, Task, ToolCall

Messages = list[dict[str, Any]]

RETRY_HEADER = "Your previous attempt had issues. History:"
RETRY_FOOTER = "Please try again."
MODES = ("replace", "append")


@dataclass
class Attempt:
    """One failed attempt in the history of the retry prompt: the model's thought ``t``, its
    action ``a`` (the tool-call text as the model wrote it) and the critic's feedback ``rfl``."""

    thought: str
    action: str
    feedback: str


_THINK_RE = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.S)


def split_response(text: str) -> tuple[str, str]:
    """(thought, action) of a response: a leading ``<think>...</think>`` block is the thought
    (tags removed), the rest the action; without such a block the whole text is the action."""
    m = _THINK_RE.match(text)
    if m is None:
        return "", text.strip()
    return " ".join(m.group(1).split()), text[m.end():].strip()


def build_retry_prompt(query: str, attempts: list[Attempt]) -> str:
    """The retry prompt of appendix C (Step 3)::

        Your previous attempt had issues. History:
        Attempt 1: [Market(trend_type="MARKET_INDEXES", country="us")]
        Feedback: Missing optional parameter 'language', which this endpoint expects.

        Original request: "I'm considering investing... top market trends in the US."
        Please try again.

    One ``Attempt i:`` / ``Feedback:`` block per attempt, oldest first, separated by blank lines.
    When an attempt has a thought, the block reads ``Attempt i: Thought: <t>`` then
    ``Action: <a>`` on the next line (q* = [q, t, a, rfl] keeps t before a). The request is
    quoted in full (the paper's example elides it only for space). Raises ValueError for no
    attempts.
    """
    if not attempts:
        raise ValueError("build_retry_prompt needs at least one attempt")
    lines = [RETRY_HEADER]
    for i, a in enumerate(attempts, 1):
        action = a.action.strip() or "(empty response)"
        if a.thought.strip():
            lines.append(f"Attempt {i}: Thought: {a.thought.strip()}")
            lines.append(f"Action: {action}")
        else:
            lines.append(f"Attempt {i}: {action}")
        lines.append(f"Feedback: {' '.join(a.feedback.split()) or '(none)'}")
        lines.append("")
    lines.append(f'Original request: "{query}"')
    lines.append(RETRY_FOOTER)
    return "\n".join(lines)


def last_user_index(messages: Messages) -> int:
    """Index of the last user message in ``messages``; ValueError when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise ValueError("the messages have no user message to reflect on")


def augmented_messages(task_messages: Messages, attempts: list[Attempt], mode: str = "replace") -> Messages:
    """The augmented query q* = [q, t, a, rfl] (sec. 3.2) as chat messages.

    ``task_messages`` is q: the messages the failed response was sampled from (system prompt with
    the tools, the user request, and any earlier steps of this turn).

    - ``mode="replace"`` (default): the last user message's content becomes the retry prompt of
      :func:`build_retry_prompt`, which already holds the original request, the attempts (t, a)
      and the feedback (rfl) -- appendix C's layout; the system prompt and any later messages
      (earlier tool steps of this turn) are kept.
    - ``mode="append"``: q is kept unchanged, the last attempt's text is appended as an assistant
      message and the retry prompt as a new user message (a chat-native rendering of [q, t, a, rfl]).

    Returns new message dicts; ``task_messages`` is not modified.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    if not attempts:
        raise ValueError("augmented_messages needs at least one attempt")
    msgs = [dict(m) for m in task_messages]
    i = last_user_index(msgs)
    query = str(msgs[i].get("content") or "")
    if mode == "replace":
        msgs[i]["content"] = build_retry_prompt(query, attempts)
        return msgs
    last = attempts[-1]
    text = (f"<think>{last.thought}</think>\n{last.action}" if last.thought else last.action)
    return msgs + [{"role": "assistant", "content": text},
                   {"role": "user", "content": build_retry_prompt(query, attempts)}]


# ---- the driver ---------------------------------------------------------------------------------


@dataclass
class Generation:
    """One sampled response: its text, token ids and per-token log-probs under the prompt it was
    sampled from (for a retry: the behaviour log-probs pi_theta(tau* | q*), Assumption 1)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class EnvFeedback:
    """What executing a response in the environment gave.

    parse:      the env's ParseResult of the response (the critic's input).
    reward:     the env's reward for it.
    correct:    the env's correctness verdict (e.g. binary reward == 1).
    env_fault:  set when the response failed because of the environment (after the tool
                client's own retries), e.g. ``EnvFault("rate_limit", "search", 429, 2.0)``.
    tool_calls: billed tool calls the attempt spent (retries included).
    info:       anything else the caller wants to keep (the env's info dict).
    continuation: a response whose episode went on (it met a fault the policy was shown, so the
                policy answered the tool, as in a rollout): each later answer, as (the observation
                tokens before it, the answer sampled under the conversation so far); the verdict above
                is the episode's at its last answer.
    steps:      with a continuation, each step's (reward, info), the response's own first.
    """

    parse: ParseResult | None = None
    reward: float = 0.0
    correct: bool = False
    env_fault: EnvFault | None = None
    tool_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    continuation: list[tuple[list[int], "Generation"]] = field(default_factory=list)
    steps: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


_RETRY_AFTER_RE = re.compile(r"retry_after=([0-9.]+)")


def visible_fault(f: dict[str, Any], also: tuple[EnvFault, ...] = ()) -> EnvFault:
    """The :class:`EnvFault` of a fault the policy was shown (an entry of the env's ``shown_faults`` or
    ``open_faults``): ``visible``, with its call's arguments and an API change's record."""
    ra = f.get("retry_after_s")
    return EnvFault(kind=str(f.get("kind") or "unknown"), tool=str(f.get("name") or ""),
                    status=f.get("status") if isinstance(f.get("status"), int) else None,
                    retry_after_s=float(ra) if ra is not None else None, attempts=int(f.get("attempts") or 1),
                    detail=str(f.get("observation") or ""), visible=True,
                    arguments=dict(f.get("arguments") or {}), also=also,
                    param=f.get("param"), new=f.get("new"))


def env_fault_from_info(info: dict[str, Any]) -> EnvFault | None:
    """The :class:`EnvFault` of an env step, from ``ToolCallEnv.astep``'s info dict, or None.

    A failure caused by faults the policy was shown and did not act on (``info["fault_caused"]``,
    ``env.fault_exposure="policy"``): a *visible* EnvFault of the first open fault, the others in
    ``also``. Otherwise the first call whose triage is "env_fault" (the client's retries gave up on
    it): its ``fault_kind``, tool name and billed attempts, and the HTTP status / Retry-After of
    that call's last observed fault event (``detail`` "retry_after=2.0"). A fault the policy was shown
    and could act on (``shown_faults``, ``policy_can_act``) at the step that ended the turn is not the
    failure's cause when the failure is not ``fault_caused``: the answer would have been wrong without it,
    so it is the policy's error (None). At a step that did not end the turn (a retry that met a fault
    and had not answered it yet) it is the fault still.
    """
    if info.get("fault_caused") and info.get("open_faults"):
        first, *rest = info["open_faults"]
        return visible_fault(first, tuple(visible_fault(f) for f in rest))
    actionable = ({f.get("call_index") for f in info.get("shown_faults") or [] if f.get("policy_can_act")}
                  if info.get("turn_ended") else set())
    for res in info.get("tool_results") or []:
        if res.get("triage") != "env_fault" or res.get("call_index") in actionable:
            continue
        idx = res.get("call_index")
        evs = [e for e in info.get("fault_events") or [] if e.get("call_index") == idx]
        last = evs[-1] if evs else {}
        m = _RETRY_AFTER_RE.search(str(last.get("detail") or ""))
        status = last.get("status")
        return EnvFault(kind=str(res.get("fault_kind") or last.get("kind") or "unknown"),
                        tool=str(res.get("name") or ""),
                        status=int(status) if isinstance(status, int) else None,
                        retry_after_s=float(m.group(1)) if m else None,
                        attempts=int(res.get("attempts") or 1),
                        detail=str(last.get("detail") or res.get("error") or ""))
    return None


def feedback_from_step(info: dict[str, Any], reward: float) -> EnvFeedback:
    """:class:`EnvFeedback` from one ``ToolCallEnv`` step (its info dict and reward): the parse
    (``calls``, ``parse_ok``, ``parse_error``; a call adapted to an API change of the episode, in the
    form of the call it stands for), correctness, billed calls and the env fault."""
    calls = [ToolCall.from_dict(c) for c in info.get("calls") or []]
    if info.get("api_changes"):  # an adapted call is judged as the call it stands for, as the env scores it
        from reflrl.envs.tool_env import canonical_call
        calls = [canonical_call(info["api_changes"], c) for c in calls]
    pr = ParseResult(ok=bool(info.get("parse_ok", True)), calls=calls, error=info.get("parse_error"))
    return EnvFeedback(parse=pr, reward=float(reward), correct=bool(info.get("correct")),
                       env_fault=env_fault_from_info(info), tool_calls=int(info.get("billed_calls") or 0),
                       info=info)


@dataclass
class RepairRecord:
    """Everything kept about one reflection-recovery episode.

    prompt_messages:    q, the original prompt (training on tau* happens under q; eq. 2).
    augmented_messages: q*, the prompt the final response was sampled under ([] when no retry).
    attempts:           the failed attempts with their feedback (the retry prompt's history).
    response_text / response_ids: the final response tau* (the last retry; the first response
                        when no retry was sampled).
    behaviour_logprobs: per-token log-probs of ``response_ids`` under q* at sampling time
                        (pi_theta_rfl of Assumption 1); same length as ``response_ids``.
    recovered:          the final response was judged positive by the critic.
    first:              the original failed response (DPO's "rejected"; sec. 4.1 DPO baseline).
    first_feedback / final_feedback: the env's verdicts on the first and the final response.
    critiques:          every critique made, in order (the first is of the original response).
    cause:              "env_fault" | "policy_error" (triage of the original failure).
    stop_reason:        "first_positive" (nothing to repair), "positive" (repaired),
                        "max_attempts", "critic_unparsed" (no reflection to build q* from).
    retries:            responses sampled under q*.
    tool_calls:         billed tool calls of the retries (the first response's are the rollout's).
    critic_latency_s:   total critic time.
    """

    prompt_messages: Messages
    augmented_messages: Messages
    attempts: list[Attempt]
    response_text: str
    response_ids: list[int]
    behaviour_logprobs: list[float]
    recovered: bool
    first: Generation
    first_feedback: EnvFeedback
    final_feedback: EnvFeedback
    critiques: list[Critique] = field(default_factory=list)
    cause: str = "policy_error"
    stop_reason: str = "max_attempts"
    retries: int = 0
    tool_calls: int = 0
    critic_latency_s: float = 0.0

    @property
    def repaired(self) -> bool:
        """A retry under q* was sampled and judged positive: tau* is a learning signal."""
        return self.recovered and self.retries > 0


MaybeAwaitable = Union[Any, Awaitable[Any]]


async def _call(fn: Callable[..., MaybeAwaitable], *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


async def reflect_and_retry(
    generate: Callable[[Messages], MaybeAwaitable],
    critic: Critic,
    step_env: Callable[[str], MaybeAwaitable],
    task: Task,
    first_response: Generation,
    max_attempts: int,
    *,
    first_feedback: EnvFeedback | None = None,
    messages: Messages | None = None,
    gold: list[ToolCall] | None = None,
    mode: str = "replace",
    stats: CriticStats | None = None,
    fmt: str = "hermes",
) -> RepairRecord:
    """Repair one failed response by critique and reflection-guided retries (Definition 1, ii).

    1. The critic judges the first response (env faults get their description, policy errors a
       comparison with the gold). Positive: nothing to repair (``stop_reason="first_positive"``).
       Unparseable critic answer: no reflection exists, so no retry (``"critic_unparsed"``).
    2. Otherwise, up to ``max_attempts`` times: build q* from all failed attempts so far
       (:func:`augmented_messages`), sample ``generate(q*)`` -> :class:`Generation`, execute it with
       ``step_env(text)`` -> :class:`EnvFeedback`, and ask the critic; stop at the first positive.

    Args:
        generate: q* messages -> Generation (sync or async); its ``logprobs`` must be the
            sampling-time log-probs under q* (Assumption 1).
        critic: any :class:`reflrl.critic.Critic`.
        step_env: response text -> EnvFeedback (sync or async); runs the response's tool calls.
        task: the task (query, tools; gold calls of turn 0 unless ``gold`` is given).
        first_response: the failed response sampled under q.
        max_attempts: maximum number of retries sampled under q* (>= 0).
        first_feedback: the env's verdict on ``first_response``; None: ``step_env`` runs it.
        messages: q (default: ``reflrl.envs.prompts.build_messages(task)``).
        gold: the gold calls of the current turn (default ``task.gold[0]`` when present).
        mode: how q* is rendered (:func:`augmented_messages`).
        stats: a :class:`CriticStats` that records every critique.
        fmt: the answer format (``env.parser``). An attempt failed by a fault the policy was shown
            and did not act on is shown in q* as the call(s) that met the fault, written in ``fmt``,
            not as what the policy wrote after it: that call was right, and the critique says to make
            it again.
    """
    if max_attempts < 0:
        raise ValueError(f"max_attempts={max_attempts}: must be >= 0")
    if messages is None:
        from reflrl.envs.prompts import build_messages
        messages = build_messages(task)
    if gold is None and task.gold:
        gold = list(task.gold[0])
    query = str(messages[last_user_index(messages)].get("content") or task.query)

    async def judge(gen: Generation, fb: EnvFeedback) -> bool:
        """Critique ``gen``, note it in ``rec``; True when the repair loop ends here (a positive
        verdict, or no reflection to retry with), else the attempt and its reflection are kept."""
        req = CritiqueRequest(query=query, tools=list(task.tools), response=gen.text,
                              parse=fb.parse, gold=gold, env_fault=fb.env_fault,
                              api_changes=list((fb.info or {}).get("api_changes") or []) or None)
        c = await critic.acritique(req)
        if stats is not None:
            stats.record(c)
        rec.critiques.append(c)
        rec.critic_latency_s += c.latency_s
        if c.positive:
            rec.recovered, rec.stop_reason = True, "positive" if rec.retries else "first_positive"
            return True
        if c.reflection is None:
            rec.stop_reason = "critic_unparsed"
            return True
        thought, action = split_response(gen.text)
        ef = fb.env_fault
        if ef is not None and ef.visible and ef.arguments is not None:
            from reflrl.envs.parsing import format_calls
            try:
                action = format_calls([ToolCall(f.tool, dict(f.arguments or {})) for f in (ef, *ef.also)], fmt)
            except ValueError:
                pass  # a call this format cannot write: the response as it was
        rec.attempts.append(Attempt(thought, action, c.reflection))
        return False

    fb0 = first_feedback if first_feedback is not None else await _call(step_env, first_response.text)
    rec = RepairRecord(
        prompt_messages=[dict(m) for m in messages], augmented_messages=[], attempts=[],
        response_text=first_response.text, response_ids=list(first_response.token_ids),
        behaviour_logprobs=list(first_response.logprobs), recovered=False, first=first_response,
        first_feedback=fb0, final_feedback=fb0,
        cause="env_fault" if fb0.env_fault is not None else "policy_error",
    )
    if await judge(first_response, fb0):
        return rec
    for _ in range(max_attempts):
        q_star = augmented_messages(messages, rec.attempts, mode=mode)
        gen: Generation = await _call(generate, q_star)
        fb: EnvFeedback = await _call(step_env, gen.text)
        rec.retries += 1
        rec.tool_calls += int(fb.tool_calls)
        rec.augmented_messages = q_star
        rec.response_text, rec.response_ids = gen.text, list(gen.token_ids)
        rec.behaviour_logprobs, rec.final_feedback = list(gen.logprobs), fb
        if await judge(gen, fb):
            return rec
    rec.stop_reason = "max_attempts"
    return rec
