"""Where research options plug into the update without touching the step (:func:`reflrl.train.step.policy_update`):
two small registries, asked once per update, so an option that is off costs the step nothing.

* **Advantage shapers** (:data:`SHAPERS`): ``shape(ctx) -> metrics``, run on the micro-batches before the
  loss; a shaper rewrites ``mb.advantages`` [B, R] (and may set ``mb.returns`` / ``mb.values``). Registered
  with ``when(algo_cfg)``. Built in: ``gae`` (PPO: per-token GAE from the value head's values,
  ``algo.advantage=gae``).
* **Auxiliary losses** (:data:`AUX_LOSSES`): ``make(ctx) -> fn | None``, called once per update (e.g. to compute
  reference log-probs); ``fn(j, mb, lp) -> (loss, metrics)`` is added to the policy loss of micro-batch ``j``
  in every epoch, with ``lp`` the policy's log-probs [B, R] of that micro-batch. Metrics are summed over
  micro-batches (so give each loss's part of the batch total, e.g. with ``ctx.denom``) and averaged over
  epochs. A loss on other data than the micro-batch sets ``fn.own_backward = True``: it is called after
  micro-batch ``j``'s backward pass with ``lp=None``, runs its own backward (so its activations are never
  alive beside the micro-batch's: the update stays within ``algo.activation_budget_mb``) and returns its
  value detached. Built in: ``kl`` (``algo.kl_coef`` x KL to the reference policy), ``value`` (``algo.value_coef``
  x PPO's clipped value loss), ``sft`` (``algo.sft_coef`` x the supervised loss on a batch of clean
  demonstrations, PPO-ptx).

Adding one::

    from reflrl.train.extras import AUX_LOSSES

    @AUX_LOSSES.register("length_penalty", when=lambda a: True)
    def length_penalty(ctx):
        return lambda j, mb, lp: (1e-3 * mb.response_mask.sum() / ctx.denom, {})
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from reflrl import config as C
from reflrl.algos import advantage_needs_critic, kl_loss, masked_whiten, outcome_to_token_rewards, value_loss
from reflrl.algos.advantages import gae_advantage
from reflrl.registry import Registry

from .batch import UpdateBatch, batch_logprobs, response_hidden

SHAPERS: Registry[Callable] = Registry("advantage shaper")     # meta: when(algo_cfg) -> bool
AUX_LOSSES: Registry[Callable] = Registry("auxiliary loss")   # meta: when(algo_cfg) -> bool


@dataclass
class UpdateContext:
    """What a shaper or an auxiliary loss may use: the model, the update's micro-batches (on the model's
    device), the algorithm settings, the loss denominator, the sampling temperature, the reference policy
    and the value head (None when absent)."""

    model: torch.nn.Module
    mbs: list[UpdateBatch]
    algo: C.AlgoConfig
    denom: float
    temperature: float = 1.0
    share_prompt: bool = True
    ref_model: torch.nn.Module | None = None
    value_head: torch.nn.Module | None = None
    demos: dict[str, torch.Tensor] | None = None  # a collated batch of clean demonstrations (reflrl.sft.collate)


def active_shapers(a: C.AlgoConfig) -> list[Callable]:
    """The registered shapers whose ``when`` holds for ``a``, in name order."""
    return [SHAPERS.get(n) for n in SHAPERS.names() if SHAPERS.meta(n)["when"](a)]


def active_aux_losses(a: C.AlgoConfig) -> list[Callable]:
    """The registered auxiliary losses whose ``when`` holds for ``a``, in name order."""
    return [AUX_LOSSES.get(n) for n in AUX_LOSSES.names() if AUX_LOSSES.meta(n)["when"](a)]


# ------------------------------------------------------------------------------------------ PPO's critic
class ValueHead(torch.nn.Module):
    """PPO's critic on the policy's trunk: V(s_t) = w . h_t + b on the final hidden state that predicts
    action token t (the state before the action), as CleanRL's shared-trunk agent; float32."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.v = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.v.weight)  # V = 0 at the start: the first advantages are the returns
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, model: torch.nn.Module, mb: UpdateBatch) -> torch.Tensor:
        """Values [B, R] at ``mb``'s action tokens (0 elsewhere); one decoder pass (prompts run once)."""
        h, rows, cols = response_hidden(model, mb)
        out = torch.zeros(mb.resp_ids.shape, dtype=torch.float32, device=h.device)
        return out.index_put((rows, cols), self.v(h.float()).squeeze(-1))


def value_head_for(model: torch.nn.Module) -> ValueHead:
    """A zero-initialised :class:`ValueHead` for ``model``, on its device."""
    return ValueHead(int(model.config.hidden_size)).to(next(model.parameters()).device)


