"""RDS, DSCL sec. 4.2: per-prompt reward statistics (eqs. 9-11), the difficulty categories of sec. 4.2.2
and the keep ratios of eq. 12."""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reflrl.envs.rewards import REWARD_RANGES, map_range

# ============================================================================ constants
CATEGORIES: tuple[str, ...] = ("a", "b.1", "b.2", "c.1", "c.2")
"""The difficulty categories of sec. 4.2.2, in the order they are reported."""

DEFAULT_RATIOS: dict[str, float] = {"a": 0.0, "b.1": 1.0, "b.2": 0.0, "c.1": 1.0, "c.2": 0.5}
"""Eq. 12: keep ratio per category (a, b.2 dropped; c.2 half kept; b.1, c.1 kept)."""


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
