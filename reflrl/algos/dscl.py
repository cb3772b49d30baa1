"""DSCL: task-based curriculum (TDCL) and reward-based dynamic sampling (RDS) over fine-grained
tool-calling rewards, with the sampling baselines the paper compares (DSCL,
"Adapting Dynamic Sampling to Fine-Grained Rewards for Tool Learning with Curriculum Learning").

Pieces (pure functions and small state classes; no trainer or CLI imports):

* TDCL, sec. 4.1: :class:`CurriculumStage` (stages 1-3 with the lambdas of sec. 4.1.1, stage
  transitions of sec. 4.1.2 / eq. 8 with the thresholds of appendix A Table 4), the stage reward
  of eq. 7 recomputed from a rollout's sub-rewards (:func:`stage_reward`) and the per-rollout
  sub-reward fractions eq. 8 averages (:func:`subreward_fractions`).
* RDS, sec. 4.2: :class:`RewardHistory` (per-prompt M, V_current, V_history: eqs. 9-11),
  :func:`categorize` (the categories a, b.1, b.2, c.1, c.2 of sec. 4.2.2), :func:`rds_select`
  (eq. 12 keep ratios 0 / 0.5 / 1, seeded).
* Baselines of Table 1 / sec. 5.2: ``"dapo"`` (DAPO dynamic sampling, an adapter over
  :func:`reflrl.algos.filters.drop_zero_variance_groups`), ``"smv"`` (sample by max variance
  only, after Xu et al. 2025), ``"smr"`` (sample by mean reward only, after Bae et al. 2025),
  ``"none"``; all behind :func:`get_sampler`.
* Visibility (Fig. 3, appendix Tables 5-6): :class:`CategoryShares`, per-epoch shares of the
  difficulty categories as a flat metrics dict.
* :class:`SamplingController` bundles them for a trainer (one object to build, call and
  checkpoint); see its docstring for the calls per step.

Scale of t_mean / t_var. Sec. 4.2.2 states category a as ``M = 4`` (the raw maximum of the
[-3, 4] reward), and appendix A.2 sweeps t_mean up to 1.00 and t_var up to 1.0 with non-empty
"c" categories (Table 5: c.2 = 9.6 % at t_mean = 1.00) and different shares for t_var = 0.5 vs
1.0 (Table 6): both are impossible if the thresholds applied to rewards mapped to [0, 1] (c would
be [1, 1) = empty; a variance on [0, 1] never exceeds 0.25). So by default the thresholds apply
to the raw reward (``unit_scale=False``); ``unit_scale=True`` compares them against rewards
mapped to [0, 1] by eq. 6 instead (the scale of the paper's Figs. 4-5 plots). With t_mean = 0.5
the mean threshold is the same point either way (0.5 is the middle of [-3, 4]); only t_var
differs (0.1 raw = 0.002 on [0, 1]).

Variances are population variances (divide by n), as ``Var`` in eqs. 10-11 is not qualified.

Metrics (what ``reflrl train`` writes to the run folder when ``sampling.sampler != "none"`` or
``sampling.curriculum`` is on; for ``reflrl report`` and anyone plotting Fig. 3 / Table 5):

* ``metrics.jsonl``, ``phase="train"`` rows, one per RL step (``step`` = steps done):

  - ``dscl/stage``: curriculum stage after this step (1 format, 2 name+key, 3 value; tracked even
    when ``curriculum`` is off, for the sampler's warm-up gate);
  - ``dscl/stage_changed``: 1.0 on the step where the stage moved, else 0.0; on that step only,
    ``dscl/transition`` = ``{"step", "from", "to", "values"}`` (``values``: the windowed eq. 8 means
    that passed the gate; JSON only, not a TensorBoard scalar);
  - ``dscl/window_batches`` and ``dscl/win_format`` / ``_name`` / ``_key`` / ``_value``: batches in
    the eq. 8 window and the windowed mean of each sub-reward (fractions in [0, 1]);
  - ``dscl/sampler_active``: 1.0 once the sampler filters (after the warm-up gate), else 0.0;
  - ``dscl/groups_in``, ``dscl/groups_kept``, ``dscl/keep_rate``: prompt groups seen / kept by the
    sampler this step (all sampling rounds of the step summed);
  - ``dscl/batch_a`` / ``_b1`` / ``_b2`` / ``_c1`` / ``_c2``: share of this step's groups in each
    category (sec. 4.2.2), summing to 1.

* ``metrics.jsonl``, ``phase="epoch"`` rows (:meth:`SamplingController.epoch_record`): one when an
  epoch of the training prompts ends (logged at the step whose sampling began the next epoch) and
  one for the current epoch when the run stops (``dscl/partial`` = 1.0 if it was cut short). If an
  epoch appears twice (e.g. after ``--resume``), the later row wins. Keys: ``epoch``,
  ``dscl/partial``, ``dscl/share_a`` / ``_b1`` / ``_b2`` / ``_c1`` / ``_c2`` (share of the
  epoch's distinct prompts by their latest category; sum to 1), ``dscl/share_b1_c1`` (Table 5's
  "b.1 & c.1" row), ``dscl/prompts`` (distinct prompts seen), ``dscl/kept`` / ``dscl/dropped``
  (sampler decisions, repeats included), ``dscl/stage`` (stage at the time of the row) and
  ``dscl/sampler`` (its name).

* ``summary.json`` key ``"sampling"`` (:meth:`SamplingController.summary`): sampler, curriculum on
  or off, final stage, every transition and ``epochs`` = epoch -> the shares above; ``null`` when
  neither a sampler nor the curriculum is configured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..envs.rewards import DSCL_STAGE_LAMBDAS, REWARD_RANGES, fine_parts, map_range
from ..envs.types import ParseResult, ToolCall
from .filters import drop_zero_variance_groups, groups_to_request

# ============================================================================ constants
CATEGORIES: tuple[str, ...] = ("a", "b.1", "b.2", "c.1", "c.2")
"""The difficulty categories of sec. 4.2.2, in the order they are reported."""

DEFAULT_RATIOS: dict[str, float] = {"a": 0.0, "b.1": 1.0, "b.2": 0.0, "c.1": 1.0, "c.2": 0.5}
"""Eq. 12: keep ratio per category (a, b.2 dropped; c.2 half kept; b.1, c.1 kept)."""

DEFAULT_THRESHOLDS: dict[str, float] = {"format": 0.90, "name": 0.75, "key": 0.70}
"""Appendix A, Table 4: R^_format (stage 1 -> 2), R^_name and R^_key (stage 2 -> 3)."""

STAGE_GATES: dict[int, tuple[str, ...]] = {1: ("format",), 2: ("name", "key")}
"""Sec. 4.1.2: the sub-rewards whose windowed mean must pass its threshold to leave a stage."""

SUBREWARDS: tuple[str, ...] = ("format", "name", "key", "value")

SAMPLERS: tuple[str, ...] = ("none", "dapo", "smv", "smr", "rds")


# ============================================================================ TDCL (sec. 4.1)
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


def scored_turn_parts(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The reward parts of each scored turn, in order, from a rollout's per-step env infos
    (``Trajectory.info["steps"]``: only the step that ends a turn carries non-empty parts)."""
    return [dict(s["reward_parts"]) for s in steps if s.get("reward_parts")]