@SHAPERS.register("gae", when=lambda a: advantage_needs_critic(a.advantage))
def gae_shaper(ctx: UpdateContext) -> dict[str, float]:
    """PPO's advantages: the outcome reward on each row's last action token, the value head's values
    V(s_t) (no gradient), GAE (gamma, lambda; :func:`reflrl.algos.advantages.gae_advantage`) per row, then
    whitened over the whole batch's action tokens as verl does. Sets ``mb.advantages``, ``mb.returns``
    (A + V, the value target) and ``mb.values`` (the old values the value loss clips around)."""
    if ctx.value_head is None:
        raise ValueError("algo.advantage='gae' needs a value head (the Trainer builds one)")
    a, raw = ctx.algo, []
    for mb in ctx.mbs:  # each row carries its outcome reward on its action tokens (group_advantages)
        m = mb.response_mask.float()
        reward = (mb.advantages * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        with torch.no_grad():
            mb.values = ctx.value_head(ctx.model, mb)
        adv, mb.returns = gae_advantage(outcome_to_token_rewards(reward, mb.response_mask), mb.values,
                                        mb.response_mask, a.gamma, a.lam, whiten=False)
        raw.append(adv)
    flat_adv = torch.cat([x[mb.response_mask.bool()] for x, mb in zip(raw, ctx.mbs)])
    flat = masked_whiten(flat_adv, torch.ones_like(flat_adv, dtype=torch.bool))
    k = 0
    for x, mb in zip(raw, ctx.mbs):
        sel = mb.response_mask.bool()
        n = int(sel.sum())
        out = torch.zeros_like(x)
        out[sel] = flat[k: k + n]
        mb.advantages, k = out, k + n
    values = torch.cat([mb.values[mb.response_mask.bool()] for mb in ctx.mbs])
    return {"value_mean": float(values.mean()), "return_mean": float(torch.cat(
        [mb.returns[mb.response_mask.bool()] for mb in ctx.mbs]).mean())}


@AUX_LOSSES.register("kl", when=lambda a: a.kl_coef > 0)
def kl_to_reference(ctx: UpdateContext) -> Callable | None:
    """``algo.kl_coef`` x KL(policy || reference) per token (``algo.kl_estimator``), aggregated like the
    policy loss; the reference log-probs are computed once per update. None without a reference."""
    if ctx.ref_model is None:
        return None
    a = ctx.algo
    with torch.no_grad():
        ref = [batch_logprobs(ctx.ref_model, mb, ctx.temperature, ctx.share_prompt) for mb in ctx.mbs]

    def loss(j: int, mb: UpdateBatch, lp: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        kl, km = kl_loss(lp, ref[j], mb.response_mask, a.kl_estimator, a.loss_agg, global_denominator=ctx.denom)
        return a.kl_coef * kl, {"kl": float(km["kl"])}  # partial sums over micro-batches add up to the batch's

    return loss


@AUX_LOSSES.register("value", when=lambda a: advantage_needs_critic(a.advantage))
def value_objective(ctx: UpdateContext) -> Callable | None:
    """``algo.value_coef`` x PPO's clipped value loss 0.5 max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clamp(V - V_old, -c, c), c = ``algo.value_clip`` (verl's and CleanRL's), on the returns
    the ``gae`` shaper set. The value head's gradient flows into the trainable layers it sits on."""
    if ctx.value_head is None:
        return None
    a, head = ctx.algo, ctx.value_head

    def loss(j: int, mb: UpdateBatch, lp: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        v = head(ctx.model, mb)
        vl, vm = value_loss(v, mb.values, mb.returns, mb.response_mask, clip_range_value=a.value_clip,
                            loss_agg_mode=a.loss_agg, global_denominator=ctx.denom)
        clipped = vm["vf_clipfrac"] * float(mb.response_mask.sum()) / max(ctx.denom, 1.0)
        return a.value_coef * vl, {"vf_loss": float(vl.detach()), "vf_clipfrac": clipped}

    return loss


@AUX_LOSSES.register("sft", when=lambda a: a.sft_coef > 0)
def sft_anchor(ctx: UpdateContext) -> Callable | None:
    """``algo.sft_coef`` x the mean negative log-likelihood of a batch of clean demonstrations' answer
    tokens (``ctx.demos``: the warm-up's gold answers, ``algo.sft_batch`` of them), added once per update
    (to the first micro-batch): the RL update keeps pulling toward what the warm-up taught, as
    InstructGPT's PPO-ptx mixes its pretraining loss in (arXiv:2203.02155 sec. 3.5). None without demos."""
    if ctx.demos is None:
        return None
    from reflrl.logprobs import nll_backward
    from reflrl.memory import budget_bytes

    def loss(j: int, mb: UpdateBatch, lp: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        if j != 0:
            return torch.zeros(()), {}
        nll, _ = nll_backward(ctx.model, ctx.demos, budget_bytes(ctx.algo.activation_budget_mb),
                              scale=ctx.algo.sft_coef)  # its own backward, in micro-batches within the budget
        if not torch.isfinite(nll):
            raise FloatingPointError(f"supervised anchor loss is {float(nll)}; check the learning rate")
        return ctx.algo.sft_coef * nll, {"sft_loss": float(nll)}

    loss.own_backward = True  # type: ignore[attr-defined]
    return loss
