"""Unit tests for reflrl.algos against hand-computed examples."""

import itertools
import json
import math
import random

import pytest
import torch

from reflrl.algos import (
    PreRolloutFilter,
    advantage_needs_critic,
    agg_loss,
    broadcast_to_tokens,
    clipped_policy_loss,
    dr_grpo_advantage,
    entropy_from_logits,
    gae_advantage,
    get_advantage_fn,
    get_policy_loss_fn,
    groups_to_request,
    grpo_advantage,
    kl_loss,
    kl_penalty,
    list_advantages,
    max_variance_subset,
    outcome_to_token_rewards,
    rloo_advantage,
    value_loss,
)

close = lambda a, b, tol=1e-5: torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)  # noqa: E731


# ---------------------------------------------------------------- advantages
def test_grpo_hand_example_unbiased_std():
    # group 0: mean .25, sample std sqrt(.75/3) = .5 -> (1-.25)/.5 = 1.5, (0-.25)/.5 = -.5
    adv = grpo_advantage(torch.tensor([1.0, 0, 0, 0]), [7, 7, 7, 7])
    assert close(adv, [1.5, -0.5, -0.5, -0.5])


def test_grpo_population_std_option():
    adv = grpo_advantage(torch.tensor([1.0, 0, 0, 0]), [0] * 4, unbiased_std=False)
    s = math.sqrt(0.75 / 4)
    assert close(adv, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])


def test_grpo_zero_variance_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not come from the arithmetic
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 1.0, 1.0])
    adv = grpo_advantage(r, ["a", "a", "a", "b", "b", "c", "c", "c"])
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.equal(adv[5:], torch.zeros(3))
    assert close(adv[3:5], [1 / (math.sqrt(0.5) + 1e-6) * 0.5] * 1 + [-0.5 / (math.sqrt(0.5) + 1e-6)])


def test_grpo_singleton_group_gives_zero():
    assert torch.equal(grpo_advantage(torch.tensor([1.0, 0.0, 1.0]), [0, 0, 1])[2:], torch.zeros(1))


def test_grpo_two_d_input_matches_flat_with_ids():
    r = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]])
    flat = grpo_advantage(r.reshape(-1), torch.tensor([0, 0, 0, 1, 1, 1]))
    two_d = grpo_advantage(r)
    assert two_d.shape == (2, 3)
    assert close(two_d.reshape(-1), flat)


def test_grpo_groups_need_not_be_contiguous():
    adv = grpo_advantage(torch.tensor([1.0, 5.0, 0.0, 5.0]), ["x", "y", "x", "y"])
    assert close(adv, [1 / (math.sqrt(0.5) + 1e-6) * 0.5, 0.0, -0.5 / (math.sqrt(0.5) + 1e-6), 0.0])


def test_dr_grpo_and_rloo_hand_examples():
    r = torch.tensor([1.0, 0, 0, 0])
    assert close(dr_grpo_advantage(r, [0] * 4), [0.75, -0.25, -0.25, -0.25])
    # leave-one-out: 1 - 0 = 1, 0 - 1/3
    assert close(rloo_advantage(r, [0] * 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
    assert torch.equal(rloo_advantage(torch.tensor([1.0, 1.0]), [0, 0]), torch.zeros(2))


def test_group_ids_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantage(torch.tensor([1.0, 0.0]), [0, 0, 0])
    with pytest.raises(ValueError, match="group_ids is required"):
        grpo_advantage(torch.tensor([1.0, 0.0]))


def test_broadcast_to_tokens_zero_on_masked():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))


