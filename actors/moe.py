"""The trainer's view of a mixture-of-experts model's routers (transformers' top-k routers: modules with `top_k` and
`num_experts` whose forward returns (router logits, routing weights, expert ids)): what each training forward
routed, for the load-balancing loss (trainer.router_aux_loss_coef) and the `moe/...` metrics."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from algorithms.moe import expert_load, load_balancing_loss, load_imbalance


def is_router(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("Router") and hasattr(module, "top_k") and hasattr(module, "num_experts")
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter))


def aux_loss_coef(configured: Optional[float], config) -> float:
    """trainer.router_aux_loss_coef, or (null) what transformers' own training would add: the model config's
    `router_aux_loss_coef` where the config asks for router logits (`output_router_logits`), else none."""
    if configured is not None:
        return configured
    config = getattr(config, "text_config", None) or config
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(config, "output_router_logits",
                                                                                False) else 0.0


class RouterTap:
    """Forward hooks on every router; they record only inside `recording()` (the training forward), not when
    gradient checkpointing recomputes a layer in the backward."""

    def __init__(self, routers: list[torch.nn.Module], coef: float):
        self.top_k, self.experts, self.coef = routers[0].top_k, routers[0].num_experts, coef
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.on = False
        for router in routers:
            router.register_forward_hook(self._record)

    @classmethod
    def attach(cls, model: torch.nn.Module, coef: Optional[float]) -> Optional["RouterTap"]:
        """The tap for `model`'s routers, or None for a dense model."""
        routers = [m for m in model.modules() if is_router(m)]
        return cls(routers, aux_loss_coef(coef, model.config)) if routers else None

    def _record(self, module, args, output) -> None:
        if self.on and torch.is_grad_enabled():  # (a no-grad forward, old log-probs: nothing to add a loss to)
            logits, _, indices = output
            self.logits.append(logits)
            self.indices.append(indices.detach())

    @contextlib.contextmanager
    def recording(self):
        self.logits, self.indices, self.on = [], [], True
        try:
            yield
        finally:
            self.on = False

    def add_aux_loss(self, loss: torch.Tensor, mask: Optional[torch.Tensor], share: float) -> tuple[torch.Tensor,
                                                                                                   dict]:
        """`loss` plus coef x the load-balancing loss of the last recorded forward, weighted by `share` (this
        micro-batch's part of the rank's rows); and its metrics. `mask` (B, T) is used where the routers saw the
        padded rows (a packed or split forward routes other token lists: all of them count)."""
        if not self.logits:
            return loss, {}
        logits = torch.stack(self.logits)  # (L, N, E)
        mask = mask.reshape(-1) if mask is not None and mask.numel() == logits.shape[1] else None
        aux = load_balancing_loss(logits, self.top_k, mask)
        load = expert_load(torch.stack(self.indices), self.experts, mask)
        self.logits, self.indices = [], []
        metrics = {"train/router_aux_loss": float(aux.detach()), "moe/expert_load": load_imbalance(load)}
        return (loss + self.coef * share * aux if self.coef else loss), metrics
