"""Advantage estimators: GAE for PPO with a critic, and critic-free group estimators (GRPO, RLOO, REINFORCE++)."""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.masked import masked_whiten


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool (B, T): true only at each row's last true position of `mask` (B, T)."""
    mask = mask.bool()
    return mask & (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016).

    rewards, values (B, T) per token; mask (B, T) bool. delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = delta_t + gamma lam A_{t+1}, with V and A taken as 0 past a row's last valid token. The recursion runs over
    the masked tokens only, in order: in a multi-turn trajectory the observation tokens between the model's turns
    are skipped (the step after a turn's last token is the next turn's first), not treated as the episode's end.
    Returns (advantages, returns = advantages + values), both (B, T) and zero outside the mask.
    """
    # Valid tokens first, in their order (a stable sort), so each row's are contiguous from position 0.
    order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)
    mask_f = torch.gather(mask.float(), 1, order)
    r, v = torch.gather(rewards.float(), 1, order), torch.gather(values.float(), 1, order)
    T = rewards.shape[1]
    packed = torch.zeros_like(r)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    for t in reversed(range(T)):
        next_mask = mask_f[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = v[:, t + 1] * next_mask if t + 1 < T else torch.zeros_like(running)
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = delta + gamma * lam * next_mask * running
        packed[:, t] = running
    advantages = torch.zeros_like(packed).scatter_(1, order, packed * mask_f)
    return advantages, (advantages + values.float()) * mask.float()


def _groups(rewards: torch.Tensor, group_size: int, needs: int = 2) -> torch.Tensor:
    if group_size < needs or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot form groups of {group_size} (need a group size >= "
                         f"{needs} that divides the batch; raise rollout.n_samples)")
    return rewards.float().view(-1, group_size)


def _centered(g: torch.Tensor) -> torch.Tensor:
    """g (N, G) minus its row mean, exactly 0 in rows whose values are all equal (fp32 rounding of the mean would
    otherwise leave ~1e-8 residues that dividing by a ~0 std blows up)."""
    equal = (g == g[:, :1]).all(-1, keepdim=True)
    return torch.where(equal, torch.zeros_like(g), g - g.mean(-1, keepdim=True))


def grpo(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps), unbiased std.

    rewards (B,) with B = num_prompts * G, samples of one prompt adjacent -> (B,). `scale_by_std=False` is Dr. GRPO
    (Liu et al. 2025). A group whose rewards are all equal gets exactly 0.
    """
    g = _groups(rewards, group_size)
    centered = _centered(g)
    if scale_by_std:
        centered = centered / (g.std(-1, keepdim=True, unbiased=True) + eps)
    return centered.view(-1)


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other G-1 rewards of its group. rewards (B,) -> (B,)."""
    g = _groups(rewards, group_size)
    # r_i - (S - r_i)/(G-1) = G/(G-1) * (r_i - mean): the same centring, so equal groups are exactly 0.
    return (_centered(g) * group_size / (group_size - 1)).view(-1)


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                 kl_coef: float = 0.0, gamma: float = 1.0, group_size: Optional[int] = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token rewards = outcome reward at the last token - kl_coef * KL per token, discounted
    returns-to-go, then whitened over the whole batch (no critic).

    rewards (B,) outcome per sequence; mask (B, T) bool; kl (B, T) per-token KL or None. `group_size` subtracts
    each prompt group's mean reward first (REINFORCE++-baseline). Returns advantages (B, T), zero outside mask.
    """
    outcome = rewards.float()
    if group_size is not None:
        g = _groups(outcome, group_size, needs=1)
        outcome = _centered(g).view(-1)
    token_rewards = last_token_mask(mask).float() * outcome[:, None]
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl.float() * mask.float()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(outcome)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t].float()
        returns[:, t] = running
    return masked_whiten(returns, mask)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (B,), a prompt's G samples adjacent -> bool (B // G,): the groups whose rewards are not all equal.
    An all-equal group has zero group-relative advantage, so no gradient (DAPO's dynamic sampling drops them)."""
    g = _groups(rewards, group_size, needs=1)
    return (g != g[:, :1]).any(-1)


def choose_groups(signal: torch.Tensor, want: int) -> torch.Tensor:
    """signal (G,) bool, one per generated group in generation order -> (min(want, G),) long: the indices of the
    groups to train on. Groups with signal first, in order; groups without top the batch up (still in order) when
    fewer than `want` have signal, so the batch size stays fixed (DAPO's dynamic sampling, Yu et al. 2025, and
    over-sampling: generate more prompts than a step trains on, keep the informative ones)."""
    order = torch.cat([torch.nonzero(signal).flatten(), torch.nonzero(~signal).flatten()])
    return order[:want]