def test_registry_grpo_returns_token_level():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    fn = get_advantage_fn("grpo")
    adv, ret = fn(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_ids=[0, 0, 1, 1], response_mask=mask, values=None)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert close(adv, [[a, a, 0], [-a, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert torch.equal(adv, ret)
    # token_rewards are summed over action tokens when no outcome rewards are given
    tr = outcome_to_token_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask)
    adv2, _ = fn(token_rewards=tr, group_ids=[0, 0, 1, 1], response_mask=mask)
    assert torch.equal(adv, adv2)


def test_registry_lookup_errors_and_critic_flag():
    assert {"grpo", "dr_grpo", "rloo", "gae"} <= set(list_advantages())
    assert advantage_needs_critic("gae") and not advantage_needs_critic("grpo")
    with pytest.raises(KeyError, match="did you mean 'grpo'"):
        get_advantage_fn("grp0")
    with pytest.raises(KeyError, match="clip_higher"):
        get_policy_loss_fn("clip_hihger")


def test_outcome_to_token_rewards_last_action_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = outcome_to_token_rewards(torch.tensor([3.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 5.0]]))
    with pytest.raises(ValueError, match="no action token"):
        outcome_to_token_rewards(torch.tensor([1.0]), torch.tensor([[0, 0]]))


def test_gae_hand_example():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.1, 0.2, 0.3]])
    m = torch.ones(1, 3)
    adv, ret = gae_advantage(r, v, m, gamma=0.9, lam=0.5, whiten=False)
    # d2 = 1 - .3 = .7 ; d1 = .9*.3 - .2 = .07 ; d0 = .9*.2 - .1 = .08 ; gl = .45
    assert close(adv, [[0.08 + 0.45 * (0.07 + 0.45 * 0.7), 0.07 + 0.45 * 0.7, 0.7]])
    assert close(ret, adv + v)
    adv1, ret1 = gae_advantage(r, v, m, gamma=1.0, lam=1.0, whiten=False)
    assert close(adv1, [[0.9, 0.8, 0.7]]) and close(ret1, [[1.0, 1.0, 1.0]])


def test_gae_skips_observation_tokens():
    # turn 1 action, one observation token (value 9 must be ignored), turn 2 action
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.1, 9.0, 0.3]])
    m = torch.tensor([[1, 0, 1]])
    adv, ret = gae_advantage(r, v, m, gamma=1.0, lam=1.0, whiten=False)
    assert close(adv, [[0.9, 0.0, 0.7]]) and close(ret, [[1.0, 0.0, 1.0]])


def test_gae_masked_equals_contiguous_actions():
    g = torch.Generator().manual_seed(0)
    m = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0]])
    v = torch.randn(1, 10, generator=g)
    r = torch.zeros(1, 10)
    r[0, 7] = 1.0
    r[0, 1] = 0.3
    adv, ret = gae_advantage(r, v, m, gamma=0.9, lam=0.8, whiten=False)
    keep = m[0].bool()
    adv_c, ret_c = gae_advantage(r[:, keep], v[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8, whiten=False)
    assert close(adv[:, keep], adv_c) and close(ret[:, keep], ret_c)
    assert torch.equal(adv[:, ~keep], torch.zeros(1, int((~keep).sum())))


def test_gae_reward_on_masked_token_is_an_error():
    with pytest.raises(ValueError, match="masked"):
        gae_advantage(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 0]]))


def test_gae_whitening_and_registry():
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    v = torch.tensor([[0.1, 0.2, 0.3, 5.0], [0.0, 0.5, 7.0, 7.0]])
    adv, _ = get_advantage_fn("gae")(rewards=torch.tensor([1.0, 0.0]), values=v, response_mask=m, group_ids=None, gamma=1.0, lam=0.95)
    vals = adv[m.bool()]
    assert abs(float(vals.mean())) < 1e-5 and abs(float(vals.std()) - 1.0) < 1e-3
    assert torch.equal(adv[~m.bool()], torch.zeros(3))
    with pytest.raises(ValueError, match="values"):
        get_advantage_fn("gae")(rewards=torch.tensor([1.0]), values=None, response_mask=torch.ones(1, 2))


# ---------------------------------------------------------------- policy loss
def _policy_example():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    old = torch.log(torch.tensor([[0.2, 0.3, 0.4, 0.5]]))
    logp = (old + torch.log(ratios)).clone().requires_grad_(True)
    return logp, old, adv


def test_clip_higher_hand_example():
    logp, old, adv = _policy_example()
    loss, met = clipped_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    # per token: -min(rA, clip(r)A) = [-1.28, 0.8, -2.2, -0.7]
    assert close(loss, (-1.28 + 0.8 - 2.2 - 0.7) / 4)
    assert met["clipfrac"] == pytest.approx(0.5)
    assert met["clipfrac_high"] == pytest.approx(0.25) and met["clipfrac_low"] == pytest.approx(0.25)
    assert met["ratio_max"] == pytest.approx(1.5) and met["ratio_min"] == pytest.approx(0.5)
    assert met["approx_kl"] == pytest.approx(float(-torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7])).mean()), abs=1e-5)
    loss.backward()
    # clipped tokens (0, 1) get no gradient; others d/dlogp (-A r)/N
    assert close(logp.grad, [[0.0, 0.0, -2.0 * 1.1 / 4, -1.0 * 0.7 / 4]])


