"""Rewards for one assistant turn: parsed prediction vs gold tool calls, chosen by name.

A reward is a function ``reward(pred: ParseResult, gold: list[ToolCall]) -> RewardResult``;
look one up with :func:`get_reward` (registry :data:`REWARDS`; add your own with
:func:`register_reward`).

Registered rewards
------------------
- ``binary``: eq. 8 of "On Effectiveness and Efficiency of Agentic Tool-calling and RL Training"
  (the efficiency paper (arXiv:2606.00135), appendix E): ``r = 1 if FormatCorrect and ToolCallMatch else 0``. FormatCorrect is
  the chosen parser's format check (``pred.ok``: the tool-call markup is present and well formed).
- ``binary_think``: eq. 8 exactly as the paper's single-turn setting states it (following
  Tool-N1): FormatCorrect also requires a ``<think>...</think>`` block, so use it with a prompt
  that asks for one (``prompts.system_prompt(..., think=True)``).
- ``binary_match``: the paper's multi-turn setting ("we remove the limit of format correctness and
  only judge the output based on tool call correctness"): ``r = ToolCallMatch``.
- ``fine``: DSCL's fine-grained reward (sec. 3, eqs. 1-6; itself ToolRL's,
  Qian et al. 2025): format + tool name + parameter keys + parameter values, the correctness part
  mapped to [-3, 3], total in [-3, 4].
- ``fine_stage1`` / ``fine_stage2`` / ``fine_stage3``: DSCL eq. 7 with the stage weights of sec.
  4.1.1 (lambda1, lambda2, lambda3) = (2.5, .5, .5), (.5, 1.5, .5), (.5, .5, 2.5); total in [-3, 4].

ToolCallMatch (the exact-match criterion)
----------------------------------------
The predicted calls equal the gold calls as a *multiset* of (name, arguments): order does not
matter (parallel calls). Argument values are compared after light normalisation
(:func:`normalize_value`): numbers by value (``1 == 1.0``; booleans are not numbers), strings
exactly after stripping surrounding whitespace, lists element-wise, objects key-wise.
``RewardResult.correct`` is ``pred.ok and ToolCallMatch`` for every reward: it is the trainer's
accuracy metric, independent of which reward shapes the training signal.

Env faults are not policy errors
--------------------------------
Rewards are computed on the model's calls only (the parsed message against the gold calls); they
never look at tool responses, so a rate limit, timeout, reset, 5xx ... cannot lower a reward. The
*environment* is responsible for rollouts hit by env faults: it decides whether such a rollout is
masked, retried or reflected, and records that treatment in ``info["env_fault_treatment"]`` (with
``info["triage"]`` and ``info["fault_events"]``) so the trainer can drop or re-weight it.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from .types import ParseResult, ToolCall


@dataclass
class RewardResult:
    """total: the scalar reward; parts: named components (for logs, DSCL's curriculum and
    sampling); correct: exact match with format check (the accuracy metric)."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)
    correct: bool = False


RewardFn = Callable[[ParseResult, list[ToolCall]], RewardResult]


# --------------------------------------------------------------------------------------------
# normalisation and exact match
# --------------------------------------------------------------------------------------------


def normalize_value(v: Any) -> Hashable:
    """A hashable canonical form of an argument value for equality tests.

    Numbers compare by value (an integral float becomes an int, so ``1 == 1.0``); ``True`` is not
    ``1``; strings are stripped of surrounding whitespace; tuples are lists; dict keys are kept
    exact. Anything else compares by ``repr``.
    """
    if v is None:
        return ("none",)
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, int):
        return ("num", v)
    if isinstance(v, float):
        if math.isfinite(v) and v == int(v):
            return ("num", int(v))
        return ("num", v) if not math.isnan(v) else ("nan",)
    if isinstance(v, str):
        return ("str", v.strip())
    if isinstance(v, (list, tuple)):
        return ("list", tuple(normalize_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted(((repr(k), normalize_value(x)) for k, x in v.items()),
                                     key=lambda kv: kv[0])))
    return ("other", repr(v))


def call_key(c: ToolCall) -> Hashable:
    """What exact match compares of one call: its name and its normalised arguments (also used to match
    single calls against the gold ones)."""
    return (c.name, normalize_value(dict(c.arguments)))


def calls_match(pred: list[ToolCall], gold: list[ToolCall]) -> bool:
    """ToolCallMatch: same multiset of (name, normalised arguments); order-insensitive."""
    if len(pred) != len(gold):
        return False
    return Counter(call_key(c) for c in pred) == Counter(call_key(c) for c in gold)