def batches_per_epoch(n_train: int, batch_prompts: int) -> int:
    """k of Table 4 ("each epoch ... consists of 7 batches, we set k = 7"): ceil(n_train / batch)."""
    if n_train < 1 or batch_prompts < 1:
        raise ValueError(f"n_train and batch_prompts must be >= 1, got {n_train}, {batch_prompts}")
    return max(1, math.ceil(n_train / batch_prompts))


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


# ============================================================================ RDS (sec. 4.2)
def _pvar(vals: Sequence[float]) -> float:
    n = len(vals)
    if n == 0:
        return 0.0
    mu = sum(vals) / n
    return sum((v - mu) ** 2 for v in vals) / n


@dataclass(frozen=True)
class PromptStats:
    """Sec. 4.2.1 for one prompt at the current batch, on the raw reward scale.

    mean: M (eq. 9); var_current: V_current (eq. 10, over this batch's rollouts); var_history:
    V_history (eq. 11, over the prompt's per-batch means so far, this one included; 0 on the first
    visit); rewards: this batch's rollout rewards; visits: batches the prompt appeared in.
    """

    prompt_id: Hashable
    mean: float
    var_current: float
    var_history: float
    rewards: tuple[float, ...] = ()
    visits: int = 1


def prompt_stats(prompt_id: Hashable, rewards: Sequence[float], past_means: Sequence[float] = ()) -> PromptStats:
    """Eqs. 9-11 for one prompt: ``rewards`` = its G rollout rewards this batch, ``past_means`` =
    M of its earlier batches. Raises on an empty group or a non-finite reward."""
    rs = tuple(float(r) for r in rewards)
    if not rs:
        raise ValueError(f"prompt {prompt_id!r}: no rewards (drop groups whose rollouts were all masked)")
    if not all(math.isfinite(r) for r in rs):
        raise ValueError(f"prompt {prompt_id!r}: rewards must be finite, got {rs}")
    m = sum(rs) / len(rs)
    hist = [float(x) for x in past_means] + [m]
    return PromptStats(prompt_id, m, _pvar(rs), _pvar(hist), rs, len(hist))


