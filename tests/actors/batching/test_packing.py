"""Token-budget micro-batches and length-balanced rank shards (actors/batching/packing.py), on hand-made lengths."""
import pytest
import torch

from actors.batching.packing import deal_by_length, micro_batches_needed, token_budget_groups


def padded(lengths, group) -> int:
    return len(group) * max(lengths[i] for i in group)


def test_groups_fit_the_budget_cover_every_row_once_and_keep_long_rows_apart():
    lengths = [30, 5, 12, 28, 6, 7, 31, 5]
    need = micro_batches_needed(lengths, budget=64)
    groups = token_budget_groups(lengths, need)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(padded(lengths, g) <= 64 for g in groups)
    assert need == 3  # longest first: 31 30 (62) | 28 12 (56) | 7 6 5 5 (28); 8 rows of 31 would be 248
    # three micro-batches cut where the costliest is smallest: 31 | 30 28 (60) | 12 7 6 5 5 (60)
    assert groups == [[6], [0, 3], [2, 5, 4, 1, 7]]
    # more micro-batches than needed (another rank needs them): the costliest is split, still every row once
    more = token_budget_groups(lengths, 6)
    assert len(more) == 6 and sorted(i for g in more for i in g) == list(range(8))
    assert max(padded(lengths, g) for g in more) <= max(padded(lengths, g) for g in groups)
    # fewer than needed (a rank has few rows): the budget is exceeded as little as it can be
    two = token_budget_groups(lengths, 2)
    assert len(two) == 2 and max(padded(lengths, g) for g in two) == 93  # 31 30 28 (93) | 12 7 6 5 5 (60)
    with pytest.raises(ValueError):
        token_budget_groups(lengths, 9)


def test_a_row_over_the_budget_is_a_micro_batch_of_its_own():
    assert micro_batches_needed([100, 3, 3], budget=10) == 2
    assert token_budget_groups([100, 3, 3], 2) == [[0], [1, 2]]


def test_dealing_by_length_balances_ranks_and_keeps_each_mini_batch_whole():
    lengths = torch.tensor([40, 1, 2, 39, 3, 38, 4, 37, 10, 11, 12, 13, 50, 51, 52, 53])
    order = deal_by_length(lengths, world_size=2, n_mini=2)
    assert sorted(order.tolist()) == list(range(16))
    shards = order.view(2, 8)  # rank 0's rows, rank 1's rows
    for rank in range(2):
        first, second = shards[rank, :4], shards[rank, 4:]
        assert (first < 8).all() and (second >= 8).all()  # mini-batch 0's rows, then mini-batch 1's
    work = [lengths[s].sum().item() for s in shards]
    assert abs(work[0] - work[1]) <= 10  # contiguous halves would give 164 against 252
    with pytest.raises(ValueError):
        deal_by_length(lengths[:15], 2, 2)


def test_packed_rows_hold_every_real_token_once_and_unpack_to_the_padded_layout():
    from actors.batching.packing import pack_rows, unpack_rows

    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]])
    mask = (ids != 0).long()
    packed, positions, where = pack_rows(ids, mask)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]  # restarts mark each row's start
    out = packed.float().unsqueeze(-1).repeat(1, 1, 2).requires_grad_()  # (1, N, 2), as logits would be
    back = unpack_rows(out, where, 3, 4)
    assert back.shape == (3, 4, 2) and torch.equal(back[..., 0], (ids * mask).float())
    back[1, 0, 1].backward()  # the gradient reaches that token's packed position only
    assert out.grad[0, :, 1].tolist() == [0, 0, 0, 1, 0, 0, 0, 0] and out.grad[..., 0].abs().sum() == 0


def test_a_packed_forward_sees_each_row_as_it_would_padded(tiny_model_dir):
    """transformers builds a block-diagonal causal mask from position ids that restart (sdpa and eager): the packed
    logits equal the padded forward's on every real token, so no row attends to another. (Only without a KV cache:
    with one, transformers ignores the restarts.)"""
    from transformers import AutoModelForCausalLM

    from actors.batching.packing import pack_rows, unpack_rows

    ids = torch.randint(3, 300, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(9)[None] < torch.tensor([9, 2, 5, 7])[:, None]).long()
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).eval()
        padded = model(input_ids=ids, attention_mask=mask).logits
        packed, positions, where = pack_rows(ids, mask)
        got = unpack_rows(model(input_ids=packed, position_ids=positions, use_cache=False).logits, where, 4, 9)
        real = mask.bool()
        assert torch.allclose(got[real], padded[real], atol=1e-5), impl
