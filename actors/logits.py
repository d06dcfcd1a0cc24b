"""Logits only where a loss reads them. Rows are right-padded [prompt | completion]; the losses read the log-probs
of completion tokens, so the logits of the positions before a micro-batch's first trained token are never used.
A causal LM that takes `logits_to_keep` (transformers' Llama, Qwen2, Mistral, Gemma, ...) skips their LM-head
matmul and softmax: for a real vocabulary (150k) and prompt-heavy rows that is most of the head's work and of the
logits' memory. TRL's GRPO trainer keeps only the completion's logits the same way."""
from __future__ import annotations

import inspect

import torch

from algorithms.logprobs import logprobs_and_entropy, token_logprobs
from common.batch import Batch, first_target


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward accepts `logits_to_keep` (a PEFT wrapper passes it on to its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def keep_kwargs(mb: Batch, enabled: bool) -> dict:
    """The forward's keyword to skip logits before the micro-batch's first trained position (none without a
    loss_mask, or when no row trains)."""
    if not enabled or "loss_mask" not in mb:
        return {}
    return {"logits_to_keep": mb["input_ids"].shape[1] - first_target(mb["loss_mask"])}


def shifted_logits(mb: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(logits, targets, s)`: logits (B, W-1-s, V) predicting targets = input_ids[:, s+1:] (B, W-1-s). The forward
    returned the logits of the last W-s positions of the (B, W) rows (s = 0: all of them); loss_mask[:, s:] lines up."""
    s = mb["input_ids"].shape[1] - logits.shape[1]
    return logits[:, :-1], mb["input_ids"][:, s + 1:], s


def shifted_logprobs(mb: Batch, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of input_ids[:, 1:] under softmax(logits / temperature), (B, W-1) fp32. With a loss_mask, zero
    wherever it is false, as the engine's rollout_logprobs are: the same numbers however rows were grouped into
    micro-batches (and so trimmed)."""
    return _at_trained_positions(mb, logits, entropy=False, temperature=temperature)[0]


def shifted_logprobs_entropy(mb: Batch, logits: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) of softmax(logits / temperature), each (B, W-1) fp32, zero outside loss_mask
    (entropies detached), from one pass."""
    return _at_trained_positions(mb, logits, entropy=True, temperature=temperature)


def _at_trained_positions(mb: Batch, logits: torch.Tensor, entropy: bool,
                          temperature: float) -> tuple[torch.Tensor, ...]:
    """With a loss_mask only its positions are computed: the rest of the window (padding after short completions,
    prompt tokens after the first trained position) would be upcast, normalised and then thrown away. The entropy
    pass is skipped where nobody reads it (reference and old log-probs). The temperature divides each row chunk after
    its fp32 upcast (vLLM's sampler divides fp32 logits too)."""
    logits, targets, s = shifted_logits(mb, logits)
    mask = mb.get("loss_mask")
    window = mask[:, s:] if mask is not None else torch.ones(targets.shape, dtype=torch.bool, device=logits.device)
    flat_logits, flat_targets = logits[window], targets[window]
    out = (logprobs_and_entropy(flat_logits, flat_targets, temperature) if entropy
           else (token_logprobs(flat_logits, flat_targets, temperature),))
    full = torch.nn.functional.pad(window, (s, 0))  # mask[:, :s] is all false
    zeros = torch.zeros(full.shape, dtype=torch.float32, device=logits.device)
    return tuple(zeros.masked_scatter(full, t) for t in out)