class RewardHistory:
    """Per-prompt history of batch means M^{i,1..j} for V_history (eq. 11, sec. 4.2.1).

    ``update(prompt_id, rewards)`` appends this batch's M and returns the prompt's
    :class:`PromptStats`. ``max_len`` (None = all) bounds the history per prompt. Call it for every
    rolled-out prompt (live rollouts only), whether or not a sampler is active, so the history is
    there when RDS switches on. ``clear()`` forgets everything (e.g. when the curriculum stage, and
    with it the reward's scale, changes). ``state_dict()`` / ``load_state_dict()`` for checkpoints.
    """

    def __init__(self, max_len: int | None = None):
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1 or None, got {max_len}")
        self.max_len = max_len
        self.means: dict[Hashable, list[float]] = {}

    def stats(self, prompt_id: Hashable, rewards: Sequence[float]) -> PromptStats:
        """Eqs. 9-11 as :meth:`update` would return them, without recording anything."""
        return prompt_stats(prompt_id, rewards, self.means.get(prompt_id, ()))

    def update(self, prompt_id: Hashable, rewards: Sequence[float]) -> PromptStats:
        """Record this batch's rollout rewards of ``prompt_id``; returns its eqs. 9-11 stats."""
        st = self.stats(prompt_id, rewards)
        h = self.means.setdefault(prompt_id, [])
        h.append(st.mean)
        if self.max_len is not None and len(h) > self.max_len:
            del h[: len(h) - self.max_len]
        return st

    def clear(self) -> None:
        self.means.clear()

    def __len__(self) -> int:
        return len(self.means)

    def state_dict(self) -> dict[str, Any]:
        return {"max_len": self.max_len, "means": [[pid, list(h)] for pid, h in self.means.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.means = {_hashable(pid): [float(x) for x in h] for pid, h in state["means"]}


def _hashable(x: Any) -> Any:
    """JSON turns tuples into lists; turn them back so they can be dict keys again."""
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x


@dataclass(frozen=True)
class RDSParams:
    """Thresholds and scale of RDS (sec. 4.2.2, appendix A Table 4).

    t_mean / t_var: thresholds on M and on the variances; r_min / r_max: the reward's range
    (category a is M = r_max; [-3, 4] for the fine rewards); unit_scale: compare the thresholds
    against rewards mapped to [0, 1] (default False: raw scale, see the module docstring);
    ratios: eq. 12's keep ratio per category; tol: float tolerance of "M = r_max".
    smv_keep: share of each batch's prompts SMV keeps; smr_low / smr_high: the band of the mean
    (mapped to [0, 1]) SMR keeps.
    """

    t_mean: float = 0.50
    t_var: float = 0.10
    r_min: float = -3.0
    r_max: float = 4.0
    unit_scale: bool = False
    ratios: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RATIOS))
    tol: float = 1e-6
    smv_keep: float = 0.5
    smr_low: float = 0.25
    smr_high: float = 0.75

    def __post_init__(self) -> None:
        if not self.r_max > self.r_min:
            raise ValueError(f"r_max must be > r_min, got [{self.r_min}, {self.r_max}]")
        missing = set(CATEGORIES) - set(self.ratios)
        if missing:
            raise ValueError(f"ratios miss categories {sorted(missing)}; need all of {CATEGORIES}")
        for c, r in self.ratios.items():
            if c not in CATEGORIES or not 0.0 <= float(r) <= 1.0:
                raise ValueError(f"ratio {c!r}={r}: categories are {CATEGORIES}, ratios in [0, 1]")
        if not 0.0 < self.smv_keep <= 1.0:
            raise ValueError(f"smv_keep must be in (0, 1], got {self.smv_keep}")
        if not 0.0 <= self.smr_low <= self.smr_high <= 1.0:
            raise ValueError(f"need 0 <= smr_low <= smr_high <= 1, got {self.smr_low}, {self.smr_high}")

    @classmethod
    def for_reward(cls, reward_name: str, **kw: Any) -> "RDSParams":
        """Params with r_min / r_max from reflrl.envs.rewards.REWARD_RANGES[reward_name]."""
        lo, hi = REWARD_RANGES.get(reward_name, (0.0, 1.0))
        return cls(r_min=lo, r_max=hi, **kw)

    def unit_mean(self, m: float) -> float:
        """M mapped to [0, 1] by eq. 6."""
        return map_range(m, self.r_min, self.r_max, 0.0, 1.0)


