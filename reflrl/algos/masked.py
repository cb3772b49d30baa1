"""Masked reductions and loss aggregation over [B, T] token tensors.

A mask is 1 (or True) on the tokens that count (the policy's own action tokens) and 0 on
prompt padding, observation (tool output) tokens and right padding. Every function here
uses ``torch.where`` instead of multiplying by the mask, so NaN/inf sitting at masked
positions (e.g. log-probs of padding) can neither leak into the result nor into gradients.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """Mask as a bool tensor; checks its shape against ``like`` when given."""
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked-out entries replaced by exact zeros (no gradient flows to them)."""
    m = as_bool_mask(mask, x)
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over unmasked entries (all dims, or along ``dim``)."""
    z = masked_fill_zero(x, mask)
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over unmasked entries; 0 where nothing is unmasked (not NaN)."""
    m = as_bool_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all unmasked entries (scalar); 0 with fewer than 2 entries."""
    m = as_bool_mask(mask, x)
    n = m.sum()
    mean = masked_mean(x, m)
    sq = masked_sum((x - mean) ** 2, m)
    denom = (n - 1) if unbiased else n
    if int(denom) <= 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return sq / denom.to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries of ``x`` [B, T]; masked entries become 0."""
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    out = (x - mean) * torch.rsqrt(var + eps) if shift_mean else x * torch.rsqrt(var + eps)
    return masked_fill_zero(out, m)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_denominator: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``loss_mat`` [B, T] into a scalar.

    Modes (as in verl's ``agg_loss``):
      * ``"token-mean"``: sum over unmasked tokens / number of unmasked tokens (DAPO's
        token-level loss; the default, and what the efficiency paper trains with).
      * ``"seq-mean-token-sum"``: per-sequence token sum, averaged over sequences.
      * ``"seq-mean-token-mean"``: per-sequence token mean, averaged over sequences
        (the original GRPO objective).
      * ``"seq-mean-token-sum-norm"``: per-sequence token sum / ``norm_len`` (default T),
        averaged over sequences (Dr.GRPO: a constant length normaliser, no length bias).
    Sequences with no unmasked token are left out of the sequence means.

    ``global_denominator``: for gradient accumulation over micro-batches, the number of
    unmasked tokens (token-mean) or of non-empty sequences (seq-* modes) in the WHOLE
    batch; micro-batch losses then sum to exactly the full-batch loss.
    An all-masked input gives a loss of 0 that still has a (zero) gradient.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    m = as_bool_mask(mask, loss_mat)
    if mode == "token-mean":
        denom = float(global_denominator) if global_denominator is not None else m.sum().clamp(min=1)
        return masked_sum(loss_mat, m) / denom
    seq_valid = m.any(dim=-1)
    n_seq = float(global_denominator) if global_denominator is not None else seq_valid.sum().clamp(min=1)
    tok_sum = masked_sum(loss_mat, m, dim=-1)  # [B]
    if mode == "seq-mean-token-sum":
        per_seq = tok_sum
    elif mode == "seq-mean-token-mean":
        per_seq = tok_sum / m.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
    else:  # seq-mean-token-sum-norm
        per_seq = tok_sum / float(norm_len if norm_len is not None else loss_mat.shape[-1])
    return masked_sum(per_seq, seq_valid) / n_seq
