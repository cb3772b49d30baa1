"""RL algorithms as small pure functions over torch tensors, chosen by name.

Any backend (the CPU trainer, later vLLM/verl) reuses them. Shapes: B responses,
T response tokens, G prompt groups, n rollouts per prompt.

    from reflrl.algos import get_advantage_fn, get_policy_loss_fn
    adv, ret = get_advantage_fn("grpo")(rewards=r, group_ids=ids, response_mask=mask)
    loss, metrics = get_policy_loss_fn("clip_higher")(logp, old_logp, adv, mask)
"""

from .advantages import (
    broadcast_to_tokens,
    dr_grpo_advantage,
    gae_advantage,
    group_index,
    group_stats,
    grpo_advantage,
    outcome_to_token_rewards,
    rloo_advantage,
)
from .filters import PreRolloutFilter, all_correct, groups_to_request, max_variance_subset, zero_variance
from .advantages import live_group_advantages
from .dpo import dpo_loss
from .importance import pooled_weight_stats
from .losses import (
    KL_ESTIMATORS,
    clipped_policy_loss,
    entropy_from_logits,
    importance_weights,
    kl_loss,
    kl_penalty,
    value_loss,
)
from .importance import rerl_importance_ratio, rerl_log_ratio, tool_rerl_policy_loss  # registers "tool_rerl"
from .masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from .registry import (
    advantage_needs_critic,
    get_advantage_fn,
    get_policy_loss_fn,
    list_advantages,
    list_policy_losses,
    register_advantage,
    register_policy_loss,
)

__all__ = [
    "KL_ESTIMATORS", "LOSS_AGG_MODES", "PreRolloutFilter", "advantage_needs_critic", "agg_loss",
    "all_correct", "broadcast_to_tokens", "clipped_policy_loss", "dr_grpo_advantage",
    "entropy_from_logits", "gae_advantage", "get_advantage_fn", "importance_weights",
    "get_policy_loss_fn", "group_index", "group_stats", "live_group_advantages", "dpo_loss", "pooled_weight_stats",
    "zero_variance", "groups_to_request", "grpo_advantage",
    "kl_loss", "kl_penalty", "list_advantages", "list_policy_losses", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "max_variance_subset",
    "outcome_to_token_rewards", "register_advantage", "register_policy_loss", "rloo_advantage",
    "value_loss",
]
