"""The trainer's view of a mixture-of-experts model's routers (transformers' top-k routers: modules with `top_k` and
`num_experts` whose forward returns (router logits, routing weights, expert ids)): what each training forward
routed, for the load-balancing loss (trainer.router_aux_loss_coef) and the `moe/...` metrics; and routing replay
(algorithm.routing_replay), where a forward's tokens go to the experts the engine chose for them."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from algorithms.moe import (agreement_counts, expert_load, load_balancing_loss, load_imbalance, no_route,
                            replayed_weights)


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
        self.layer = {router: i for i, router in enumerate(routers)}  # (module order: the layers' order)
        # algorithm.routing_replay: off (routes ignored) | measure (compared with the trainer's own) | rollout (used)
        self.mode = "off"
        self.routes: Optional[torch.Tensor] = None  # (N, MoE layers, top-k) the engine's, for this forward's tokens
        # token-layers whose experts the trainer would choose as the engine did, and compared (on the device: read
        # once an optimizer step, not once a layer)
        self.agree: list = [0, 0]
        for router in routers:
            router.register_forward_hook(self._hook)

    @classmethod
    def attach(cls, model: torch.nn.Module, coef: Optional[float]) -> Optional["RouterTap"]:
        """The tap for `model`'s routers, or None for a dense model."""
        routers = [m for m in model.modules() if is_router(m)]
        return cls(routers, aux_loss_coef(coef, model.config)) if routers else None

    def use_routes(self, routes: Optional[torch.Tensor]) -> None:
        """The engine's routes of the next forward's rows, (B, T, MoE layers, top-k) (the rollout's `routes`), or
        None. They stay in place through its backward: gradient checkpointing routes the layers it recomputes the
        same way."""
        if self.mode == "off" or routes is None:
            self.routes = None
            return
        if routes.shape[2] != len(self.layer) or routes.shape[3] != self.top_k:
            raise ValueError(f"the engine recorded routes for {routes.shape[2]} MoE layers x top-{routes.shape[3]}; "
                             f"the trainer's model has {len(self.layer)} x top-{self.top_k}")
        self.routes = routes.reshape(-1, *routes.shape[2:])

    def _hook(self, module, args, output):
        logits, weights, indices = output
        if self.routes is not None:
            if len(self.routes) != len(indices):
                raise RuntimeError(f"routing replay: the router saw {len(indices)} tokens, the rollout recorded "
                                   f"{len(self.routes)} (a forward that repacks the rows: packing, shared_prefix or "
                                   "sequence parallelism, cannot replay)")
            given = self.routes[:, self.layer[module]].to(indices.device)
            valid = (given != no_route(given.dtype)).all(-1)
            if not torch.is_grad_enabled() or self.on:  # (once per forward, not again when a layer is recomputed)
                same, seen = agreement_counts(indices, given, valid)
                self.agree[0] += same
                self.agree[1] += seen
            if self.mode == "rollout":
                indices = torch.where(valid[:, None], given.long(), indices)
                weights = replayed_weights(logits, indices, getattr(module, "norm_topk_prob", True))
        if self.on and torch.is_grad_enabled():  # (a no-grad forward, old log-probs: nothing to add a loss to)
            self.logits.append(logits)
            self.indices.append(indices.detach())
        return logits, weights, indices

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
