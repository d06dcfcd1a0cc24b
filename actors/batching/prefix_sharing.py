"""Shared-prefix forward (`trainer.shared_prefix`): rows that begin with the same untrained prefix (a prompt's G
samples, a DPO pair's prompt) go through the model as one row: the prefix once, then each row's own tokens after
it, under a 4D attention mask that lets every continuation see the prefix and itself only, with position ids that
restart at the prefix's end for each continuation. The prefix's work is done once per group instead of once per row.
The outputs are gathered back into the padded layout the losses read, so the loss is the padded forward's; and so is
the gradient (a prefix position read by G rows receives the sum of what the G rows send back). Prefix Grouper
(Liu et al., 2025, arXiv:2506.05433) shows the same equivalence for GRPO. Pure functions on tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SharedLayout:
    """R packed rows of width N for B padded rows of width W."""

    input_ids: torch.Tensor  # (R, N) one row per distinct prefix: prefix | continuation 1 | ... | continuation k | pad
    position_ids: torch.Tensor  # (R, N) 0.. along the prefix; each continuation goes on from the prefix's length
    allowed: torch.Tensor  # (R, 1, N, N) bool: query i may attend to key j
    source: torch.Tensor  # (B, W) index into the flattened (R * N) packed tokens of each padded token; -1 on padding

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def prefix_lengths(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Tokens before each row's first trained token (its whole length where it trains none).
    attention_mask (B, W), loss_mask (B, W-1) (loss_mask[:, t] trains token t+1) -> (B,) int64."""
    trains = loss_mask.any(1)
    first = loss_mask.int().argmax(1) + 1
    return torch.where(trains, first, attention_mask.sum(1)).long()


