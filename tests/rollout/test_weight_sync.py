"""Bucket planning and packing (pure), and the standalone sync process group between two real processes."""
import torch
import torch.multiprocessing as mp

from actors.dist import free_port
from rollout.weight_sync import (SyncGroup, TensorSpec, pack_bucket, plan_buckets, receive_weights, send_weights,
                                 spec_of, unpack_bucket)


def specs(*sizes):
    return [TensorSpec(f"w{i}", (n,), "torch.float32") for i, n in enumerate(sizes)]


def test_plan_buckets_bounds_size_and_keeps_order():
    plan = plan_buckets(specs(10, 10, 10, 30, 5), bucket_bytes=80)  # 40, 40, 40, 120, 20 bytes
    assert [[s.name for s in b] for b in plan] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert plan_buckets(specs(1, 1, 1), bucket_bytes=1 << 20) == [specs(1, 1, 1)]


def test_pack_unpack_round_trip_mixed_dtypes():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6).view(2, 3)}
    buf = pack_bucket(list(tensors.values()))
    assert buf.dtype == torch.uint8 and buf.numel() == 48 + 16 + 48  # the bf16 tensor is padded 10 -> 16 bytes
    out = dict(unpack_bucket(buf, [spec_of(k, v) for k, v in tensors.items()]))
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)


def _rank(rank, port, plan, weights, out):
    group = SyncGroup("127.0.0.1", port, rank, 3, timeout_s=60)
    if rank == 0:
        out[0] = send_weights(group, weights, plan)
    else:
        out[rank] = {k: v.clone() for k, v in receive_weights(group, plan)}


def test_broadcast_reaches_every_receiver():
    weights = [("x", torch.randn(100)), ("y", torch.randn(7, 3)), ("z", torch.randn(50))]
    plan = plan_buckets([spec_of(k, v) for k, v in weights], bucket_bytes=300)
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_rank, args=(free_port(), plan, weights, out), nprocs=3, join=True)
        results = dict(out)
    assert results[0] == (100 + 21 + 50) * 4
    for r in (1, 2):
        assert all(torch.equal(results[r][k], v) for k, v in weights)
