"""The `broadcast` channel: trainer rank 0 and every engine join a dedicated process group (gloo on CPU, NCCL on GPU)
that is independent of the trainer's own group. The engine side is a generator, so vLLM's one `reload_weights` call
consumes buckets as they arrive."""
from __future__ import annotations

import datetime
from typing import Iterable, Iterator

import torch

from common.net import tcp_store
from rollout.sync.buckets import TensorSpec, bucket_contents, bucket_nbytes, bucket_tensors, pack_bucket


class SyncGroup:
    """A standalone process group: rank 0 is the trainer's rank 0, ranks 1..N the engines. Not the default group,
    so it coexists with DeepSpeed's group in the trainer and vLLM's inside the engines."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = tcp_store(host, port, rank == 0, world_size, timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is not None:  # torch's own new_group builds its NCCL options this way (distributed_c10d)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # else NCCL's 10-minute default, whatever timeout_s says
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


def send_weights(group: SyncGroup, named: Iterable[tuple[str, torch.Tensor]], plan: list[list[TensorSpec]]) -> int:
    """Trainer rank 0: broadcast every bucket of the plan, taking tensors from `named` in plan order. Returns the
    payload bytes (without padding)."""
    sent = 0
    for bucket, tensors in bucket_tensors(named, plan):
        group.broadcast(pack_bucket([t.to(group.device) if group.device is not None else t for t in tensors]))
        sent += sum(s.nbytes for s in bucket)
    return sent


def receive_weights(group: SyncGroup, plan: list[list[TensorSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yields the named tensors bucket by bucket as the broadcasts arrive (a fresh buffer per bucket,
    since the consumer may keep views of it)."""
    def arrived():
        for bucket in plan:
            buf = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8, device=group.device)
            group.broadcast(buf)
            yield bucket, buf
    return bucket_contents(arrived())
