"""Supervised fine-tuning loss: next-token negative log-likelihood on the masked (answer) tokens."""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.logprobs import token_logprobs
from algorithms.masked import aggregate_loss


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
             normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """Token-mean NLL. logits (B, T, V) predict labels (B, T) (already shifted: logits[:, t] scores labels[:, t]);
    mask (B, T) bool marks the tokens that count. `normalizer`: global token count (see aggregate_loss)."""
    return nll_loss(token_logprobs(logits, labels), mask, normalizer)


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor,
             normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """`sft_loss` from the targets' log-probs (B, T) (where the logits were never materialised)."""
    nll = -logprobs
    loss = aggregate_loss(nll, mask, "token-mean", normalizer=normalizer)
    n = mask.sum().clamp(min=1)
    return loss, {"sft/nll": ((nll * mask).sum() / n).detach(), "sft/tokens": mask.sum().detach()}
