"""Packing rows into tensors: masks aligned with shifted targets, pairs interleaved, ragged inference chunks."""
import pytest
import torch

from common.batch import chunks, pack_pairs, pack_sequences, samples_to_batch, sequence_logprobs, split_batch
from rollout.engine import Sample


def test_pack_sequences_masks_only_completion_targets():
    b = pack_sequences([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # targets are input_ids[:, 1:] = [2,4,5,6] and [7,0,0,0]
    assert b["loss_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]


def test_samples_to_batch_aligns_rollout_logprobs():
    s = [Sample(0, [1, 2], [3, 4], [-0.5, -0.25], "stop"), Sample(0, [1], [5], [-1.0], "length")]
    b = samples_to_batch(s, pad_id=0)
    assert b["rollout_logprobs"].tolist() == [[0.0, -0.5, -0.25], [-1.0, 0.0, 0.0]]
    assert sequence_logprobs(b["rollout_logprobs"], b["loss_mask"]).tolist() == [-0.75, -1.0]


def test_pack_pairs_interleaves_and_split_keeps_pairs_together():
    b = pack_pairs([[1], [2]], [[10], [20]], [[11, 12], [21]], pad_id=0)
    assert b["input_ids"][:, :2].tolist() == [[1, 10], [1, 11], [2, 20], [2, 21]]
    halves = split_batch(b, 2)
    assert [h["input_ids"][:, 0].tolist() for h in halves] == [[1, 1], [2, 2]]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), b["input_ids"])


def test_chunks_are_ragged_and_split_batch_is_not():
    b = {"x": torch.arange(10)}
    assert [c["x"].tolist() for c in chunks(b, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="cannot split 10 rows into 4"):
        split_batch(b, 4)


def test_length_grouped_sorts_cuts_and_scatters_back():
    from actors.batching.microbatch import length_grouped, scatter_rows
    batch = pack_sequences([[1], [1], [1], [1]], [[2], [2, 3, 4, 5], [2, 3], [2, 3, 4]], pad_id=0)  # lengths 2 5 3 4
    batch["score"] = torch.tensor([10.0, 11.0, 12.0, 13.0])
    pieces = length_grouped(batch, size=2)
    assert [idx.tolist() for idx, _ in pieces] == [[1, 3], [2, 0]]
    (_, long), (_, short) = pieces
    assert long["input_ids"].shape == (2, 5) and long["loss_mask"].shape == (2, 4)
    assert short["input_ids"].tolist() == [[1, 2, 3], [1, 2, 0]] and short["loss_mask"].shape == (2, 2)
    assert short["score"].tolist() == [12.0, 10.0]
    # A per-token result computed on the cut micro-batches lands where the full batch would have it.
    back = scatter_rows([(idx, mb["loss_mask"].float()) for idx, mb in pieces], 4, 4)
    assert torch.equal(back, batch["loss_mask"].float())
    assert torch.equal(scatter_rows([(idx, mb["score"]) for idx, mb in pieces], 4, 0), batch["score"])


def test_length_grouped_keeps_pairs_together():
    from actors.batching.microbatch import length_grouped
    from common.batch import pack_pairs
    batch = pack_pairs([[1], [1], [1]], [[2], [2, 3, 4], [2]], [[3], [3], [3, 4]], pad_id=0)  # pair lengths 2, 4, 3
    pieces = length_grouped(batch, size=2, unit=2)
    assert [idx.tolist() for idx, _ in pieces] == [[2, 3], [4, 5], [0, 1]]
    with pytest.raises(ValueError, match="2-row units"):
        length_grouped(batch, size=3, unit=2)


def test_even_spans_cover_the_rows_in_order_with_sizes_one_apart():
    from common.batch import even_spans
    assert even_spans(10, 3) == [(0, 0, 3), (1, 3, 6), (2, 6, 10)]
    assert even_spans(2, 4) == [(1, 0, 1), (3, 1, 2)]  # empty parts are left out
    assert even_spans(0, 2) == []


def test_a_shipped_shard_carries_its_own_rows_only(ray_local):
    """A row slice is a view, and pickling a view writes its whole storage: each rank would receive the batch."""
    import pickle

    import ray

    from common.batch import shards
    from common.remote import ship
    batch = {"input_ids": torch.arange(64 * 100).view(64, 100), "mask": torch.ones(64, 100, dtype=torch.bool)}
    assert len(pickle.dumps(split_batch(batch, 8)[0])) > 0.9 * len(pickle.dumps(batch))  # why compact exists
    assert len(pickle.dumps(shards(batch, 8)[0])) < 0.2 * len(pickle.dumps(batch))
    got = ray.get(ship(batch, 4).refs[1])
    assert torch.equal(got["input_ids"], batch["input_ids"][16:32])
    assert got["input_ids"].untyped_storage().nbytes() == got["input_ids"].nbytes
