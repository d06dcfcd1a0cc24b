"""Batches: a step's rollout as one typed value (`RolloutBatch`), and the plain dicts of tensors the workers read
(`Batch`): building them from token ids, and splitting/concatenating along dim 0."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from algorithms.moe import no_route

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RolloutBatch:
    """A step's rollout, built once by the rollout phase and only read after it: B samples (a prompt's n_samples
    adjacent) as rows [prompt | completion | padding] of L tokens. Per-token fields line up with the shifted
    targets input_ids[:, 1:] (L-1 columns) and are zero outside loss_mask."""
    samples: list  # B rollout.engine.Sample: token ids, finish reasons, environment outcomes
    input_ids: torch.Tensor  # (B, L) int64, right-padded
    attention_mask: torch.Tensor  # (B, L) int64, 1 on the row's tokens
    loss_mask: torch.Tensor  # (B, L-1) bool, the tokens the model sampled: what the update trains
    rollout_logprobs: torch.Tensor  # (B, L-1) fp32, the engine's log-probs of those tokens
    rewards: torch.Tensor  # (B,) fp32, one score a sample
    # (B, L) int64 where a row holds several sequences (an agent episode's contexts: segment_positions), else None
    position_ids: Optional[torch.Tensor] = None
    # algorithm.routing_replay: (B, L, MoE layers, top-k) uint8 the experts the engine routed each token to
    # (rollout.engines.routes; 255 where none was recorded), else None
    routes: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, samples: list, rewards: torch.Tensor, pad_id: int, rows: Batch | None = None) -> "RolloutBatch":
        """From the samples and their rewards; `rows`: samples_to_batch(samples, pad_id) when already packed."""
        return cls(samples=samples, rewards=rewards, **(rows or samples_to_batch(samples, pad_id)))

    def rows(self) -> Batch:
        """The row tensors every worker call of the step reads (the samples and rewards stay on the driver)."""
        rows = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                "rollout_logprobs": self.rollout_logprobs}
        if self.routes is not None:
            rows["routes"] = self.routes
        return rows if self.position_ids is None else {**rows, "position_ids": self.position_ids}


def pack_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Right-padded prompt+completion rows.

    Returns input_ids (B, L), attention_mask (B, L) and, aligned with the *shifted* targets input_ids[:, 1:],
    `loss_mask` (B, L-1) bool that is true on completion tokens.
    """
    return pack_masked([list(p) + list(c) for p, c in zip(prompts, completions)],
                       [[False] * len(p) + [True] * len(c) for p, c in zip(prompts, completions)], pad_id)


