"""DSCL: curriculum stage machine, RDS categories and sampling, baselines, configs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from reflrl.algos.dscl import (
    CATEGORIES,
    DEFAULT_RATIOS,
    CategoryShares,
    CurriculumStage,
    PromptStats,
    RDSParams,
    RewardHistory,
    SamplingController,
    batches_per_epoch,
    categorize,
    get_sampler,
    list_samplers,
    prompt_stats,
    rds_select,
    episode_stage_reward,
    scored_turn_parts,
    stage_reward,
    subreward_fractions,
)
from reflrl.algos.filters import zero_variance
from reflrl.config import ConfigError, load_config, registered
from reflrl.envs.rewards import DSCL_STAGE_LAMBDAS, fine_parts, fine_reward
from reflrl.envs.types import ParseResult, ToolCall

ROOT = Path(__file__).resolve().parents[1]
P = RDSParams()  # fine reward range [-3, 4], t_mean 0.5, t_var 0.1, raw scale


def stats_from(history_means, rewards, pid="p"):
    h = RewardHistory()
    for m in history_means:
        h.update(pid, [m, m])  # a batch whose mean is m (and zero current variance)
    return h.update(pid, rewards)


# ------------------------------------------------------------------------- eqs. 9-11
def test_prompt_stats_follow_eqs_9_to_11():
    h = RewardHistory()
    s1 = h.update("q", [4.0, 2.0, 0.0, -2.0])
    assert s1.mean == pytest.approx(1.0)                        # eq. 9
    assert s1.var_current == pytest.approx((9 + 1 + 1 + 9) / 4)  # eq. 10, population variance
    assert s1.var_history == 0.0 and s1.visits == 1              # eq. 11 over {M^1}
    s2 = h.update("q", [3.0, 3.0])
    assert s2.var_current == 0.0
    assert s2.var_history == pytest.approx(np.var([1.0, 3.0]))   # eq. 11 over {M^1, M^2}
    assert s2.visits == 2
    assert h.stats("q", [0.0]).var_history == pytest.approx(np.var([1.0, 3.0, 0.0]))
    assert len(h.means["q"]) == 2  # stats() records nothing
    with pytest.raises(ValueError, match="no rewards"):
        h.update("q", [])
    with pytest.raises(ValueError, match="finite"):
        h.update("q", [float("nan")])


@pytest.mark.parametrize("history, rewards, expected", [
    ([], [4.0] * 8, "a"),                                   # M = 4
    ([-3.0, 4.0], [4.0] * 8, "a"),                          # a regardless of variances
    ([], [-3.0] * 8, "b.2"),                                # M < t_mean, stable now and before
    ([], [-3.0, -2.0] * 4, "b.1"),                          # V_current = 0.25 > 0.1
    ([-3.0, 0.3], [0.3] * 8, "b.1"),                        # V_current = 0, V_history > 0.1 ("or")
    ([0.2, 0.2], [0.2, 0.4] * 4, "b.2"),                    # both variances < 0.1
    ([], [1.0, 3.0] * 4, "c.2"),                            # V_current 1 > .1 but V_history = 0 ("and")
    ([-1.0], [1.0, 3.0] * 4, "c.1"),                        # both > 0.1
    ([2.0, 2.0], [2.0] * 8, "c.2"),                         # intermediate, stable
    ([], [0.5] * 8, "c.2"),                                 # M = t_mean belongs to c ([t_mean, 4))
    ([-1.0], [3.9, 4.0] * 4, "c.2"),                        # M just under 4; V_current 0.0025 < .1
])
def test_categories_match_sec_4_2_2(history, rewards, expected):
    assert categorize(stats_from(history, rewards), P) == expected


def test_variance_equal_to_threshold_is_not_above_it():
    st = PromptStats("p", mean=0.0, var_current=0.1, var_history=0.1)
    assert categorize(st, P) == "b.2"
    st = PromptStats("p", mean=1.0, var_current=0.1, var_history=0.5)
    assert categorize(st, P) == "c.2"


def test_unit_scale_maps_mean_and_variance():
    # raw variance 0.49 = 0.01 on [0, 1] (span 7): above t_var raw, below it on the unit scale
    st = PromptStats("p", mean=-2.0, var_current=0.49, var_history=0.0)
    assert categorize(st, P) == "b.1"
    assert categorize(st, RDSParams(unit_scale=True)) == "b.2"
    # M = 1.0 raw is above t_mean = 0.5 raw, but 4/7 = 0.571 on the unit scale: still c
    st = PromptStats("p", mean=1.0, var_current=0.0, var_history=0.0)
    assert categorize(st, RDSParams(unit_scale=True, t_mean=0.6)) == "b.2"
    assert categorize(st, RDSParams(t_mean=0.6)) == "c.2"
    binary = RDSParams.for_reward("binary")
    assert (binary.r_min, binary.r_max) == (0.0, 1.0)
    assert categorize(prompt_stats("p", [1.0, 1.0]), binary) == "a"


# ------------------------------------------------------------------------- eq. 12
def test_rds_kept_fraction_per_category_equals_ratio_in_expectation():
    cats = ["a"] * 7 + ["b.1"] * 5 + ["b.2"] * 6 + ["c.1"] * 4 + ["c.2"] * 9
    rng = np.random.default_rng(123)
    kept = {c: 0 for c in CATEGORIES}
    draws = 4000
    for _ in range(draws):
        mask = rds_select(cats, DEFAULT_RATIOS, rng)
        for c, k in zip(cats, mask):
            kept[c] += k
    for c in CATEGORIES:
        frac = kept[c] / (draws * cats.count(c))
        assert frac == pytest.approx(DEFAULT_RATIOS[c], abs=0.01), c
    # deterministic parts: ratio 0 never kept, ratio 1 always kept
    mask = rds_select(cats, DEFAULT_RATIOS, 7)
    assert not any(k for c, k in zip(cats, mask) if c in ("a", "b.2"))
    assert all(k for c, k in zip(cats, mask) if c in ("b.1", "c.1"))
    # 9 c.2 prompts at ratio .5: 4 or 5 kept each draw
    assert sum(k for c, k in zip(cats, mask) if c == "c.2") in (4, 5)


def test_rds_other_ratios_and_seeding():
    cats = ["c.2"] * 10 + ["b.1"] * 3
    ratios = {"a": 0.0, "b.1": 0.3, "b.2": 0.0, "c.1": 1.0, "c.2": 0.25}
    rng = np.random.default_rng(0)
    tot = np.zeros(2)
    for _ in range(4000):
        m = rds_select(cats, ratios, rng)
        tot += [sum(m[:10]), sum(m[10:])]
    assert tot[0] / (4000 * 10) == pytest.approx(0.25, abs=0.01)
    assert tot[1] / (4000 * 3) == pytest.approx(0.3, abs=0.015)
    assert rds_select(cats, ratios, 5) == rds_select(cats, ratios, 5)
    with pytest.raises(ValueError, match="no keep ratio"):
        rds_select(["a"], {"b.1": 1.0}, 0)


def test_rds_sampler_on_stats():
    st = [stats_from([], [4.0] * 4, "easy"), stats_from([], [-3.0] * 4, "stuck"),
          stats_from([], [-3.0, -1.0] * 2, "explore"), stats_from([-1.0], [1.0, 3.0] * 2, "diverse")]
    assert get_sampler("rds")(st, P, np.random.default_rng(0)) == [False, False, True, True]


# ------------------------------------------------------------------------- baselines
def test_smv_keeps_the_max_variance_prompts():
    st = [prompt_stats(i, r) for i, r in enumerate(
        [[0.0, 0.0], [-3.0, 4.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 3.0], [2.0, 2.5]])]
    keep = get_sampler("smv")(st, P, np.random.default_rng(0))
    assert keep == [False, True, True, False, True, False]  # ceil(.5 * 6) = 3 largest V_current (12.25, 4, .25)
    one = get_sampler("smv")(st, RDSParams(smv_keep=1.0), np.random.default_rng(0))
    assert one == [False, True, True, False, True, True]  # zero-variance groups never kept


def test_smr_keeps_the_mean_reward_band():
    # means mapped to [0, 1] by (M + 3) / 7: -3 -> 0, -1.25 -> .25, 0.5 -> .5, 2.25 -> .75, 4 -> 1
    st = [prompt_stats(i, [m, m]) for i, m in enumerate([-3.0, -1.25, 0.5, 2.25, 2.5, 4.0, -1.5])]
    keep = get_sampler("smr")(st, P, np.random.default_rng(0))
    assert keep == [False, True, True, True, False, False, False]
    # variance is ignored
    assert get_sampler("smr")([prompt_stats(0, [-3.0, 4.0])], P, np.random.default_rng(0)) == [True]


def test_dapo_adapter_agrees_with_filters():
    groups = [[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [-3.0, -3.0, -3.0], [2.0, 2.5, 2.0]]
    st = [prompt_stats(i, g) for i, g in enumerate(groups)]
    expect = [not zero_variance(g) for g in groups]
    assert get_sampler("dapo")(st, P, np.random.default_rng(0)) == expect == [False, True, False, True]
    assert get_sampler("none")(st, P, np.random.default_rng(0)) == [True] * 4
    assert set(list_samplers()) == set(registered("sampler")) == {"none", "dapo", "smv", "smr", "rds"}
    with pytest.raises(ValueError, match="unknown sampler 'rsd'"):
        get_sampler("rsd")


# ------------------------------------------------------------------------- TDCL
def rows(n, **vals):
    return [dict(vals) for _ in range(n)]


def test_stage_moves_only_when_the_windowed_threshold_is_passed():
    cur = CurriculumStage(window=3)
    assert cur.stage == 1 and cur.lambdas == DSCL_STAGE_LAMBDAS[1] and not cur.format_converged
    # window not yet full: no transition however high the format reward
    assert cur.observe_batch(0, rows(4, format=1.0)) is None
    assert cur.observe_batch(1, rows(4, format=1.0)) is None
    assert cur.stage == 1
    # full window; pooled mean (eq. 8) = (8 + 4 * 0.6) / 12 = 0.8667 < 0.9
    assert cur.observe_batch(2, rows(4, format=0.6)) is None
    # window is now batches 1..3: (4 + 2.4 + 4 * .9) / 12 = 0.833 -> no
    assert cur.observe_batch(3, rows(4, format=0.9)) is None
    # exactly at the threshold does not "surpass" it (eq. 8: R_format > R^_format)
    cur2 = CurriculumStage(window=1)
    assert cur2.observe_batch(0, rows(2, format=0.9)) is None
    ev = cur2.observe_batch(1, rows(2, format=0.95))
    assert ev is not None and (ev.from_stage, ev.to_stage, ev.step) == (1, 2, 1)
    # the pooled mean counts rollouts, not batches
    cur3 = CurriculumStage(window=2)
    cur3.observe_batch(0, rows(1, format=0.0))
    ev = cur3.observe_batch(1, rows(19, format=1.0))
    assert ev is not None and ev.values["format"] == pytest.approx(0.95)


def test_stage_two_needs_name_and_key_and_never_goes_back():
    cur = CurriculumStage(window=2)
    cur.observe_batch(0, rows(2, format=1.0, name=0.9, key=0.9))
    ev = cur.observe_batch(1, rows(2, format=1.0, name=0.9, key=0.9))
    assert ev.to_stage == 2 and cur.lambdas == DSCL_STAGE_LAMBDAS[2]  # one transition per batch
    assert cur.format_converged
    # name passes, key does not -> stay
    cur.observe_batch(2, rows(2, format=1.0, name=0.9, key=0.5))
    assert cur.observe_batch(3, rows(2, format=1.0, name=0.9, key=0.5)) is None
    assert cur.stage == 2
    # format collapses: the stage does not move backwards
    cur.observe_batch(4, rows(2, format=0.0, name=0.0, key=0.0))
    cur.observe_batch(5, rows(2, format=0.0, name=0.0, key=0.0))
    assert cur.stage == 2
    cur.observe_batch(6, rows(2, format=0.0, name=0.8, key=0.75))
    ev = cur.observe_batch(7, rows(2, format=0.0, name=0.8, key=0.75))
    assert (ev.from_stage, ev.to_stage) == (2, 3) and cur.lambdas == DSCL_STAGE_LAMBDAS[3]
    for s in range(8, 12):
        assert cur.observe_batch(s, rows(2, format=0.0, name=0.0, key=0.0)) is None
    assert cur.stage == 3
    assert [(t.from_stage, t.to_stage) for t in cur.transitions] == [(1, 2), (2, 3)]
    assert cur.metrics()["dscl/stage"] == 3.0


def test_reset_window_and_unweighted_mode():
    cur = CurriculumStage(window=2, reset_window_on_transition=True, weighted=False)
    assert cur.lambdas == (1.0, 1.0, 1.0) and cur.reward_name == "fine"
    cur.observe_batch(0, rows(1, format=1.0, name=1.0, key=1.0))
    assert cur.observe_batch(1, rows(1, format=1.0, name=1.0, key=1.0)).to_stage == 2
    assert cur.observe_batch(2, rows(1, format=1.0, name=1.0, key=1.0)) is None  # window refilling
    assert cur.observe_batch(3, rows(1, format=1.0, name=1.0, key=1.0)).to_stage == 3
    assert cur.lambdas == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="not a fraction"):
        cur.observe_batch(4, [{"key": 2.0}])  # raw R_key, not normalised
    with pytest.raises(ValueError, match="window"):
        CurriculumStage(window=0)


def test_subreward_fractions_normalise_by_the_maxima():
    gold = [ToolCall("a", {"x": 1, "y": 2}), ToolCall("b", {"z": 3})]
    pred = ParseResult(ok=True, calls=[ToolCall("a", {"x": 1, "y": 5})])
    parts = fine_parts(pred, gold)
    fr = subreward_fractions(parts)
    assert fr["format"] == 1.0 and fr["name"] == pytest.approx(0.5)
    assert fr["key"] == pytest.approx(1.0 / 2)     # R_key = 1 of |Y| = 2
    assert fr["value"] == pytest.approx(1.0 / 3)   # 1 of 3 gold keys right
    # fine_reward's parts carry no maxima: they come from the gold
    rparts = fine_reward(pred, gold).parts
    assert subreward_fractions(rparts, gold) == pytest.approx(fr)
    with pytest.raises(ValueError, match="gold"):
        subreward_fractions(rparts)
    # a "no call" gold: key / value have no maximum and are left out
    assert set(subreward_fractions(fine_parts(ParseResult(ok=True), []))) == {"format", "name"}
    assert subreward_fractions({"format": 1.0, "match": 0.0}) == {"format": 1.0}  # binary reward


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_reward_is_eq7_and_stays_in_range(stage):
    gold = [ToolCall("a", {"x": 1, "y": 2}), ToolCall("b", {"z": 3})]
    preds = [
        ParseResult(ok=False),
        ParseResult(ok=True),
        ParseResult(ok=True, calls=[ToolCall("a", {"x": 1, "y": 5})]),
        ParseResult(ok=True, calls=[ToolCall("a", {"x": 1, "y": 2}), ToolCall("b", {"z": 3})]),
        ParseResult(ok=True, calls=[ToolCall("c", {})]),
    ]
    lam = DSCL_STAGE_LAMBDAS[stage]
    for pred in preds:
        res = fine_reward(pred, gold, lambdas=lam)
        r = stage_reward(res.parts, gold, lam)
        assert r == pytest.approx(res.total)
        assert -3.0 - 1e-9 <= r <= 4.0 + 1e-9
    assert stage_reward(fine_reward(preds[3], gold).parts, gold, lam) == pytest.approx(4.0)


def test_episode_stage_reward_matches_the_env_scoring():
    golds = [[ToolCall("a", {"x": 1})], [ToolCall("b", {"y": 2})], [ToolCall("c", {})]]
    preds = [ParseResult(ok=True, calls=[ToolCall("a", {"x": 1})]),
             ParseResult(ok=True, calls=[ToolCall("b", {"y": 3})])]
    lam = DSCL_STAGE_LAMBDAS[3]
    steps = [{"parse_ok": True, "reward_parts": {}},  # a tool step inside turn 0: no parts
             {"parse_ok": True, "reward_parts": fine_reward(preds[0], golds[0]).parts},
             {"parse_ok": True, "reward_parts": fine_reward(preds[1], golds[1]).parts}]
    parts = scored_turn_parts([s["reward_parts"] for s in steps])
    assert len(parts) == 2
    want = (fine_reward(preds[0], golds[0], lambdas=lam).total
            + fine_reward(preds[1], golds[1], lambdas=lam).total - 3.0) / 3
    assert episode_stage_reward(parts, golds, 3, lam) == pytest.approx(want)
    with pytest.raises(ValueError):
        episode_stage_reward(parts, golds, 1, lam)


def test_batches_per_epoch():
    assert batches_per_epoch(256, 8) == 32 and batches_per_epoch(50, 8) == 7
    with pytest.raises(ValueError):
        batches_per_epoch(0, 8)


# ------------------------------------------------------------------------- visibility
def test_category_shares_per_epoch():
    sh = CategoryShares()
    for pid, c in [("p1", "b.2"), ("p2", "b.2"), ("p3", "c.1"), ("p4", "a")]:
        sh.record(0, pid, c, kept=c == "c.1")
    sh.record(0, "p1", "b.1", kept=True)  # seen again: its latest category counts
    m = sh.epoch_metrics(0)
    assert m["dscl/share_b2"] == 0.25 and m["dscl/share_b1"] == 0.25 and m["dscl/share_c1"] == 0.25
    assert m["dscl/share_b1_c1"] == 0.5 and m["dscl/share_a"] == 0.25 and m["dscl/share_c2"] == 0.0
    assert m["dscl/prompts"] == 4 and m["dscl/kept"] == 2 and m["dscl/dropped"] == 3
    assert sh.epoch_metrics(5)["dscl/prompts"] == 0
    assert "b.1 & c.1\t50.0" in sh.format_table()
    with pytest.raises(ValueError, match="category"):
        sh.record(0, "x", "d")


# ------------------------------------------------------------------------- controller + checkpoints
def test_controller_gates_sampler_until_format_converges():
    ctl = SamplingController("rds", curriculum=CurriculumStage(window=1, weighted=True), seed=3)
    groups = [("easy", [4.0] * 4), ("stuck", [-3.0] * 4), ("masked", [])]
    assert not ctl.active
    assert ctl.select(0, 0, groups) == [True, True, False]  # warm-up: keep all live groups
    ev = ctl.observe_subrewards(1, rows(4, format=1.0))
    assert ev.to_stage == 2 and ctl.active
    assert len(ctl.history) == 0  # history forgotten at the stage change (reward re-weighted)
    assert ctl.select(1, 0, groups) == [False, False, False]  # a and b.2 dropped
    m = ctl.step_metrics()
    assert m["dscl/stage"] == 2 and m["dscl/sampler_active"] == 1.0 and m["dscl/groups_kept"] == 0
    assert ctl.epoch_metrics(0)["dscl/share_a"] == 0.5
    # the reward: eq. 7 with the stage's lambdas; env reward unchanged without curriculum
    gold = [ToolCall("a", {"x": 1})]
    parts = fine_reward(ParseResult(ok=True, calls=[ToolCall("a", {"x": 2})]), gold).parts
    assert ctl.reward(parts, gold, 0.0) == pytest.approx(
        fine_reward(ParseResult(ok=True, calls=[ToolCall("a", {"x": 2})]), gold, lambdas=DSCL_STAGE_LAMBDAS[2]).total)
    assert SamplingController("rds").reward(parts, gold, 1.25) == 1.25
    # no warm-up gate: acts at once; "none" never acts
    assert SamplingController("dapo", warmup_gate=False).active
    assert not SamplingController("none", warmup_gate=False).active
    assert SamplingController("dapo", refill=True).to_request(8, 4, 0.5) == 8
    assert SamplingController("dapo").to_request(8, 4, 0.5) == 0


def test_state_dicts_round_trip_through_json():
    ctl = SamplingController("rds", curriculum=CurriculumStage(window=2), warmup_gate=False, seed=1)
    for step in range(3):
        ctl.observe_subrewards(step, rows(3, format=1.0, name=0.5, key=0.2))
        ctl.select(step, step // 2, [(("t", step % 2), [0.0, 1.0, 4.0]), ("u", [-3.0, -3.0])])
    state = json.loads(json.dumps(ctl.state_dict()))
    other = SamplingController("rds", curriculum=CurriculumStage(window=2), warmup_gate=False, seed=1)
    other.load_state_dict(state)
    assert other.state_dict() == ctl.state_dict()
    assert other.curriculum.stage == ctl.curriculum.stage == 2
    assert other.curriculum.windowed() == pytest.approx(ctl.curriculum.windowed())
    assert other.history.means == ctl.history.means and ("t", 0) in other.history.means
    assert other.shares.table() == ctl.shares.table()
    # same decisions afterwards (RNG derived from seed, step, round)
    g = [(("t", 0), [0.0, 2.0]), ("u", [1.0, 1.0]), ("v", [3.0, 1.0])]
    assert other.select(9, 2, g) == ctl.select(9, 2, g)
    with pytest.raises(ValueError, match="sampler"):
        SamplingController("smv").load_state_dict(state)
    bad = dict(state["curriculum"], stage=0)
    with pytest.raises(ValueError, match="stage"):
        CurriculumStage().load_state_dict(bad)


# ------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name, sampler, curriculum", [
    ("dscl", "rds", True), ("dapo", "dapo", False), ("smv", "smv", True), ("smr", "smr", True),
    ("rds", "rds", False), ("tdcl", "none", True), ("toolrl", "none", False),
])
def test_yaml_configs_load(name, sampler, curriculum):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.sampling.sampler == sampler and cfg.sampling.curriculum is curriculum
    assert cfg.env.reward == "fine"
    ctl = SamplingController.from_config(cfg.sampling, reward_name=cfg.env.reward,
                                         batches_per_epoch=batches_per_epoch(cfg.data.n_train, cfg.rollout.batch_prompts))
    assert ctl.sampler_name == sampler and ctl.curriculum.weighted is curriculum
    assert (ctl.params.r_min, ctl.params.r_max) == (-3.0, 4.0)
    if name == "dscl":
        assert ctl.curriculum.window == 7 and ctl.params.ratios == DEFAULT_RATIOS
        assert ctl.curriculum.thresholds == {"format": 0.9, "name": 0.75, "key": 0.7}


@pytest.mark.parametrize("name", ["dscl", "dapo", "smv", "smr", "rds", "tdcl", "toolrl"])
def test_sampling_configs_start_from_the_default_recipe(name):
    """`reflrl train --config configs/X.yaml` runs on the embedded default: every key the recipe
    does not set is the default recipe's (configs/default.yaml), not the code default."""
    from reflrl.config import config_diff

    default = load_config(ROOT / "configs" / "default.yaml")
    diff = config_diff(load_config(ROOT / "configs" / f"{name}.yaml"), default)
    assert set(diff) <= ({"env.reward", "reflection.variant"}
                         | {k for k in diff if k.startswith("sampling.")})
    assert diff["env.reward"] == ("binary", "fine")
    assert diff["reflection.variant"] == ("tool_rerl", "grpo")  # DSCL compares samplers on plain GRPO


