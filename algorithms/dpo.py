"""Direct preference optimisation losses on summed per-sequence log-probs."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_tokens: Optional[torch.Tensor] = None,
             rejected_tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """All inputs (B,): log-probs summed over each completion's tokens; `*_tokens` (B,) their token counts.

    h = (pi_c - ref_c) - (pi_r - ref_r)
    sigmoid: -(1-eps) logsigmoid(beta h) - eps logsigmoid(-beta h)   (Rafailov et al. 2023; eps: conservative DPO)
    ipo:     (h - 1/(2 beta))^2 with each log-ratio divided by its completion's token count (Azar et al. 2023 on
             length-normalised log-probs, as TRL does), so the loss does not grow with the completions' length
    hinge:   relu(1 - beta h)                                          (SLiC, Zhao et al. 2023)
    label_smoothing applies to sigmoid only. Metrics: implicit rewards beta*(pi - ref) (summed log-probs),
    reward accuracy (chosen > rejected) and margin.
    """
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to the sigmoid loss only, not {loss_type!r}")
    h = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs chosen_tokens and rejected_tokens (length normalisation)")
        h = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)).square()
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    return losses.mean(), {
        "dpo/reward_chosen": chosen_reward.mean(), "dpo/reward_rejected": rejected_reward.mean(),
        "dpo/reward_accuracy": (chosen_reward > rejected_reward).float().mean(),
        "dpo/reward_margin": (chosen_reward - rejected_reward).mean(),
    }


def dpo_objective(logps: torch.Tensor, ref_logps: torch.Tensor, tokens: torch.Tensor, beta: float = 0.1,
                  loss_type: str = "sigmoid", label_smoothing: float = 0.0, nll_coef: float = 0.0,
                  normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """DPO on interleaved pairs: `logps`, `ref_logps`, `tokens` (2P,) with chosen at even rows, rejected at odd (the
    policy's and the reference's summed completion log-probs, the completions' token counts).

    loss = dpo_loss + nll_coef * the chosen completions' per-token NLL (keeps the chosen answer likely, where plain
    DPO may lower both sides; RPO, Pang et al. 2024), a mean over the P pairs; with `normalizer` (the mini-batch's
    sequence count, when it spans several micro-batches) scaled by 2P / normalizer so the mini-batch's micro-batch
    losses add up to its mean."""
    loss, metrics = dpo_loss(logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], beta=beta,
                             loss_type=loss_type, label_smoothing=label_smoothing, chosen_tokens=tokens[0::2],
                             rejected_tokens=tokens[1::2])
    if nll_coef > 0:
        nll = (-logps[0::2] / tokens[0::2].clamp(min=1)).mean()
        loss = loss + nll_coef * nll
        metrics["dpo/chosen_nll"] = nll.detach()
    return (loss if normalizer is None else loss * len(logps) / normalizer), metrics
