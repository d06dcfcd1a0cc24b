"""Ulysses sequence parallelism (trainer.sequence_parallel_size = P): each sequence's tokens are split across P ranks,
so a rank holds 1/P of every activation the backward keeps. Built on DeepSpeed's own Ulysses (ALST) pieces: its
process groups (`parallel_state_sp`, which DeepSpeed's engine reads to reduce gradients over data and sequence
ranks) and its attention (`UlyssesSPAttentionHF`: an all-to-all turns the local tokens of all heads into all tokens
of 1/P of the heads, the model's own attention kernel runs causally, and a second all-to-all turns it back).

What this module adds is the part DeepSpeed leaves to the trainer:
- the ranks of an SP group get the same rows (actors/group.py deals rows to data-parallel ranks only);
- `shard`: a micro-batch's width padded to a multiple of P (right padding, as the rows already are), and this
  rank's slice of tokens with their global position ids (attention is causal, so no mask is needed: the padding
  after a row's tokens is never attended by them);
- `gather`: the model's per-token output (logits, hidden states for the deferred head, values) gathered back to
  the whole width, differentiably, so every loss, log-prob, entropy and KL term reads the same (B, W, ...) layout as
  without SP and is exact. Each rank of the group then computes the same loss; the all-gather's backward sums the P
  copies of its gradient, so the trainer divides the loss it backpropagates by P (`DSModel.optimizer_step`).

The attention hook is process-wide (transformers looks attention functions up by name at every call), so it is
installed once and does its all-to-all only inside `active()`: a model in the same process that is not split
(vLLM's, a reference model's) runs its attention as before."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_STATE: dict = {"active": None, "installed": {}}


def attention_heads(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (its text config for a multimodal one)."""
    config = getattr(config, "get_text_config", lambda: config)()
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def heads_split(heads: int, kv: int, size: int) -> bool:
    """Whether `size` workers can each take whole heads (key/value heads divided, or replicated)."""
    return heads % size == 0 and (kv % size == 0 or size % kv == 0)


def refusal(config, attn_implementation: Optional[str], size: int) -> Optional[str]:
    """Why a model of this transformers `config` cannot be split over `size` ranks, or None where it can."""
    heads, kv = attention_heads(config)
    config = getattr(config, "get_text_config", lambda: config)()
    if heads % size:
        return (f"its {heads} attention heads do not split over {size} ranks (Ulysses gives each rank whole heads): "
                f"choose a size that divides {heads}")
    if not heads_split(heads, kv, size):
        return f"its {kv} key/value heads and {size} ranks: one must divide the other"
    if attn_implementation == "eager":
        return "eager attention needs a (T, T) mask per row; use trainer.attn_implementation=sdpa (or flash)"
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return ("it attends through a sliding window, and the split attention is plain causal (the window's mask "
                "is not carried across ranks)")
    return None


def loss_scale(zero_stage: int, size: int) -> float:
    """What each rank's loss is multiplied by before its backward, so the reduced gradient is the whole batch's.
    Every rank of a group computes the whole loss, and the gather's backward adds their P gradients; DeepSpeed then
    averages over the data-parallel ranks in ZeRO 0-2, but ZeRO-3's reduce-scatter (its default) averages over all
    P x D ranks of the sequence-data group, which already divides by P."""
    return 1.0 if size <= 1 or zero_stage == 3 else 1.0 / size


def sequence_groups(size: int):
    """DeepSpeed's sequence/data groups for this process (once: every DSModel of a process shares them); returns
    the module DeepSpeed takes as `mpu`, or None for size 1."""
    if size <= 1:
        return None
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(size)
    elif mpu.get_sequence_parallel_world_size() != size:
        raise RuntimeError(f"this process already splits sequences over {mpu.get_sequence_parallel_world_size()} "
                           f"ranks, not {size}")
    return mpu


