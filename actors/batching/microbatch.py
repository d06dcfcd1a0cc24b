"""The trainers' micro-batches: a rollout's rows grouped by length (or by a token budget), each group cut to its
longest row, and per-row results scattered back into the batch's order."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from common.batch import Batch


def length_grouped(batch: Batch, size: int, unit: int = 1) -> list[tuple[torch.Tensor, Batch]]:
    """`batch` as micro-batches of `size` rows (the last may be smaller) grouped by length, longest first, each cut
    to its longest row: padding costs compute, and a loss normalised by a global count does not depend on which
    rows share a micro-batch. Rows stay together in `unit`s (2 for interleaved preference pairs). Returns
    (positions of its rows in `batch`, micro-batch) pairs.

    Columns are cut only where every row of the micro-batch is padding (right padding, as pack_sequences makes).
    Tensors (B, L) are cut to width w, (B, L-1) to w-1; others, e.g. (B,), are only reordered.
    """
    rows = len(batch["input_ids"])
    if rows % unit or size % unit:
        raise ValueError(f"{rows} rows in micro-batches of {size} cannot keep {unit}-row units whole")
    unit_len = batch["attention_mask"].sum(1).view(-1, unit).max(1).values
    order = torch.argsort(unit_len, descending=True, stable=True)
    row_order = (order[:, None] * unit + torch.arange(unit)).flatten()
    return [grouped_rows(batch, idx) for idx in row_order.split(size)]


def grouped_rows(batch: Batch, idx: torch.Tensor) -> tuple[torch.Tensor, Batch]:
    """(idx, the rows `idx` of `batch` cut to their longest row): one micro-batch."""
    width = batch["input_ids"].shape[1]
    used = batch["attention_mask"][idx].any(0).nonzero()
    w = int(used.max()) + 1 if len(used) else 1
    return idx, {k: _cut(v[idx], width, w) for k, v in batch.items()}


def _cut(t: torch.Tensor, width: int, w: int) -> torch.Tensor:
    if t.dim() >= 2 and t.shape[1] == width:
        return t[:, :w]
    if t.dim() >= 2 and t.shape[1] == width - 1:
        return t[:, :w - 1]
    return t


def map_grouped(batch: Batch, size: int, fn, unit: int = 1, max_tokens: Optional[int] = None) -> torch.Tensor:
    """fn(micro-batch) -> per-row result, (b,) or (b, w', ...), over length_grouped micro-batches of `size` rows
    (kept together in `unit`s), or with `max_tokens` of as many rows as fit that many padded tokens
    (budget_grouped); returned in the batch's row order, dim 1 zero-padded back by what each cut removed
    ((b, w-1) -> (B, L-1))."""
    groups = budget_grouped(batch, max_tokens, unit) if max_tokens else length_grouped(batch, size, unit)
    return map_pieces(batch, groups, fn)


def map_pieces(batch: Batch, groups: list[tuple[torch.Tensor, Batch]], fn) -> torch.Tensor:
    """`map_grouped` over micro-batches already cut: (positions of its rows in `batch`, micro-batch) pairs."""
    pieces, width = [], batch["input_ids"].shape[1]
    for rows, mb in groups:
        out = fn(mb)
        pieces.append((rows, out))
        full = width - mb["input_ids"].shape[1] + (out.shape[1] if out.dim() > 1 else 0)
    return scatter_rows(pieces, len(batch["input_ids"]), full)


def budget_grouped(batch: Batch, max_tokens: int, unit: int = 1,
                   count: Optional[int] = None) -> list[tuple[torch.Tensor, Batch]]:
    """`batch` as micro-batches of at most `max_tokens` padded tokens (rows x longest row; a longer unit alone),
    longest first, `unit` rows kept together; `count` forces how many (ranks that must run as many as each other
    agree on it first: actors/batching/packing.py: token_budget_groups). Returns what length_grouped returns."""
    from actors.batching.packing import micro_batches_needed, token_budget_groups
    lengths = batch["attention_mask"].sum(1).view(-1, unit).max(1).values.tolist()  # per unit (a DPO pair)
    count = count if count is not None else micro_batches_needed(lengths, max_tokens // unit)
    return [grouped_rows(batch, torch.tensor([u * unit + j for u in g for j in range(unit)]))
            for g in token_budget_groups(lengths, count)]


def scatter_rows(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """Per-row results of length_grouped micro-batches, (b,) or (b, w', ...), back into one tensor of `rows` rows in
    the original order; dim 1 is zero-padded to `width`."""
    first = pieces[0][1]
    out = first.new_zeros((rows,) + ((width,) + tuple(first.shape[2:]) if first.dim() > 1 else ()))
    for idx, t in pieces:
        if t.dim() > 1:
            out[idx, :t.shape[1]] = t
        else:
            out[idx] = t
    return out
