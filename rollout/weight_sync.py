"""Weight sync from the trainer into rollout engines.

Channels:
- `broadcast`: trainer rank 0 and every engine join a dedicated process group (gloo on CPU, NCCL on GPU) that is
  independent of the trainer's own group; full weights go over it in size-bounded byte buckets. The engine side is a
  generator, so vLLM's one `reload_weights` call consumes buckets as they arrive.
- `in_process`: the engine lives in the trainer's process and takes the named tensors directly.

The bucket plan (names, shapes, dtypes) is computed once from the trainer's parameter list and shipped to both ends,
so no per-tensor RPC is needed.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _DTYPES[self.dtype].itemsize


def spec_of(name: str, tensor: torch.Tensor, shape=None) -> TensorSpec:
    return TensorSpec(name, tuple(shape if shape is not None else tensor.shape), str(tensor.dtype))


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, order-preserving grouping into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not buckets or (size + _padded(spec.nbytes) > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += _padded(spec.nbytes)
    return buckets


_ALIGN = 8  # every tensor starts on an 8-byte boundary, so a uint8 slice can be viewed as any dtype


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def bucket_nbytes(specs: list[TensorSpec]) -> int:
    return sum(_padded(s.nbytes) for s in specs)


def pack_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of any dtype into one flat uint8 buffer (each padded to 8 bytes)."""
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        if _padded(raw.numel()) > raw.numel():
            parts.append(raw.new_zeros(_padded(raw.numel()) - raw.numel()))
    return torch.cat(parts)


def unpack_bucket(buf: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of `buf` as the named tensors of `specs` (inverse of pack_bucket)."""
    out, offset = [], 0
    for s in specs:
        out.append((s.name, buf[offset:offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)))
        offset += _padded(s.nbytes)
    return out


class SyncGroup:
    """A standalone process group: rank 0 is the trainer's rank 0, ranks 1..N the engines. Not the default group,
    so it coexists with DeepSpeed's group in the trainer and vLLM's inside the engines."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is not None:
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
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
    it = iter(named)
    sent = 0
    for bucket in plan:
        tensors = []
        for spec in bucket:
            name, tensor = next(it)
            if name != spec.name or tuple(tensor.shape) != spec.shape:
                raise RuntimeError(f"weight sync out of order: expected {spec.name}{spec.shape}, got "
                                   f"{name}{tuple(tensor.shape)}")
            tensors.append(tensor.to(group.device) if group.device is not None else tensor)
        group.broadcast(pack_bucket(tensors))
        sent += sum(s.nbytes for s in bucket)
    return sent


def receive_weights(group: SyncGroup, plan: list[list[TensorSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yields the named tensors bucket by bucket as the broadcasts arrive (a fresh buffer per bucket,
    since the consumer may keep views of it)."""
    for bucket in plan:
        buf = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8, device=group.device)
        group.broadcast(buf)
        yield from unpack_bucket(buf, bucket)
