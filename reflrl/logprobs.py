"""Memory-lean per-token log-probabilities of given tokens under a causal LM (differentiable).

The output head of SmolLM2 maps 576 -> 49,152. Full logits for a batch of 32 x 441 tokens are
about 2.8 GB in float32, and autograd keeps them (and the log-softmax) for the backward pass;
that is how a plain forward+backward reaches 24 GB on this machine. Here the decoder runs once,
the hidden states are gathered only at the positions that predict a response token, and the head
projection + log-softmax run on those rows in chunks (optionally recomputed in the backward pass
instead of stored). Log-probs use temperature-scaled logits, ``log_softmax(logits / T)``, the
distribution the rollout engine samples from (before any top-p truncation), so the importance
ratio rho of the GRPO objective (the efficiency paper (arXiv:2606.00135), sec. 2.2, eq. 3) is 1 when
nothing changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens: [B,T] mask -> [B,T] long (pads get 0).

    Works for left padding (generation) and right padding (training batches).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def head_of(model: nn.Module) -> tuple[nn.Module, torch.Tensor, torch.Tensor | None]:
    """(decoder, head weight [V,H], head bias [V] or None) of a causal LM (peft-wrapped or not)."""
    head = model.get_output_embeddings()
    return model.get_decoder(), head.weight, getattr(head, "bias", None)


def hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Final (normed) hidden states of the decoder: [B,T] ids -> [B,T,H], no output head."""
    decoder, _, _ = head_of(model)
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 512,
    recompute: bool | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """log softmax(h W^T + b) / T)[target] for each row: hidden [N,H], targets [N] -> [N] float32.

    Rows are processed ``chunk_size`` at a time in ``compute_dtype`` (float32: bfloat16 logits
    would be off by ~0.05 nats). ``recompute`` (default: when gradients are on and there is more
    than one chunk) stores only the hidden rows for the backward pass and recomputes each chunk's
    logits there, so peak memory is one chunk of logits instead of N x V.
    ``temperature`` <= 0 is treated as 1 (greedy decoding has no sampling distribution).
    """
    n = hidden.shape[0]
    if n == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    t = float(temperature) if temperature and temperature > 0 else 1.0
    w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    if recompute is None:
        recompute = torch.is_grad_enabled() and n > chunk_size

    def chunk_fn(h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h.to(compute_dtype), w, b)
        if t != 1.0:
            logits = logits / t
        picked = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        return (picked - torch.logsumexp(logits, dim=-1)).float()

    outs = []
    for s in range(0, n, chunk_size):
        h, tgt = hidden[s : s + chunk_size], targets[s : s + chunk_size]
        if recompute and h.requires_grad:
            outs.append(checkpoint(chunk_fn, h, tgt, use_reentrant=False))
        else:
            outs.append(chunk_fn(h, tgt))
    return torch.cat(outs)


class ValueHead(nn.Module):
    """Scalar value per position for PPO: Linear(hidden, 1) in float32 on the final hidden states.

    PPO's critic (Tool-ReRL, appendix A.2, GAE) shares the policy trunk; the head
    starts at zero so initial values are 0. ``forward``: hidden [..., H] -> values [...] float32.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    recompute: bool | None = None,
) -> torch.Tensor:
    """Per-token log p(x_t | x_<t) at response positions, differentiable.

    Args:
        model: a causal LM (transformers, optionally peft-wrapped).
        input_ids: [B,T] long, prompt + response tokens (any padding side).
        attention_mask: [B,T] 1 for real tokens, 0 for pads.
        response_mask: [B,T] 1 where the token is one whose log-prob is wanted (sampled action
            tokens; 0 on prompt, observation and pad tokens). Position 0 has no context and is
            always 0 in the output.
        temperature: logits are divided by it (match the sampling temperature; <=0 means 1).
        chunk_size, recompute: see :func:`token_logprobs_from_hidden`.

    Returns:
        [B,T] float32: ``out[b,t] = log softmax(logits(x_<t) / T)[x_t]`` where
        ``response_mask[b,t]`` (and t >= 1), 0 elsewhere. Gradients flow to the trainable
        parameters through the gathered rows only.
    """
    if input_ids.shape != attention_mask.shape or input_ids.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: input_ids {tuple(input_ids.shape)}, attention_mask "
            f"{tuple(attention_mask.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    lp, _ = _logprobs_from(
        model, hidden_states(model, input_ids, attention_mask), input_ids, attention_mask,
        response_mask, temperature, chunk_size, recompute,
    )
    return lp


def sequence_logprobs_and_values(
    model: nn.Module,
    value_head: ValueHead,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    recompute: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs as :func:`sequence_logprobs` and PPO values from ONE decoder pass.

    Returns (logprobs [B,T], values [B,T]) float32; ``values[b,t]`` is the value of the state
    before token t (``value_head(h[b,t-1])``), the state in which the response token at t was
    chosen, at response positions (0 elsewhere) -- the alignment GAE needs (appendix A.2 of
    Tool-ReRL).
    """
    h = hidden_states(model, input_ids, attention_mask)
    return _logprobs_from(
        model, h, input_ids, attention_mask, response_mask, temperature, chunk_size, recompute,
        value_head=value_head,
    )


