"""Rewards: the reward model's training loss, and shaping added to a sample's reward (DAPO's overlong penalty)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-log sigmoid(s_c - s_r), mean over pairs (Bradley & Terry 1952; Ouyang et al. 2022). Inputs (B,) scores."""
    diff = chosen_scores.float() - rejected_scores.float()
    return -F.logsigmoid(diff).mean(), {"rm/accuracy": (diff > 0).float().mean().detach(),
                                        "rm/margin": diff.mean().detach()}


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each sample's reward: lengths (B,)
    completion tokens -> (B,) fp32, with L_max = max_len (the budget) and L_cache = buffer:

        R_length(y) = 0                                     if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                    = -1                                    if |y| > L_max          (times `penalty`)

    A completion cut at the budget loses `penalty`; one a little shorter, a fraction of it; buffer 0 = off."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1.0)
