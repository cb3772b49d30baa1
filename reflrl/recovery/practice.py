"""Reflection practice for the warm-up: SFT examples that teach a small policy to act on a critique.

Tool-ReRL (Reflective Reinforcement Tool Learning, sec. 3.2, Assumption 1) samples the repair tau*
from the SAME policy under the augmented query q* = [q, t, a, rfl]; its policies are 7B instruction
models that follow appendix C's retry prompt out of the box. A 135M model warmed up on q -> gold calls
only has never seen that prompt, and measured recovery with it stayed near 1-2%. So, as a documented
design decision for small models (``warmup.reflection_share``, 0 = off), a share of the warm-up's
examples are q* -> gold: q* holds a plausibly wrong first attempt at the task (one of the mistakes a
policy makes: a missing or extra argument, a wrong value, the wrong tool, a missing call of a parallel
answer) and the critic's analysis of it, rendered exactly as the trainer renders q* for a real failure
(:func:`reflrl.recovery.reflection.augmented_messages`); the target is the gold answer. The policy's
prompt q never carries the ground truth: only the critic sees it, as at RL time.
"""
from __future__ import annotations

import copy
import random
from typing import Any, Callable, Sequence

from reflrl.critic.base import CritiqueRequest
from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.prompts import tool_schema
from reflrl.envs.types import Task, ToolCall

from .reflection import Attempt, augmented_messages

MISTAKES = ("missing_argument", "wrong_value", "wrong_tool", "missing_call", "extra_argument")


def _other_value(v: Any, rng: random.Random, pool: Sequence[Any]) -> Any:
    """A different value of the same kind: one seen elsewhere in the data, or a small edit."""
    same = [p for p in pool if type(p) is type(v) and p != v]
    if same and rng.random() < 0.7:
        return rng.choice(same)
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.choice((-2, -1, 1, 2, 10))
    if isinstance(v, float):
        return round(v * rng.choice((0.5, 2.0, 1.5)), 2)
    if isinstance(v, str):
        return v[: max(1, len(v) // 2)] if len(v) > 3 else v + "s"
    return None


def mistake(gold: Sequence[ToolCall], tools: Sequence[dict], rng: random.Random, pool: Sequence[Any],
            kind: str | None = None) -> list[ToolCall] | None:
    """``gold`` with one policy-like mistake (``kind`` or a random applicable one); None if none applies."""
    calls = [ToolCall(c.name, copy.deepcopy(dict(c.arguments))) for c in gold]
    kinds = [kind] if kind else list(MISTAKES)
    rng.shuffle(kinds)
    names = [tool_schema(t)["name"] for t in tools]
    for k in kinds:
        i = rng.randrange(len(calls))
        c = calls[i]
        if k == "missing_argument" and c.arguments:
            c.arguments.pop(rng.choice(sorted(c.arguments)))
        elif k == "wrong_value" and c.arguments:
            key = rng.choice(sorted(c.arguments))
            new = _other_value(c.arguments[key], rng, pool)
            if new is None or new == c.arguments[key]:
                continue
            c.arguments[key] = new
        elif k == "wrong_tool" and len(set(names) - {c.name}) > 0:
            calls[i] = ToolCall(rng.choice(sorted(set(names) - {c.name})), dict(c.arguments))
        elif k == "missing_call" and len(calls) > 1:
            calls.pop(i)
        elif k == "extra_argument":
            c.arguments[rng.choice(("limit", "note", "id", "lang"))] = rng.choice((1, "x", True))
        else:
            continue
        return calls
    return None


def practice_messages(tasks: Sequence[Task], *, messages_fn: Callable[[Task], list[dict]], critic: Any,
                      fmt: str, count: int, seed: int, mode: str = "replace") -> list[tuple[Task, list[dict]]]:
    """``count`` (task, q*) pairs: for tasks drawn with ``seed``, a mistaken first attempt, the critic's
    negative analysis of it, and q* rendered as for a real failure. Tasks without gold calls are skipped."""
    rng = random.Random(seed)
    usable = [t for t in tasks if t.gold and t.gold[0]]
    pool = [v for t in usable for c in t.gold[0] for v in c.arguments.values()
            if isinstance(v, (str, int, float, bool))]
    out: list[tuple[Task, list[dict]]] = []
    tries = 0
    while usable and len(out) < count and tries < 20 * count:
        tries += 1
        t = rng.choice(usable)
        bad = mistake(t.gold[0], t.tools, rng, pool)
        if bad is None:
            continue
        text = format_calls(bad, fmt)
        c = critic.critique(CritiqueRequest(query=t.query, tools=list(t.tools), response=text,
                                            parse=parse(text, fmt), gold=list(t.gold[0])))
        if c.positive or not c.analysis:
            continue
        out.append((t, augmented_messages(messages_fn(t), [Attempt("", text, c.analysis)], mode)))
    return out
