"""Per-token log-probabilities and entropy from logits."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

_CHUNK_ROWS = 1024  # rows of (B*T, V) processed at once, to bound the fp32 working set for large vocabularies


def _fp32(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits upcast, then tempered (the division in fp32, as vLLM's sampler does it)."""
    rows = rows.float()
    return rows if temperature == 1.0 else rows / temperature


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label] per token.

    logits (B, T, V) any float dtype; labels (B, T) int64 -> (B, T) fp32.
    Computed as logit[label] - logsumexp(logits) in row chunks upcast to fp32, so a full fp32 copy of bf16
    (B, T, V) logits is never materialised at once.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = torch.empty(flat_labels.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_logits.shape[0], _CHUNK_ROWS):
        rows = _fp32(flat_logits[start:start + _CHUNK_ROWS], temperature)
        picked = rows.gather(-1, flat_labels[start:start + _CHUNK_ROWS].unsqueeze(-1)).squeeze(-1)
        out[start:start + _CHUNK_ROWS] = picked - torch.logsumexp(rows, dim=-1)
    return out.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per token: logits (B, T, V) -> (B, T) fp32. H = logsumexp(z) - sum softmax(z) z."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], _CHUNK_ROWS):
        rows = flat[start:start + _CHUNK_ROWS].float()
        probs = torch.softmax(rows, dim=-1)
        out[start:start + _CHUNK_ROWS] = torch.logsumexp(rows, dim=-1) - (probs * rows).sum(-1)
    return out.view(logits.shape[:-1])


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `entropy_from_logits` of softmax(logits / temperature) from one pass over the logits:
    logits (N, V), labels (N,) -> (N,) fp32 log-probs (differentiable) and (N,) fp32 entropies (detached, a metric).
    Each row chunk is upcast and its logsumexp computed once for both; with a 49k-150k vocabulary these passes cost
    as much as a layer."""
    logp = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    ent = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], _CHUNK_ROWS):
        rows = _fp32(logits[start:start + _CHUNK_ROWS], temperature)
        lse = torch.logsumexp(rows, dim=-1)
        logp[start:start + _CHUNK_ROWS] = rows.gather(-1, labels[start:start + _CHUNK_ROWS, None]).squeeze(-1) - lse
        with torch.no_grad():
            ent[start:start + _CHUNK_ROWS] = lse - (torch.exp(rows - lse[:, None]) * rows).sum(-1)
    return logp, ent


def head_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                  temperature: float = 1.0, entropy: bool = False,
                  chunk_rows: int = _CHUNK_ROWS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`logprobs_and_entropy` of the logits `head(hidden)` without ever holding them for all rows: hidden (N, H)
    final hidden states, head (n, H) -> (n, V) (the LM head), labels (N,) -> (N,) fp32 log-probs (differentiable,
    to `hidden` and to the head's weights) and (N,) fp32 entropies (detached) or None.

    `chunk_rows` rows at a time; where gradients are wanted each chunk is checkpointed, so the backward recomputes
    its (chunk_rows, V) logits instead of keeping them: the peak extra memory is one chunk's logits, whatever N is,
    for one more head matmul in the backward."""
    logps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or _has_trainable(head))
    for start in range(0, hidden.shape[0], chunk_rows):
        rows, targets = hidden[start:start + chunk_rows], labels[start:start + chunk_rows]
        if grad:
            logp, ent = checkpoint(_head_chunk, rows, targets, head, temperature, entropy, use_reentrant=False,
                                   preserve_rng_state=False)
        else:
            logp, ent = _head_chunk(rows, targets, head, temperature, entropy)
        logps.append(logp)
        ents.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logp = torch.cat(logps) if logps else empty
    return logp, (torch.cat(ents) if ents else empty) if entropy else None


def _has_trainable(head: Callable) -> bool:
    """Whether the head has weights to train (an nn.Module, or anything with its `parameters()`)."""
    return hasattr(head, "parameters") and any(p.requires_grad for p in head.parameters())


def _head_chunk(rows: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                temperature: float, entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    logits = _fp32(head(rows), temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp, None
    with torch.no_grad():
        return logp, lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
