"""Masked reductions and loss aggregation modes shared by every loss."""
from __future__ import annotations

from typing import Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x where mask is true. x, mask (B, T) -> scalar, or (B,) / (T,) along `dim`. Empty mask -> 0."""
    mask = mask.to(x.dtype)
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries of x (B, T) -> scalar (Bessel-corrected when unbiased and count > 1)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked entries; x, mask (B, T) -> (B, T), zero where mask is false."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   normalizer: Optional[float] = None, max_len: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) with a bool mask (B, T) to a scalar.

    token-mean:              sum of all masked tokens / number of masked tokens (DAPO, Yu et al. 2025)
    seq-mean-token-mean:     mean over sequences of each sequence's token mean (GRPO, Shao et al. 2024)
    seq-mean-token-sum:      mean over sequences of each sequence's token sum
    seq-mean-token-sum-norm: token sums / `max_len`, mean over sequences (Dr. GRPO, Liu et al. 2025)

    `normalizer` replaces the denominator of the outer mean (tokens for token-mean, sequences otherwise): pass the
    count over the whole global batch, so micro-batches and data-parallel ranks sum to the full-batch loss.
    `max_len` is seq-mean-token-sum-norm's constant, the generation budget; required, since a micro-batch's width T
    varies with how rows are grouped and would make the same rows' loss depend on the split.
    """
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = m.sum().clamp(min=1) if normalizer is None else normalizer
        return (loss_mat * m).sum() / denom
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = (loss_mat * m).sum(-1)
    elif mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len, a constant (the generation budget)")
        per_seq = (loss_mat * m).sum(-1) / max_len
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    denom = per_seq.shape[0] if normalizer is None else normalizer
    return per_seq.sum() / max(denom, 1)
