"""PPO-family losses: the policy loss (a surrogate from algorithms.policy_losses, with dual clip and truncated
importance sampling) and the clipped value loss."""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.masked import aggregate_loss, masked_mean
from algorithms.policy_losses import LOG_RATIO_CLAMP, POLICY_LOSSES


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None,
                rollout_logprobs: Optional[torch.Tensor] = None, tis_cap: Optional[float] = None,
                agg: str = "token-mean", normalizer: Optional[float] = None,
                max_len: Optional[int] = None, surrogate: str = "clip",
                tis_mask: Optional[tuple[float, float]] = None, tis_level: str = "token") -> tuple[torch.Tensor, dict]:
    """The policy loss, all inputs (B, T), mask bool: `surrogate` names the per-token loss in
    algorithms.policy_losses.POLICY_LOSSES (clip = PPO's clipped ratio, Schulman et al. 2017, with DAPO's asymmetric
    "clip-higher" range, Yu et al. 2025; gspo, gspo_token, cispo).

    dual_clip = c > 1 caps the clip surrogate's loss of negative-advantage tokens at -c A (Ye et al. 2020).
    rollout_logprobs + tis_cap weight each token by min(pi_old / pi_rollout, tis_cap), the truncated importance
    sampling fix for the vLLM-vs-trainer mismatch (Yao et al. 2025) and for samples from older weights
    (asynchronous RL); `tis_mask` = (low, high) zeroes the tokens whose pi_old / pi_rollout falls outside [low, high]
    (IcePop; without tis_cap the others keep the plain ratio as weight); `tis_level` = "sequence" caps and masks one
    weight per sequence instead (see behaviour_weight). `normalizer`, `max_len`: see aggregate_loss.
    Returns (loss, metrics with the clipped fraction, approximate KL to pi_old and mean token ratio, and the shares
    of tokens capped and masked by the importance weight).
    """
    if surrogate not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {surrogate!r}; valid: {', '.join(POLICY_LOSSES)}")
    loss_mat, clipped = POLICY_LOSSES[surrogate](logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    if dual_clip is not None:
        if dual_clip <= 1 or surrogate != "clip":
            raise ValueError(f"dual_clip must be > 1 and is for the clip surrogate; got {dual_clip} with {surrogate}")
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -advantages * dual_clip), loss_mat)
    metrics = {}
    if rollout_logprobs is not None and (tis_cap is not None or tis_mask is not None):
        weight, metrics = behaviour_weight(old_logprobs, rollout_logprobs, mask, tis_cap, tis_mask, tis_level)
        loss_mat = loss_mat * weight
    loss = aggregate_loss(loss_mat, mask, agg, normalizer=normalizer, max_len=max_len)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    metrics.update({
        "policy/clip_frac": masked_mean(clipped.float(), mask),
        "policy/approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
        "policy/ratio_mean": masked_mean(torch.exp(log_ratio), mask),
    })
    return loss, metrics


def behaviour_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     cap: Optional[float], bounds: Optional[tuple[float, float]],
                     level: str = "token") -> tuple[torch.Tensor, dict]:
    """(B, T) detached importance weight for pi_old over the policy that sampled it: the ratio capped at `cap`, and
    zero where the ratio is outside `bounds`; with the shares of tokens capped and masked. `level` "token": each
    token's own ratio; "sequence": one ratio per row, the product over its masked tokens
    exp(sum_t (old - rollout)), given to every token of the row (sequence-level importance sampling, as verl's
    rollout correction and GSPO weigh whole responses)."""
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown importance-weight level {level!r}; valid: token, sequence")
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP))
    weight = ratio if cap is None else ratio.clamp(max=cap)
    metrics = {"policy/tis_capped_frac": masked_mean((ratio > cap).float(), mask) if cap is not None
               else torch.zeros(())}
    if bounds is not None:
        outside = (ratio < bounds[0]) | (ratio > bounds[1])
        weight = weight.masked_fill(outside, 0.0)
        metrics["policy/tis_masked_frac"] = masked_mean(outside.float(), mask)
    return weight, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: Optional[float] = 0.2, normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (PPO2 baselines): 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2),
    token-mean over mask. All inputs (B, T). clip=None disables clipping."""
    err = (values - returns).square()
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped_values - returns).square()
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).float(), mask)
    else:
        loss_mat, clip_frac = 0.5 * err, torch.zeros(())
    loss = aggregate_loss(loss_mat, mask, "token-mean", normalizer=normalizer)
    return loss, {"critic/clip_frac": clip_frac.detach(), "critic/values_mean": masked_mean(values, mask).detach()}