def categorize(st: PromptStats, p: RDSParams = RDSParams()) -> str:
    """The category of sec. 4.2.2 of one prompt: 'a', 'b.1', 'b.2', 'c.1' or 'c.2'.

    a: M = r_max (4 for the fine reward). b (hard): M < t_mean; b.1 if V_current > t_var OR
    V_history > t_var, else b.2. c (intermediate): M in [t_mean, r_max); c.1 if V_current > t_var
    AND V_history > t_var, else c.2. A variance equal to t_var is not "> t_var" (the paper's "<"
    and ">" leave equality open; b.2 and c.2 are taken as the complements of b.1 and c.1).
    """
    m, vc, vh = st.mean, st.var_current, st.var_history
    if m >= p.r_max - p.tol:
        return "a"
    if p.unit_scale:
        span = p.r_max - p.r_min
        m, vc, vh = p.unit_mean(m), vc / span ** 2, vh / span ** 2
    if m < p.t_mean:
        return "b.1" if (vc > p.t_var or vh > p.t_var) else "b.2"
    return "c.1" if (vc > p.t_var and vh > p.t_var) else "c.2"


def _rng(rng: np.random.Generator | int | Sequence[int] | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def rds_select(prompt_stats: Sequence[PromptStats | str], ratios: Mapping[str, float] | None = None,
               rng: np.random.Generator | int | Sequence[int] | None = None,
               params: RDSParams | None = None) -> list[bool]:
    """Eq. 12 (sec. 4.2.2): keep mask over a batch's prompts, by category.

    ``prompt_stats``: :class:`PromptStats` (categorised with ``params``) or category strings.
    Within each category c with n_c prompts, ``ratios[c] * n_c`` prompts are kept: the integer
    part for sure, one more with probability equal to the fractional part, chosen uniformly at
    random with ``rng`` (a numpy Generator or a seed). So the expected kept fraction per category
    is exactly the ratio (0 -> none, 1 -> all), with less spread than independent coin flips.
    """
    p = params or RDSParams()
    ratios = dict(p.ratios if ratios is None else ratios)
    cats = [s if isinstance(s, str) else categorize(s, p) for s in prompt_stats]
    for c in set(cats):
        if c not in ratios:
            raise ValueError(f"no keep ratio for category {c!r} (ratios: {ratios})")
    g = _rng(rng)
    keep = [False] * len(cats)
    for c in CATEGORIES:
        idx = [i for i, x in enumerate(cats) if x == c]
        if not idx:
            continue
        want = float(ratios[c]) * len(idx)
        k = int(math.floor(want + 1e-12))
        if want - k > 1e-12 and g.random() < want - k:
            k += 1
        k = min(k, len(idx))
        chosen = idx if k == len(idx) else [idx[i] for i in g.choice(len(idx), size=k, replace=False)]
        for i in chosen:
            keep[i] = True
    return keep


# ============================================================================ samplers (Table 1)
SamplerFn = Callable[[Sequence[PromptStats], RDSParams, np.random.Generator], list[bool]]


def select_none(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """ToolRL baseline: no dynamic sampling, every prompt is kept."""
    return [True] * len(stats)


def select_dapo(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """DAPO dynamic sampling (Yu et al. 2025; Table 1 "w/ DAPO"): keep the groups whose rewards
    are not all equal, via :func:`reflrl.algos.filters.drop_zero_variance_groups` (per group, so
    groups of different sizes are fine). DAPO then refills the batch: see :func:`groups_to_request`."""
    return [bool(drop_zero_variance_groups(torch.tensor([list(s.rewards)], dtype=torch.float64),
                                           tol=p.tol)[0]) if len(s.rewards) > 1 else False
            for s in stats]


def select_smv(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """SMV, "sample only by max variance" (sec. 5.2, Table 1; Xu et al. 2025's max-variance
    criterion applied to prompts): keep the ceil(smv_keep * G) prompts of the batch with the
    largest current reward variance V_current (eq. 10), never a zero-variance one (no GRPO
    signal). Ties are broken at random with ``rng``. (Xu et al.'s rollout-level version, m of n
    rollouts per group, is ``algo.downsample_m`` / :func:`reflrl.algos.filters.max_variance_subset`.)
    """
    n = len(stats)
    if n == 0:
        return []
    k = math.ceil(p.smv_keep * n - 1e-9)
    tie = rng.random(n)
    order = sorted(range(n), key=lambda i: (-stats[i].var_current, tie[i]))
    keep = [False] * n
    for i in order[:k]:
        keep[i] = stats[i].var_current > 0.0
    return keep


def select_smr(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """SMR, "sample only by mean reward" (sec. 5.2, Table 1; Bae et al. 2025's balanced online
    difficulty filtering): keep a prompt iff its mean reward, mapped to [0, 1] (eq. 6), lies in
    [smr_low, smr_high] (default [0.25, 0.75], a band centred on 0.5 where Bae et al. show the
    learning signal peaks). Variance plays no part."""
    return [p.smr_low <= p.unit_mean(s.mean) <= p.smr_high for s in stats]


def select_rds(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """RDS (sec. 4.2): categories of sec. 4.2.2, keep ratios of eq. 12 (:func:`rds_select`)."""
    return rds_select(stats, p.ratios, rng, p)


_SAMPLERS: dict[str, SamplerFn] = {
    "none": select_none, "dapo": select_dapo, "smv": select_smv, "smr": select_smr, "rds": select_rds,
}


def get_sampler(name: str) -> SamplerFn:
    """The sampler registered as ``name`` ("none", "dapo", "smv", "smr", "rds"):
    ``fn(stats: Sequence[PromptStats], params: RDSParams, rng: np.random.Generator) -> keep mask``."""
    try:
        return _SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(_SAMPLERS)}") from None


def list_samplers() -> list[str]:
    return list(_SAMPLERS)


# ============================================================================ visibility (Fig. 3)
def _slug(c: str) -> str:
    return c.replace(".", "")


class CategoryShares:
    """Per-epoch shares of the difficulty categories (Fig. 3; appendix Tables 5-6).

    ``record(epoch, prompt_id, category, kept)`` once per rolled-out prompt; a prompt seen twice
    in an epoch counts with its latest category (one datum, one category per epoch, as the
    paper's tables). ``epoch_metrics(epoch)`` gives a flat dict for the metrics log:
    ``dscl/share_a``, ``dscl/share_b1``, ``dscl/share_b2``, ``dscl/share_c1``, ``dscl/share_c2``,
    ``dscl/share_b1_c1`` (the tables' "b.1 & c.1" row), ``dscl/prompts`` (distinct prompts) and
    ``dscl/kept`` / ``dscl/dropped`` (sampler decisions that epoch, repeats included).
    """

    def __init__(self) -> None:
        self.latest: dict[int, dict[Hashable, str]] = {}
        self.decisions: dict[int, list[int]] = {}  # epoch -> [kept, dropped]

    def record(self, epoch: int, prompt_id: Hashable, category: str, kept: bool | None = None) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        self.latest.setdefault(int(epoch), {})[prompt_id] = category
        if kept is not None:
            d = self.decisions.setdefault(int(epoch), [0, 0])
            d[0 if kept else 1] += 1

    def shares(self, epoch: int) -> dict[str, float]:
        """Category -> share of the epoch's distinct prompts (all 0 for an unseen epoch)."""
        cats = list(self.latest.get(int(epoch), {}).values())
        n = len(cats)
        return {c: (cats.count(c) / n if n else 0.0) for c in CATEGORIES}

    def epoch_metrics(self, epoch: int) -> dict[str, float]:
        sh = self.shares(epoch)
        out = {f"dscl/share_{_slug(c)}": v for c, v in sh.items()}
        out["dscl/share_b1_c1"] = sh["b.1"] + sh["c.1"]
        out["dscl/prompts"] = float(len(self.latest.get(int(epoch), {})))
        kept, dropped = self.decisions.get(int(epoch), [0, 0])
        out["dscl/kept"], out["dscl/dropped"] = float(kept), float(dropped)
        return out

    def table(self) -> dict[int, dict[str, float]]:
        """epoch -> :meth:`epoch_metrics` for every recorded epoch (for plots like Fig. 3)."""
        return {e: self.epoch_metrics(e) for e in sorted(self.latest)}

    def format_table(self) -> str:
        """A text table like appendix Table 5 (rows b.2, b.1 & c.1, c.2, a; columns epochs; %)."""
        epochs = sorted(self.latest)
        rows = [("b.2", ["b.2"]), ("b.1 & c.1", ["b.1", "c.1"]), ("c.2", ["c.2"]), ("a", ["a"])]
        lines = ["epoch\t" + "\t".join(str(e) for e in epochs)]
        for label, cs in rows:
            vals = [100 * sum(self.shares(e)[c] for c in cs) for e in epochs]
            lines.append(label + "\t" + "\t".join(f"{v:.1f}" for v in vals))
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        return {"latest": {str(e): [[pid, c] for pid, c in d.items()] for e, d in self.latest.items()},
                "decisions": {str(e): list(v) for e, v in self.decisions.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latest = {int(e): {_hashable(pid): str(c) for pid, c in d} for e, d in state["latest"].items()}
        self.decisions = {int(e): [int(v[0]), int(v[1])] for e, v in state["decisions"].items()}


# ============================================================================ the bundle
class SamplingController:
    """Everything a trainer needs for DSCL and the sampling baselines, in one checkpointable object.

    Per training step, on the live (unmasked) rollouts of the batch (DSCL Fig. 2: "for each
    training batch, the TDCL method first determines the training stage ... Then the RDS method
    dynamically samples the data")::

        ctl.observe_subrewards(step, rows)   # rows: subreward_fractions(parts, gold) per rollout
        r = ctl.reward(parts, gold, r_env)   # per rollout: eq. 7 with the stage's lambdas (or r_env)
        keep = ctl.select(step, epoch, [(prompt_id, [r, ...]), ...], round_=k)
        ...train on the kept groups; with ctl.refill, ask groups_to_request(...) more and repeat
        metrics.update(ctl.step_metrics()); at an epoch's end metrics.update(ctl.epoch_metrics(e))

    ``sampler``: a :func:`get_sampler` name. ``warmup_gate``: the sampler only acts once the
    format stage has converged (sec. 4.2.2 last paragraph, sec. 6.4, Table 3; the paper runs SMV
    and SMR "with curriculum learning based on our methodology", sec. 5.2); before that every
    group is kept. Categories are computed and recorded for every group with every sampler (so
    Fig. 3 can be drawn for the baselines too). ``reset_history_on_stage``: forget the per-prompt
    means when the stage changes, since eq. 7's weights change the reward's meaning.
    The RNG of each selection is derived from (seed, step, round_), so a resumed run decides the
    same way without an RNG state in the checkpoint.
    """

    def __init__(self, sampler: str = "none", params: RDSParams | None = None, *,
                 curriculum: CurriculumStage | None = None, warmup_gate: bool = True,
                 refill: bool = False, reset_history_on_stage: bool = True, seed: int = 0,
                 history_max_len: int | None = None):
        self.sampler_name = sampler
        self.sampler = get_sampler(sampler)
        self.params = params or RDSParams()
        self.curriculum = curriculum or CurriculumStage(weighted=False)
        self.warmup_gate = bool(warmup_gate)
        self.refill = bool(refill)
        self.reset_history_on_stage = bool(reset_history_on_stage)
        self.seed = int(seed)
        self.history = RewardHistory(history_max_len)
        self.shares = CategoryShares()
        self._step: int | None = None  # the step the per-step tallies below belong to
        self._tally: dict[str, float] = {}  # per step, summed over its sampling rounds
        self._step_transitions: list[StageTransition] = []

    def _begin(self, step: int) -> None:
        """Start the per-step tallies afresh when ``step`` is a new step (a step may have several
        sampling rounds, DAPO-style refills: they all add to the same step's metrics)."""
        if self._step != int(step):
            self._step = int(step)
            self._tally = {}
            self._step_transitions = []

    @classmethod
    def from_config(cls, sc: Any, *, reward_name: str, batches_per_epoch: int, seed: int = 0
                    ) -> "SamplingController":
        """Build from a ``reflrl.config.SamplingConfig`` (duck-typed: read by attribute)."""
        ratios = {"a": sc.keep_a, "b.1": sc.keep_b1, "b.2": sc.keep_b2, "c.1": sc.keep_c1, "c.2": sc.keep_c2}
        params = RDSParams.for_reward(reward_name, t_mean=sc.t_mean, t_var=sc.t_var,
                                      unit_scale=sc.unit_scale, ratios=ratios, smv_keep=sc.smv_keep,
                                      smr_low=sc.smr_low, smr_high=sc.smr_high)
        cur = CurriculumStage(window=sc.window or batches_per_epoch,
                              thresholds={"format": sc.format_threshold, "name": sc.name_threshold,
                                          "key": sc.key_threshold},
                              weighted=sc.curriculum, reset_window_on_transition=sc.reset_window_on_stage)
        return cls(sc.sampler, params, curriculum=cur, warmup_gate=sc.warmup_gate, refill=sc.refill,
                   reset_history_on_stage=sc.reset_history_on_stage, seed=seed)

    # -- TDCL -------------------------------------------------------------------------------------
    def observe_subrewards(self, step: int, rows: Iterable[Mapping[str, float]]) -> StageTransition | None:
        """Feed the batch's sub-reward fractions to the stage machine; returns a transition, if any."""
        self._begin(step)
        ev = self.curriculum.observe_batch(step, rows)
        if ev is not None:
            self._step_transitions.append(ev)
            if self.reset_history_on_stage and self.curriculum.weighted:
                self.history.clear()
        return ev

    def reward(self, parts: Mapping[str, float], gold: Sequence[ToolCall], env_reward: float) -> float:
        """The reward to train on: eq. 7 with the current stage's lambdas when the curriculum is
        on, else ``env_reward`` unchanged."""
        if not self.curriculum.weighted:
            return float(env_reward)
        return stage_reward(parts, gold, self.curriculum.lambdas)

    # -- RDS and the baselines ----------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the sampler filters now (False before format convergence with warmup_gate)."""
        return self.sampler_name != "none" and (not self.warmup_gate or self.curriculum.format_converged)

    def select(self, step: int, epoch: int, groups: Sequence[tuple[Hashable, Sequence[float]]],
               round_: int = 0) -> list[bool]:
        """Keep mask over ``groups`` = (prompt_id, live rollout rewards) of one sampling round.

        Updates the reward history (eqs. 9-11), records each prompt's category for the epoch, and
        applies the sampler when :attr:`active` (else keeps all). Groups with no rewards (all
        rollouts masked) are not kept and leave no trace in the history.
        """
        self._begin(step)
        idx = [i for i, (_, rs) in enumerate(groups) if len(rs) > 0]
        stats = [self.history.update(groups[i][0], groups[i][1]) for i in idx]
        cats = [categorize(s, self.params) for s in stats]
        if self.active:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(step), int(round_)])
            sub = self.sampler(stats, self.params, rng)
        else:
            sub = [True] * len(stats)
        keep = [False] * len(groups)
        for j, i in enumerate(idx):
            keep[i] = bool(sub[j])
            self.shares.record(epoch, groups[i][0], cats[j], keep[i])
        t = self._tally
        t["active"] = float(self.active)
        t["rounds"] = t.get("rounds", 0.0) + 1
        t["in"] = t.get("in", 0.0) + len(stats)
        t["kept"] = t.get("kept", 0.0) + sum(bool(x) for x in sub)
        for c in CATEGORIES:
            t[c] = t.get(c, 0.0) + cats.count(c)
        return keep

    def to_request(self, target: int, have: int, keep_rate: float | None, max_request: int | None = None) -> int:
        """With ``refill`` (DAPO-style): more groups to sample, :func:`groups_to_request`; else 0."""
        return groups_to_request(target, have, keep_rate, max_request=max_request) if self.refill else 0

    # -- logging / checkpoints ------------------------------------------------------------------
    def step_metrics(self) -> dict[str, Any]:
        """The current step's metrics (keys in the module docstring, "Metrics"): the stage machine's
        state, whether the stage changed during this step, and the sampler's decisions and the
        batch's category shares summed over the step's sampling rounds."""
        out: dict[str, Any] = dict(self.curriculum.metrics())
        out["dscl/stage_changed"] = float(bool(self._step_transitions))
        if self._step_transitions:
            ev = self._step_transitions[-1]
            out["dscl/transition"] = {**ev.to_dict(), "from": self._step_transitions[0].from_stage}
        t = self._tally
        if "in" in t:
            n = max(1.0, t["in"])
            out.update({"dscl/sampler_active": t["active"], "dscl/groups_in": t["in"],
                        "dscl/groups_kept": t["kept"], "dscl/keep_rate": t["kept"] / n})
            for c in CATEGORIES:
                out[f"dscl/batch_{_slug(c)}"] = t[c] / n
        return out

    def epoch_metrics(self, epoch: int) -> dict[str, float]:
        """Category shares and sampler decisions of ``epoch`` (:meth:`CategoryShares.epoch_metrics`)."""
        return self.shares.epoch_metrics(epoch)

    def epoch_record(self, epoch: int, *, partial: bool = False) -> dict[str, Any]:
        """One ``phase="epoch"`` record of metrics.jsonl (module docstring, "Metrics"): the epoch,
        whether it was cut short by the end of the run, its category shares and decisions, the stage
        at its end and the stage transitions that happened during it (by step)."""
        return {"epoch": int(epoch), "dscl/partial": float(bool(partial)), **self.epoch_metrics(epoch),
                "dscl/stage": float(self.curriculum.stage), "dscl/sampler": self.sampler_name}

    def summary(self) -> dict[str, Any]:
        """For summary.json: sampler, final stage, every stage transition and the per-epoch category
        shares (Fig. 3 / Table 5 of DSCL), the last (possibly partial) epoch included."""
        return {"sampler": self.sampler_name, "curriculum": self.curriculum.weighted,
                "stage": self.curriculum.stage,
                "transitions": [t.to_dict() for t in self.curriculum.transitions],
                "epochs": {str(e): m for e, m in self.shares.table().items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler_name, "curriculum": self.curriculum.state_dict(),
                "history": self.history.state_dict(), "shares": self.shares.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("sampler", self.sampler_name) != self.sampler_name:
            raise ValueError(f"checkpoint used sampler {state['sampler']!r}, this run {self.sampler_name!r}")
        self.curriculum.load_state_dict(state["curriculum"])
        self.history.load_state_dict(state["history"])
        self.shares.load_state_dict(state["shares"])


__all__ = [
    "CATEGORIES", "DEFAULT_RATIOS", "DEFAULT_THRESHOLDS", "SAMPLERS", "STAGE_GATES", "CategoryShares",
    "CurriculumStage", "PromptStats", "RDSParams", "RewardHistory", "SamplingController",
    "StageTransition", "batches_per_epoch", "categorize", "fine_maxima", "get_sampler",
    "episode_stage_reward", "list_samplers", "prompt_stats", "scored_turn_parts", "rds_select", "select_dapo", "select_none", "select_rds",
    "select_smr", "select_smv", "stage_reward", "subreward_fractions",
]
