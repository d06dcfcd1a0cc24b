"""Routing replay (algorithm.routing_replay: rollout), the engine's half: inside a vLLM worker, the experts every
mixture-of-experts layer chose for every token it computed, for the trainer to route the same tokens the same way.

vLLM 0.32 returns routed experts itself only through its Model Runner V2 (`enable_return_routed_experts`), which
needs Triton: not on CPU. So the capture here is the worker's own, on the hook vLLM's capturer uses too (each MoE
layer's router `set_capture_fn`, called with the layer's top-k expert ids for the forward's tokens), on CPU and GPU;
on a GPU the engine then runs eagerly on vLLM's V1 model runner (a hook installed after CUDA graphs were captured
would not run inside them). Each token's ids are written to its KV-cache slot (the forward context's slot mapping),
as vLLM's capturer does: a token computed once serves every request that reads its KV, so the prompt a prefix-cache
hit skipped, or that the n samples of a prompt share, still has its routes. A request's routes are read from its
blocks when it finishes, before the slots can be handed to another request (the worker forgets it at its next
step), and kept by request id until the engine fetches them.

Routes are (tokens, MoE layers, top-k), uint8 (int16 past 255 experts), `algorithms.moe.no_route` where no route
was recorded (the last sampled token is never computed)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from algorithms.moe import no_route


def route_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts < 255 else np.dtype(np.int16)


def external_id(request_id: str) -> str:
    """vLLM's internal request id less the suffix its input processor appends ("k3-1a2b3c4d" -> "k3"); the n
    samples of one request are "{index}_{id}"."""
    return request_id.rsplit("-", 1)[0]


class RouteRecorder:
    """Installed in one vLLM worker (`model_runner`: its GPU/CPU model runner, after the KV cache exists)."""

    def __init__(self, model_runner):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        layers = sorted((m for m in model_runner.get_model().modules() if isinstance(m, MoERunner)),
                        key=lambda m: m.layer_id)
        if not layers:
            raise ValueError("algorithm.routing_replay: the engine's model has no mixture-of-experts layer; "
                             "set algorithm.routing_replay: off")
        fused = [type(m._quant_method).__name__ for m in layers if getattr(m._quant_method, "is_monolithic", False)]
        if fused:  # (its kernel routes inside itself and never calls the router's hook)
            raise ValueError(f"algorithm.routing_replay: the engine's MoE kernel ({fused[0]}) routes inside one "
                             "fused kernel the recorder cannot see; set algorithm.routing_replay: off")
        config = model_runner.model_config
        self.experts, self.top_k = config.get_num_experts(), config.get_num_experts_per_tok()
        self.dtype = route_dtype(self.experts)
        self.block_size = model_runner.cache_config.block_size
        slots = model_runner.kv_cache_config.num_blocks * self.block_size
        # on the model's device, written inside the forward without a host sync; one row more, where padding tokens
        # (slot -1) write
        self.buffer = torch.full((slots + 1, len(layers), self.top_k), no_route(self.dtype), device=model_runner.device,
                                 dtype=torch.uint8 if self.dtype == np.uint8 else torch.int16)
        self.padding = slots
        self.runner = model_runner
        self.finished: dict[str, np.ndarray] = {}  # request id -> its routes, until fetched
        for i, layer in enumerate(layers):
            layer.router.set_capture_fn(lambda ids, i=i: self._capture(i, ids))
        step = model_runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._keep_finished(scheduler_output.finished_req_ids)  # (before this step may reuse their slots)
            return step(scheduler_output, *args, **kwargs)
        model_runner.execute_model = execute_model

    def shape(self) -> tuple[int, int, int]:
        """(MoE layers, top-k, experts)."""
        return self.buffer.shape[1], self.top_k, self.experts

    def _capture(self, layer: int, ids: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        mappings = get_forward_context().slot_mapping
        if not mappings:  # (a profiling or warm-up forward: no KV cache yet)
            return
        if isinstance(mappings, list):
            raise RuntimeError("algorithm.routing_replay: the engine splits its batches into micro-batches (vLLM's "
                               "dual-batch overlap), which the route recorder does not follow; turn that off")
        slots = next(iter(mappings.values()))[:ids.shape[0]]
        slots = torch.where(slots >= 0, slots, self.padding)
        self.buffer[slots, layer] = ids.to(self.buffer.dtype)

    def _read(self, request_id: str) -> Optional[np.ndarray]:
        """The routes in `request_id`'s blocks, every position they hold (the engine cuts them to its tokens)."""
        state = self.runner.requests.get(request_id)
        if state is None:
            return None
        blocks = torch.tensor(state.block_ids[0], dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return self.buffer[slots.to(self.buffer.device)].cpu().numpy()

    def _keep_finished(self, request_ids) -> None:
        for rid in request_ids:
            routes = self._read(rid)
            if routes is not None:
                self.finished[external_id(rid)] = routes

    def take(self, request_ids: list[str], expected: list[str]) -> dict[str, Optional[np.ndarray]]:
        """Routes of the requests `request_ids` (external ids): of the newest request under each id (one started
        again after an adapter sync reuses its id), running or finished; None where unknown. Finished requests
        neither asked for nor `expected` later (the engine's kept requests) are dropped (an evaluation's, an aborted
        copy's)."""
        running = {external_id(rid): rid for rid in self.runner.requests}
        out = {}
        for key in request_ids:
            routes = self._read(running[key]) if key in running else None
            out[key] = routes if routes is not None else self.finished.get(key)
        keep = set(expected) - set(request_ids)
        self.finished = {k: v for k, v in self.finished.items() if k in keep}
        return out


class EngineRoutes:
    """The engine's side (`llm`: its vllm.LLM): starts the recorder in every worker and fetches requests' routes
    from the first (each tensor-parallel worker routes every token, the same way)."""

    def __init__(self, llm):
        self.llm = llm
        self.layers, self.top_k, self.experts = llm.collective_rpc("rlhf_record_routes")[0]
        self.dtype = route_dtype(self.experts)

    def fetch(self, lengths: dict[str, int], expected: list[str]) -> dict[str, Optional[np.ndarray]]:
        """{request id: its routes, (length, layers, top-k)} for requests {id: tokens computed}; `expected`: the
        ids whose routes will be asked for later (requests kept across calls)."""
        got = self.llm.collective_rpc("rlhf_take_routes", args=(list(lengths), list(expected)))[0]
        out = {}
        for key, n in lengths.items():
            raw = got.get(key)
            if raw is None:
                out[key] = None
                continue
            routes = np.frombuffer(raw, dtype=self.dtype).reshape(-1, self.layers, self.top_k)[:n]
            if len(routes) < n:  # (positions its blocks did not hold: none recorded)
                pad = np.full((n - len(routes), self.layers, self.top_k), no_route(self.dtype), self.dtype)
                routes = np.concatenate([routes, pad])
            out[key] = routes
        return out