def pack_masked(seqs: Sequence[Sequence[int]], targets: Sequence[Sequence[bool]], pad_id: int) -> Batch:
    """Right-padded rows whose tokens are trained where `targets` is true (e.g. every assistant turn of a
    conversation). Same tensors as pack_sequences: `loss_mask[i, j - 1]` is `targets[i][j]` (the first token is
    never a target: nothing predicts it)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        attn[i, :len(s)] = 1
        loss_mask[i, :len(s) - 1] = torch.tensor(list(t)[1:], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def first_target(loss_mask: torch.Tensor) -> int:
    """The first column of loss_mask (B, L-1) that any row trains on (0 when none does): a forward's logits before
    it are never read."""
    cols = loss_mask.any(0).nonzero()
    return int(cols[0]) if len(cols) else 0


def even_spans(rows: int, n: int) -> list[tuple[int, int, int]]:
    """`rows` cut into `n` contiguous ranges whose sizes differ by at most one: `(part, lo, hi)` for each non-empty
    part, in order (fewer than `n` when rows < n)."""
    bounds = [rows * i // n for i in range(n + 1)]
    return [(i, lo, hi) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]


def split_batch(batch: Batch, n_chunks: int) -> list[Batch]:
    """Split every tensor along dim 0 into `n_chunks` equal parts (rows must divide evenly)."""
    rows = len(next(iter(batch.values())))
    if rows % n_chunks:
        raise ValueError(f"cannot split {rows} rows into {n_chunks} equal chunks")
    size = rows // n_chunks
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n_chunks)]


def compact(batch: Batch) -> Batch:
    """`batch` with every tensor that views a larger storage copied out: a view pickles its whole storage, so a row
    shard sent to a Ray worker would carry every row of the batch."""
    return {k: v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > v.nbytes else v
            for k, v in batch.items()}


def shards(batch: Batch, n: int) -> list[Batch]:
    """`split_batch` for sending: each shard holds its own rows only (`compact`)."""
    return [compact(part) for part in split_batch(batch, n)]


def samples_to_batch(samples, pad_id: int) -> Batch:
    """Pack rollout samples like pack_sequences, plus `rollout_logprobs` (B, L-1) aligned with the shifted targets
    (zero outside loss_mask). A multi-turn sample's loss_mask covers the tokens the model sampled, not the
    observations between its turns."""
    batch = pack_masked([list(s.prompt_ids) + list(s.completion_ids) for s in samples],
                        [[False] * len(s.prompt_ids) + (list(s.completion_mask) if s.completion_mask is not None
                                                         else [True] * len(s.completion_ids)) for s in samples],
                        pad_id)
    rollout = torch.zeros(batch["loss_mask"].shape, dtype=torch.float32)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        # (a copy: arrays Ray hands over from its object store are read-only)
        rollout[i, start:start + len(s.completion_ids)] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    batch["rollout_logprobs"] = rollout
    if any(s.segments for s in samples):
        batch["position_ids"] = segment_positions(batch["input_ids"].shape[1], [s.segments or [] for s in samples])
    if any(getattr(s, "routes", None) is not None for s in samples):
        batch["routes"] = routes_batch([s.routes for s in samples], batch["input_ids"].shape[1])
    return batch


def routes_batch(routes: Sequence[Optional[np.ndarray]], width: int) -> torch.Tensor:
    """Each sample's routes (T_i, layers, k) as (B, width, layers, k), aligned with input_ids; the id that means
    "none recorded" (rollout.engines.routes: 255, or -1 past 255 experts) fills the rest, and the rows of samples
    without routes (ended before the checkpoint a run resumed from)."""
    first = next(r for r in routes if r is not None)
    out = np.full((len(routes), width) + first.shape[1:], no_route(first.dtype), dtype=first.dtype)
    for i, r in enumerate(routes):
        if r is not None:
            out[i, :len(r)] = r[:width]
    return torch.from_numpy(out)


def segment_positions(width: int, starts: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, width) position ids that restart at 0 at each of a row's `starts` (a row holding several sequences;
    padding continues the last). A forward given these and no attention mask treats each run as its own sequence:
    transformers reads a restart as a sequence boundary (a block-diagonal causal mask), and right padding after a
    row's tokens is never attended by them."""
    positions = torch.arange(width).repeat(len(starts), 1)
    for i, row in enumerate(starts):
        for start in row:
            positions[i, start:] -= positions[i, start].clone()
    return positions


def attention_inputs(mb: Batch) -> Batch:
    """What a forward takes besides input_ids: the padding mask, or for rows holding several sequences their
    restarting position ids instead (segment_positions)."""
    if "position_ids" in mb:  # (no cache: with one, transformers does not look for restarts)
        return {"position_ids": mb["position_ids"], "use_cache": False}
    return {"attention_mask": mb["attention_mask"]}


def pack_pairs(prompts: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]],
               rejected: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Preference pairs as 2B interleaved rows (chosen 0, rejected 0, chosen 1, ...), so any even split keeps each
    pair together."""
    rows_p = [p for p in prompts for _ in (0, 1)]
    rows_c = [c for pair in zip(chosen, rejected) for c in pair]
    return pack_sequences(rows_p, rows_c, pad_id)


def sequence_logprobs(token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of completion-token log-probs per row: (B, L-1) -> (B,)."""
    return (token_logprobs * loss_mask).sum(-1)


def chunks(batch: Batch, size: int) -> list[Batch]:
    """Consecutive pieces of at most `size` rows (the last may be smaller): for inference, where any split works."""
    rows = len(next(iter(batch.values())))
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]
