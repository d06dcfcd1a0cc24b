"""PPO policy/value losses, DPO, Bradley-Terry and SFT losses on hand-made inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

from algorithms.dpo import dpo_loss
from algorithms.ppo import policy_loss, value_loss
from algorithms.reward import bradley_terry_loss
from algorithms.sft import sft_loss

LOG = math.log


def test_policy_loss_clipping_hand_computed():
    old = torch.zeros(1, 4)
    logp = torch.tensor([[LOG(1.5), LOG(1.5), LOG(0.5), LOG(1.1)]])  # ratios 1.5, 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    # per token: -min(rA, clip(r)A): [-1.3, 1.5, 0.8, -2.2]
    assert loss.item() == pytest.approx((-1.3 + 1.5 + 0.8 - 2.2) / 4)
    assert m["policy/clip_frac"].item() == pytest.approx(2 / 4)


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[LOG(5.0), LOG(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    plain, _ = policy_loss(logp, torch.zeros(1, 2), adv, mask, agg="seq-mean-token-sum")
    dual, _ = policy_loss(logp, torch.zeros(1, 2), adv, mask, dual_clip=3.0, agg="seq-mean-token-sum")
    assert plain.item() == pytest.approx(5.0 - 1.2)
    assert dual.item() == pytest.approx(3.0 - 1.2)
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros(1, 2), adv, mask, dual_clip=0.5)


def test_truncated_importance_sampling_weights():
    old = torch.tensor([[LOG(0.5), LOG(0.5)]])
    rollout = torch.tensor([[LOG(0.25), LOG(0.5)]])  # pi_old/pi_rollout = 2 and 1
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = policy_loss(old, old, adv, mask)
    capped, _ = policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_cap=1.5)
    assert base.item() == pytest.approx(-1.0)
    assert capped.item() == pytest.approx(-(1.5 + 1.0) / 2)


def test_icepop_mask_drops_tokens_whose_ratio_is_out_of_bounds():
    old = torch.tensor([[LOG(0.5), LOG(0.5), LOG(0.5), LOG(0.05)]])
    rollout = torch.tensor([[LOG(0.25), LOG(0.5), LOG(0.05), LOG(0.5)]])  # ratios 2, 1, 10, 0.1
    adv, mask = torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_cap=1.5, tis_mask=(0.5, 5.0))
    assert loss.item() == pytest.approx(-(1.5 + 1.0 + 0.0 + 0.0) / 4)  # 10 and 0.1 masked, 2 capped at 1.5
    assert m["policy/tis_masked_frac"].item() == pytest.approx(0.5)
    assert m["policy/tis_capped_frac"].item() == pytest.approx(0.5)  # 2 and 10 above the cap
    plain, _ = policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_mask=(0.5, 5.0))
    assert plain.item() == pytest.approx(-(2.0 + 1.0) / 4)  # IcePop alone: the in-bounds ratio as the weight


def test_sequence_level_correction_weighs_each_response_by_its_whole_ratio():
    # row 0: token ratios 2 and 1.5 (product 3); row 1: 0.5, then a padding token (ratio 8) that must not count
    old = torch.tensor([[LOG(0.5), LOG(0.3)], [LOG(0.25), LOG(0.4)]])
    rollout = torch.tensor([[LOG(0.25), LOG(0.2)], [LOG(0.5), LOG(0.05)]])
    adv, mask = torch.ones(2, 2), torch.tensor([[True, True], [True, False]])
    capped, m = policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0, tis_level="sequence")
    assert capped.item() == pytest.approx(-(2.0 + 2.0 + 0.5) / 3)  # row 0 capped at 2 on both tokens
    assert m["policy/tis_capped_frac"].item() == pytest.approx(2 / 3)
    masked, m = policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_mask=(0.6, 5.0), tis_level="sequence")
    assert masked.item() == pytest.approx(-(3.0 + 3.0 + 0.0) / 3)  # row 1's 0.5 is out of bounds: dropped whole
    assert m["policy/tis_masked_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="token, sequence"):
        policy_loss(old, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0, tis_level="tokens")


def test_policy_loss_respects_mask_and_gradient_sign():
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, _ = policy_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 50.0]]), mask)
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, 0.5, 0.0]]


def test_value_loss_clipped():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 2, dtype=torch.bool), clip=0.2)
    # token 0: unclipped err 0, clipped value 0.2 -> err 0.64 -> max 0.64; token 1: err 1 both
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    assert m["critic/clip_frac"].item() == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 2, dtype=torch.bool), clip=None)
    assert unclipped.item() == pytest.approx(0.5 * 1.0 / 2)


def test_dpo_sigmoid_matches_reference_formula():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.5])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.5])
    beta = 0.3
    loss, m = dpo_loss(pc, pr, rc, rr, beta)
    expected = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    assert loss.item() == pytest.approx(expected.item())
    assert loss.item() == pytest.approx(-(math.log(1 / (1 + math.exp(-0.3 * 1.5))) +
                                          math.log(1 / (1 + math.exp(-0.3 * -1.0)))) / 2)
    assert m["dpo/reward_accuracy"].item() == 0.5
    assert m["dpo/reward_margin"].item() == pytest.approx(beta * (1.5 - 1.0) / 2)


def test_dpo_label_smoothing_ipo_hinge():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.0, -1.0))  # h = 1
    beta = 0.5
    smooth, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.1)
    z = beta * 1.0
    expected = -0.9 * math.log(1 / (1 + math.exp(-z))) - 0.1 * math.log(1 / (1 + math.exp(z)))
    assert smooth.item() == pytest.approx(expected)
    one = torch.tensor([1.0])
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo", chosen_tokens=one, rejected_tokens=one)
    assert ipo.item() == pytest.approx((1.0 - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo", label_smoothing=0.1)
    hinge, _ = dpo_loss(pc, pr, rc, rr, beta, loss_type="hinge")
    assert hinge.item() == pytest.approx(1 - 0.5)
    with pytest.raises(ValueError, match="valid: sigmoid, ipo, hinge"):
        dpo_loss(pc, pr, rc, rr, beta, loss_type="kto")


def test_ipo_uses_length_normalised_log_probs():
    """A pair whose completions are the same tokens said twice (every log-prob sum doubles, the per-token means
    stay) has the same IPO loss: (h/len - 1/(2 beta))^2 on mean log-ratios, by hand."""
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-2.0, -6.0, -3.0, -4.0))  # per-token over 2 and 4 tokens
    beta = 0.2
    kw = dict(beta=beta, loss_type="ipo")
    short, _ = dpo_loss(pc, pr, rc, rr, chosen_tokens=torch.tensor([2.0]), rejected_tokens=torch.tensor([4.0]), **kw)
    twice, _ = dpo_loss(2 * pc, 2 * pr, 2 * rc, 2 * rr, chosen_tokens=torch.tensor([4.0]),
                        rejected_tokens=torch.tensor([8.0]), **kw)
    h = (-2.0 + 3.0) / 2 - (-6.0 + 4.0) / 4  # 0.5 + 0.5
    assert short.item() == pytest.approx((h - 1 / (2 * beta)) ** 2)
    assert twice.item() == pytest.approx(short.item())
    with pytest.raises(ValueError, match="needs chosen_tokens"):
        dpo_loss(pc, pr, rc, rr, **kw)


def test_bradley_terry():
    loss, m = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((-math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(1)))) / 2)
    assert m["rm/accuracy"].item() == 0.5 and m["rm/margin"].item() == pytest.approx(0.0)


def test_sft_loss_masks_prompt_tokens():
    logits = torch.tensor([[[0.0, LOG(3.0)], [5.0, 5.0], [9.0, 0.0]]])
    labels = torch.tensor([[1, 0, 1]])
    mask = torch.tensor([[False, True, True]])
    loss, m = sft_loss(logits, labels, mask)
    expected = -(LOG(0.5) + (0.0 - math.log(math.exp(9) + 1))) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["sft/tokens"].item() == 2
