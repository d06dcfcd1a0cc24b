"""The RL algorithms as data: `ESTIMATORS[algorithm.name]` turns a rollout's outcome rewards (and, where used, the
per-token KL to the reference and the critic's values) into token-level advantages, with that algorithm's own
reward shaping. The controller looks the name up once and holds no per-algorithm branches.

Shapes: rewards (B,) outcome per sequence, B = prompts * G with a prompt's G samples adjacent; mask (B, T) bool
over completion tokens; kl, values, teacher_kl (B, T). Every estimator returns (advantages (B, T) zero outside the mask,
returns (B, T) for the critic or None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from algorithms import advantages as adv
from algorithms.masked import masked_whiten


@dataclass(frozen=True)
class EstimatorInputs:
    rewards: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) bool
    group_size: int  # G, samples per prompt
    kl: Optional[torch.Tensor] = None  # (B, T) KL(pi || ref) estimate per token, when the penalty is in the reward
    kl_coef: float = 0.0
    values: Optional[torch.Tensor] = None  # (B, T) the critic's values (ppo)
    gamma: float = 1.0
    lam: float = 0.95
    scale_by_std: bool = True  # grpo; False = Dr. GRPO
    teacher_kl: Optional[torch.Tensor] = None  # (B, T) log pi(y_t) - log pi_teacher(y_t) per sampled token (opd)
    task_coef: float = 0.0  # opd: weight of the task reward's GRPO advantage beside the teacher's signal


Result = tuple[torch.Tensor, Optional[torch.Tensor]]


def _sequence_shaped(x: EstimatorInputs) -> torch.Tensor:
    """Outcome reward minus kl_coef x the sequence's summed KL (the RLOO paper's sequence-level penalty, sec. 3)."""
    if x.kl is None:
        return x.rewards.float()
    return x.rewards.float() - x.kl_coef * (x.kl * x.mask).sum(-1)


def grpo(x: EstimatorInputs) -> Result:
    """(r - group mean) / group std, the same value on every token of the sequence (Shao et al. 2024)."""
    return adv.grpo(_sequence_shaped(x), x.group_size, x.scale_by_std)[:, None] * x.mask, None


def rloo(x: EstimatorInputs) -> Result:
    """r minus the mean of the other G - 1 rewards of the group, on every token (Ahmadian et al. 2024)."""
    return adv.rloo(_sequence_shaped(x), x.group_size)[:, None] * x.mask, None


def reinforce_pp(x: EstimatorInputs) -> Result:
    """REINFORCE++ (Hu 2025): per-token KL in the token rewards, returns-to-go, whitened over the batch; with G > 1
    the group mean is subtracted first (REINFORCE++-baseline)."""
    group = x.group_size if x.group_size > 1 else None
    return adv.reinforce_pp(x.rewards, x.mask, x.kl, x.kl_coef, x.gamma, group_size=group), None


def ppo(x: EstimatorInputs) -> Result:
    """Outcome reward on the last token minus per-token KL, GAE on the critic's values (Schulman et al. 2016),
    advantages whitened over the batch; returns are the critic's targets."""
    if x.values is None:
        raise ValueError("ppo's estimator needs the critic's values")
    token_rewards = adv.last_token_mask(x.mask).float() * x.rewards.float()[:, None]
    if x.kl is not None:
        token_rewards = token_rewards - x.kl_coef * x.kl * x.mask
    advantages, returns = adv.gae(token_rewards, x.values, x.mask, x.gamma, x.lam)
    return masked_whiten(advantages, x.mask), returns


def opd(x: EstimatorInputs) -> Result:
    """On-policy distillation (Agarwal et al. 2024; Lu and Thinking Machines 2025): the student's own samples, each
    token's advantage the negative reverse-KL estimate -(log pi(y_t) - log pi_teacher(y_t)), no discount, no
    baseline; plus task_coef x the task reward's GRPO advantage (group-normalised) where the rewards differ."""
    if x.teacher_kl is None:
        raise ValueError("opd's estimator needs the teacher's log-probs (teacher_kl)")
    advantages = -x.teacher_kl * x.mask
    if x.task_coef:
        advantages = advantages + x.task_coef * adv.grpo(x.rewards.float(), x.group_size, x.scale_by_std)[:, None] \
            * x.mask
    return advantages, None


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[EstimatorInputs], Result]
    needs_critic: bool = False  # the controller starts a critic and passes its values
    min_group_size: int = 1  # below this every advantage would be 0 (a group compares its own samples)
    from_rewards: bool = True  # the rewards drive the advantages (opd: the teacher does, the task only by task_coef)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, min_group_size=2),
    "rloo": Estimator(rloo, min_group_size=2),
    "reinforce_pp": Estimator(reinforce_pp),
    "ppo": Estimator(ppo, needs_critic=True),
    "opd": Estimator(opd, from_rewards=False),
}


def estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]
