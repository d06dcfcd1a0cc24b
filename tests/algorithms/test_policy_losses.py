"""The policy surrogates of algorithms.policy_losses (GSPO, GSPO-token, CISPO) on hand-made inputs, their known
identities against PPO's clip, and DAPO's overlong penalty."""
import math

import pytest
import torch

from algorithms.policy_losses import POLICY_LOSSES
from algorithms.ppo import policy_loss
from algorithms.reward import overlong_penalty

LOG = math.log


def grad_of(surrogate: str, logp: torch.Tensor, old, adv, mask, agg: str, **kw) -> torch.Tensor:
    logp = logp.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, agg=agg, surrogate=surrogate, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def test_gspo_clips_the_sequence_ratio_hand_computed():
    # sequence 0: token ratios 2 and 1/2 -> geometric mean 1 (unclipped); sequence 1: 1.21 and 1.21 -> s = 1.21,
    # above 1 + 0.2: clipped to 1.2 with a positive advantage; the padding column is never read
    logp = torch.tensor([[LOG(2.0), LOG(0.5), 0.0], [LOG(1.21), LOG(1.21), 5.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean",
                          surrogate="gspo")
    assert loss.item() == pytest.approx((-1.0 * 1.0 + -2.0 * 1.2) / 2, abs=1e-6)
    assert m["policy/clip_frac"].item() == pytest.approx(0.5)  # sequence 1's two tokens of four
    # the gradient: sequence 0 gets -A s (1/|y|) per token; sequence 1 none (clipped)
    grad = grad_of("gspo", logp, old, adv, mask, "seq-mean-token-mean", clip_low=0.2, clip_high=0.2)
    assert torch.allclose(grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_gspo_on_one_token_sequences_is_ppo_clip():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 1, generator=g) * 0.3, torch.randn(6, 1, generator=g) * 0.3
    adv, mask = torch.randn(6, 1, generator=g), torch.ones(6, 1, dtype=torch.bool)
    for surrogate in ("gspo", "gspo_token"):
        for agg in ("token-mean", "seq-mean-token-mean"):
            got, _ = policy_loss(logp, old, adv, mask, agg=agg, surrogate=surrogate)
            want, _ = policy_loss(logp, old, adv, mask, agg=agg)
            assert got.item() == pytest.approx(want.item(), abs=1e-6)
            assert torch.allclose(grad_of(surrogate, logp, old, adv, mask, agg), grad_of("clip", logp, old, adv, mask,
                                                                                           agg), atol=1e-6)


def test_gspo_token_with_sequence_advantages_is_gspo():
    """With one advantage per sequence (GRPO's), GSPO-token's value and gradient are GSPO's (the paper's eq. 14)."""
    g = torch.Generator().manual_seed(1)
    logp, old = torch.randn(4, 5, generator=g) * 0.1, torch.randn(4, 5, generator=g) * 0.1
    adv = torch.randn(4, 1, generator=g).expand(4, 5).contiguous()
    mask = torch.arange(5) < torch.tensor([[5], [3], [1], [4]])
    kw = dict(clip_low=0.05, clip_high=0.05)  # tight: some sequences clip
    a, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean", surrogate="gspo", **kw)
    b, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean", surrogate="gspo_token", **kw)
    assert a.item() == pytest.approx(b.item(), abs=1e-6)
    ga = grad_of("gspo", logp, old, adv, mask, "seq-mean-token-mean", **kw)
    gb = grad_of("gspo_token", logp, old, adv, mask, "seq-mean-token-mean", **kw)
    assert torch.allclose(ga, gb, atol=1e-6) and ga.abs().sum() > 0


def test_cispo_weights_log_pi_by_the_clipped_ratio_hand_computed():
    logp = torch.tensor([[LOG(0.5), LOG(0.25)]])  # old probs 0.25 and 0.5: ratios 2 and 1/2
    old = torch.tensor([[LOG(0.25), LOG(0.5)]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, surrogate="cispo")
    # weights clip(2) = 1.28, clip(1/2) = 0.8, each a stop-gradient: L = -(1.28 * 1 * log .5 + 0.8 * -1 * log .25) / 2
    assert loss.item() == pytest.approx(-(1.28 * LOG(0.5) - 0.8 * LOG(0.25)) / 2, abs=1e-6)
    assert m["policy/clip_frac"].item() == 1.0
    grad = grad_of("cispo", logp, old, adv, mask, "token-mean", clip_low=0.2, clip_high=0.28)
    assert torch.allclose(grad, torch.tensor([[-1.28 / 2, 0.8 / 2]]), atol=1e-6)  # both tokens keep a gradient
    ppo = grad_of("clip", logp, old, adv, mask, "token-mean", clip_low=0.2, clip_high=0.28)
    assert torch.equal(ppo, torch.zeros(1, 2))  # PPO's clip zeroes both


def test_cispo_gradient_on_unclipped_tokens_is_ppos():
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(3, 4, generator=g) * 0.05  # ratios within 1 +- 0.2: nothing clips
    old, adv = torch.zeros(3, 4), torch.randn(3, 4, generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-sum"):
        assert torch.allclose(grad_of("cispo", logp, old, adv, mask, agg), grad_of("clip", logp, old, adv, mask, agg),
                              atol=1e-6)


def test_surrogate_names_agree_with_the_config_and_unknown_ones_are_refused():
    from rlhf.config import POLICY_LOSSES as accepted
    assert tuple(POLICY_LOSSES) == accepted
    one = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        policy_loss(one, one, one, one.bool(), surrogate="ppo2")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(one, one, one, one.bool(), surrogate="gspo", dual_clip=3.0)


def test_overlong_penalty_ramps_over_the_buffer_hand_computed():
    lengths = torch.tensor([10, 12, 14, 15, 16])  # budget 16, buffer 4: the ramp starts after 12 tokens
    assert overlong_penalty(lengths, max_len=16, buffer=4).tolist() == [0.0, 0.0, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, max_len=16, buffer=4, penalty=0.5).tolist() == [0.0, 0.0, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, max_len=16, buffer=0).tolist() == [0.0] * 5
