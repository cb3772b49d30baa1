"""TDCL, DSCL sec. 4.1: the three-stage curriculum (lambdas of sec. 4.1.1) and its stage transitions
(sec. 4.1.2, eq. 8, thresholds of appendix A Table 4)."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reflrl.envs.rewards import DSCL_STAGE_LAMBDAS

from .rewards import SUBREWARDS

DEFAULT_THRESHOLDS: dict[str, float] = {"format": 0.90, "name": 0.75, "key": 0.70}
"""Appendix A, Table 4: R^_format (stage 1 -> 2), R^_name and R^_key (stage 2 -> 3)."""

STAGE_GATES: dict[int, tuple[str, ...]] = {1: ("format",), 2: ("name", "key")}
"""Sec. 4.1.2: the sub-rewards whose windowed mean must pass its threshold to leave a stage."""


@dataclass(frozen=True)
class StageTransition:
    """A curriculum stage change: the step it happened at, from/to stage, and the windowed means
    (eq. 8) of every sub-reward at that moment (the gating ones passed their thresholds)."""

    step: int
    from_stage: int
    to_stage: int
    values: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "from": self.from_stage, "to": self.to_stage, "values": dict(self.values)}


class CurriculumStage:
    """TDCL's stage machine (DSCL sec. 4.1).

    Stages 1, 2, 3 weight the reward with DSCL_STAGE_LAMBDAS (sec. 4.1.1: (2.5, .5, .5),
    (.5, 1.5, .5), (.5, .5, 2.5)); eq. 7 keeps the total in [-3, 4] (see :func:`stage_reward`).

    Transitions (sec. 4.1.2): after each training batch, :meth:`observe_batch` adds the batch's
    per-rollout sub-reward fractions to a window of the last ``window`` (= k) batches; eq. 8 is the
    pooled mean over every rollout of the window (sum / count, i.e. divided by k * batchsize * G *
    Max(R) when no rollout is left out). Once the window holds k batches, stage 1 -> 2 when the
    windowed format mean is strictly above ``thresholds["format"]`` and stage 2 -> 3 when both the
    name AND key means are strictly above theirs (Table 4: 0.90; 0.75, 0.70). At most one
    transition per batch; stage 3 is final; the stage never moves backwards.

    ``weighted=False`` keeps tracking the stage (RDS needs "format converged", sec. 6.4) but
    :attr:`lambdas` stays (1, 1, 1), i.e. the plain eq. 5 reward: the "w/ RDS" rows of Table 1.
    ``reset_window_on_transition`` (default False, the paper says nothing about it) empties the
    window at each transition so the next stage's gate needs k fresh batches.
    """

    def __init__(self, window: int = 7, thresholds: Mapping[str, float] | None = None, *,
                 weighted: bool = True, reset_window_on_transition: bool = False,
                 lambdas: Mapping[int, tuple[float, float, float]] | None = None):
        if window < 1:
            raise ValueError(f"window (k) must be >= 1, got {window}")
        th = dict(DEFAULT_THRESHOLDS)
        th.update(thresholds or {})
        for name, v in th.items():
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"threshold {name!r} must be in [0, 1] (sub-rewards are normalised), got {v}")
        self.window = int(window)
        self.thresholds = th
        self.weighted = bool(weighted)
        self.reset_window_on_transition = bool(reset_window_on_transition)
        self.stage_lambdas = dict(lambdas or DSCL_STAGE_LAMBDAS)
        self.stage = 1
        self._win: deque[tuple[dict[str, float], dict[str, int]]] = deque(maxlen=self.window)
        self.transitions: list[StageTransition] = []
        self.batches_seen = 0

    # -- what the trainer reads ------------------------------------------------------------------
    @property
    def lambdas(self) -> tuple[float, float, float]:
        """(l1, l2, l3) of eq. 7 for the current stage; (1, 1, 1) = eq. 5 when not weighted."""
        return tuple(self.stage_lambdas[self.stage]) if self.weighted else (1.0, 1.0, 1.0)  # type: ignore[return-value]

    @property
    def reward_name(self) -> str:
        """The registered reward (reflrl.envs.rewards) equal to the current stage's reward."""
        return f"fine_stage{self.stage}" if self.weighted else "fine"

    @property
    def format_converged(self) -> bool:
        """True once stage 1 is over: RDS may act (sec. 4.2.2 last paragraph, sec. 6.4)."""
        return self.stage >= 2

    def windowed(self) -> dict[str, float]:
        """Eq. 8 over the current window for every sub-reward seen in it (missing = never seen)."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for s, c in self._win:
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + v
            for k, n in c.items():
                counts[k] = counts.get(k, 0) + n
        return {k: sums.get(k, 0.0) / n for k, n in counts.items() if n > 0}

    # -- updates -------------------------------------------------------------------------------------
    def observe_batch(self, step: int, rows: Iterable[Mapping[str, float]]) -> StageTransition | None:
        """Add one training batch: ``rows`` = one :func:`subreward_fractions` dict per live rollout
        (per scored turn in multi-turn episodes). Returns the transition it caused, if any."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for row in rows:
            for k, v in row.items():
                if k not in SUBREWARDS:
                    continue
                v = float(v)
                if not math.isfinite(v) or v < -1e-9 or v > 1 + 1e-9:
                    raise ValueError(f"sub-reward {k!r} = {v} is not a fraction in [0, 1]; "
                                     "pass subreward_fractions(parts, gold), not raw parts")
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
        return self.observe_totals(step, sums, counts)

    def observe_totals(self, step: int, sums: Mapping[str, float], counts: Mapping[str, int]
                       ) -> StageTransition | None:
        """Like :meth:`observe_batch` with the batch already summed: per sub-reward, the sum of the
        fractions and the number of rollouts that contributed."""
        self._win.append(({k: float(v) for k, v in sums.items()}, {k: int(n) for k, n in counts.items()}))
        self.batches_seen += 1
        if self.stage not in STAGE_GATES or len(self._win) < self.window:
            return None
        values = self.windowed()
        gate = STAGE_GATES[self.stage]
        if not all(g in values and values[g] > self.thresholds[g] for g in gate):
            return None
        ev = StageTransition(step=int(step), from_stage=self.stage, to_stage=self.stage + 1, values=values)
        self.stage += 1
        self.transitions.append(ev)
        if self.reset_window_on_transition:
            self._win.clear()
        return ev

    # -- logging / checkpoints ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Flat metrics: ``dscl/stage`` and the windowed eq. 8 mean of each sub-reward."""
        out: dict[str, float] = {"dscl/stage": float(self.stage), "dscl/window_batches": float(len(self._win))}
        for k, v in self.windowed().items():
            out[f"dscl/win_{k}"] = v
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (stage, window, transitions)."""
        return {
            "stage": self.stage,
            "window": self.window,
            "batches_seen": self.batches_seen,
            "win": [[dict(s), dict(c)] for s, c in self._win],
            "transitions": [t.to_dict() for t in self.transitions],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. A different window size keeps the most recent batches."""
        stage = int(state["stage"])
        if stage not in (1, 2, 3):
            raise ValueError(f"curriculum stage must be 1, 2 or 3, got {stage}")
        self.stage = stage
        self.batches_seen = int(state.get("batches_seen", 0))
        self._win = deque(((dict(s), {k: int(n) for k, n in c.items()}) for s, c in state["win"]),
                          maxlen=self.window)
        self.transitions = [StageTransition(int(t["step"]), int(t["from"]), int(t["to"]), dict(t["values"]))
                            for t in state.get("transitions", [])]
