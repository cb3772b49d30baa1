"""verl's loss path (rollout correction on the driver + ``ppo_loss`` in the actor, called as verl calls
them) gives the same value and gradient as our CPU losses (reflrl.algos) on the same batch,
including reflected trajectories whose behaviour log-probs come from q* (Tool-ReRL eq. 2)."""
from __future__ import annotations

import pytest
import torch

verl = pytest.importorskip("verl")

from tensordict import TensorDict  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from reflrl.algos import clipped_policy_loss, tool_rerl_policy_loss  # noqa: E402
from reflrl.verl_backend.config import rollout_correction_for  # noqa: E402
from reflrl.verl_backend.losses import (  # noqa: E402
    LOSS_LEVELS,
    UNREPAIRED_LOGPROB,
    behaviour_from_is_weights,
    split_behaviour,
)

PROMPT_LENS = [3, 2, 4, 3]
RESP_LENS = [5, 4, 5, 2]
T = 5  # padded response length


def actor_config(loss_mode: str, agg: str = "token-mean", clip_low=0.2, clip_high=0.2, c=3.0) -> FSDPActorConfig:
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                           clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                           clip_ratio_c=c, loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
                           use_kl_loss=False, entropy_coeff=0.0, rollout_n=1)


def make_batch(seed: int = 0):
    """4 rows: 0 ordinary (engine ~ trainer), 1 reflected with a large positive shift (A > 0),
    2 reflected with a negative shift (A < 0) and a tool-token gap (mask 0 inside), 3 ordinary short."""
    g = torch.Generator().manual_seed(seed)
    B = len(PROMPT_LENS)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(RESP_LENS):
        mask[i, :n] = 1
    mask[2, 2] = 0  # an observation (tool) token inside the response: no loss, no gradient
    old = -torch.rand(B, T, generator=g) * 2 - 0.1  # actor's recomputation on (q, tau*)
    rollout = old + 0.01 * torch.randn(B, T, generator=g)  # engine numerics for ordinary rows
    rollout[1] = old[1] - 0.4  # tau* far more likely under q*: Tool-ReRL weight > 1
    rollout[2] = old[2] + 0.3  # tau* less likely under q*: weight < 1
    adv = torch.tensor([0.7, 1.3, -0.9, -0.2])[:, None].expand(B, T).clone()
    # the current policy, a little away from "old" (as after an earlier mini-batch)
    cur = old + 0.05 * torch.randn(B, T, generator=g)
    return mask, old, rollout, adv, cur


