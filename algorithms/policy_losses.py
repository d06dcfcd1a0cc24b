"""The policy surrogates `algorithm.policy_loss` picks, as one table: each maps (log-probs, old log-probs,
advantages, mask, clip range) to a per-token loss (B, T) before aggregation, and the tokens it clipped.

    clip        PPO's clipped ratio per token (Schulman et al. 2017; DAPO's asymmetric range)
    gspo        GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its token
                ratios, clipped per sequence; each of the sequence's tokens carries the sequence's loss
    gspo_token  GSPO-token: the sequence's ratio as the value, each token's own gradient and advantage
    cispo       CISPO (MiniMax-M1, 2025): the clipped ratio as a stop-gradient weight on log pi; every token keeps
                its gradient, where PPO's clip zeroes the clipped ones

Inputs are (B, T); `mask` bool (B, T). The aggregation (algorithms.masked.aggregate_loss) is the caller's: GSPO's paper
averages per sequence (`seq-mean-token-mean`), CISPO's over all tokens (`token-mean`).
"""
from __future__ import annotations

from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0
SurrogateFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def clipped_ratio_loss(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per element, and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_clip(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """r_t = pi(y_t) / pi_old(y_t);  L_t = max(-A_t r_t, -A_t clip(r_t, 1 - e_low, 1 + e_high))."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return clipped_ratio_loss(ratio, advantages, clip_low, clip_high)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): log s_i = (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)) over the sequence's masked tokens (GSPO eq. 7)."""
    m = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the sequence's advantage, the mean over its masked tokens (GRPO's are equal along a sequence)."""
    m = mask.to(advantages.dtype)
    return (advantages * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def gspo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """s_i = exp(log s_i);  L_i = max(-A_i s_i, -A_i clip(s_i, 1 - e_low, 1 + e_high))  (GSPO eq. 5), broadcast to
    the sequence's tokens: a per-sequence mean of tokens gives L_i back."""
    s = torch.exp(sequence_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, clipped = clipped_ratio_loss(s, sequence_advantage(advantages, mask), clip_low, clip_high)
    return loss.expand_as(logprobs), clipped.expand_as(mask)


def gspo_token(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)]: the value s_i, the gradient of token t's own log-prob (GSPO eq. 13);
    L_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - e_low, 1 + e_high))."""
    log_s = sequence_log_ratio(logprobs, old_logprobs, mask).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s_token = torch.exp(log_s + logprobs - logprobs.detach())
    return clipped_ratio_loss(s_token, advantages, clip_low, clip_high)


def cispo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """L_t = -sg[clip(r_t, 1 - e_low, 1 + e_high)] A_t log pi(y_t)  (MiniMax-M1 eq. 4): the weight is clipped, never
    the gradient; on unclipped tokens its gradient, -r_t A_t grad log pi, is PPO's."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -weight * advantages * logprobs, weight != ratio


POLICY_LOSSES: dict[str, SurrogateFn] = {"clip": ppo_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}