def test_clip_high_is_looser_than_clip_low():
    logp, old, adv = _policy_example()
    sym, _ = clipped_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    assert close(sym, (-1.2 + 0.8 - 2.2 - 0.7) / 4)


def test_observation_tokens_get_no_gradient():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(2, 6, generator=g) - 0.1
    logp = (old + 0.05 * torch.randn(2, 6, generator=g)).detach()
    logp[0, 2] = float("nan")  # garbage at masked positions must not leak
    logp[1, 5] = float("-inf")
    logp.requires_grad_(True)
    adv = torch.randn(2, 6, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"):
        logp.grad = None
        ref = torch.full_like(old, -1.0)
        loss, _ = clipped_policy_loss(logp, old, adv, mask, loss_agg_mode=mode, importance_weights=torch.ones_like(old))
        kl, _ = kl_loss(logp, ref, mask)
        (loss + 0.1 * kl).backward()
        assert torch.isfinite(loss)
        assert torch.equal(logp.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert (logp.grad[mask == 1] != 0).all()


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[10.0, 10.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    loss, met = clipped_policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip_c=3.0)
    # token 0: max(10, 0.8) = 10 -> capped at 3; token 1: max(-10, -1.28) = -1.28
    assert close(loss, (3.0 - 1.28) / 2)
    assert met["dual_clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip_c"):
        clipped_policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip_c=0.5)


def test_importance_weights_scale_per_token_loss():
    logp, old, adv = _policy_example()
    w = torch.tensor([[2.0, 0.0, 1.0, 1.0]])
    loss, _ = clipped_policy_loss(logp, old, adv, torch.ones(1, 4), importance_weights=w)
    assert close(loss, (-1.28 * 2 + 0.0 - 2.2 - 0.7) / 4)


def test_policy_loss_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        clipped_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_agg_loss_modes_hand_example():
    lm = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the empty row is left out of seq means
    assert close(agg_loss(lm, mask, "token-mean"), 2.0)
    assert close(agg_loss(lm, mask, "seq-mean-token-sum"), 3.0)
    assert close(agg_loss(lm, mask, "seq-mean-token-mean"), 2.25)
    assert close(agg_loss(lm, mask, "seq-mean-token-sum-norm"), 1.0)
    assert close(agg_loss(lm, mask, "seq-mean-token-sum-norm", norm_len=6), 0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(lm, mask, "token_mean")


def test_agg_loss_all_masked_is_zero_with_gradient():
    x = torch.ones(2, 3, requires_grad=True)
    loss = agg_loss(x, torch.zeros(2, 3), "token-mean")
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(x.grad, torch.zeros(2, 3))


def test_global_denominator_makes_microbatches_sum_to_full_batch():
    g = torch.Generator().manual_seed(2)
    lm = torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).int()
    mask[:, 0] = 1
    for mode, denom in (("token-mean", int(mask.sum())), ("seq-mean-token-mean", 4)):
        full = agg_loss(lm, mask, mode)
        parts = agg_loss(lm[:2], mask[:2], mode, global_denominator=denom) + agg_loss(lm[2:], mask[2:], mode, global_denominator=denom)
        assert close(full, parts)


# ---------------------------------------------------------------- KL, value, entropy
def test_kl_estimators_hand_example():
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    ln2 = math.log(2)
    assert close(kl_penalty(lp, ref, "k1"), [[ln2]])
    assert close(kl_penalty(lp, ref, "abs"), [[ln2]])
    assert close(kl_penalty(lp, ref, "k2"), [[0.5 * ln2**2]])
    assert close(kl_penalty(lp, ref, "low_var_kl"), [[0.5 + ln2 - 1]])
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(lp, lp, est), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(lp, ref, "k4")


def test_value_loss_clipped_hand_example():
    v = torch.tensor([[1.0, 0.6]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5]])
    ret = torch.tensor([[2.0, 0.5]])
    loss, met = value_loss(v, old, ret, torch.tensor([[1, 1]]), clip_range_value=0.2)
    # token 0: (1-2)^2=1 vs clipped (0.7-2)^2=1.69 -> .845 ; token 1: .01 vs .01 -> .005
    assert close(loss, (0.845 + 0.005) / 2)
    assert met["vf_clipfrac"] == pytest.approx(0.5)
    loss2, _ = value_loss(v, old, ret, torch.tensor([[1, 1]]), clip_range_value=None)
    assert close(loss2, (0.5 + 0.005) / 2)