def flat_logprobs(cur: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """The model output verl's ppo_loss gets for ``rows``: log-probs over the packed (no-padding)
    sequences, left-shifted (the position before token t holds its log-prob), as verl's engines
    produce them; differentiable w.r.t. ``cur`` [B, T]."""
    rows = list(range(cur.shape[0])) if rows is None else rows
    vals = []
    for i in rows:
        p, r = PROMPT_LENS[i], RESP_LENS[i]
        vals += [torch.zeros(p - 1), cur[i, :r], torch.zeros(1)]
    return torch.cat(vals)


def verl_tensordict(mask, old, adv, rollout_is_weights, *, rows=None, batch_num_tokens=None,
                    global_batch_size=None, dp_size=1):
    """verl's actor-side micro-batch (padded mode) for ``rows`` of the batch."""
    rows = list(range(mask.shape[0])) if rows is None else rows
    B, P = len(rows), max(PROMPT_LENS[i] for i in rows)
    prompts = torch.zeros(B, P, dtype=torch.long)
    att = torch.zeros(B, P + T, dtype=torch.long)
    for k, i in enumerate(rows):
        p, r = PROMPT_LENS[i], RESP_LENS[i]
        prompts[k, P - p:] = 1
        att[k, P - p: P + r] = 1
    fields = {"prompts": prompts, "responses": torch.ones(B, T, dtype=torch.long), "attention_mask": att,
              "response_mask": mask[rows], "old_log_probs": old[rows], "advantages": adv[rows]}
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = rollout_is_weights[rows]
    td = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    return td


def driver_is_weights(mask, old, rollout, rc: RolloutCorrectionConfig) -> torch.Tensor:
    """What verl's trainer does on the driver before the update (decoupled mode)."""
    dp = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    dp, _ = compute_rollout_correction_and_add_to_batch(dp, rc)
    assert torch.equal(dp.batch["response_mask"], mask)  # no rejection sampling
    return dp.batch["rollout_is_weights"]


def test_our_losses_are_registered_in_verls_registry():
    for name in LOSS_LEVELS:
        assert name in POLICY_LOSS_REGISTRY


def test_behaviour_log_probs_are_recovered_from_token_is_weights():
    mask, old, rollout, _, _ = make_batch()
    w = driver_is_weights(mask, old, rollout, rollout_correction_for("reflrl_tool_rerl"))
    beh = behaviour_from_is_weights(old, w, mask)
    m = mask.bool()
    assert torch.allclose(beh[m], rollout[m], atol=1e-5)
    assert torch.all(beh[~m] == 0)


@pytest.mark.parametrize("loss_mode", sorted(LOSS_LEVELS))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_tool_rerl_through_verl_ppo_loss_equals_cpu_loss(loss_mode, agg):
    mask, old, rollout, adv, cur = make_batch()
    w = driver_is_weights(mask, old, rollout, rollout_correction_for(loss_mode))
    cfg = actor_config(loss_mode, agg)

    cur_v = cur.clone().requires_grad_(True)
    td = verl_tensordict(mask, old, adv, w)
    assert torch.equal(no_padding_2_padding(flat_logprobs(cur), td) * mask, cur * mask)  # layout check
    loss_v, metrics = ppo_loss(cfg, {"log_probs": flat_logprobs(cur_v)}, td)
    loss_v.backward()

    cur_c = cur.clone().requires_grad_(True)  # the CPU trainer's padded [B, T] log-probs
    loss_c, m_c = tool_rerl_policy_loss(cur_c, rollout, adv, mask, repaired=None, level=LOSS_LEVELS[loss_mode],
                                        clip_low=0.2, clip_high=0.2, dual_clip_c=3.0, loss_agg_mode=agg)
    loss_c.backward()
    assert torch.allclose(loss_v, loss_c, atol=1e-6), (float(loss_v), float(loss_c))
    assert torch.allclose(cur_v.grad, cur_c.grad, atol=1e-6)
    assert cur_v.grad.abs().sum() > 0 and torch.all(cur_v.grad[~mask.bool()] == 0)
    # the reflected rows really are off-policy: their trajectory weights are far from 1
    traj_w = torch.exp(((cur - rollout) * mask).sum(-1))
    assert traj_w[1] > 2.0 and traj_w[2] < 0.5
    assert "actor/rerl/weight_max" in metrics and "actor/pg_clipfrac" in metrics


@pytest.mark.parametrize("loss_mode", sorted(LOSS_LEVELS))
def test_marked_ordinary_rows_get_the_cpu_trainers_ppo_ratio(loss_mode):
    """The agent loop marks rows that were not repaired (rollout log-prob = UNREPAIRED_LOGPROB): verl's
    loss then equals the CPU loss with the ``repaired`` mask -- token-level PPO against the actor's old
    log-probs for ordinary rows, eq. 2 against the q* behaviour log-probs for repaired rows."""
    mask, old, rollout, adv, cur = make_batch(2)
    repaired = torch.tensor([False, True, True, False])
    rollout = torch.where(repaired[:, None], rollout, torch.full_like(rollout, UNREPAIRED_LOGPROB))
    w = driver_is_weights(mask, old, rollout, rollout_correction_for(loss_mode))
    beh, rep = split_behaviour(old, w, mask)
    assert rep.tolist() == repaired.tolist()
    cur_v = cur.clone().requires_grad_(True)
    loss_v, _ = ppo_loss(actor_config(loss_mode), {"log_probs": flat_logprobs(cur_v)}, verl_tensordict(mask, old, adv, w))
    loss_v.backward()
    cur_c = cur.clone().requires_grad_(True)
    cpu_old = torch.where(repaired[:, None], rollout, old)  # what the CPU trainer passes as old_log_prob
    loss_c, m_c = tool_rerl_policy_loss(cur_c, cpu_old, adv, mask, repaired=repaired, level=LOSS_LEVELS[loss_mode],
                                        clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    loss_c.backward()
    assert m_c["rerl/count"] == 2.0
    assert torch.allclose(loss_v, loss_c, atol=1e-6), (float(loss_v), float(loss_c))
    assert torch.allclose(cur_v.grad, cur_c.grad, atol=1e-6)
    assert cur_v.grad[0].abs().sum() > 0 and cur_v.grad[3].abs().sum() > 0  # ordinary rows are trained


def test_eq2_clip_differs_from_verls_decoupled_rollout_is():
    """Why we register our own loss: verl's vanilla loss x sequence-level rollout_is weight is NOT eq. 2."""
    mask, old, rollout, adv, _ = make_batch()
    cur = old.clone()  # first mini-batch: pi_theta == pi_old
    rc_seq = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1e9)
    w_seq = driver_is_weights(mask, old, rollout, rc_seq)
    c1 = cur.clone().requires_grad_(True)
    loss_vanilla, _ = ppo_loss(actor_config("vanilla"), {"log_probs": flat_logprobs(c1)},
                               verl_tensordict(mask, old, adv, w_seq))
    loss_vanilla.backward()
    c2 = cur.clone().requires_grad_(True)
    w_tok = driver_is_weights(mask, old, rollout, rollout_correction_for("reflrl_tool_rerl"))
    loss_ours, _ = ppo_loss(actor_config("reflrl_tool_rerl"), {"log_probs": flat_logprobs(c2)},
                            verl_tensordict(mask, old, adv, w_tok))
    loss_ours.backward()
    # row 1: reflected, r = pi(tau*|q)/pi_rfl(tau*|q*) = e^1.6 > 1 + eps and A > 0
    assert c2.grad[1].abs().max() == 0  # eq. 2: the clipped branch is active -> no gradient
    assert c1.grad[1].abs().max() > 0  # verl decoupled: w * A * grad log pi, w = e^1.6
    assert not torch.allclose(loss_vanilla, loss_ours)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_vanilla_verl_loss_equals_cpu_clip_higher_with_micro_batches(agg):
    """The GRPO recipes use verl's own vanilla loss: same value/gradient as reflrl.algos.clipped_policy_loss
    (clip-higher 0.2/0.28, dual clip c=3), also when verl splits the batch in micro-batches."""
    mask, old, _, adv, cur = make_batch(1)
    cfg = actor_config("vanilla", agg, clip_low=0.2, clip_high=0.28, c=3.0)
    n_tok, n_seq = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    cur_v = cur.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2, 3]):  # two micro-batches normalised by the global batch, as verl does
        td = verl_tensordict(mask, old, adv, None, rows=rows, batch_num_tokens=n_tok, global_batch_size=n_seq)
        loss, _ = ppo_loss(cfg, {"log_probs": flat_logprobs(cur_v, rows)}, td)
        loss.backward()
        total = total + float(loss.detach())
    cur_c = cur.clone().requires_grad_(True)
    loss_c, _ = clipped_policy_loss(cur_c, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                                    loss_agg_mode=agg)
    loss_c.backward()
    assert abs(total - float(loss_c.detach())) < 1e-6, (total, float(loss_c.detach()))
    assert torch.allclose(cur_v.grad, cur_c.grad, atol=1e-6)


