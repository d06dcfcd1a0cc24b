"""The policy update's whole objective for one micro-batch: the surrogate (algorithms/ppo.py), the KL to the
reference as a loss term, and what the update reports about the rollout it trains on. The trainer's loss is one call
of `rl_objective`."""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.kl import kl_estimate
from algorithms.masked import aggregate_loss, masked_mean
from algorithms.ppo import policy_loss


def rl_objective(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 entropy: torch.Tensor, *, ref_logprobs: Optional[torch.Tensor] = None,
                 rollout_logprobs: Optional[torch.Tensor] = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                 agg: str = "token-mean", normalizer: Optional[float] = None, max_len: Optional[int] = None,
                 **surrogate) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of one micro-batch; every tensor (B, T) over the completion tokens, `mask` bool.

    loss = policy_loss(logprobs, old_logprobs, advantages; `surrogate`: clip_low, clip_high, dual_clip, tis_cap,
    tis_mask, tis_level, surrogate) + kl_coef * agg(KL(pi || ref)) where `ref_logprobs` are given (the KL as a loss
    term, GRPO's form; as a reward penalty it is in the advantages instead and no ref_logprobs come here).
    `agg`, `normalizer`, `max_len`: algorithms/masked.py's aggregate_loss, the same for both terms.

    Metrics beside policy_loss's: policy/kl (pi to ref), policy/entropy, and the rollout's own checks from the old
    log-probs: rollout/logprob_diff (mean |old - engine|, the engine/trainer agreement) and rollout/kl (old to ref).
    """
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs=rollout_logprobs,
                                agg=agg, normalizer=normalizer, max_len=max_len, **surrogate)
    if rollout_logprobs is not None:
        metrics["rollout/logprob_diff"] = masked_mean((old_logprobs - rollout_logprobs).abs(), mask)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("a KL loss term (kl_coef > 0) needs ref_logprobs")
    if ref_logprobs is not None:
        metrics["rollout/kl"] = masked_mean(kl_estimate(old_logprobs, ref_logprobs, kl_estimator), mask)
        if kl_coef > 0:
            kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
            loss = loss + kl_coef * aggregate_loss(kl, mask, agg, normalizer=normalizer, max_len=max_len)
            metrics["policy/kl"] = masked_mean(kl, mask).detach()
    metrics["policy/entropy"] = masked_mean(entropy, mask)
    return loss, metrics
