"""Routing statistics of a mixture of experts (algorithms/moe.py), against transformers' own load-balancing loss and
hand-made routes."""
import pytest
import torch

from algorithms.moe import expert_load, load_balancing_loss, load_imbalance, router_agreement


def test_the_load_balancing_loss_is_transformers_own_and_ignores_padding():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    torch.manual_seed(0)
    logits, mask = torch.randn(3, 40, 8), (torch.rand(40) > 0.3).long()
    assert float(load_balancing_loss(logits, 2, mask)) == pytest.approx(
        float(load_balancing_loss_func(tuple(logits), 8, 2, mask.view(4, 10))), rel=1e-5)
    assert float(load_balancing_loss(logits, 2)) == pytest.approx(float(load_balancing_loss_func(tuple(logits), 8, 2)))
    padded = torch.cat([logits, 50 * torch.randn(3, 10, 8)], dim=1)  # wild logits on padding change nothing
    assert float(load_balancing_loss(padded, 2, torch.cat([mask, torch.zeros(10, dtype=torch.long)]))) == \
        pytest.approx(float(load_balancing_loss(logits, 2, mask)), rel=1e-6)
    assert float(load_balancing_loss(torch.zeros(2, 16, 4), 2)) == pytest.approx(2.0)  # even: top_k
    skewed = torch.zeros(2, 16, 4)
    skewed[..., 0] = 5.0
    assert float(load_balancing_loss(skewed, 2)) > 2.5
    logits.requires_grad_(True)
    load_balancing_loss(logits, 2).backward()
    assert logits.grad.abs().sum() > 0  # through the router probabilities


def test_expert_load_imbalance_and_agreement_on_hand_made_routes():
    even = torch.tensor([[[0, 1], [2, 3]]])  # 1 layer, 2 tokens, top-2 over 4 experts
    assert torch.allclose(expert_load(even, 4), torch.full((1, 4), 0.25)) and load_imbalance(expert_load(even, 4)) == 1
    crowded = torch.tensor([[[0, 1], [0, 2]]])
    assert load_imbalance(expert_load(crowded, 4)) == pytest.approx(2.0)  # expert 0 took half of 4 slots: 2x even
    assert load_imbalance(expert_load(crowded, 4, torch.tensor([1, 0]))) == pytest.approx(2.0)  # (token 1 padding)
    swapped = torch.tensor([[[1, 0], [3, 2]]])
    assert router_agreement(even, swapped) == 1.0  # the same sets in another order
    assert router_agreement(even, crowded) == 0.5 and router_agreement(even, crowded, torch.tensor([1, 0])) == 1.0


def test_replayed_weights_are_the_routers_own_where_it_would_choose_the_same_experts():
    from algorithms.moe import replayed_weights
    torch.manual_seed(0)
    logits = torch.randn(6, 8, requires_grad=True)
    top = logits.softmax(-1).topk(2, -1)
    own = replayed_weights(logits, top.indices)
    assert torch.allclose(own, top.values / top.values.sum(-1, keepdim=True))
    assert torch.allclose(replayed_weights(logits, top.indices, normalize=False), top.values)
    other = (top.indices + 3) % 8  # experts the router would not choose: still its probabilities there
    forced = replayed_weights(logits, other)
    assert torch.allclose(forced.sum(-1), torch.ones(6)) and not torch.allclose(forced, own)
    forced[:, 0].sum().backward()
    assert logits.grad.abs().sum() > 0  # the router learns through the replayed experts' weights


def test_agreement_counts_compare_sets_of_experts_over_the_valid_tokens():
    from algorithms.moe import agreement_counts
    own = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    given = torch.tensor([[1, 0], [2, 1], [1, 2], [0, 3]], dtype=torch.uint8)
    same, seen = agreement_counts(own, given, torch.tensor([True, True, True, False]))
    assert (int(same), int(seen)) == (2, 3)
