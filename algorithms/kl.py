"""KL(pi || ref) estimators per token, from sampled-token log-probs (Schulman, "Approximating KL divergence", 2020)."""
from __future__ import annotations

import torch

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps exp() finite in fp32 and bf16
_K3_CLAMP = 10.0  # bound one token's k3 so a single outlier cannot dominate the penalty


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """logprobs, ref_logprobs (B, T) -> per-token KL estimate (B, T).

    k1 = log p - log q                        (unbiased, high variance, can be negative)
    k2 = 1/2 (log p - log q)^2                (biased, low variance; its gradient is the true KL gradient)
    k3 = exp(log q - log p) - 1 - (log q - log p)   (unbiased, always >= 0, low variance; the GRPO paper's choice)
    For k3 the log-ratio is clamped to +-20 and the result to [-10, 10] against overflow.
    """
    diff = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        r = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(r) - 1 - r).clamp(-_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: k1, k2, k3")
