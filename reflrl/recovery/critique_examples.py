"""Critique-following examples for the warm-up: q* of a policy error -> the gold call.

Tool-ReRL samples a repair tau* from the same policy under the augmented query q* = [q, t, a, rfl]
(sec. 3.2; appendix C's retry prompt). A small policy warmed up on gold answers alone does not read
that prompt: it writes the call it memorised, whatever the critique says. So a share of the warm-up's
examples (``warmup.critique_share``) teach it to act on a critique: each takes a task's gold call,
makes one mistake a policy makes (the wrong tool, a wrong value or a dropped argument; seeded), has
the ground-truth rule critic judge that attempt at a level whose analysis names the fix
(``warmup.critique_reveal``: the expected values, the expected call), and renders q* exactly as the
RL phase's reflection retries do (:func:`reflrl.recovery.reflection.augmented_messages`, in
``reflection.mode``); the target is the gold call (:func:`reflrl.sft.example_from_messages`).

Policy errors only: no example shows a tool failing, a fault's critique or a change of the tools' API
(the critic is asked without an env fault), so acting on a misbehaving tool is still left to RL. The
task's own prompt q never holds the answer; only the critique does, as at RL time.

Names from the context (``warmup.rename_share``): a policy that learnt one catalogue writes its names
from memory, so an example may first rename one name of its task's catalogue (a parameter of the gold
call, or the gold tool; :func:`renamed_task`), in the tool list of the prompt and in the target alike.
A gold demonstration of a renamed task teaches taking names from the tool list; a critique example of one
shows the attempt with the name as it was (``stale_name``: the memorised call, a policy error against
this catalogue) and its critique naming the call to make. Neither shows a tool error or an API change.

Pure: no torch; the critic and the task's messages are passed in.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from reflrl.critic.base import CritiqueRequest
from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.prompts import tool_schema
from reflrl.envs.rewards import calls_match
from reflrl.envs.types import Task, ToolCall

from .reflection import Attempt, Messages, last_user_index, augmented_messages

CORRUPTIONS = ("wrong_tool", "wrong_value", "dropped_argument")
STALE = "stale_name"  # the corruption of a renamed task's example: the call with the name as it was


@dataclass
class CritiqueExample:
    """One critique-following example: ``messages`` (q*) -> ``gold`` (the target).

    corruption: which mistake ``attempt`` makes (one of :data:`CORRUPTIONS`).
    attempt:    the corrupted gold call(s), shown in q* as the failed action.
    feedback:   the critic's analysis of ``attempt`` (the reflection in q*).
    """

    task: Task
    corruption: str
    attempt: list[ToolCall]
    feedback: str
    messages: Messages
    gold: list[ToolCall]


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool))


def _other_value(key: str, v: Any, rng: random.Random, pool: dict[str, list[Any]]) -> Any:
    """A different value of the same type for argument ``key``: one the data gives that argument
    elsewhere, or a small edit of ``v``; None for a value that is not a string, number or boolean."""
    same = [p for p in pool.get(key, ()) if type(p) is type(v) and p != v]
    if same and rng.random() < 0.8:
        return rng.choice(same)
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.choice((-2, -1, 1, 2, 10))
    if isinstance(v, float):
        return round(v * rng.choice((0.5, 1.5, 2.0)) + 1.0, 2)
    if isinstance(v, str):
        return v[: max(1, len(v) // 2)] if len(v) > 3 else v + "s"
    return None


def corrupt(gold: Sequence[ToolCall], tool_names: Sequence[str], rng: random.Random,
            pool: dict[str, list[Any]] | None = None, kind: str | None = None) -> tuple[str, list[ToolCall]] | None:
    """``(corruption, calls)``: ``gold`` with one mistake (``kind``, or the first of the
    :data:`CORRUPTIONS` in a seeded order that applies), on one call picked by ``rng``; the calls
    never match ``gold``. None when no mistake applies (e.g. one tool offered and no argument).

    - wrong_tool: the call names another tool of ``tool_names`` (its arguments kept);
    - wrong_value: one string, number or boolean argument gets another value of its type
      (``pool``: the values the data gives each argument name);
    - dropped_argument: one argument is left out."""
    if kind is not None and kind not in CORRUPTIONS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(CORRUPTIONS)}")
    if not gold:
        return None
    kinds = [kind] if kind else rng.sample(CORRUPTIONS, len(CORRUPTIONS))
    for k in kinds:
        calls = [ToolCall(c.name, copy.deepcopy(dict(c.arguments))) for c in gold]
        i = rng.randrange(len(calls))
        c = calls[i]
        if k == "wrong_tool":
            others = sorted(set(tool_names) - {c.name})
            if not others:
                continue
            calls[i] = ToolCall(rng.choice(others), dict(c.arguments))
        elif k == "wrong_value":
            keys = sorted(a for a, v in c.arguments.items() if _scalar(v))
            if not keys:
                continue
            key = rng.choice(keys)
            new = _other_value(key, c.arguments[key], rng, pool or {})
            if new is None:
                continue
            c.arguments[key] = new
        else:  # dropped_argument
            if not c.arguments:
                continue
            c.arguments.pop(rng.choice(sorted(c.arguments)))
        if not calls_match(calls, list(gold)):
            return k, calls
    return None


def renamed_task(task: Task, rng: random.Random) -> Task | None:
    """``task`` with one name of its catalogue renamed, in its tool list and its gold calls alike: a
    parameter of a gold call (a synonym, the camelCase form or a prefixed or suffixed variant) or a gold
    call's tool (``<tool>_v2``-style), picked by ``rng``; the request is the same. None for a task with no
    gold call. The new name is not one of the tool's parameters (tools) already."""
    from reflrl.faults.evolve import param_pool, successor_pool

    if not task.gold or not task.gold[0]:
        return None
    schemas = [copy.deepcopy(tool_schema(t)) for t in task.tools]
    by_name = {sc["name"]: sc for sc in schemas}
    target = rng.choice(list(task.gold[0]))
    sc = by_name.get(target.name)
    if sc is None:
        return None
    props = (sc.get("parameters") or {}).get("properties") or {}
    keys = sorted(k for k in target.arguments if k in props)
    rename = lambda c, f: ToolCall(*f(c.name, dict(c.arguments)))  # noqa: E731
    if keys and rng.random() < 0.5:
        old = rng.choice(keys)
        free = [n for n in param_pool(old) if n not in props]
        if not free:
            return None
        new = rng.choice(free)
        params = sc["parameters"]
        params["properties"] = {(new if k == old else k): v for k, v in props.items()}
        if isinstance(params.get("required"), list):
            params["required"] = [new if k == old else k for k in params["required"]]

        def fix(name: str, args: dict) -> tuple[str, dict]:
            if name != target.name:
                return name, args
            return name, {(new if k == old else k): v for k, v in args.items()}
    else:
        old = target.name
        free = [n for n in successor_pool(old) if n not in by_name]
        if not free:
            return None
        new = rng.choice(free)
        sc["name"] = new

        def fix(name: str, args: dict) -> tuple[str, dict]:
            return (new if name == old else name), args
    gold = [[rename(c, fix) for c in turn] for turn in task.gold]
    return replace(task, tools=schemas, gold=gold, meta={**task.meta, "renamed": {"from": old, "to": new}})