def prefix_groups(input_ids: torch.Tensor, cuts: list[int]) -> list[list[int]]:
    """Row indices grouped by identical prefix (input_ids[b, :cuts[b]]), in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, c in enumerate(cuts):
        groups.setdefault(tuple(input_ids[b, :c].tolist()), []).append(b)
    return list(groups.values())


def group_unit(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """G when the rows are consecutive runs of G rows sharing a prefix (a rollout's groups, in order), else 1: the
    number of rows a micro-batch must keep together for each group's prefix to be computed once."""
    cuts = prefix_lengths(attention_mask, loss_mask).tolist()
    groups = prefix_groups(input_ids, cuts)
    size = len(groups[0])
    contiguous = all(g == list(range(g[0], g[0] + size)) for g in groups)
    return size if contiguous and all(len(g) == size for g in groups) else 1


MASK_ALIGN = 16


@dataclass(frozen=True)
class ForwardCost:
    """What one forward of a decoder costs, to compare layouts: `token_flops` per token (2 x its weights'
    parameters), `attention_flops` per (query, key) pair (4 x hidden x layers: scores and the weighted sum, dense
    however the mask is), `mask_bytes` per (query, key) pair of the shared layout's 4D mask."""
    token_flops: float
    attention_flops: float
    mask_bytes: int

    def sharing_pays(self, plan: "PrefixPlan", max_mask_bytes: int = 256 * 2**20) -> bool:
        """Whether the shared layout of `plan`'s rows costs less than their padded forward, and its mask (one
        (R, 1, N, N) tensor for every layer) fits `max_mask_bytes`. Prompt-heavy groups gain (the prompt once);
        long continuations lose (G of them in one row: G^2 times the attention pairs of one padded row each), and
        so does a group of one."""
        r, n, rows, used = len(plan.groups), plan.width, len(plan.lengths), plan.used
        shared = self.token_flops * r * n + self.attention_flops * r * n * n
        padded = self.token_flops * rows * used + self.attention_flops * rows * used * used
        return shared < padded and r * n * n * self.mask_bytes <= max_mask_bytes


def forward_cost(model: torch.nn.Module, mask_dtype: torch.dtype) -> ForwardCost:
    """`ForwardCost` of a transformers causal LM (or a PEFT wrapper of one) from its config and weights. The
    embedding is a lookup, and the LM head runs on the trained positions only, the same ones in either layout: neither
    counts. (ZeRO-3 partitions parameters: their full size is `ds_numel`.)"""
    config = model.config
    ends = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    skip = {id(w) for w in ends}
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if id(p) not in skip)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return ForwardCost(2.0 * params, 4.0 * hidden * layers, torch.finfo(mask_dtype).bits // 8)


@dataclass(frozen=True)
class PrefixPlan:
    """Which of B right-padded rows share a prefix: what the cost check and the layout both need, found once."""

    lengths: list[int]  # (B) each row's tokens
    cuts: list[int]  # (B) each row's untrained prefix (`prefix_lengths`)
    groups: list[list[int]]  # row indices by identical prefix (`prefix_groups`)
    used: int  # the padded width the rows use (their longest length)
    align: int = 1  # the width's multiple: MASK_ALIGN on CUDA

    @property
    def width(self) -> int:
        """N, the packed row's width: the longest group's prefix and continuations, rounded up to a multiple of
        `align` (the extra positions are padding)."""
        n = max(self.cuts[g[0]] + sum(self.lengths[b] - self.cuts[b] for b in g) for g in self.groups)
        return -(-n // self.align) * self.align


def plan_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                  align: int = 1) -> PrefixPlan:
    """input_ids, attention_mask (B, W); loss_mask (B, W-1). `align`: the packed width's multiple (`mask_align`)."""
    lengths = attention_mask.sum(1).tolist()
    cuts = prefix_lengths(attention_mask, loss_mask).tolist()
    return PrefixPlan(lengths, cuts, prefix_groups(input_ids, cuts), max(max(lengths), 1), align)


def mask_align(device: torch.device) -> int:
    """The packed width's multiple on `device`: CUDA's memory-efficient attention copies a mask whose row stride is
    not a multiple of 8 or 16 elements (by release) into a padded tensor in every layer, and keeps each copy for the
    backward (layers x the mask); CPU kernels take any stride, where extra width is only cost."""
    return MASK_ALIGN if device.type == "cuda" else 1


def share_prefixes(input_ids: torch.Tensor, plan: PrefixPlan) -> SharedLayout:
    """The packed layout of right-padded rows input_ids (B, W), grouped by `plan`."""
    lengths, cuts, groups, n = plan.lengths, plan.cuts, plan.groups, plan.width
    rows, width = input_ids.shape
    ids = torch.zeros((len(groups), n), dtype=input_ids.dtype)
    positions = torch.zeros((len(groups), n), dtype=torch.long)
    allowed = torch.eye(n, dtype=torch.bool).repeat(len(groups), 1, 1, 1)  # padding sees itself: no empty softmax
    source = torch.full((rows, width), -1, dtype=torch.long)
    for r, members in enumerate(groups):
        c = cuts[members[0]]
        ids[r, :c], positions[r, :c] = input_ids[members[0], :c], torch.arange(c)
        allowed[r, 0, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        at = c
        for b in members:
            source[b, :c] = r * n + torch.arange(c)
            k = lengths[b] - c
            ids[r, at:at + k], positions[r, at:at + k] = input_ids[b, c:c + k], torch.arange(c, c + k)
            allowed[r, 0, at:at + k, :c] = True
            allowed[r, 0, at:at + k, at:at + k] = torch.ones(k, k, dtype=torch.bool).tril()
            source[b, c:c + k] = r * n + at + torch.arange(k)
            at += k
    return SharedLayout(ids, positions, allowed, source)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as the float one eager attention adds to its scores: 0 where allowed, dtype's min elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def windowed(layout: SharedLayout, window: int) -> torch.Tensor:
    """`allowed` within a sliding window of `window` positions: a query at position p sees keys at positions
    p - window + 1 .. p (transformers' sliding_window_overlay), counted along each row's own positions, so a
    continuation sees the end of its prefix exactly as its padded row does. (R, 1, N, N) bool."""
    pos = layout.position_ids
    near = (pos[:, :, None] - pos[:, None, :]) < window
    return layout.allowed & near[:, None]


def layer_masks(layout: SharedLayout, config, dtype: Optional[torch.dtype] = None, device=None):
    """The 4D mask(s) a model's attention takes for the shared layout: one mask, or where some layers attend
    within a sliding window (Gemma-3, Qwen2 with use_sliding_window: `config.layer_types`), one per layer type
    (transformers' causal_mask_mapping), since a 4D mask is used as given and the window would otherwise be lost;
    a model whose every layer is windowed (Mistral: `sliding_window` without layer_types) gets the windowed one.
    Bool (sdpa), or additive in `dtype` (eager); on `device`."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window and types and "sliding_attention" in types:
        masks = {t: windowed(layout, window) if t == "sliding_attention" else layout.allowed for t in set(types)}
    elif window and types is None:
        masks = windowed(layout, window)
    else:
        masks = layout.allowed

    def finish(m: torch.Tensor) -> torch.Tensor:
        return (m if dtype is None else additive_mask(m, dtype)).to(device)

    return {t: finish(m) for t, m in masks.items()} if isinstance(masks, dict) else finish(masks)


def gather_rows(packed: torch.Tensor, layout: SharedLayout, start: int = 0) -> torch.Tensor:
    """The packed output back in the padded layout, from column `start` on: (B, W - start, ...), zeros on padding.
    `packed` (R, K, ...) holds the last K positions of each packed row (a forward with logits_to_keep = K); a padded
    position whose packed position is not among them (a prefix token before `start`) is zero as well.
    Differentiable: a packed position read by several rows gets the sum of their gradients."""
    n, keep = layout.width, packed.shape[1]
    src = layout.source[:, start:].to(packed.device)
    row, pos = src.div(n, rounding_mode="floor"), src.remainder(n) - (n - keep)
    valid = (src >= 0) & (pos >= 0)
    flat = packed.reshape((-1,) + tuple(packed.shape[2:]))
    out = packed.new_zeros(tuple(src.shape) + tuple(packed.shape[2:]))
    return out.index_put(tuple(valid.nonzero().T), flat[(row * keep + pos)[valid]])
