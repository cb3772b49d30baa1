"""Per-episode settings and task rows of the verl agent loop (no verl import: the config builder
checks them too)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from reflrl.envs.types import Task, ToolCall


def task_from_dict(d: dict[str, Any]) -> Task:
    """A Task from our row (``reflrl.envs.datasets.task_to_dict``, or its JSON string); ValueError names
    a bad row."""
    if isinstance(d, str):
        try:
            d = json.loads(d)
        except json.JSONDecodeError as e:
            raise ValueError(f"extra_info['task'] is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"extra_info['task'] must be a dict (task_to_dict), got {type(d).__name__}")
    missing = [k for k in ("id", "query", "tools", "gold") if k not in d]
    if missing:
        raise ValueError(f"extra_info['task'] lacks {missing}")
    fields = {f.name for f in dataclasses.fields(Task)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["gold"] = [[c if isinstance(c, ToolCall) else ToolCall.from_dict(c) for c in turn] for turn in d["gold"]]
    kw["tools"] = list(d["tools"])
    kw["turns"] = list(d.get("turns") or [])
    kw["meta"] = dict(d.get("meta") or {})
    return Task(**kw)


@dataclass
class EpisodeSettings:
    """Env and reflection settings of one episode.

    faults: FaultPlan spec string ("" = none); fault_seed; seed (episode seed);
    reward: "binary" | "fine" ...; parser: "hermes" | ...; prompt_style; think;
    critic: critic registry name ("rule" = embedded, no model); max_attempts: retries under q*
    (0 = no reflection); retry_max_attempts / retry_budget_s: the tool client's retry policy
    (``env.retry`` of our Config); mark_unrepaired: write the ordinary-row marker as rollout log-probs
    of rows that were not repaired (reflrl.verl_backend.losses: they then get the token-level PPO ratio,
    as in the CPU trainer); reflect_on: "failure" (any negative critique) | "env_fault" (only failures
    caused by the environment); mode: q* rendering ("replace" | "append", see reflrl.recovery.reflection).
    """

    faults: str = ""
    fault_seed: int = 0
    seed: int = 0
    reward: str = "binary"
    parser: str = "hermes"
    prompt_style: str = "json"
    think: bool = False
    critic: str = "rule"
    max_attempts: int = 2
    reflect_on: str = "failure"
    mode: str = "replace"
    retry_max_attempts: int = 4
    retry_budget_s: float = 30.0
    mark_unrepaired: bool = True

    @classmethod
    def from_sources(cls, defaults: Any = None, row: Any = None) -> "EpisodeSettings":
        """Settings from the config's ``reflrl`` section (``defaults``; an unknown key raises
        ValueError naming it) overridden by a dataset row's ``extra_info`` (``row``; only the known
        keys are read, the row also carries the task, its index and anything verl adds)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        if defaults:
            items = dict(defaults.items()) if hasattr(defaults, "items") else dict(defaults)
            unknown = sorted(set(items) - names)
            if unknown:
                raise ValueError(f"reflrl episode settings {unknown} are unknown; known: {sorted(names)}")
            kw.update(items)
        if row:
            kw.update({k: v for k, v in dict(row).items() if k in names and v is not None})
        s = cls(**kw)
        if s.reflect_on not in ("failure", "env_fault"):
            raise ValueError(f"reflect_on={s.reflect_on!r}: expected 'failure' or 'env_fault'")
        if int(s.max_attempts) < 0:
            raise ValueError(f"max_attempts={s.max_attempts}: must be >= 0")
        if s.faults:
            from reflrl.faults.spec import FaultPlan

            FaultPlan.coerce(s.faults)  # FaultSpecError names the bad entry
        return s