def critique_examples(tasks: Sequence[Task], *, messages_fn: Callable[[Task], Messages], critic: Any, fmt: str,
                      count: int, seed: int, mode: str = "replace", rename_share: float = 0.0) -> list[CritiqueExample]:
    """Up to ``count`` critique-following examples (module doc) from ``tasks`` with gold calls, taken in a
    seeded order (each task once before any twice): a corrupted gold call (:func:`corrupt`), ``critic``'s
    negative analysis of it, and q* built from ``messages_fn(task)`` as a reflection retry builds it
    (the request the critic sees is the last user message of q, the attempt is the corrupted call
    written in ``fmt``). A task where no mistake applies, whose mistake ``fmt`` cannot write, or whose
    critique is positive or gives no reflection, is skipped; fewer than ``count`` come back only when no task gives one any more.
    ``rename_share``: the share of examples made on a renamed task (:func:`renamed_task`) whose attempt is
    the gold call with the name as it was (:data:`STALE`). The same arguments give the same examples."""
    rng = random.Random(seed)
    usable = [t for t in tasks if t.gold and t.gold[0]]
    pool: dict[str, list[Any]] = {}
    for t in usable:
        for c in t.gold[0]:
            for k, v in c.arguments.items():
                if _scalar(v) and v not in pool.setdefault(k, []):
                    pool[k].append(v)
    out: list[CritiqueExample] = []
    order: list[Task] = []
    misses = 0  # tasks in a row that gave no example: a whole pass of them ends the search
    while usable and len(out) < count and misses < len(usable):
        if not order:
            order = rng.sample(usable, len(usable))
        t = order.pop()
        made = None
        if rename_share > 0 and rng.random() < rename_share:
            renamed = renamed_task(t, rng)
            if renamed is not None:  # the memorised call, against the renamed catalogue
                made, t = (STALE, list(t.gold[0])), renamed
        gold = list(t.gold[0])
        if made is None:
            made = corrupt(gold, [tool_schema(s)["name"] for s in t.tools], rng, pool)
        if made is None:
            misses += 1
            continue
        kind, bad = made
        try:
            text = format_calls(bad, fmt).strip()
        except ValueError:  # a call this format cannot write
            misses += 1
            continue
        q = messages_fn(t)
        query = str(q[last_user_index(q)].get("content") or t.query)
        c = critic.critique(CritiqueRequest(query=query, tools=list(t.tools), response=text,
                                            parse=parse(text, fmt), gold=gold))
        if c.positive or c.reflection is None:
            misses += 1
            continue
        misses = 0
        out.append(CritiqueExample(t, kind, bad, c.reflection,
                                   augmented_messages(q, [Attempt("", text, c.reflection)], mode), gold))
    return out


def critique_count(share: float, demonstrations: int) -> int:
    """How many critique examples make them ``share`` of the warm-up's examples beside
    ``demonstrations`` gold answers: round(share / (1 - share) * demonstrations)."""
    if not 0 <= share < 1:
        raise ValueError(f"share={share}: must be in [0, 1)")
    return round(share / (1 - share) * demonstrations)
