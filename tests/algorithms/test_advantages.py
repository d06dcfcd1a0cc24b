"""GAE, GRPO, RLOO and REINFORCE++ on hand-computed inputs."""

import pytest
import torch

from algorithms.advantages import choose_groups, gae, grpo, informative_groups, last_token_mask, reinforce_pp, rloo


def test_gae_hand_computed_with_ragged_mask():
    # Row 0: three valid tokens, reward 1 at the end; row 1: two valid tokens. gamma=0.9, lam=0.5.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0], [1.0, 1.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.3  # value past the last valid token counts as 0, not 9
    d1 = 0.0 + 0.9 * 0.3 - 0.4
    d0 = 0.0 + 0.9 * 0.4 - 0.5
    a2, a1 = d2, d1 + 0.45 * d2
    a0 = d0 + 0.45 * a1
    e1 = 2.0 - 1.5
    e0 = 0.9 * 1.5 - 1.0 + 0.45 * e1
    expected = torch.tensor([[a0, a1, a2, 0.0], [e0, e1, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.allclose(ret, (expected + values) * mask, atol=1e-6)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.7, 0.6]]))
    assert torch.allclose(ret, torch.ones(1, 3))


def test_gae_skips_observation_tokens_between_turns():
    """Multi-turn: model tokens at 1, 2 and 5, 6 (an observation at 3, 4; the prompt at 0). The recursion runs
    over the model tokens as one sequence: turn 1's last token bootstraps from turn 2's first value, not from 0."""
    rewards = torch.tensor([[9.0, 0.0, 0.0, 9.0, 9.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]]).bool()
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    packed, _ = gae(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.2, 0.3, 0.4]]),
                    torch.ones(1, 4, dtype=torch.bool), gamma=0.9, lam=0.5)
    d = [0.9 * 0.2 - 0.1, 0.9 * 0.3 - 0.2, 0.9 * 0.4 - 0.3, 1.0 - 0.4]
    a3 = d[3]
    a2 = d[2] + 0.45 * a3
    a1 = d[1] + 0.45 * a2
    a0 = d[0] + 0.45 * a1
    assert torch.allclose(packed, torch.tensor([[a0, a1, a2, a3]]), atol=1e-6)
    assert torch.allclose(adv, torch.tensor([[0.0, a0, a1, 0.0, 0.0, a2, a3]]), atol=1e-6)
    assert torch.allclose(ret, (adv + values) * mask, atol=1e-6)


def test_grpo_uses_unbiased_std_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    got = grpo(r, group_size=4, eps=0.0)
    s = torch.tensor([1.0, 0.0, 0.0, 1.0]).std(unbiased=True).item()  # 0.5773...
    assert got[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    s2 = torch.tensor([3.0, 1.0, 2.0, 2.0]).std(unbiased=True).item()
    assert got[4:].tolist() == pytest.approx([1 / s2, -1 / s2, 0.0, 0.0])
    assert grpo(r, 4, scale_by_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 1, -1, 0, 0])


def test_equal_rewards_give_zero_not_nan():
    r = torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 0.0])
    for adv in (grpo(r, 3), rloo(r, 3), reinforce_pp(r, torch.ones(6, 2, dtype=torch.bool), group_size=3)):
        assert torch.isfinite(adv).all() and (adv == 0).all()


def test_rloo_leave_one_out():
    got = rloo(torch.tensor([1.0, 0.0, 0.0, 3.0]), group_size=4)
    assert got.tolist() == pytest.approx([1 - 1, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3])


def test_group_size_errors():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="group size >= 2"):
        rloo(torch.zeros(4), 1)


def test_last_token_mask():
    m = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()
    assert last_token_mask(m).tolist() == [[False, False, True, False], [True, False, False, False],
                                           [False, False, False, False]]


def test_reinforce_pp_returns_then_global_whitening():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    kl = torch.tensor([[0.1, 0.2, 5.0], [0.0, 0.3, 0.1]])
    adv = reinforce_pp(rewards, mask, kl=kl, kl_coef=1.0, gamma=1.0)
    # token rewards: row 0 [-0.1, 1-0.2]; row 1 [0, -0.3, -0.1]; returns-to-go:
    returns = torch.tensor([0.7, 0.8, -0.4, -0.4, -0.1])
    expected = (returns - returns.mean()) / returns.std(unbiased=True)
    assert adv[mask].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert adv[0, 2] == 0


def test_reinforce_pp_group_baseline():
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv = reinforce_pp(torch.tensor([1.0, 0.0, 5.0, 5.0]), mask, group_size=2)
    # centred outcomes [0.5, -0.5, 0, 0], then whitened over the batch
    c = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert adv.view(-1).tolist() == pytest.approx((c / c.std(unbiased=True)).tolist(), abs=1e-5)


def test_informative_groups_are_those_with_unequal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5000001])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, True]
    assert informative_groups(rewards, 4).tolist() == [True, True]
    assert informative_groups(torch.tensor([0.3]), 1).tolist() == [False]  # one sample: nothing to compare


def test_choose_groups_takes_informative_groups_first_then_tops_up_in_order():
    signal = torch.tensor([False, True, False, True, True])
    assert choose_groups(signal, 2).tolist() == [1, 3]  # over-sampled: the first two with signal
    assert choose_groups(signal, 4).tolist() == [1, 3, 4, 0]  # too few with signal: the first without fill up
    assert choose_groups(torch.tensor([False, False]), 2).tolist() == [0, 1]
    assert choose_groups(signal, 9).tolist() == [1, 3, 4, 0, 2]  # never more than was generated
