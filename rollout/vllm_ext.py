"""A vLLM worker extension (`worker_extension_cls`): methods mixed into vLLM's worker, called through
`LLM.collective_rpc`, that load new weights into the running model with vLLM's own in-place reload path.

Arguments arrive as plain Python values (lists, str, bytes): with the multiprocess engine, tensors passed through
collective_rpc are turned into lists, so tensors travel as safetensors bytes or over the sync process group.
"""
from __future__ import annotations

from rollout.weight_sync import SyncGroup, TensorSpec, receive_weights


def plan_from_plain(plain: list) -> list[list[TensorSpec]]:
    return [[TensorSpec(name, tuple(shape), dtype, tuple(part) if part else None)
             for name, shape, dtype, part in bucket] for bucket in plain]


def plan_to_plain(plan: list[list[TensorSpec]]) -> list:
    return [[[s.name, list(s.shape), s.dtype, list(s.part) if s.part else None] for s in bucket] for bucket in plan]


class WeightSyncExtension:
    def rlhf_init_sync_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        self._rlhf_sync_group = SyncGroup(host, port, rank, world_size)

    def rlhf_receive_broadcast(self, plain_plan: list) -> int:
        """Receive every bucket of the plan from trainer rank 0, streamed into the reload. Returns #tensors."""
        return self._rlhf_reload(receive_weights(self._rlhf_sync_group, plan_from_plain(plain_plan)))

    def rlhf_init_ipc(self, host: str, port: int, src: int, engine: int, handles: list) -> None:
        from rollout.ipc_sync import IpcReceiver, connect_store
        self._rlhf_ipc = IpcReceiver(connect_store(host, port, is_master=False), src, engine, handles)

    def rlhf_receive_ipc(self, plain_plan: list) -> int:
        """`ipc` channel: copy every bucket out of the trainer's shared buffers, streamed into the reload."""
        return self._rlhf_reload(self._rlhf_ipc.receive(plan_from_plain(plain_plan)))

    def rlhf_load_tensors(self, named) -> int:
        """In-process channel: `named` is a list of (name, tensor), or safetensors bytes across processes."""
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

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count[0]
