"""Mixture-of-experts routing statistics: the load-balancing loss, each expert's share of the tokens, and how often
two routers chose the same experts. Routers here are top-k over softmax(router logits)."""
from __future__ import annotations

from typing import Optional

import torch


def load_balancing_loss(router_logits: torch.Tensor, top_k: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """router_logits (L, N, E) of L layers for N tokens, mask (N,) 1 for real tokens -> scalar.

    The Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) with top-k assignments, pooled over
    layers as transformers' `load_balancing_loss_func` pools them (so the model config's `router_aux_loss_coef`
    means what it means there): E * sum_e f_e * P_e, f_e expert e's top-k assignments per token-layer, P_e its
    mean router probability. top_k when perfectly balanced, more when not; differentiable through P."""
    experts = router_logits.shape[-1]
    probs = router_logits.float().softmax(-1)  # (L, N, E)
    chosen = probs.topk(top_k, dim=-1).indices
    w = torch.ones(probs.shape[1], device=probs.device) if mask is None else mask.float().reshape(-1)
    counts = torch.zeros(experts, device=probs.device).index_add_(
        0, chosen.reshape(-1), w.repeat_interleave(top_k).repeat(probs.shape[0]))
    rows = w.sum() * probs.shape[0]
    mean_prob = (probs * w[None, :, None]).sum((0, 1)) / rows
    return experts * (counts / rows * mean_prob).sum()


def expert_load(indices: torch.Tensor, experts: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """indices (L, N, k) the experts each of N tokens went to in each of L layers, mask (N,) -> (L, E): each
    expert's share of the layer's assignments (rows sum to 1)."""
    w = torch.ones(indices.shape[1]) if mask is None else mask.float().reshape(-1).cpu()
    per_slot = w.repeat_interleave(indices.shape[2])
    load = torch.stack([torch.zeros(experts).index_add_(0, layer.reshape(-1).cpu(), per_slot) for layer in indices])
    return load / load.sum(-1, keepdim=True).clamp(min=1e-12)


def load_imbalance(load: torch.Tensor) -> float:
    """load (L, E) from `expert_load` -> the busiest expert's share over the even share, worst layer (1 = even)."""
    return float((load.max(-1).values * load.shape[-1]).max())


def router_agreement(a: torch.Tensor, b: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """a, b (L, N, k) two routers' top-k expert ids for the same tokens -> the fraction of token-layer pairs whose
    sets of k experts are equal (order ignored)."""
    same = (a.sort(-1).values == b.sort(-1).values).all(-1).float()  # (L, N)
    w = torch.ones(same.shape[1]) if mask is None else mask.float().reshape(-1).cpu()
    return float((same.cpu() * w).sum() / (w.sum() * same.shape[0]).clamp(min=1e-12))


def no_route(dtype) -> int:
    """The expert id that stands for "no route recorded" in routes of `dtype` (numpy or torch): 255 in uint8 (up to
    254 experts), -1 in int16."""
    return 255 if str(dtype).removeprefix("torch.") == "uint8" else -1


def replayed_weights(router_logits: torch.Tensor, indices: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """router_logits (N, E), indices (N, k) the experts each token is made to use (routing replay) -> (N, k) their
    gate weights: the router's own softmax probabilities at those experts (renormalised over the k when the model's
    router renormalises its top-k), in the logits' dtype. The experts are given; the weights stay differentiable
    through the logits, so the router still learns."""
    probs = router_logits.float().softmax(-1).gather(-1, indices)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.to(router_logits.dtype)


def agreement_counts(own: torch.Tensor, given: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """own, given (N, k) two top-k choices for N tokens, valid (N,) bool -> (tokens whose sets of k experts are
    equal, tokens compared), over the valid ones: 0-dim tensors on the inputs' device (summed there, read once)."""
    same = (own.sort(-1).values == given.to(own.dtype).sort(-1).values).all(-1) & valid
    return same.sum(), valid.sum()
