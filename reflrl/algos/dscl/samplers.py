"""The group samplers DSCL compares (Table 1, sec. 5.2), by name: none, DAPO, SMV, SMR and RDS."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from reflrl.registry import Registry

from ..filters import zero_variance
from .rds import PromptStats, RDSParams, rds_select

SamplerFn = Callable[[Sequence[PromptStats], RDSParams, np.random.Generator], list[bool]]


def select_none(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """ToolRL baseline: no dynamic sampling, every prompt is kept."""
    return [True] * len(stats)


def select_dapo(stats: Sequence[PromptStats], p: RDSParams, rng: np.random.Generator) -> list[bool]:
    """DAPO dynamic sampling (Yu et al. 2025; Table 1 "w/ DAPO"): keep the groups whose rewards are not
    all equal (:func:`reflrl.algos.filters.zero_variance`, the one DAPO rule the trainer's
    ``algo.dynamic_sampling`` uses too). DAPO then refills the batch: see ``groups_to_request``."""
    return [not zero_variance(s.rewards, tol=p.tol) for s in stats]


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


SAMPLERS_REGISTRY: Registry[SamplerFn] = Registry("sampler")
for _name, _fn in (("none", select_none), ("dapo", select_dapo), ("smv", select_smv), ("smr", select_smr),
                   ("rds", select_rds)):
    SAMPLERS_REGISTRY.register(_name, _fn)
SAMPLERS: tuple[str, ...] = ("none", "dapo", "smv", "smr", "rds")


def get_sampler(name: str) -> SamplerFn:
    """The sampler registered as ``name`` ("none", "dapo", "smv", "smr", "rds"):
    ``fn(stats: Sequence[PromptStats], params: RDSParams, rng: np.random.Generator) -> keep mask``."""
    return SAMPLERS_REGISTRY.get(name)


def list_samplers() -> list[str]:
    return list(SAMPLERS)