def test_missing_is_weights_is_a_clear_error():
    mask, old, _, adv, cur = make_batch()
    with pytest.raises(ValueError, match="rollout_is='token'"):
        ppo_loss(actor_config("reflrl_tool_rerl"), {"log_probs": flat_logprobs(cur)},
                 verl_tensordict(mask, old, adv, None))


@pytest.mark.parametrize("name,norm_std", [("reflrl_grpo", True), ("reflrl_dr_grpo", False)])
def test_group_advantages_through_verls_compute_advantage(name, norm_std):
    """verl's driver-side compute_advantage with our estimator = the CPU trainer's GRPO on the rollouts
    that count; a masked (unrecovered env fault) rollout leaves its group and gets 0 -- verl's own
    grpo would count its reward."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from reflrl.algos import grpo_advantage

    B, T = 6, 4
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, 3] = 0
    mask[2] = 0  # masked episode (env fault not recovered)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    rewards = torch.zeros(B, T)
    rewards[:, 2] = scores
    uid = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)

    def run(est):
        dp = DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone()},
                                 non_tensors={"uid": uid})
        return compute_advantage(dp, adv_estimator=est, norm_adv_by_std_in_grpo=norm_std).batch["advantages"]

    ours = run(name)
    keep = [0, 1, 3, 4, 5]
    cpu = grpo_advantage(scores[keep], [uid[i] for i in keep], norm_std=norm_std)
    assert torch.allclose(ours[keep, 0], cpu, atol=1e-6)
    assert torch.all(ours[2] == 0) and torch.all(ours[:, 3] == 0)
    builtin = run("grpo")
    assert not torch.allclose(builtin[[0, 1], 0], ours[[0, 1], 0])  # the masked 0-reward row shifts verl's mean


def test_tool_rerl_data_parallel_ranks_sum_to_the_cpu_loss():
    """Two data-parallel ranks (dp_size=2, global token count): DDP averages the ranks' gradients,
    so the mean of the rank losses/gradients must equal the CPU full-batch loss/gradient."""
    mask, old, rollout, adv, cur = make_batch(3)
    repaired = torch.tensor([False, True, True, False])
    rollout = torch.where(repaired[:, None], rollout, torch.full_like(rollout, UNREPAIRED_LOGPROB))
    w = driver_is_weights(mask, old, rollout, rollout_correction_for("reflrl_tool_rerl"))
    n_tok = int(mask.sum())
    cfg = actor_config("reflrl_tool_rerl")
    cur_v = cur.clone().requires_grad_(True)
    total = torch.zeros(())
    for rows in ([0, 1], [2, 3]):  # rank 0, rank 1
        td = verl_tensordict(mask, old, adv, w, rows=rows, batch_num_tokens=n_tok, dp_size=2)
        loss, _ = ppo_loss(cfg, {"log_probs": flat_logprobs(cur_v, rows)}, td)
        (loss / 2).backward()  # DDP's gradient average over the 2 ranks
        total = total + loss.detach() / 2
    cur_c = cur.clone().requires_grad_(True)
    loss_c, _ = tool_rerl_policy_loss(cur_c, torch.where(repaired[:, None], rollout, old), adv, mask,
                                      repaired=repaired, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    loss_c.backward()
    assert torch.allclose(total, loss_c.detach(), atol=1e-6)
    assert torch.allclose(cur_v.grad, cur_c.grad, atol=1e-6)
