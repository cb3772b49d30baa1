"""The run's state (:class:`RunState`): what a run has done so far, checkpointed as JSON with each checkpoint
(``state.json``) and read back by ``--resume``; the summary is built from it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timers:
    """Seconds spent per part of the run (across --resume)."""

    rollout_s: float = 0.0
    update_s: float = 0.0
    eval_s: float = 0.0
    warmup_s: float = 0.0


@dataclass
class RunState:
    """What a run has done so far.

    Fields are typed; the mapping access (``state["masked"]``, ``get``, ``setdefault``, ``in``) reads and
    writes the same fields (the summary and older callers use it), and a key that is no field lands in
    ``extra`` (kept through checkpoints). ``timers`` reads as a dict through the mapping access too."""

    phase: str = "start"                  # start -> rl -> done
    timers: Timers = field(default_factory=Timers)
    elapsed_before_s: float = 0.0         # wall time of the run before this process (--resume)
    rl_seconds: float = 0.0               # RL step time so far
    zero_var_ratio: list[float] = field(default_factory=list)  # per step: share of groups without signal
    rewards: list[float] = field(default_factory=list)         # per step: mean reward of the own rollouts
    masked: int = 0                       # rollouts left out of the loss (env faults)
    trajectories: int = 0                 # rollouts sampled (repairs included)
    episodes: int = 0                     # episodes started by RL sampling
    recovery: dict[str, Any] | None = None  # reflrl.recovery.RecoveryLedger's totals (from the first RL step)
    budget_cuts: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None        # steps | rl_minutes | time_budget
    eval_before: dict[str, Any] | None = None
    warmup: dict[str, Any] | None = None
    eval_after_warmup: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None
    reflection_error_shown: bool = False
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # per phase (load, eval, warmup, rl): MB
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- mapping access ---------------------------------------------------------------------------
    def _is_field(self, key: str) -> bool:
        return key != "extra" and key in _FIELDS

    def __getitem__(self, key: str) -> Any:
        if self._is_field(key):
            v = getattr(self, key)
            if key == "timers":
                return _TimersView(v)
            if v is None:
                raise KeyError(key)
            return v
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "timers" and isinstance(value, dict):
            value = Timers(**value)
        if self._is_field(key):
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and self._is_field(key):
            return getattr(self, key) is not None
        return key in self.extra

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, other: dict[str, Any]) -> None:
        for k, v in other.items():
            self[k] = v

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the checkpoint's and the summary's view): the fields that are set, and ``extra``."""
        out = {f: getattr(self, f) for f in _FIELDS if f != "extra" and getattr(self, f) is not None}
        out["timers"] = dataclasses.asdict(self.timers)
        out.update(self.extra)
        return out


_FIELDS = tuple(f.name for f in dataclasses.fields(RunState))


class _TimersView(dict):
    """``state["timers"]`` as a dict whose writes go to the :class:`Timers`."""

    def __init__(self, timers: Timers):
        super().__init__(dataclasses.asdict(timers))
        self._t = timers

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        setattr(self._t, key, value)
