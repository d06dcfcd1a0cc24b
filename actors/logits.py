"""Logits only where a loss reads them. Rows are right-padded [prompt | completion]; the losses read the log-probs
of completion tokens, so the logits of the positions before a micro-batch's first trained token are never used.
A causal LM that takes `logits_to_keep` (transformers' Llama, Qwen2, Mistral, Gemma, ...) skips their LM-head
matmul and softmax: for a real vocabulary (150k) and prompt-heavy rows that is most of the head's work and of the
logits' memory. TRL's GRPO trainer keeps only the completion's logits the same way."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from algorithms.logprobs import head_logprobs, logprobs_and_entropy, token_logprobs
from common.batch import Batch, first_target
from common.dtypes import autocast


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


def shifted_logprobs(mb: Batch, out, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of input_ids[:, 1:] under softmax(logits / temperature), (B, W-1) fp32, from a forward's output
    (`.logits`, or `HeadOutput`). With a loss_mask, zero wherever it is false, as the engine's rollout_logprobs are:
    the same numbers however rows were grouped into micro-batches (and so trimmed)."""
    return _at_trained_positions(mb, out, entropy=False, temperature=temperature)[0]


def shifted_logprobs_entropy(mb: Batch, out, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) of softmax(logits / temperature), each (B, W-1) fp32, zero outside loss_mask
    (entropies detached), from one pass."""
    return _at_trained_positions(mb, out, entropy=True, temperature=temperature)


def _at_trained_positions(mb: Batch, out, entropy: bool, temperature: float) -> tuple[torch.Tensor, ...]:
    """With a loss_mask only its positions are computed: the rest of the window (padding after short completions,
    prompt tokens after the first trained position) would be upcast, normalised and then thrown away. The entropy
    pass is skipped where nobody reads it (reference and old log-probs). The temperature divides each row chunk after
    its fp32 upcast (vLLM's sampler divides fp32 logits too). A `HeadOutput` gets its head applied here, to the
    selected positions only, a chunk at a time."""
    head = out.head if isinstance(out, HeadOutput) else None
    values, targets, s = shifted_logits(mb, out.hidden if head is not None else out.logits)
    mask = mb.get("loss_mask")
    window = mask[:, s:] if mask is not None else torch.ones(targets.shape, dtype=torch.bool, device=values.device)
    idle = values.requires_grad and not window.any()  # no row here trains (an agent that failed before its call)
    # One position goes through the head all the same, its result times zero: this rank's backward then takes the
    # path every other rank's takes (under ZeRO-3 each module's gathers, and with checkpointing its recompute, in
    # the same order), not a shortcut from the loss to the decoder's output.
    if idle:  # (the last position of the first row: every row has one, a one-token row's window has none)
        last = (out.hidden if head is not None else out.logits)[:1, -1]
        flat, flat_targets = last, mb["input_ids"][:1, -1]
    else:
        flat, flat_targets = values[window], targets[window]
    if head is not None:
        got = head.logprobs(flat, flat_targets, temperature, entropy)
        got = got if entropy else got[:1]
    elif entropy:
        got = logprobs_and_entropy(flat, flat_targets, temperature)
    else:
        got = (token_logprobs(flat, flat_targets, temperature),)
    full = torch.nn.functional.pad(window, (s, 0))  # mask[:, :s] is all false
    zeros = torch.zeros(full.shape, dtype=torch.float32, device=values.device)
    if idle:
        got = tuple(g * 0.0 for g in got)
        zeros = zeros + got[0].sum()  # (a zero on the graph: masked_scatter would take none of it)
    logp = zeros.masked_scatter(full, got[0])
    return (logp, *(zeros.detach().masked_scatter(full, t) for t in got[1:]))  # (entropies: a metric)


@dataclass
class HeadOutput:
    """A forward run with its LM head deferred (`DeferredHead`): the last hidden states (B, W, H) where the logits
    would be, in the same layout, and the head that turns them into logits."""
    hidden: torch.Tensor
    head: "DeferredHead"


class DeferredHead:
    """trainer.chunked_logprobs: log-probs from the final hidden states without the (rows, T, V) logits. While the
    model runs inside `deferring()` its LM head passes the hidden states through, so the forward (and every layout
    that moves its output: padded, packed, shared-prefix) returns those instead of logits; the log-prob functions
    above then apply the head to the trained positions only, `chunk_rows` at a time (algorithms.logprobs.
    head_logprobs). The head stays a module called as itself, so DeepSpeed's hooks (ZeRO-3 gathers) still run."""

    def __init__(self, model: torch.nn.Module, precision: str, device: torch.device,
                 budget_bytes: int = 256 * 2**20):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.module = base.get_output_embeddings()
        self.chunk_rows = max(16, budget_bytes // (4 * self.module.out_features))  # fp32 logits of one chunk
        self.precision, self.device = precision, device  # applied later, outside the forward's autocast: its own
        self.deferred, self._forward = False, self.module.forward
        self.module.forward = self._call  # an instance attribute: the class's forward is untouched

    @classmethod
    def attach(cls, model: torch.nn.Module, wanted: bool, precision: str,
               device: torch.device) -> Optional["DeferredHead"]:
        """The deferred head of `model` where it is wanted (trainer.chunked_logprobs) and possible (`defers_head`),
        else None: such a model computes its full logits as before."""
        return cls(model, precision, device) if wanted and defers_head(model) is None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden` (n, H) -> (n, V), as the model's own forward computes them."""
        with autocast(self.precision, self.device):
            return self.module(hidden)

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                 entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """algorithms.logprobs.head_logprobs of hidden (N, H) and targets (N,), in exactly one call of the head
        module whatever N is, 0 included. Under ZeRO-3 a module call is a collective (its weight is gathered before
        it and, in the backward, again): a call per chunk would make ranks with different numbers of trained
        positions wait on each other for ever. Inside the call the chunks use the gathered weight directly."""
        with autocast(self.precision, self.device):
            return self.module(hidden, targets, temperature, entropy)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def _call(self, hidden: torch.Tensor, targets: Optional[torch.Tensor] = None, temperature: float = 1.0,
              entropy: bool = False):
        if targets is None:  # the model's own forward calling its head
            return hidden if self.deferred else self._forward(hidden)
        unhooked = _Unhooked(self._forward, self.module)
        logp, ent = head_logprobs(hidden, unhooked, targets, temperature, entropy, self.chunk_rows)
        if not len(hidden) and not logp.requires_grad and torch.is_grad_enabled() and hidden.requires_grad:
            # no trained position on this rank: a zero through the head all the same, so its weight gets a
            # gradient (zero) as on the other ranks, whose reduction ZeRO waits for
            logp = logp + self._forward(hidden.new_zeros(1, hidden.shape[-1])).sum() * 0.0
        return logp, ent

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False


class _Unhooked:
    """The head's own forward, called inside the module's one call (not through the module: no hooks again)."""

    def __init__(self, forward, module: torch.nn.Module):
        self.forward, self.module = forward, module

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.forward(rows)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()


def defers_head(model: torch.nn.Module) -> Optional[str]:
    """Why the head of `model` cannot be deferred, or None where it can: a causal LM whose logits are its output
    layer's (no final soft-capping or scaling, which the forward would apply to the hidden states instead)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return f"{type(base).__name__} has no linear output layer"
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"its config sets {key}={getattr(config, key)}, applied to the logits after the head"
    return None