def has_think(pred: ParseResult) -> bool:
    """Tool-N1's thinking-format check as far as a ParseResult shows it: the text outside the
    tool-call markup opens with one ``<think>`` block that is closed."""
    c = pred.content.lstrip()
    return c.startswith("<think>") and c.count("<think>") == 1 and c.count("</think>") == 1


# --------------------------------------------------------------------------------------------
# binary (the efficiency paper (arXiv:2606.00135) appendix E, eq. 8)
# --------------------------------------------------------------------------------------------


def binary_reward(pred: ParseResult, gold: list[ToolCall], *, think: bool = False,
                  check_format: bool = True) -> RewardResult:
    """Eq. 8 (the efficiency paper (arXiv:2606.00135), appendix E): ``r = 1[FormatCorrect and ToolCallMatch]``.

    FormatCorrect = ``pred.ok`` (and, with ``think=True``, a ``<think>`` block as in the paper's
    single-turn setting). ``check_format=False`` is the paper's multi-turn setting (match only).
    """
    fmt = bool(pred.ok) and (not think or has_think(pred))
    match = bool(pred.ok) and calls_match(pred.calls, gold)
    total = 1.0 if (match and (fmt or not check_format)) else 0.0
    return RewardResult(total=total, parts={"format": float(fmt), "match": float(match)},
                        correct=match)


# --------------------------------------------------------------------------------------------
# fine-grained (DSCL sec. 3 eqs. 1-6, sec. 4.1.1 eq. 7)
# --------------------------------------------------------------------------------------------


def _jaccard(a: list[Hashable], b: list[Hashable]) -> float:
    """Multiset Jaccard |A n B| / |A u B|; two empty collections are identical (1.0)."""
    if not a and not b:
        return 1.0
    ca, cb = Counter(a), Counter(b)
    inter = sum((ca & cb).values())
    union = sum((ca | cb).values())
    return inter / union if union else 0.0


def _values_correct(pred_args: dict[str, Any], gold_args: dict[str, Any]) -> int:
    return sum(1 for k, v in gold_args.items()
               if k in pred_args and normalize_value(pred_args[k]) == normalize_value(v))


def map_range(r: float, r_min: float, r_max: float, lo: float, hi: float) -> float:
    """Eq. 6 (DSCL): M_lo^hi(R) = (hi - lo) * (R - Min(R)) / (Max(R) - Min(R)) + lo."""
    if r_max <= r_min:
        return hi
    return (hi - lo) * (r - r_min) / (r_max - r_min) + lo


def fine_parts(pred: ParseResult, gold: list[ToolCall]) -> dict[str, float]:
    """The sub-rewards of DSCL sec. 3, for a prediction and its gold calls.

    - ``format`` (eq. 1): 1 if "all required fields appear": the message is well formed in the
      chosen format (``pred.ok``) AND it has the field the gold answer needs -- a tool call when
      gold has calls, a plain answer (no call) when gold has none, as ToolRL's format check
      (which DSCL's eq. 1 follows) requires ``<tool_call>`` or ``<response>`` per the gold. So
      a plain-text reply to a task that needs a call gets no format credit (total -3).
    - ``name`` (eq. 2): |N_pred n N_gold| / |N_pred u N_gold| over tool names, counted as
      multisets (equal to eq. 2 when names are distinct; a repeated parallel call must be
      repeated), 1.0 when both are empty.
    - ``key`` (eq. 3): sum over gold calls y_i of Jaccard(K(f(y_i)), K(y_i)), where f(y_i) is the
      best-matching unused predicted call with the same name (greedy over gold calls in order,
      best = key Jaccard + correct values, as in ToolRL's reference code); 0 if none.
    - ``value`` (eq. 4): sum over gold calls of the number of gold keys whose value f(y_i)
      matches (normalised equality). Note: eq. 4 as printed divides each term by
      |V(f(y_i)) u V(y_i)|, which contradicts the range the paper gives right beside it,
      R_value in [0, sum_i |K(y_i)|], and the Max(R) used by eqs. 5-6; we follow the stated range
      and ToolRL's definition the paper defers to (an undivided count).
    - ``max_name_key`` = 1 + |Y| and ``max_value`` = sum_i |K(y_i)|: the maxima used by eq. 6.
    """
    calls = pred.calls if pred.ok else []
    r_format = 1.0 if pred.ok and bool(calls) == bool(gold) else 0.0
    r_name = _jaccard([c.name for c in calls], [g.name for g in gold])
    r_key = 0.0
    r_value = 0.0
    used: set[int] = set()
    for g in gold:
        best, best_i, best_key, best_val = -1.0, -1, 0.0, 0
        for i, p in enumerate(calls):
            if i in used or p.name != g.name:
                continue
            k = _jaccard(list(p.arguments), list(g.arguments))
            v = _values_correct(p.arguments, g.arguments)
            if k + v > best:
                best, best_i, best_key, best_val = k + v, i, k, v
        if best_i >= 0:
            used.add(best_i)
            r_key += best_key
            r_value += best_val
    return {
        "format": r_format,
        "name": r_name,
        "key": r_key,
        "value": r_value,
        "max_name_key": 1.0 + len(gold),
        "max_value": float(sum(len(g.arguments) for g in gold)),
    }


