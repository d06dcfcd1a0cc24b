"""Token-budget micro-batches (`trainer.max_tokens_per_micro_batch`, verl's dynamic batch size) and rows dealt to
data-parallel ranks by length. Pure functions on row lengths; the loss normaliser stays global (actors/ds_model.py),
so the update does not depend on how rows are grouped.

A micro-batch is padded to its longest row, so its cost is rows x longest; rows are taken longest first and cut
into contiguous runs, which keeps that padding small.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _cost(lengths: Sequence[int], lo: int, hi: int) -> int:
    """Padded tokens of the run lengths[lo:hi] (sorted longest first)."""
    return (hi - lo) * lengths[lo]


def _greedy(lengths: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """Runs of the sorted lengths, each as long as its padded cost stays within `cap` (at least one row)."""
    runs, lo = [], 0
    while lo < len(lengths):
        hi = lo + 1
        while hi < len(lengths) and _cost(lengths, lo, hi + 1) <= cap:
            hi += 1
        runs.append((lo, hi))
        lo = hi
    return runs


def micro_batches_needed(lengths: Sequence[int], budget: int) -> int:
    """How many micro-batches of at most `budget` padded tokens the rows need (a row longer than the budget is a
    micro-batch of its own)."""
    return len(_greedy(sorted(lengths, reverse=True), budget))


def token_budget_groups(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Row indices in exactly `count` micro-batches (count <= rows), longest rows first, cut where the largest
    micro-batch's padded cost is smallest (a binary search on that cost). Every rank of a data-parallel group must
    run as many micro-batches as the others (ZeRO's collectives): agree on `count` first, e.g. the most any rank's
    rows need under the budget (micro_batches_needed)."""
    if not 0 < count <= len(lengths):
        raise ValueError(f"cannot cut {len(lengths)} rows into {count} micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    lo, hi = ls[0], len(ls) * ls[0]
    while lo < hi:  # the smallest cap whose greedy cut needs at most `count` runs
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_greedy(ls, mid)) <= count else (mid + 1, hi)
    runs = _greedy(ls, lo)
    while len(runs) < count:  # split the costliest run in two until there are `count`
        k = max((i for i, (a, b) in enumerate(runs) if b - a > 1), key=lambda i: _cost(ls, *runs[i]))
        a, b = runs[k]
        runs[k:k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [order[a:b] for a, b in runs]


def deal_by_length(lengths: torch.Tensor, world_size: int, n_mini: int) -> torch.Tensor:
    """A row order whose `world_size` equal contiguous shards hold each mini-batch's rows in near-equal padded
    work: within each of the `n_mini` consecutive mini-batches, rows sorted by length are dealt to the ranks in a
    snake (0, 1, ..., r-1, r-1, ..., 0, ...), so rank r's shard is its share of mini-batch 0, then of mini-batch 1...
    Mini-batches keep their rows (a prompt's group stays in its update). lengths (B,) -> permutation (B,)."""
    rows = len(lengths)
    if rows % (world_size * n_mini):
        raise ValueError(f"{rows} rows do not split into {n_mini} mini-batches over {world_size} ranks")
    per_mini = rows // n_mini
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for m in range(n_mini):
        idx = torch.arange(m * per_mini, (m + 1) * per_mini)
        ranked = idx[torch.argsort(lengths[idx], descending=True, stable=True)].tolist()
        for j, row in enumerate(ranked):
            turn, pos = divmod(j, world_size)
            shards[pos if turn % 2 == 0 else world_size - 1 - pos].append(row)
    return torch.tensor([row for shard in shards for row in shard])


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows as one row without padding (`trainer.packing`): every row's tokens end to end, with
    position ids restarting at 0 where a row starts. transformers reads the restarts as sequence boundaries (a
    block-diagonal causal mask under sdpa/eager, variable-length kernels under flash attention), so each token sees
    only its own row, as it would padded.

    input_ids, attention_mask (B, W) -> packed ids (1, N), position_ids (1, N), and `where` (N,): each packed
    token's flat position in (B * W), for `unpack_rows`. N = attention_mask.sum(). `position_ids` (B, W): rows that
    hold several sequences restart there too (common.batch.segment_positions)."""
    real = attention_mask.bool()
    where = real.reshape(-1).nonzero().squeeze(-1)
    positions = (real.cumsum(1) - 1 if position_ids is None else position_ids).reshape(-1)[where]
    return input_ids.reshape(-1)[where].unsqueeze(0), positions.unsqueeze(0), where


def unpack_rows(packed: torch.Tensor, where: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A packed per-token output (1, N, ...) back in the padded layout (B, W, ...), zeros on padding (differentiable:
    its gradient is the gradient at each token's packed position)."""
    flat = packed.new_zeros((rows * width,) + tuple(packed.shape[2:]))
    flat.index_copy_(0, where, packed[0])  # in place: one logits-sized tensor, not two
    return flat.view((rows, width) + tuple(packed.shape[2:]))
