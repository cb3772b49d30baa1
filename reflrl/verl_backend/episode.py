"""Per-episode settings and task rows of the verl agent loop (no verl import: the config builder
checks them too)."""
from __future__ import annotations

import dataclasses
import json
import re
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

    faults: FaultPlan spec string ("" = none); fault_seed (null: derived from seed); seed: the base of
    every episode's seeds (an episode's env seed, fault seed and id derive from (seed, dataset index,
    rollout index): :func:`episode_seeds`);
    reward: "binary" | "fine" ...; parser: "hermes" | ...; prompt_style; think;
    critic: critic registry name ("rule" = embedded, no model); max_attempts: retries under q*
    (0 = no reflection); retry_max_attempts / retry_budget_s: the tool client's retry policy
    (``env.retry`` of our Config); mark_unrepaired: write the ordinary-row marker as rollout log-probs
    of rows that were not repaired (reflrl.verl_backend.losses: they then get the token-level PPO ratio,
    as in the CPU trainer); reflect_on: "failure" (any negative critique) | "env_fault" (only failures
    caused by the environment); mode: q* rendering ("replace" | "append", see reflrl.recovery.reflection);
    reveal / critic_base_url / critic_model / critic_timeout_s: the critic's settings (``reflection.*``);
    max_steps: the env's assistant-message limit (null: env default); max_turns / max_total_tokens:
    a multi-turn episode ends after that many assistant turns / prompt + response tokens (null: no limit).
    """

    faults: str = ""
    fault_seed: int | None = None
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
    reveal: str = "query"
    critic_base_url: str | None = None
    critic_model: str | None = None  # null: the one model the endpoint serves
    critic_timeout_s: float = 60.0
    max_steps: int | None = None
    max_turns: int | None = None
    max_total_tokens: int | None = None

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
        if s.critic not in ("rule", "llm"):
            raise ValueError(f"critic={s.critic!r}: the agent loop runs the 'rule' or the 'llm' critic")
        if s.critic == "llm" and int(s.max_attempts) > 0 and not s.critic_base_url:
            raise ValueError("critic='llm' needs critic_base_url (reflection.critic_base_url)")
        if s.faults:
            from reflrl.faults.spec import FaultPlan

            FaultPlan.coerce(s.faults)  # FaultSpecError names the bad entry
        return s


def episode_seeds(settings: EpisodeSettings, index: int, rollout: int) -> dict[str, Any]:
    """The seeds of the episode of dataset row ``index``, rollout ``rollout`` of its group, as the CPU
    trainer derives one per env and episode: {"seed": the env seed (its data seed, and its fault seed
    unless ``fault_seed`` is set), "fault_seed": ``fault_seed`` made per episode (None when unset),
    "prefix": the episode-id prefix}. The same (seed, index, rollout) gives the same faults."""
    from reflrl.envs.tool_env import derive_seed

    seed = derive_seed(int(settings.seed), int(index), int(rollout))
    fault = None if settings.fault_seed is None else derive_seed(int(settings.fault_seed), int(index), int(rollout))
    return {"seed": seed, "fault_seed": fault, "prefix": f"verl-{int(index)}-{int(rollout)}"}


_LABEL = re.compile(r"(?m)^(Attempt \d+: (?:Thought: )?|Action: |Feedback: )")
_REQUEST = '\nOriginal request: "'
CUT = " [...]"


def _shorten_retry_prompt(text: str, budget: int) -> str:
    """The retry prompt (reflrl.recovery.reflection.build_retry_prompt) with the text after every
    ``Attempt i:`` / ``Action:`` / ``Feedback:`` label (up to the next label, over several lines if the
    answer has them) cut to ``budget`` characters; the header, the original request and the footer are
    kept whole."""
    end = text.rfind(_REQUEST)
    first = _LABEL.search(text)
    if end < 0 or first is None or first.start() > end:
        return text
    head, region, tail = text[: first.start()], text[first.start(): end], text[end:]
    parts = _LABEL.split(region)  # ["", label, body, label, body, ...]
    out = [parts[0]]
    for label, body in zip(parts[1::2], parts[2::2]):
        core = body.rstrip("\n")
        sep = body[len(core):]  # the line breaks that end the block stay
        out.append(label + (core[:budget] + CUT if len(core) > budget else core) + sep)
    return head + "".join(out) + tail


async def fit_qstar(messages: list[dict[str, Any]], n_q: int, count: Any, limit: int) -> list[dict[str, Any]]:
    """q* ``messages`` shortened to at most ``limit`` tokens (``await count(messages)``): the failed
    answers and the critic's analyses (the attempt lines of the retry prompt, and in "append" mode the
    assistant message after q) are cut to the longest common length that fits; the first ``n_q``
    messages before them (the system prompt with the tools, earlier turns) and the original request
    are never cut. Raises ValueError when even the empty attempts do not fit (q itself is too long)."""
    if await count(messages) <= limit:
        return messages

    def shortened(budget: int) -> list[dict[str, Any]]:
        out = [dict(m) for m in messages]
        for i in range(len(out)):
            text = str(out[i].get("content") or "")
            if out[i].get("role") == "user" and i == len(out) - 1:
                out[i]["content"] = _shorten_retry_prompt(text, budget)
            elif out[i].get("role") == "assistant" and i >= n_q and len(text) > budget:
                out[i]["content"] = text[:budget] + CUT
        return out

    longest = max(len(str(m.get("content") or "")) for m in messages)
    if await count(shortened(0)) > limit:
        raise ValueError(f"q* does not fit in {limit} prompt tokens even with the failed answers and the analyses "
                         "removed; raise verl.max_prompt_length")
    lo, hi = 0, longest  # shortened(lo) fits, shortened(hi) is the original, which does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await count(shortened(mid)) <= limit:
            lo = mid
        else:
            hi = mid
    return shortened(lo)
