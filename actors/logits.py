"""Logits only where a loss reads them. Rows are right-padded [prompt | completion]; the losses read the log-probs
of completion tokens, so the logits of the positions before a micro-batch's first trained token are never used.
A causal LM that takes `logits_to_keep` (transformers' Llama, Qwen2, Mistral, Gemma, ...) skips their LM-head
matmul and softmax: for a real vocabulary (150k) and prompt-heavy rows that is most of the head's work and of the
logits' memory. TRL's GRPO trainer keeps only the completion's logits the same way."""
from __future__ import annotations

import inspect

import torch

from algorithms.logprobs import token_logprobs
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


def shifted_logprobs(mb: Batch, logits: torch.Tensor) -> torch.Tensor:
    """Log-probs of input_ids[:, 1:], (B, W-1) fp32. With a loss_mask, zero wherever it is false, as the engine's
    rollout_logprobs are: the same numbers however rows were grouped into micro-batches (and so trimmed)."""
    logits, targets, s = shifted_logits(mb, logits)
    logp = torch.nn.functional.pad(token_logprobs(logits, targets), (s, 0))
    return logp.masked_fill(~mb["loss_mask"], 0.0) if "loss_mask" in mb else logp
