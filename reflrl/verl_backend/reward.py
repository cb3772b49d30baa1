"""Our rewards as verl's ``reward.custom_reward_function`` (verl 0.9.1, ``reward.custom_reward_function.path``
= this file, ``.name`` = ``compute_score``).

verl's reward manager calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` for
every response (the decoded response text) when the agent loop did not already set a reward. Rows
written by :func:`reflrl.verl_backend.data.rows_from_tasks` hold the gold calls as
``reward_model.ground_truth`` (JSON) and the reward/parser names in ``extra_info``. The score is
exactly what the CPU env computes: ``reflrl.envs.rewards.get_reward(name)(parse(text), gold)``
(binary = efficiency paper eq. 8; fine = DSCL eqs. 1-7). The reflrl agent loop computes the reward
in the env itself (with faults and reflection) and sets ``reward_score``; this function is then
only used for validation/plain single-turn runs.

Pure Python: no torch, no verl import (verl loads the file by path in its reward workers).
"""
from __future__ import annotations

import json
from typing import Any


def gold_from_ground_truth(ground_truth: Any) -> list:
    """The gold ToolCalls of the first turn from ``reward_model.ground_truth``: a JSON string or a
    list of {"name", "arguments"} dicts (one turn) or of such lists (turns). ValueError names a bad value."""
    from reflrl.envs.types import ToolCall

    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(gt, list):
        raise ValueError(f"ground_truth must be a list of calls (or of turns), got {type(gt).__name__}")
    if gt and isinstance(gt[0], list):
        gt = gt[0]
    try:
        return [ToolCall.from_dict(c) for c in gt]
    except Exception as e:  # noqa: BLE001 - name the bad row
        raise ValueError(f"ground_truth has a malformed call: {e}") from e


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **_: Any) -> dict[str, Any]:
    """verl's reward hook -> {"score": total, "correct": bool, "format_ok": bool, <reward parts>}.

    ``extra_info["reward"]`` (default "binary") and ``extra_info["parser"]`` (default "hermes") pick
    the reward and the parser, as ``env.reward`` / ``env.parser`` do in our Config.
    """
    from reflrl.envs import parsing
    from reflrl.envs.rewards import get_reward

    info = dict(extra_info or {})
    gold = gold_from_ground_truth(ground_truth)
    pr = parsing.parse(solution_str or "", str(info.get("parser") or "hermes"))
    res = get_reward(str(info.get("reward") or "binary"))(pr, gold)
    out: dict[str, Any] = {"score": float(res.total), "correct": bool(res.correct), "format_ok": bool(pr.ok)}
    for k, v in dict(res.parts).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"part_{k}"] = float(v)
    return out