def test_step_metrics_sum_the_rounds_of_a_step_and_flag_transitions():
    ctl = SamplingController("rds", curriculum=CurriculumStage(window=1, weighted=True), warmup_gate=False)
    ctl.select(0, 0, [("p1", [4.0, 4.0]), ("p2", [-3.0, 4.0])], round_=0)
    ctl.select(0, 0, [("p3", [-3.0, -3.0])], round_=1)  # a refill round of the same step
    m = ctl.step_metrics()
    assert m["dscl/groups_in"] == 3 and m["dscl/stage_changed"] == 0.0 and "dscl/transition" not in m
    assert m["dscl/batch_a"] == pytest.approx(1 / 3) and m["dscl/batch_b2"] == pytest.approx(1 / 3)
    assert sum(m[f"dscl/batch_{c.replace('.', '')}"] for c in CATEGORIES) == pytest.approx(1.0)
    ctl.observe_subrewards(1, rows(2, format=1.0))  # next step: stage 1 -> 2
    ctl.select(1, 0, [("p1", [4.0, 4.0])])
    m = ctl.step_metrics()
    assert m["dscl/groups_in"] == 1 and m["dscl/stage"] == 2 and m["dscl/stage_changed"] == 1.0
    assert m["dscl/transition"]["from"] == 1 and m["dscl/transition"]["to"] == 2
    ctl.select(2, 1, [("p2", [0.0, 1.0])])
    assert ctl.step_metrics()["dscl/stage_changed"] == 0.0
    rec = ctl.epoch_record(0)
    assert rec["epoch"] == 0 and rec["dscl/partial"] == 0.0 and rec["dscl/prompts"] == 3
    s = json.loads(json.dumps(ctl.summary()))
    assert s["stage"] == 2 and s["transitions"][0]["to"] == 2 and set(s["epochs"]) == {"0", "1"}


def test_default_config_window_is_batches_per_epoch():
    cfg = load_config(ROOT / "configs" / "default.yaml")
    assert cfg.sampling.sampler == "none" and cfg.sampling.window is None
    ctl = SamplingController.from_config(cfg.sampling, reward_name=cfg.env.reward, batches_per_epoch=32)
    assert ctl.curriculum.window == 32 and not ctl.active


@pytest.mark.parametrize("overrides, needle", [
    (["sampling.sampler=rsd"], "did you mean 'rds'"),
    (["sampling.keep_c2=1.5"], "sampling.keep_c2"),
    (["sampling.smr_low=0.8", "sampling.smr_high=0.2"], "smr_low"),
    (["sampling.window=0"], "sampling.window"),
    (["sampling.curriculum=true", "env.reward=binary"], "fine-grained reward"),
])
def test_bad_sampling_config_names_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
