"""The bucket format of a weight sync: the trainer's parameters in export order, grouped into size-bounded byte
buffers (`plan_buckets`, `pack_bucket`/`unpack_bucket`); `bucket_tensors` (sender) and `bucket_contents` (receiver)
walk a plan. The plan (names, shapes, dtypes) is computed once from the trainer's parameter list and handed to both
ends at set-up, so no per-tensor RPC is needed. A tensor larger than a bucket (a 7B model's 1 GB embedding) is cut
into byte parts across consecutive buckets, so every staging buffer stays within `sync_bucket_mb`; the receiver
joins the parts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Optional

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"
    part: Optional[tuple[int, int]] = None  # (byte offset, byte count): this bucket carries only those bytes

    @property
    def full_nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """The bytes this spec puts in its bucket."""
        return self.part[1] if self.part is not None else self.full_nbytes


def spec_of(name: str, tensor: torch.Tensor, shape=None) -> TensorSpec:
    return TensorSpec(name, tuple(shape if shape is not None else tensor.shape), str(tensor.dtype))


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, order-preserving grouping into buckets of at most `bucket_bytes`; a larger tensor is cut into parts
    of `bucket_bytes` (rounded down to the alignment), one bucket each."""
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        for piece in _parts(spec, max(_ALIGN, bucket_bytes - bucket_bytes % _ALIGN)):
            if not buckets or (size + _padded(piece.nbytes) > bucket_bytes and buckets[-1]):
                buckets.append([])
                size = 0
            buckets[-1].append(piece)
            size += _padded(piece.nbytes)
    return buckets


def _parts(spec: TensorSpec, step: int) -> list[TensorSpec]:
    total = spec.full_nbytes
    if _padded(total) <= step:
        return [spec]
    return [replace(spec, part=(lo, min(step, total - lo))) for lo in range(0, total, step)]


def bucket_tensors(named: Iterable[tuple[str, torch.Tensor]],
                   plan: list[list[TensorSpec]]) -> Iterator[tuple[list[TensorSpec], list[torch.Tensor]]]:
    """Sender side: per bucket, the tensors its specs name (a part: that byte range of the tensor, as uint8),
    taken from `named` in plan order and checked against it. A tensor cut into parts is held until its last part
    is out, so a ZeRO-3 gather (open while the producer is suspended) covers all of it."""
    it, current = iter(named), None
    for bucket in plan:
        tensors = []
        for spec in bucket:
            if spec.part is None or spec.part[0] == 0:
                name, current = next(it)
                if name != spec.name or tuple(current.shape) != spec.shape:
                    raise RuntimeError(f"weight sync out of order: expected {spec.name}{spec.shape}, got "
                                       f"{name}{tuple(current.shape)}")
            if spec.part is None:
                tensors.append(current)
            else:
                lo, n = spec.part
                tensors.append(current.detach().contiguous().view(-1).view(torch.uint8)[lo:lo + n])
        yield bucket, tensors


def bucket_contents(buckets: Iterable[tuple[list[TensorSpec], torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: the named tensors in received bucket buffers, in plan order. The parts of a cut tensor are
    copied into one buffer, which is yielded once its last part has arrived."""
    whole = None
    for bucket, buf in buckets:
        for spec, (name, view) in zip(bucket, unpack_bucket(buf, bucket)):
            if spec.part is None:
                yield name, view
                continue
            lo, n = spec.part
            if lo == 0:
                whole = torch.empty(spec.full_nbytes, dtype=torch.uint8, device=buf.device)
            whole[lo:lo + n].copy_(view)
            if lo + n == spec.full_nbytes:
                yield name, whole.view(_DTYPES[spec.dtype]).view(spec.shape)


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
    """Views of `buf` as the named tensors of `specs` (inverse of pack_bucket); a part stays raw uint8 bytes."""
    out, offset = [], 0
    for s in specs:
        raw = buf[offset:offset + s.nbytes]
        out.append((s.name, raw if s.part is not None else raw.view(_DTYPES[s.dtype]).view(s.shape)))
        offset += _padded(s.nbytes)
    return out


def plan_to_plain(plan: list[list[TensorSpec]]) -> list:
    """Lists and strings only: what vLLM's collective_rpc carries to a multiprocess engine core unchanged."""
    return [[[s.name, list(s.shape), s.dtype, list(s.part) if s.part else None] for s in bucket] for bucket in plan]


def plan_from_plain(plain: list) -> list[list[TensorSpec]]:
    return [[TensorSpec(name, tuple(shape), dtype, tuple(part) if part else None)
             for name, shape, dtype, part in bucket] for bucket in plain]
