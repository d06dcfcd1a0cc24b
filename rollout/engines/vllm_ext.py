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
        count = [0]

        def counted():
            for item in named:
                count[0] += 1
                yield item

        # the worker's own reload_weights: it enters set_current_vllm_config, which reload steps may read
        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count[0]
