"""DSCL's rewards seen from the curriculum (sec. 3, sec. 4.1.1): the fine-grained reward's sub-rewards as
fractions of their maxima, the stage reward of eq. 7, and the per-turn parts a rollout recorded."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from reflrl.envs.rewards import fine_parts, map_range
from reflrl.envs.types import ParseResult, ToolCall

SUBREWARDS: tuple[str, ...] = ("format", "name", "key", "value")


def fine_maxima(gold: Sequence[ToolCall]) -> tuple[float, float]:
    """(Max(R_name + R_key), Max(R_value)) = (1 + |Y|, sum_i |K(y_i)|) for one turn's gold calls,
    the maxima eq. 6 maps from (DSCL sec. 3); taken from :func:`reflrl.envs.rewards.fine_parts`
    so the definition lives in one place."""
    p = fine_parts(ParseResult(ok=False), list(gold))
    return float(p["max_name_key"]), float(p["max_value"])


def subreward_fractions(parts: Mapping[str, float], gold: Sequence[ToolCall] | None = None
                        ) -> dict[str, float]:
    """One rollout's sub-rewards divided by their maxima, the terms eq. 8 averages (sec. 4.1.2).

    ``parts``: the fine reward's parts (``info["reward_parts"]`` of an env using a ``fine*``
    reward, or :func:`reflrl.envs.rewards.fine_parts`): format in {0, 1}, name in [0, 1], key in
    [0, |Y|], value in [0, sum_i |K(y_i)|]. The maxima come from ``parts`` when present
    (``max_name_key``, ``max_value`` from ``fine_parts``), else from ``gold`` (the turn's gold
    calls). A sub-reward whose maximum is 0 (key/value of a "no call" gold) is left out: it says
    nothing about convergence, so it enters neither the numerator nor the denominator of eq. 8.
    Parts missing from ``parts`` are left out too (e.g. a binary reward only has ``format``).
    """
    out: dict[str, float] = {}
    if "format" in parts:
        out["format"] = float(parts["format"])
    if "name" in parts:
        out["name"] = float(parts["name"])
    if "key" not in parts and "value" not in parts:
        return out
    if "max_name_key" in parts and "max_value" in parts:
        max_nk, max_v = float(parts["max_name_key"]), float(parts["max_value"])
    elif gold is not None:
        max_nk, max_v = fine_maxima(gold)
    else:
        raise ValueError("subreward_fractions: parts have no maxima (max_name_key, max_value); "
                         "pass the turn's gold calls")
    max_k = max_nk - 1.0  # R_key in [0, |Y|]
    if "key" in parts and max_k > 0:
        out["key"] = float(parts["key"]) / max_k
    if "value" in parts and max_v > 0:
        out["value"] = float(parts["value"]) / max_v
    return out


def stage_reward(parts: Mapping[str, float], gold: Sequence[ToolCall],
                 lambdas: tuple[float, float, float]) -> float:
    """Eq. 7 (sec. 4.1.1) from a rollout's sub-rewards: ``l1*R_format + M_{-3}^{4-l1}(l2*(R_name +
    R_key) + l3*R_value)``, total in [-3, 4].

    Equal to ``reflrl.envs.rewards.fine_reward(pred, gold, lambdas=lambdas).total`` for the
    parts of that prediction (tested), so a trainer can roll out once with the plain ``fine``
    reward and score each rollout with the current stage's lambdas.
    """
    l1, l2, l3 = (float(x) for x in lambdas)
    max_nk, max_v = fine_maxima(gold)
    corr = l2 * (float(parts["name"]) + float(parts["key"])) + l3 * float(parts["value"])
    return l1 * float(parts["format"]) + map_range(corr, 0.0, l2 * max_nk + l3 * max_v, -3.0, 4.0 - l1)


def episode_stage_reward(turn_parts: Sequence[Mapping[str, float]], golds: Sequence[Sequence[ToolCall]],
                         n_turns: int, lambdas: tuple[float, float, float], r_min: float = -3.0) -> float:
    """Eq. 7 for a multi-turn episode, scored as the multi-turn env scores it (reflrl.envs.tool_env):
    the mean over the task's ``n_turns`` user turns of each scored turn's :func:`stage_reward`
    (``turn_parts[i]`` against ``golds[i]``), turns never reached scoring ``r_min``."""
    if n_turns < 1:
        raise ValueError(f"n_turns must be >= 1, got {n_turns}")
    if len(turn_parts) > n_turns:
        raise ValueError(f"{len(turn_parts)} scored turns but the task has {n_turns}")
    scores = [stage_reward(pt, golds[i] if i < len(golds) else [], lambdas) for i, pt in enumerate(turn_parts)]
    return (sum(scores) + r_min * (n_turns - len(scores))) / n_turns


def scored_turn_parts(step_parts: Sequence[Mapping[str, float] | None]) -> list[dict[str, float]]:
    """The reward parts of each scored turn, in order, from a rollout's per-step reward parts (only the
    step that ends a turn carries non-empty parts)."""
    return [dict(p) for p in step_parts if p]


def batches_per_epoch(n_train: int, batch_prompts: int) -> int:
    """k of Table 4 ("each epoch ... consists of 7 batches, we set k = 7"): ceil(n_train / batch)."""
    if n_train < 1 or batch_prompts < 1:
        raise ValueError(f"n_train and batch_prompts must be >= 1, got {n_train}, {batch_prompts}")
    return max(1, math.ceil(n_train / batch_prompts))
