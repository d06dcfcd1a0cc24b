"""KL(pi || ref) estimators per token, from sampled-token log-probs (Schulman, "Approximating KL divergence", 2020)."""
from __future__ import annotations

import torch

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps exp() finite in fp32 and bf16
_K3_CLAMP = 10.0  # bound one token's k3 so a single outlier cannot dominate the penalty
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """logprobs, ref_logprobs (B, T) -> per-token KL estimate (B, T).

    k1 = log p - log q                        (unbiased, high variance, can be negative)
    k2 = 1/2 (log p - log q)^2                (biased, low variance)
    k3 = exp(log q - log p) - 1 - (log q - log p)   (unbiased, always >= 0, low variance; the GRPO paper's choice)
    k3+ = k3's value with k2's gradient (straight-through: k3 + k2 - stop_grad(k2))

    As a loss term on tokens sampled from p (kl_in_reward=false), the gradients in expectation are:
    k1: E_p[grad log p] = 0, no KL gradient at all; k2: E_p[(log p - log q) grad log p] = grad KL(p || q), the
    reverse KL the penalty means; k3: E_p[(1 - q/p) grad log p] = grad KL(q || p), the *forward* KL, not the one
    whose value it estimates; k3+: k3's low-variance value in the logs, k2's gradient (grad KL(p || q)).
    For k3 the log-ratio is clamped to +-20 and the result to [-10, 10] against overflow.
    """
    diff = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "k3+"):
        r = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = (torch.exp(r) - 1 - r).clamp(-_K3_CLAMP, _K3_CLAMP)
        if kind == "k3":
            return k3
        k2 = 0.5 * diff.square()
        return k3.detach() + k2 - k2.detach()
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")
