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
  :func:`reflrl.algos.filters.zero_variance`), ``"smv"`` (sample by max variance
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

from .controller import CategoryShares, SamplingController
from .curriculum import DEFAULT_THRESHOLDS, STAGE_GATES, CurriculumStage, StageTransition
from .rds import CATEGORIES, DEFAULT_RATIOS, PromptStats, RDSParams, RewardHistory, categorize, prompt_stats, rds_select
from .rewards import (SUBREWARDS, batches_per_epoch, episode_stage_reward, fine_maxima, scored_turn_parts, stage_reward,
                      subreward_fractions)
from .samplers import (SAMPLERS, get_sampler, list_samplers, select_dapo, select_none, select_rds, select_smr,
                       select_smv)

__all__ = [
    "CATEGORIES", "DEFAULT_RATIOS", "DEFAULT_THRESHOLDS", "SAMPLERS", "STAGE_GATES", "SUBREWARDS", "CategoryShares",
    "CurriculumStage", "PromptStats", "RDSParams", "RewardHistory", "SamplingController",
    "StageTransition", "batches_per_epoch", "categorize", "fine_maxima", "get_sampler",
    "episode_stage_reward", "list_samplers", "prompt_stats", "scored_turn_parts", "rds_select", "select_dapo",
    "select_none", "select_rds", "select_smr", "select_smv", "stage_reward", "subreward_fractions",
]