def test_entropy_from_logits_uniform():
    assert close(entropy_from_logits(torch.zeros(1, 2, 4)), [[math.log(4)] * 2])


# ---------------------------------------------------------------- pre-rollout filter
ALL = [1.0, 1.0, 1.0, 1.0]
MIX = [1.0, 0.0, 1.0, 1.0]


def test_prefilter_skips_exactly_streak_ge_k():
    f = PreRolloutFilter(k=2)
    ids = ["a", "b", "c", "d"]
    assert f.keep(ids, epoch=0) == ids
    for pid, r in zip(ids, [ALL, ALL, MIX, ALL]):
        f.update(pid, r, r_max=1.0)
    assert f.keep(ids, epoch=1) == ids  # streaks 1,1,0,1 < 2
    for pid, r in zip(ids, [ALL, MIX, ALL, ALL]):
        f.update(pid, r, r_max=1.0)
    assert f.streaks == {"a": 2, "b": 0, "c": 1, "d": 2}
    assert f.keep(ids, epoch=2) == ["b", "c"]
    assert f.skipped_count(2) == 2 and f.skip_ratio(2) == pytest.approx(0.5)
    assert f.skipped_count(1) == 0


def test_prefilter_skipped_prompts_come_back_and_stay_when_they_fail():
    f = PreRolloutFilter(k=1)
    f.keep(["a", "b"], epoch=0)
    f.update("a", ALL)
    f.update("b", ALL)
    assert f.keep(["a", "b"], epoch=1) == []  # both skipped for one epoch
    assert f.keep(["a", "b"], epoch=2) == ["a", "b"]  # re-enter and are re-checked (eq. 5, z=0 while skipped)
    f.update("a", MIX)  # a now fails -> streak 0
    f.update("b", ALL)  # b still all-correct -> skipped again
    assert f.keep(["a", "b"], epoch=3) == ["a"]
    f.update("a", MIX)
    assert f.keep(["a", "b"], epoch=4) == ["a", "b"]


def test_prefilter_batches_within_an_epoch_and_r_max():
    f = PreRolloutFilter(k=1)
    f.keep(["a"], epoch=0)
    f.update("a", [0.5, 0.5], r_max=0.5)  # all at r_max (not 1.0)
    f.update("b", [0.5, 0.4], r_max=0.5)
    f.start_epoch(1)
    assert f.keep(["a", "b"]) == ["b"]
    assert f.keep(["a"]) == []  # still skipped within the same epoch
    assert f.skipped_count() == 1
    with pytest.raises(ValueError, match="backwards"):
        f.start_epoch(0)


def test_prefilter_k0_disables_and_state_roundtrip_json():
    off = PreRolloutFilter(k=0)
    off.update("a", ALL)
    assert off.keep(["a"], epoch=1) == ["a"]

    f = PreRolloutFilter(k=1)
    f.keep(["a", "b", ("t", 1)], epoch=0)
    f.update("a", ALL)
    f.update("b", MIX)
    f.update(("t", 1), ALL)
    f.keep(["a", "b", ("t", 1)], epoch=1)
    state = json.loads(json.dumps(f.state_dict()))
    g = PreRolloutFilter(k=1)
    g.load_state_dict(state)
    assert g.streaks == f.streaks and g.history == f.history
    for flt in (f, g):
        assert flt.keep(["a", "b", ("t", 1)], epoch=2) == ["a", "b", ("t", 1)]
    with pytest.raises(ValueError, match="k=1"):
        PreRolloutFilter(k=2).load_state_dict(state)


# ---------------------------------------------------------------- max-variance down-sampling
def _var(xs):
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs) / len(xs)