def _logprobs_from(
    model: nn.Module,
    h: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    chunk_size: int,
    recompute: bool | None,
    value_head: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if input_ids.shape != attention_mask.shape or input_ids.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: input_ids {tuple(input_ids.shape)}, attention_mask "
            f"{tuple(attention_mask.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    bsz, seqlen = input_ids.shape
    _, weight, bias = head_of(model)
    sel = response_mask[:, 1:].bool() & attention_mask[:, 1:].bool()  # target positions t>=1
    rows, cols = sel.nonzero(as_tuple=True)  # predicting token (rows, cols+1) from h[rows, cols]
    lp = token_logprobs_from_hidden(
        h[rows, cols],
        input_ids[rows, cols + 1],
        weight,
        bias,
        temperature=temperature,
        chunk_size=chunk_size,
        recompute=recompute,
    )
    out = torch.zeros(bsz, seqlen, dtype=torch.float32, device=input_ids.device)
    out = out.index_put((rows, cols + 1), lp)
    if value_head is None:
        return out, None
    vals = torch.zeros(bsz, seqlen, dtype=torch.float32, device=input_ids.device)
    return out, vals.index_put((rows, cols + 1), value_head(h[rows, cols]).float())


def shared_prefix_logprobs(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    suffix_ids: torch.Tensor,
    suffix_mask: torch.Tensor,
    response_mask: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    chunk_size: int = 512,
    recompute: bool | None = None,
) -> torch.Tensor:
    """:func:`sequence_logprobs` for GRPO groups that share a prompt, running each prompt ONCE.

    A group's ``n`` rollouts share their prompt; a plain forward recomputes it ``n`` times (with
    a 377-token prompt and 64 new tokens, 85 % of the tokens of the batch are prompt copies).
    Here the prompts run once with a KV cache, the cache is repeated ``n`` times (a
    differentiable copy), and only the suffixes (responses, and observations in multi-turn
    episodes) run per rollout. Gradients still reach the prompt's keys/values in trainable layers.
    Not compatible with activation checkpointing (which disables the cache); use
    :func:`sequence_logprobs` there.

    Args:
        prefix_ids: [G,P] long, the G distinct prompts, LEFT-padded.
        prefix_mask: [G,P] 1 on real prompt tokens.
        suffix_ids: [G*n,S] long, what follows each prompt, RIGHT-padded; row ``g*n + j`` is
            rollout j of prompt g (the engine's prompt-major order).
        suffix_mask: [G*n,S] 1 on real suffix tokens.
        response_mask: [G*n,S] 1 on the suffix tokens whose log-prob is wanted.
        n: rollouts per prompt.
        temperature, chunk_size, recompute: as in :func:`sequence_logprobs`.

    Returns:
        [G*n,S] float32: log p(suffix[r,s] | prompt, suffix[r,<s]) (temperature-scaled) where
        ``response_mask`` and ``suffix_mask`` are 1, 0 elsewhere.
    """
    from transformers import DynamicCache

    g, _ = prefix_ids.shape
    r, s = suffix_ids.shape
    if prefix_mask.shape != prefix_ids.shape:
        raise ValueError(f"prefix_mask {tuple(prefix_mask.shape)} != prefix_ids {tuple(prefix_ids.shape)}")
    if r != g * n or suffix_mask.shape != suffix_ids.shape or response_mask.shape != suffix_ids.shape:
        raise ValueError(
            f"shape mismatch: {g} prompts x n={n} needs {g * n} suffix rows; suffix_ids "
            f"{tuple(suffix_ids.shape)}, suffix_mask {tuple(suffix_mask.shape)}, response_mask "
            f"{tuple(response_mask.shape)}"
        )
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        raise ValueError("shared_prefix_logprobs needs the KV cache; activation checkpointing is on")
    decoder, weight, bias = head_of(model)
    cache = DynamicCache(config=model.config)
    hp = decoder(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=position_ids_from_mask(prefix_mask),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # [G,P,H]
    mask_p = prefix_mask
    if n > 1:
        cache.batch_repeat_interleave(n)
        mask_p = prefix_mask.repeat_interleave(n, dim=0)
    start = mask_p.long().sum(-1, keepdim=True)  # first suffix position of each row
    hs = decoder(
        input_ids=suffix_ids,
        attention_mask=torch.cat([mask_p, suffix_mask.to(mask_p.dtype)], dim=1),
        position_ids=start + position_ids_from_mask(suffix_mask),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # [R,S,H]
    last_p = hp[:, -1:]
    if n > 1:
        last_p = last_p.repeat_interleave(n, dim=0)
    pred = torch.cat([last_p, hs[:, :-1]], dim=1)  # hidden state that predicts suffix token s
    rows, cols = (response_mask.bool() & suffix_mask.bool()).nonzero(as_tuple=True)
    lp = token_logprobs_from_hidden(
        pred[rows, cols], suffix_ids[rows, cols], weight, bias,
        temperature=temperature, chunk_size=chunk_size, recompute=recompute,
    )
    out = torch.zeros(r, s, dtype=torch.float32, device=suffix_ids.device)
    return out.index_put((rows, cols), lp)


def nll_backward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    budget: int | None = None,
    scale: float = 1.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, int]:
    """Token-mean negative log-likelihood of a batch's response tokens, and its gradient (times
    ``scale``) accumulated into the parameters' ``.grad``, within a memory budget.

    ``batch``: ``input_ids``, ``attention_mask``, ``response_mask``, each [B, L], right-padded (the
    layout of :func:`reflrl.sft.collate`). The loss is ``-sum(log p of response tokens) / (response
    tokens of the whole batch)``, the value of ``reflrl.sft.sft_loss``. Rows run in micro-batches
    (sorted by length, each trimmed to its longest row) whose activations fit ``budget`` bytes by
    :class:`reflrl.memory.ActivationCost`; each micro-batch's backward runs before the next forward,
    so only one micro-batch's activations are alive, and the summed gradient is the unsplit one up
    to float rounding. ``budget`` None runs the whole batch at once.

    Returns (the loss, detached, float32 scalar; the number of micro-batches).
    """
    from reflrl.memory import ActivationCost, split_to_budget

    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    denom = resp.bool().sum().clamp(min=1)
    lens = attn.sum(-1).tolist()
    order = sorted(range(ids.shape[0]), key=lambda i: lens[i])
    if budget is None:
        groups = [order]
    else:
        cost = ActivationCost.of(model)
        groups = split_to_budget(order, lambda g: cost.forward_bytes(len(g), max(lens[i] for i in g)) + cost.logits,
                                 budget)
    total = torch.zeros((), dtype=torch.float32)
    for g in groups:
        ix = torch.as_tensor(g, dtype=torch.long, device=ids.device)
        width = max(1, max(lens[i] for i in g))
        m = resp[ix, :width]
        lp = sequence_logprobs(model, ids[ix, :width], attn[ix, :width], m, temperature)
        part = -(torch.where(m.bool(), lp, torch.zeros_like(lp)).sum() / denom)
        (part * scale).backward()
        total = total + part.detach().float().cpu()
    return total, len(groups)