def fine_reward(pred: ParseResult, gold: list[ToolCall], *,
                lambdas: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> RewardResult:
    """DSCL's fine-grained reward.

    With the default lambdas this is eq. 5: ``R = R_format + M_{-3}^{3}(R_name + R_key +
    R_value)``; in general eq. 7: ``R = l1*R_format + M_{-3}^{4-l1}(l2*(R_name + R_key) +
    l3*R_value)``, with eq. 6's M mapping the correctness sum from [0, l2*(1+|Y|) +
    l3*sum_i|K(y_i)|] (its Min and Max for this gold) onto [-3, 4-l1]. The total lies in
    [-3, 4] for any 0 <= l1 <= 7; exact gold in the right format gets 4. A format failure has no
    calls, so its correctness part is Min (-3) unless the gold is also "no call".
    """
    l1, l2, l3 = lambdas
    p = fine_parts(pred, gold)
    corr = l2 * (p["name"] + p["key"]) + l3 * p["value"]
    corr_max = l2 * p["max_name_key"] + l3 * p["max_value"]
    mapped = map_range(corr, 0.0, corr_max, -3.0, 4.0 - l1)
    total = l1 * p["format"] + mapped
    correct = bool(pred.ok) and calls_match(pred.calls, gold)
    parts = {"format": p["format"], "name": p["name"], "key": p["key"], "value": p["value"],
             "correctness": corr, "correctness_mapped": mapped}
    return RewardResult(total=total, parts=parts, correct=correct)


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

DSCL_STAGE_LAMBDAS: dict[int, tuple[float, float, float]] = {
    1: (2.5, 0.5, 0.5),
    2: (0.5, 1.5, 0.5),
    3: (0.5, 0.5, 2.5),
}
"""(lambda1, lambda2, lambda3) of DSCL's three curriculum stages (DSCL sec. 4.1.1)."""

REWARDS: dict[str, RewardFn] = {
    "binary": lambda pred, gold: binary_reward(pred, gold),
    "binary_think": lambda pred, gold: binary_reward(pred, gold, think=True),
    "binary_match": lambda pred, gold: binary_reward(pred, gold, check_format=False),
    "fine": lambda pred, gold: fine_reward(pred, gold),
    **{f"fine_stage{s}": (lambda lam: (lambda pred, gold: fine_reward(pred, gold, lambdas=lam)))(lam)
       for s, lam in DSCL_STAGE_LAMBDAS.items()},
}
"""Reward registry: name -> ``reward(pred, gold) -> RewardResult``."""

REWARD_RANGES: dict[str, tuple[float, float]] = {
    "binary": (0.0, 1.0), "binary_think": (0.0, 1.0), "binary_match": (0.0, 1.0),
    "fine": (-3.0, 4.0), "fine_stage1": (-3.0, 4.0), "fine_stage2": (-3.0, 4.0),
    "fine_stage3": (-3.0, 4.0),
}
"""(min, max) each registered reward can take (for normalisation and sanity checks)."""


def register_reward(name: str, fn: RewardFn, value_range: tuple[float, float] | None = None) -> None:
    """Add a reward to the registry (refuses to overwrite an existing name)."""
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn
    if value_range is not None:
        REWARD_RANGES[name] = value_range


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {', '.join(sorted(REWARDS))}") from None


__all__ = ["RewardResult", "RewardFn", "REWARDS", "REWARD_RANGES", "DSCL_STAGE_LAMBDAS",
           "get_reward", "register_reward", "binary_reward", "fine_reward", "fine_parts",
           "calls_match", "normalize_value", "map_range", "has_think"]