class SequenceParallel:
    """One model's split: `shard` its micro-batches, run it inside `active()`, `gather` its output."""

    def __init__(self, model: torch.nn.Module, size: int):
        mpu = sequence_groups(size)
        self.size, self.group = size, mpu.get_sequence_parallel_group()
        self.rank = mpu.get_sequence_parallel_rank()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = base.config.get_text_config()
        self.kernel = getattr(base.config, "_attn_implementation", None) or "sdpa"
        why = refusal(base.config, self.kernel, size)
        if why is not None:
            raise ValueError(f"trainer.sequence_parallel_size={size} cannot split {type(base).__name__}: {why}")
        self.attention = _install(self.kernel, self.config, self.group)

    @classmethod
    def attach(cls, model: torch.nn.Module, size: int, per_token: bool) -> Optional["SequenceParallel"]:
        if size <= 1:
            return None
        if not per_token:
            raise ValueError("a sequence classifier (the reward model) reads one position a row and is not split; "
                             "trainer.sequence_parallel_size applies to the policy and the critic")
        return cls(model, size)

    def shard(self, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids) of this rank's tokens, each (B, W'/P), W' = the micro-batch's width W rounded up
        to a multiple of P with padding."""
        if "position_ids" in mb:
            raise ValueError("rows holding several sequences (restarting position ids) cannot be split over "
                             "trainer.sequence_parallel_size ranks: the split attention is one causal sequence a "
                             "row; set trainer.sequence_parallel_size=1 for this rollout kind")
        ids = mb["input_ids"]
        width = -(-ids.shape[1] // self.size) * self.size
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))  # (the pad id is never attended)
        positions = torch.arange(width, device=ids.device).expand(len(ids), -1)
        part = width // self.size
        lo, hi = self.rank * part, (self.rank + 1) * part
        return ids[:, lo:hi], positions[:, lo:hi]

    def gather(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """This rank's output (B, W'/P, ...) -> the group's (B, width, ...), with a gradient back to each part."""
        return _Gather.apply(local.contiguous(), self.group, self.rank, self.size)[:, :width]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Attention splits inside this block: the forward, and the backward (gradient checkpointing recomputes
        each layer's attention there)."""
        before, _STATE["active"] = _STATE["active"], self.attention
        try:
            yield
        finally:
            _STATE["active"] = before


class _Gather(torch.autograd.Function):
    """All-gather along dim 1; the backward sums each rank's gradient of the whole (every rank of the group computes
    the loss) and keeps this rank's part. An all-reduce, not a reduce-scatter: gloo has no reduce-scatter."""

    @staticmethod
    def forward(ctx, local, group, rank, size):
        ctx.group, ctx.rank, ctx.width = group, rank, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(size)]
        torch.distributed.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None, None, None


def _install(kernel: str, config, group):
    """Route transformers' `kernel` attention through a hook that splits heads across the group while a
    `SequenceParallel` is active; returns the Ulysses attention for this model's shape."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kernel not in _STATE["installed"]:
        original = ALL_ATTENTION_FUNCTIONS[kernel]
        _STATE["installed"][kernel] = original

        def hook(module, query, key, value, attention_mask, *args, **kwargs):
            split = _STATE["active"]
            if split is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            return split(module, query, key, value, None, *args, **kwargs)  # causal, no (T, T) mask
        ALL_ATTENTION_FUNCTIONS[kernel] = hook
    heads, kv = attention_heads(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return _any_rows(UlyssesSPAttentionHF)(
        attn=_STATE["installed"][kernel], batch_size=1, attn_head_count=heads, attn_head_size=head_dim,
        kv_head_count=kv,
        num_hidden_layers=config.num_hidden_layers, process_group=group, seq_length_is_variable=True)


def _any_rows(cls):
    """UlyssesSPAttentionHF checks its inputs against the row count it was built for; micro-batches here vary in
    rows (token budgets, the last group of an inference pass), so the count is taken from each call."""
    class AnyRows(cls):
        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            rows = query.shape[0]
            if rows != self.batch_size:
                self.batch_size = rows
                self.required_query_shape = torch.Size([1, rows, *self.required_query_shape[2:]])
                self.required_key_value_shape = torch.Size([1, rows, *self.required_key_value_shape[2:]])
                self.required_context_shape = torch.Size([1, rows, *self.required_context_shape[2:]])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)
    return AnyRows
