"""Hand-computed checks of log-probs, masked reductions, aggregation modes and KL estimators."""
import math
import subprocess
import sys

import pytest
import torch

from algorithms.kl import kl_estimate
from algorithms.logprobs import entropy_from_logits, logprobs_and_entropy, token_logprobs
from algorithms.masked import aggregate_loss, masked_mean, masked_var, masked_whiten
from tests.helpers import ROOT


def test_importable_without_ray_vllm_deepspeed():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('ray', 'vllm', 'deepspeed'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import algorithms.logprobs, algorithms.masked, algorithms.kl, algorithms.advantages\n"
            "import algorithms.ppo, algorithms.dpo, algorithms.reward, algorithms.sft, algorithms.estimators\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_token_logprobs_matches_log_softmax_and_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # softmax rows: [1/4, 3/4], [1/2, 1/2]
    labels = torch.tensor([[1, 0]])
    got = token_logprobs(logits, labels)
    assert torch.allclose(got, torch.tensor([[math.log(0.75), math.log(0.5)]]))
    big = torch.randn(3, 700, 11)  # crosses the chunk boundary (1024 rows)
    lab = torch.randint(0, 11, (3, 700))
    ref = torch.log_softmax(big, -1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(big, lab), ref, atol=1e-6)
    # at a temperature: the log-probs of softmax(logits / T), the distribution sampled from
    tempered = torch.tensor([[math.log(0.9), math.log(0.5)]])  # softmax([0, 2 log 3]) = [1/10, 9/10]
    assert torch.allclose(token_logprobs(logits, labels, temperature=0.5), tempered)


def test_token_logprobs_of_bf16_logits_is_fp32_and_accurate():
    logits = torch.randn(2, 5, 300).to(torch.bfloat16)
    labels = torch.randint(0, 300, (2, 5))
    got = token_logprobs(logits, labels)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-5)


def test_entropy_uniform_and_peaked():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([[math.log(4.0), 0.0]]), atol=1e-6)


X = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0]])
M = torch.tensor([[True, True, True, False], [True, True, False, False]])


def test_masked_mean_ignores_masked_values():
    assert masked_mean(X, M).item() == pytest.approx(15 / 5)
    assert torch.allclose(masked_mean(X, M, dim=1), torch.tensor([2.0, 4.5]))
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var_is_unbiased():
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert masked_var(X, M).item() == pytest.approx(vals.var(unbiased=True).item())
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(vals.var(unbiased=False).item())


def test_masked_whiten_zero_mean_unit_std_and_zero_outside():
    w = masked_whiten(X, M)
    assert masked_mean(w, M).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(w, M).item() == pytest.approx(1.0, abs=1e-5)
    assert w[0, 3] == 0 and w[1, 2] == 0


def test_aggregation_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 6.0, 100.0, 100.0]])
    assert aggregate_loss(loss, M, "token-mean").item() == pytest.approx(16 / 5)
    assert aggregate_loss(loss, M, "seq-mean-token-mean").item() == pytest.approx((2.0 + 5.0) / 2)
    assert aggregate_loss(loss, M, "seq-mean-token-sum").item() == pytest.approx((6.0 + 10.0) / 2)
    assert aggregate_loss(loss, M, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((6 / 8 + 10 / 8) / 2)
    with pytest.raises(ValueError, match="needs max_len"):  # never the micro-batch's width T
        aggregate_loss(loss, M, "seq-mean-token-sum-norm")
    assert aggregate_loss(loss, M, "token-mean", normalizer=10).item() == pytest.approx(16 / 10)
    with pytest.raises(ValueError, match="valid modes: token-mean"):
        aggregate_loss(loss, M, "mean")


def test_kl_estimators_hand_computed():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([[math.log(2), -math.log(2)]]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([[0.5 * math.log(2) ** 2] * 2]))
    # k3 = q/p - 1 - log(q/p)
    assert torch.allclose(kl_estimate(logp, ref, "k3"),
                          torch.tensor([[0.5 - 1 + math.log(2), 2 - 1 - math.log(2)]]))
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_k3_plus_has_k3s_value_and_k2s_gradient():
    """k2's gradient is (log p - log q) grad log p (the reverse KL's, in expectation); k3's is (1 - q/p) grad log p
    (the forward KL's); k3+ reports k3 and back-propagates k2."""
    ref = torch.tensor([[-1.0, -2.0, -0.5]])
    grads = {}
    for kind in ("k2", "k3", "k3+"):
        logp = torch.tensor([[-0.5, -2.5, -0.5]], requires_grad=True)
        value = kl_estimate(logp, ref, kind)
        value.sum().backward()
        grads[kind] = (value.detach(), logp.grad)
    diff = torch.tensor([[0.5, -0.5, 0.0]])
    assert torch.allclose(grads["k2"][1], diff)  # d/dlogp 1/2 diff^2
    assert torch.allclose(grads["k3"][1], 1 - torch.exp(-diff))  # d/dlogp (e^-diff - 1 + diff)
    assert torch.equal(grads["k3+"][0], grads["k3"][0]) and torch.allclose(grads["k3+"][1], grads["k2"][1])


def test_k3_is_clamped_not_inf():
    logp = torch.tensor([[-100.0, 0.0]])
    ref = torch.tensor([[0.0, -100.0]])
    out = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(out).all() and out.max().item() == 10.0


def test_config_accepts_exactly_the_kl_estimators():
    from algorithms.kl import KL_ESTIMATORS
    from rlhf.config import KL_ESTIMATORS as accepted
    assert accepted == KL_ESTIMATORS


def test_logprobs_and_entropy_in_one_pass_equal_the_two_functions():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2500, 300, generator=g) * 3).requires_grad_()  # more rows than one chunk
    labels = torch.randint(0, 300, (2500,), generator=g)
    logp, ent = logprobs_and_entropy(logits, labels)
    assert torch.allclose(logp, token_logprobs(logits, labels), atol=1e-5)
    assert torch.allclose(ent, entropy_from_logits(logits), atol=1e-4) and not ent.requires_grad
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (expected,) = torch.autograd.grad(token_logprobs(logits, labels).sum(), logits)
    assert torch.allclose(grad, expected, atol=1e-6)
    hot_logp, hot_ent = logprobs_and_entropy(logits, labels, temperature=0.7)
    assert torch.allclose(hot_logp, token_logprobs(logits / 0.7, labels), atol=1e-5)
    assert torch.allclose(hot_ent, entropy_from_logits(logits / 0.7), atol=1e-4)
    assert (hot_ent < ent).float().mean() > 0.9  # a temperature below 1 sharpens
