"""pass@k (Chen et al. 2021) against values computed by hand from the binomial formula."""
import pytest
import torch

from algorithms.evaluation import pass_at_k, pass_at_k_levels


def test_pass_at_k_hand_computed():
    correct = torch.tensor([0, 1, 2, 5])
    # n=5: pass@1 = c/5; pass@2 = 1 - C(5-c,2)/C(5,2) = 1 - {10, 6, 3, 0}/10
    assert pass_at_k(correct, 5, 1).tolist() == pytest.approx([0.0, 0.2, 0.4, 1.0])
    assert pass_at_k(correct, 5, 2).tolist() == pytest.approx([0.0, 0.4, 0.7, 1.0])
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210
    assert pass_at_k(torch.tensor([3]), 10, 4).item() == pytest.approx(1 - 35 / 210)
    assert pass_at_k(torch.tensor([1]), 4, 4).item() == 1.0  # n - c < k: some draw holds the correct one


def test_pass_at_k_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.tensor([1]), 4, 5)
    with pytest.raises(ValueError, match="correct counts"):
        pass_at_k(torch.tensor([5]), 4, 1)


def test_levels():
    assert pass_at_k_levels(1) == [1] and pass_at_k_levels(8) == [1, 2, 4, 8] and pass_at_k_levels(6) == [1, 2, 4, 6]
