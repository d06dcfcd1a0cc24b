"""Reward-model training loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-log sigmoid(s_c - s_r), mean over pairs (Bradley & Terry 1952; Ouyang et al. 2022). Inputs (B,) scores."""
    diff = chosen_scores.float() - rejected_scores.float()
    return -F.logsigmoid(diff).mean(), {"rm/accuracy": (diff > 0).float().mean().detach(),
                                        "rm/margin": diff.mean().detach()}
