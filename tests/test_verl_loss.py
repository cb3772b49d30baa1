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
from reflrl.verl_backend.losses import LOSS_LEVELS, behaviour_from_is_weights  # noqa: E402

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


def flat_logprobs(cur: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model output verl's ppo_loss gets: log-probs over the packed (no-padding) sequence,
    left-shifted (position of token t+1 predicts it), as verl's engines produce them."""
    vals = []
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        seq = torch.zeros(p + r)
        seq[p - 1: p - 1 + r] = cur[i, :r]
        vals.append(seq)
    return torch.cat(vals).clone().requires_grad_(True)


def verl_tensordict(mask, old, adv, rollout_is_weights, *, batch_num_tokens=None, global_batch_size=None,
                    dp_size=1):
    B = mask.shape[0]
    P = max(PROMPT_LENS)
    prompts = torch.zeros(B, P, dtype=torch.long)
    att = torch.zeros(B, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        prompts[i, P - p:] = 1
        att[i, P - p: P + r] = 1
    fields = {"prompts": prompts, "responses": torch.ones(B, T, dtype=torch.long), "attention_mask": att,
              "response_mask": mask, "old_log_probs": old, "advantages": adv}
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = rollout_is_weights
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

    flat = flat_logprobs(cur, mask)
    loss_v, metrics = ppo_loss(cfg, {"log_probs": flat}, verl_tensordict(mask, old, adv, w))
    loss_v.backward()
    grad_v = flat.grad.clone()

    flat2 = flat_logprobs(cur, mask)
    lp = no_padding_2_padding(flat2, verl_tensordict(mask, old, adv, w))
    loss_c, m_c = tool_rerl_policy_loss(lp, rollout, adv, mask, repaired=None, level=LOSS_LEVELS[loss_mode],
                                        clip_low=0.2, clip_high=0.2, dual_clip_c=3.0, loss_agg_mode=agg)
    loss_c.backward()
    assert torch.allclose(loss_v, loss_c, atol=1e-6), (float(loss_v), float(loss_c))
    assert torch.allclose(grad_v, flat2.grad, atol=1e-6)
    assert grad_v.abs().sum() > 0
    # the reflected rows really are off-policy: their trajectory weights are far from 1
    assert m_c["rerl/weight_max"] > 2.0 and m_c["rerl/weight_min"] < 0.5
    assert metrics["actor/rerl/weight_max"].value if hasattr(metrics["actor/rerl/weight_max"], "value") else True


def test_eq2_clip_differs_from_verls_decoupled_rollout_is():
    """Why we register our own loss: verl's vanilla loss x sequence-level rollout_is weight is NOT eq. 2."""
    mask, old, rollout, adv, _ = make_batch()
    cur = old.clone()  # first mini-batch: pi_theta == pi_old
    rc_seq = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1e9)
    w_seq = driver_is_weights(mask, old, rollout, rc_seq)
    flat = flat_logprobs(cur, mask)
    loss_vanilla, _ = ppo_loss(actor_config("vanilla"), {"log_probs": flat}, verl_tensordict(mask, old, adv, w_seq))
    loss_vanilla.backward()
    flat2 = flat_logprobs(cur, mask)
    w_tok = driver_is_weights(mask, old, rollout, rollout_correction_for("reflrl_tool_rerl"))
    loss_ours, _ = ppo_loss(actor_config("reflrl_tool_rerl"), {"log_probs": flat2}, verl_tensordict(mask, old, adv, w_tok))
    loss_ours.backward()
    P1 = PROMPT_LENS[0] + RESP_LENS[0]  # row 1 (reflected, r ~ e^2 > 1.2, A > 0) starts here
    row1 = slice(P1 + PROMPT_LENS[1] - 1, P1 + PROMPT_LENS[1] - 1 + RESP_LENS[1])
    assert flat2.grad[row1].abs().max() == 0  # eq. 2: clipped branch active -> no gradient
    assert flat.grad[row1].abs().max() > 0  # verl decoupled: w * A * grad log pi
    assert not torch.allclose(loss_vanilla, loss_ours)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_vanilla_verl_loss_equals_cpu_clip_higher_with_micro_batches(agg):
    """The GRPO recipes use verl's own vanilla loss: same value/gradient as reflrl.algos.clipped_policy_loss
    (clip-higher 0.2/0.28, dual clip c=3), also when verl splits the batch in micro-batches."""
    mask, old, _, adv, cur = make_batch(1)
    cfg = actor_config("vanilla", agg, clip_low=0.2, clip_high=0.28, c=3.0)
    n_tok, n_seq = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    flat = flat_logprobs(cur, mask)
    td = verl_tensordict(mask, old, adv, None, batch_num_tokens=n_tok, global_batch_size=n_seq)
    lp = no_padding_2_padding(flat, td)
    total = 0.0
    for rows in ([0, 1], [2, 3]):  # two micro-batches, normalised by the global batch (as verl does)
        sub = verl_tensordict(mask[rows], old[rows], adv[rows], None, batch_num_tokens=n_tok, global_batch_size=n_seq)
        sub_prompts = [PROMPT_LENS[i] for i in rows]
        # rebuild the micro-batch's packed log-probs from the full padded ones
        vals = []
        for k, i in enumerate(rows):
            seq = torch.zeros(sub_prompts[k] + RESP_LENS[i])
            seq = seq.index_put((torch.arange(RESP_LENS[i]) + sub_prompts[k] - 1,), lp[i, :RESP_LENS[i]])
            vals.append(seq)
        sub_prompt_ids = torch.zeros(len(rows), max(sub_prompts), dtype=torch.long)
        att = torch.zeros(len(rows), max(sub_prompts) + T, dtype=torch.long)
        for k, i in enumerate(rows):
            att[k, max(sub_prompts) - sub_prompts[k]: max(sub_prompts) + RESP_LENS[i]] = 1
        sub["prompts"] = sub_prompt_ids
        sub["attention_mask"] = att
        loss, _ = ppo_loss(cfg, {"log_probs": torch.cat(vals)}, sub)
        total = total + loss
    total.backward()
    g_v = flat.grad.clone()
    flat2 = flat_logprobs(cur, mask)
    lp2 = no_padding_2_padding(flat2, td)
    loss_c, _ = clipped_policy_loss(lp2, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                                    loss_agg_mode=agg)
    loss_c.backward()
    assert torch.allclose(total, loss_c, atol=1e-6), (float(total), float(loss_c))
    assert torch.allclose(g_v, flat2.grad, atol=1e-6)


def test_missing_is_weights_is_a_clear_error():
    mask, old, _, adv, cur = make_batch()
    with pytest.raises(ValueError, match="rollout_is='token'"):
        ppo_loss(actor_config("reflrl_tool_rerl"), {"log_probs": flat_logprobs(cur, mask)},
                 verl_tensordict(mask, old, adv, None))
