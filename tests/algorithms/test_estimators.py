"""Each algorithm's entry in the estimator table, with its reward shaping, against values worked out by hand."""
import math

import pytest
import torch

from algorithms.estimators import ESTIMATORS, EstimatorInputs, estimator

# Two prompts x G=2 samples; completions of 2, 1, 2 and 1 tokens.
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.bool)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])
KL = torch.tensor([[0.1, 0.1], [0.4, 9.0], [0.0, 0.0], [0.0, 0.0]])  # 9.0 sits outside the mask


def run(name, **kw):
    return estimator(name).fn(EstimatorInputs(REWARDS, MASK, 2, **kw))


def test_grpo_with_the_kl_penalty_on_the_sequence_reward():
    adv, returns = run("grpo", kl=KL, kl_coef=1.0)
    # shaped rewards: 1 - 0.2 = 0.8 and 0 - 0.4 = -0.4; group 2 stays 0.5, 0.5 (all equal -> 0)
    # group 1: mean 0.2, unbiased std = |0.8 - -0.4| / sqrt(2) = 0.8485
    a = 0.6 / (1.2 / math.sqrt(2) + 1e-6)
    assert torch.allclose(adv, torch.tensor([[a, a], [-a, 0.0], [0.0, 0.0], [0.0, 0.0]]), atol=1e-5)
    assert returns is None


def test_dr_grpo_does_not_divide_by_the_std():
    adv, _ = run("grpo", scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))


def test_rloo_subtracts_the_other_samples_mean():
    adv, _ = run("rloo")
    # G = 2: r_i - r_other = 1 and -1 in group 1, 0 in group 2
    assert torch.allclose(adv, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


def test_reinforce_pp_baseline_then_returns_then_whitening():
    adv, returns = run("reinforce_pp", kl=KL, kl_coef=1.0)
    # baseline: group-centred outcomes 0.5, -0.5, 0, 0 on the last token; token rewards minus KL, returns-to-go:
    # row 0: [-0.1 + (0.5 - 0.1), 0.5 - 0.1] = [0.3, 0.4]; row 1: [-0.5 - 0.4] = [-0.9]; rows 2, 3: 0
    raw = torch.tensor([0.3, 0.4, -0.9, 0.0, 0.0, 0.0])
    white = (raw - raw.mean()) / raw.std()
    want = torch.zeros(4, 2)
    want[MASK] = white
    assert torch.allclose(adv, want, atol=1e-5) and returns is None


def test_ppo_gae_on_the_critics_values():
    values = torch.tensor([[0.5, 0.2], [0.1, 7.0], [0.0, 0.4], [0.3, 7.0]])
    adv, returns = run("ppo", values=values, gamma=1.0, lam=1.0)
    # lambda = gamma = 1: A_t = sum of later rewards - V_t; reward only on the last token
    raw = torch.tensor([[1.0 - 0.5, 1.0 - 0.2], [0.0 - 0.1, 0.0], [0.5 - 0.0, 0.5 - 0.4], [0.5 - 0.3, 0.0]])
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.5, 0.0]]), atol=1e-6)
    flat = raw[MASK]
    want = torch.zeros(4, 2)
    want[MASK] = (flat - flat.mean()) / flat.std()
    assert torch.allclose(adv, want, atol=1e-5)
    with pytest.raises(ValueError, match="needs the critic's values"):
        run("ppo")


def test_the_table_is_what_the_config_accepts():
    from rlhf.config import ALGORITHMS
    assert ALGORITHMS == tuple(ESTIMATORS)
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["ppo"]
    with pytest.raises(ValueError, match="valid: grpo, rloo, reinforce_pp, ppo"):
        estimator("ppo2")


def test_opd_advantage_is_the_negative_teacher_kl_per_token_plus_the_weighted_task_advantage():
    teacher_kl = torch.tensor([[0.5, -0.25], [1.0, 7.0], [0.0, 2.0], [-1.0, 3.0]])  # 7.0 sits outside the mask
    adv, returns = run("opd", teacher_kl=teacher_kl)  # distillation alone: the rewards play no part
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.25], [-1.0, 0.0], [0.0, -2.0], [1.0, 0.0]]))
    assert returns is None
    mixed, _ = run("opd", teacher_kl=teacher_kl, task_coef=0.5, scale_by_std=False)
    # group 1's GRPO advantages +-0.5 (Dr. GRPO), group 2's 0; times 0.5 on every sampled token
    assert torch.allclose(mixed - adv, torch.tensor([[0.25, 0.25], [-0.25, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="teacher"):
        run("opd")
