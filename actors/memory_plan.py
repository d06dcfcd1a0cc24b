"""A step that plans its memory (trainer.plan_memory): before each update the trainer estimates what the backward
will keep for each micro-batch, from the model's shape and the rows' lengths, against the memory free on its device
now; where the configured micro-batches would not fit it takes fewer rows a micro-batch (a token budget), and where
even one row would not fit it recomputes each layer in the backward (gradient checkpointing). Both change how the
step is computed, not its loss or gradient.

The estimate is the usual account of a decoder's activations (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.1, for a gated MLP): per layer and token, the inputs of each
matmul, norm and activation the backward reads; plus, where attention is computed by a kernel that materialises its
(heads, T, T) probabilities (eager attention, and sdpa on CPU), those for every layer. With checkpointing, one
hidden state per layer and token, and one layer's full activations at a time. Constants the estimate leaves out (the
weights, gradients and optimizer states, which do not grow with the rows) are in what is already in use."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

SAFETY = 0.7  # the share of the free memory a step plans to use: allocator caching and transient copies take more


@dataclass(frozen=True)
class Shape:
    """What a step's activations scale with: decoder layers, hidden and MLP widths, attention heads, the bytes of an
    activation, whether attention keeps (heads, T, T) probabilities for the backward, and the ranks a sequence is
    split over (trainer.sequence_parallel_size: each holds 1/split of the tokens, and of the heads in attention)."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    act_bytes: int
    quadratic: bool
    split: int = 1

    @classmethod
    def of(cls, config, act_bytes: int, attn_implementation: Optional[str], on_cuda: bool,
           split: int = 1) -> Optional["Shape"]:
        """From a transformers config (its text config for a multimodal one); None when it does not say."""
        config = getattr(config, "text_config", None) or config
        try:
            layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
            heads = int(config.num_attention_heads)
        except (AttributeError, TypeError):
            return None
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        # flash and memory-efficient kernels (sdpa on CUDA) keep O(T) per head; eager, and sdpa's math path on CPU,
        # keep the probabilities
        quadratic = attn_implementation == "eager" or not on_cuda
        return cls(layers, hidden, intermediate, heads, act_bytes, quadratic, split)

    def row_bytes(self, tokens: int, checkpointing: bool) -> float:
        """What the backward keeps on this rank for one row of `tokens` (padded) tokens."""
        local = -(-tokens // self.split)
        per_layer = local * self.act_bytes * (6 * self.hidden + 3 * self.intermediate)  # matmul/norm/MLP inputs
        if self.quadratic:  # the softmax's output, kept for its backward: in fp32, and a 16-bit copy beside it
            kept = 4 if self.act_bytes == 4 else 4 + self.act_bytes
            per_layer += tokens * tokens * (self.heads // self.split) * kept
        if not checkpointing:
            return self.layers * per_layer
        return self.layers * local * self.hidden * self.act_bytes + per_layer  # layer inputs + one layer at a time


@dataclass(frozen=True)
class Plan:
    """`max_tokens`: padded tokens a micro-batch (None: the configured rows); `checkpointing`: recompute layers in
    the backward; `need`, `free`: the estimate in bytes for the biggest micro-batch, and what the step may use."""
    max_tokens: Optional[int]
    checkpointing: bool
    need: float
    free: float

    def fits(self) -> bool:
        return self.need <= self.free


def plan_step(shape: Shape, lengths: Sequence[int], rows_per_micro_batch: int, free: float, checkpointing: bool,
              max_tokens: Optional[int] = None) -> Plan:
    """The micro-batching for rows of `lengths` tokens: as configured (`rows_per_micro_batch` rows, or `max_tokens`
    padded tokens) where its biggest micro-batch fits in `free` bytes x SAFETY; else as many rows of the longest as
    fit; else the same with checkpointing (kept once on, `checkpointing`). A plan that still does not fit is one row
    a micro-batch with checkpointing, and says so (`fits`)."""
    budget, longest = free * SAFETY, max(lengths)
    if max_tokens is not None:
        rows = max(1, max_tokens // longest)
    else:
        rows = min(rows_per_micro_batch, len(lengths))
    need = rows * shape.row_bytes(longest, checkpointing)
    if need <= budget:
        return Plan(max_tokens, checkpointing, need, budget)
    for gc in sorted({checkpointing, True}):
        one = shape.row_bytes(longest, gc)
        fit = int(budget // one)
        if fit >= 1:
            return Plan(fit * longest, gc, fit * one, budget)
    return Plan(longest, True, shape.row_bytes(longest, True), budget)


HEAD_WORKSET = 3 * 256 * 2**20  # the deferred head's chunk of fp32 logits (actors.logits), its softmax and gradient


def step_overhead(model, precision: str, zero_stage: int, world_size: int, deferred_head: bool) -> float:
    """Bytes a step allocates beyond the activations `Shape` counts, which the process does not hold yet when it
    plans: the trained parameters' gradients (16-bit ones and the optimizer's fp32 copies under a 16-bit "true"
    precision; partitioned over the ranks under ZeRO 2-3) and the deferred head's working set."""
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)  # (ZeRO-3)
    grad_bytes = 6 if precision in ("bf16-true", "fp16-true") else 4
    return trained * grad_bytes / (world_size if zero_stage >= 2 else 1) + (HEAD_WORKSET if deferred_head else 0)


def free_bytes(device, ranks_here: int, limit_gb: Optional[float] = None, pending: float = 0.0) -> float:
    """The memory this rank's step may take: on CUDA the device's free memory plus what torch holds cached; on CPU
    the node's available memory shared by the `ranks_here` trainer ranks that step at once; less `pending`, what
    the step's own buffers will take (step_overhead). With `limit_gb` (trainer.memory_limit_gb), no more than that
    limit less what the process holds now and `pending`."""
    import torch
    if getattr(device, "type", str(device)) == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free = float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        held = float(torch.cuda.memory_allocated(device))
    else:
        import psutil
        free, held = psutil.virtual_memory().available / max(1, ranks_here), float(psutil.Process().memory_info().rss)
    limit = limit_gb * float(1 << 30) if limit_gb else None
    free -= pending  # what the step's own buffers will take (step_overhead)
    return max(0.0, free if limit is None else min(free, limit - held - pending))


def return_freed_memory() -> None:
    """Give the pages glibc holds free back to the system (malloc_trim). A CPU step's freed activations otherwise
    stay in the process: the next micro-batch's are allocated beside them and its peak resident memory is about the
    sum, so smaller micro-batches would lower the live tensors but not the process's memory."""
    import ctypes
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # (glibc's; other C libraries lack it)
    if trim is not None:
        trim(0)


def describe(plan: Plan, rows_per_micro_batch: int, longest: int) -> str:
    """One line for the log: what the step chose and why."""
    gib = 1 << 30
    what = (f"micro-batches of {plan.max_tokens} padded tokens ({plan.max_tokens // longest} row(s) of {longest})"
            if plan.max_tokens is not None else f"micro-batches of {rows_per_micro_batch} rows")
    gc = ", gradient checkpointing on" if plan.checkpointing else ""
    verdict = "" if plan.fits() else " - still more than fits: lower rollout.max_new_tokens"
    return (f"memory plan: {what}{gc}: about {plan.need / gib:.1f} GiB of activations against the "
            f"{plan.free / gib:.1f} GiB it may use{verdict}")


def enable_checkpointing(model) -> None:
    """Gradient checkpointing on `model` (its base under a LoRA wrapper), non-reentrant: a layer's activations are
    recomputed in the backward from its input."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class MemoryPlanner:
    """A trainer rank's plan, made again each step from its rows (trainer.plan_memory). Checkpointing, once turned
    on, stays on (the next step's rows may be as long). Every rank takes the same plan, the most careful any rank
    made, so they run as many forwards, each with as many collectives."""

    def __init__(self, model, shape: Shape, device, ranks_here: int, checkpointing: bool, rank: int = 0,
                 limit_gb: Optional[float] = None, pending: float = 0.0):
        self.model, self.shape, self.device, self.ranks_here, self.rank = model, shape, device, ranks_here, rank
        self.limit_gb, self.pending = limit_gb, pending  # trainer.memory_limit_gb; step_overhead
        self.checkpointing, self.said = checkpointing, None
        self.tokens: Optional[int] = None  # the last step's budget (None: the configured rows)

    @classmethod
    def attach(cls, model, tr, precision: str, device, world_size: int, rank: int) -> Optional["MemoryPlanner"]:
        """The planner for `model` under TrainerConfig `tr`, or None (trainer.plan_memory off, or a model whose
        config does not give its shape)."""
        on_cuda = getattr(device, "type", str(device)) == "cuda"
        attn = tr.attn_implementation or getattr(model.config, "_attn_implementation", None)
        shape = (Shape.of(model.config, 4 if precision == "fp32" else 2, attn, on_cuda, tr.sequence_parallel_size)
                 if tr.plan_memory else None)
        ranks_here = 1 if on_cuda else world_size  # (on CPU every rank steps at once on the one node)
        if shape is None:
            return None
        pending = step_overhead(model, precision, tr.zero_stage, world_size, tr.chunked_logprobs)
        return cls(model, shape, device, ranks_here, tr.gradient_checkpointing, rank, tr.memory_limit_gb, pending)

    def budget(self, lengths: Sequence[int], rows_per_micro_batch: int, max_tokens: Optional[int],
               all_reduce_max) -> Optional[int]:
        """The padded-token budget of this step's micro-batches (None: `rows_per_micro_batch` rows)."""
        import torch
        free = free_bytes(self.device, self.ranks_here, self.limit_gb, self.pending)
        plan = plan_step(self.shape, lengths, rows_per_micro_batch, free, self.checkpointing, max_tokens)
        unset = float(1 << 62)  # (no budget: the configured rows)
        agreed = all_reduce_max(torch.tensor([float(plan.checkpointing), -float(plan.max_tokens or unset)],
                                             dtype=torch.float64))
        gc, tokens = bool(agreed[0].item()), -agreed[1].item()
        tokens = None if tokens >= unset else int(tokens)
        if self.said is None:
            self.said = (max_tokens, self.checkpointing)  # what the config asked for, said by nobody
        if gc and not self.checkpointing:
            enable_checkpointing(self.model)
            self.checkpointing = True
        if (tokens, gc) != self.said and self.rank == 0:
            print(describe(Plan(tokens, gc, plan.need, plan.free), rows_per_micro_batch, max(lengths)), flush=True)
        self.said, self.tokens = (tokens, gc), tokens
        return tokens

    def preview(self, tokens: int, rows: int, max_tokens: Optional[int]) -> str:
        """What a step of `rows` rows of `tokens` tokens would choose now, said before the first step (nothing is
        changed: each step still plans from its own rows)."""
        free = free_bytes(self.device, self.ranks_here, self.limit_gb, self.pending)
        plan = plan_step(self.shape, [tokens] * rows, rows, free, self.checkpointing, max_tokens)
        where = getattr(self.device, "type", str(self.device))
        return f"on {where}, rows of {tokens} tokens: " + describe(plan, rows, tokens).removeprefix("memory plan: ")

    def metrics(self) -> dict[str, float]:
        """The plan the last step ran, for the driver to log (a Ray worker's own prints stay in its log)."""
        return {"train/planned_tokens": float(self.tokens or 0), "train/checkpointing": float(self.checkpointing)}
