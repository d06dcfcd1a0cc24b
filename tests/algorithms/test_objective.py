"""The RL objective as one function (algorithms/objective.py) and DPO's (algorithms/dpo.py): their terms against the
pieces they are made of, by hand."""
import pytest
import torch

from algorithms.dpo import dpo_loss, dpo_objective
from algorithms.kl import kl_estimate
from algorithms.masked import aggregate_loss, masked_mean
from algorithms.objective import rl_objective
from algorithms.ppo import policy_loss


def _rollout(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g) - 0.1
    old = logp + 0.05 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    return logp, old, torch.randn(3, 1, generator=g).expand(3, 5), mask, torch.rand(3, 5, generator=g)


def test_the_objective_adds_the_kl_term_to_the_surrogate_and_reports_the_rollout_checks():
    logp, old, adv, mask, entropy = _rollout()
    ref, engine = logp - 0.2, old + 0.01
    loss, m = rl_objective(logp, old, adv, mask, entropy, ref_logprobs=ref, rollout_logprobs=engine, kl_coef=0.5,
                           kl_estimator="k2", agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    surrogate, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, rollout_logprobs=engine,
                               agg="seq-mean-token-mean")
    kl = 0.5 * 0.2 ** 2  # k2 of a constant log-ratio 0.2, on every token
    assert loss.item() == pytest.approx(surrogate.item() + 0.5 * kl, rel=1e-5)
    assert m["policy/kl"].item() == pytest.approx(kl, rel=1e-5)
    assert m["rollout/kl"].item() == pytest.approx(masked_mean(kl_estimate(old, ref, "k2"), mask).item())
    assert m["rollout/logprob_diff"].item() == pytest.approx(0.01, rel=1e-4)
    assert m["policy/entropy"].item() == pytest.approx(masked_mean(entropy, mask).item())


def test_without_a_reference_there_is_no_kl_term_and_asking_for_one_is_refused():
    logp, old, adv, mask, entropy = _rollout(1)
    loss, m = rl_objective(logp, old, adv, mask, entropy)
    assert loss.item() == pytest.approx(policy_loss(logp, old, adv, mask)[0].item())
    assert "policy/kl" not in m and "rollout/kl" not in m and "rollout/logprob_diff" not in m
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_objective(logp, old, adv, mask, entropy, kl_coef=0.1)


def test_the_kl_term_is_aggregated_as_the_surrogate_is():
    logp, old, adv, mask, entropy = _rollout(2)
    ref = logp.detach() - torch.linspace(0, 1, 5)  # a log-ratio that grows along the row
    args = dict(ref_logprobs=ref, kl_coef=1.0, kl_estimator="k1", agg="seq-mean-token-sum-norm", max_len=5,
                normalizer=4.0)
    with_kl, _ = rl_objective(logp, old, adv, mask, entropy, **args)
    without, _ = rl_objective(logp, old, adv, mask, entropy, agg="seq-mean-token-sum-norm", max_len=5, normalizer=4.0)
    expected = aggregate_loss(logp - ref, mask, "seq-mean-token-sum-norm", normalizer=4.0, max_len=5)
    assert (with_kl - without).item() == pytest.approx(expected.item(), rel=1e-5)


def test_dpo_objective_is_the_pair_loss_plus_the_chosen_nll_per_token():
    logps = torch.tensor([-4.0, -9.0, -6.0, -5.0])  # chosen, rejected, chosen, rejected
    ref = torch.tensor([-5.0, -8.0, -6.5, -5.5])
    tokens = torch.tensor([4, 3, 2, 5])
    pair, m0 = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=0.1)
    loss, m = dpo_objective(logps, ref, tokens, beta=0.1, nll_coef=0.5)
    nll = (4.0 / 4 + 6.0 / 2) / 2
    assert m["dpo/chosen_nll"].item() == pytest.approx(nll)
    assert loss.item() == pytest.approx(pair.item() + 0.5 * nll)
    assert m["dpo/reward_accuracy"] == m0["dpo/reward_accuracy"]
    scaled, _ = dpo_objective(logps, ref, tokens, beta=0.1, normalizer=8.0)  # this micro-batch: 4 of 8 sequences
    assert scaled.item() == pytest.approx(pair.item() * 4 / 8)