def test_downsample_binary_picks_half_from_each_class():
    r = [1, 0, 1, 1, 0, 0, 1, 0]
    idx = max_variance_subset(r, 4)
    assert len(idx) == 4 and sorted(r[i] for i in idx) == [0, 0, 1, 1]
    idx6 = max_variance_subset([1, 1, 1, 1, 0, 0, 0, 0, 1, 0], 6)
    assert sorted([1, 1, 1, 1, 0, 0, 0, 0, 1, 0][i] for i in idx6) == [0, 0, 0, 1, 1, 1]


def test_downsample_binary_rare_class_all_kept():
    r = [1, 1, 1, 0, 1, 1, 1, 1]
    idx = max_variance_subset(r, 4)
    assert 3 in idx and len(idx) == 4


def test_downsample_continuous_hand_example():
    # m'=2 -> {0, .1, 1.0} var .2022 beats m'=1 {0, .2, 1.0} var .1867
    assert max_variance_subset([1.0, 0.0, 0.2, 0.1], 3) == [0, 1, 3]
    assert max_variance_subset([0.1, 0.5, 0.9, 0.2, 0.8], 2) == [0, 2]


def test_downsample_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 8)
        m = rng.randint(1, n - 1)
        r = [rng.choice([0.0, 0.25, 0.5, 1.0]) if rng.random() < 0.5 else rng.random() for _ in range(n)]
        best = max(_var([r[i] for i in c]) for c in itertools.combinations(range(n), m))
        got = max_variance_subset(r, m)
        assert len(set(got)) == m and _var([r[i] for i in got]) == pytest.approx(best, abs=1e-9)


def test_downsample_edge_cases():
    assert max_variance_subset([1, 0], 5) == [0, 1]  # m >= n keeps everything
    with pytest.raises(ValueError):
        max_variance_subset([1.0, 0.0], -1)


# ---------------------------------------------------------------- DAPO dynamic sampling
def test_zero_variance_is_dapos_rule():
    from reflrl.algos import zero_variance

    groups = [[1.0, 1, 1], [0.0, 1, 0], [0.0, 0, 0], [0.3, 0.3, 0.30001]]
    assert [zero_variance(g) for g in groups] == [True, False, True, False]
    assert [zero_variance(g, tol=1e-3) for g in groups] == [True, False, True, True]
    assert zero_variance([1.0]) and zero_variance([])  # fewer than two rollouts: no signal either
    assert not zero_variance(torch.tensor([0.0, 1.0]))


def test_groups_to_request():
    assert groups_to_request(8, 8, 0.5) == 0
    assert groups_to_request(8, 5, None) == 3
    assert groups_to_request(8, 5, 0.5) == 6
    assert groups_to_request(8, 0, 0.0) == 160  # floored at 5% keep rate
    assert groups_to_request(8, 0, 0.0, max_request=32) == 32


def test_importance_weights_token_and_sequence_level():
    from reflrl.algos import importance_weights

    tgt = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    beh = torch.log(torch.tensor([[0.25, 0.8, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])
    assert close(importance_weights(tgt, beh, mask), [[2.0, 0.5, 0.0]])
    assert close(importance_weights(tgt, beh, mask, level="sequence"), [[1.0, 1.0, 0.0]])
    assert close(importance_weights(tgt, beh, mask, cap=1.5), [[1.5, 0.5, 0.0]])


def test_bfloat16_log_probs_are_computed_in_float32():
    logp, old, adv = _policy_example()
    loss32, _ = clipped_policy_loss(logp, old, adv, torch.ones(1, 4))
    lp16 = logp.detach().to(torch.bfloat16).requires_grad_(True)
    loss16, _ = clipped_policy_loss(lp16, old.to(torch.bfloat16), adv, torch.ones(1, 4))
    assert loss16.dtype == torch.float32
    loss16.backward()
    assert lp16.grad is not None and lp16.grad.dtype == torch.bfloat16
    assert abs(float(loss16.detach()) - float(loss32.detach())) < 0.05


def test_nonfinite_rewards_are_refused():
    with pytest.raises(ValueError, match="finite"):
        grpo_advantage(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="finite"):
        max_variance_subset([1.0, float("nan"), 0.0], 2)
