"""Direct preference optimisation losses on summed per-sequence log-probs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """All inputs (B,): log-probs summed over each completion's tokens.

    h = (pi_c - ref_c) - (pi_r - ref_r)
    sigmoid: -(1-eps) logsigmoid(beta h) - eps logsigmoid(-beta h)   (Rafailov et al. 2023; eps: conservative DPO)
    ipo:     (h - 1/(2 beta))^2                                       (Azar et al. 2023)
    hinge:   relu(1 - beta h)                                          (SLiC, Zhao et al. 2023)
    Metrics: implicit rewards beta*(pi - ref), reward accuracy (chosen > rejected) and margin.
    """
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
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
