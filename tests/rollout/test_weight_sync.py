"""Bucket planning and packing (pure); the broadcast sync group and the shared-memory (ipc) channel between real
processes."""
import os

import torch
import torch.multiprocessing as mp

from common.net import free_port
from rollout.sync.buckets import (TensorSpec, bucket_contents, bucket_nbytes, bucket_tensors, pack_bucket,
                                   plan_buckets, spec_of, unpack_bucket)
from rollout.sync.broadcast import SyncGroup, receive_weights, send_weights


def specs(*sizes):
    return [TensorSpec(f"w{i}", (n,), "torch.float32") for i, n in enumerate(sizes)]


def test_plan_buckets_bounds_size_and_keeps_order():
    plan = plan_buckets(specs(10, 10, 10, 5), bucket_bytes=80)  # 40, 40, 40, 20 bytes
    assert [[s.name for s in b] for b in plan] == [["w0", "w1"], ["w2", "w3"]]
    assert plan_buckets(specs(1, 1, 1), bucket_bytes=1 << 20) == [specs(1, 1, 1)]


def test_a_tensor_larger_than_a_bucket_is_cut_into_parts():
    """No bucket (so no staging buffer) exceeds the bound: w1's 120 bytes go as 80 + 40 in two buckets, and the
    receiver joins them into the tensor that was sent."""
    plan = plan_buckets(specs(10, 30, 5), bucket_bytes=80)  # 40, 120, 20 bytes
    assert max(bucket_nbytes(b) for b in plan) <= 80
    assert [[(s.name, s.part) for s in b] for b in plan] == [[("w0", None)], [("w1", (0, 80))],
                                                             [("w1", (80, 40)), ("w2", None)]]
    weights = [("w0", torch.randn(10)), ("w1", torch.randn(30)), ("w2", torch.randn(5))]
    sent = [(bucket, pack_bucket(tensors)) for bucket, tensors in bucket_tensors(weights, plan)]
    got = list(bucket_contents(sent))
    assert [k for k, _ in got] == ["w0", "w1", "w2"]
    assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, weights))


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
    assert [s.part for s in plan[0] + plan[1]][:2] == [(0, 296), (296, 104)]  # x (400 bytes) is cut in two
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_rank, args=(free_port(), plan, weights, out), nprocs=3, join=True)
        results = dict(out)
    assert results[0] == (100 + 21 + 50) * 4
    for r in (1, 2):
        assert all(torch.equal(results[r][k], v) for k, v in weights)


def _ipc_trainer(port, plan, syncs, handles_q, out):
    from rollout.sync.ipc import IpcSender, connect_store
    sender = IpcSender(connect_store("127.0.0.1", port, is_master=True, timeout_s=60), 0, [1, 2], plan)
    handles_q.put(sender.handles())
    sender.store.wait(["opened/1", "opened/2"])
    sender.opened()
    out["names_left"] = [p for p in sender.paths if os.path.exists(p)]
    out["sent"] = [sender.send(iter(weights), plan) for weights in syncs]
    out["keys_left"] = sender.store.num_keys()
    out["staging_bytes"] = sum(b.numel() for b in sender.buffers)


def _ipc_engine(engine, port, plan, n_syncs, handles_q, out):
    from rollout.sync.ipc import IpcReceiver, connect_store
    receiver = IpcReceiver(connect_store("127.0.0.1", port, is_master=False, timeout_s=60), 0, engine,
                           handles_q.get(timeout=60))
    receiver.store.set(f"opened/{engine}", b"1")
    out[engine] = [{k: v.clone() for k, v in receiver.receive(plan)} for _ in range(n_syncs)]


def test_ipc_channel_streams_every_bucket_through_two_shared_buffers():
    """Real processes, real shared memory: 4 buckets through 2 staging buffers (each refilled only after both
    engines' acks), to 2 engines, twice with different weights."""
    weights = [("x", torch.randn(100)), ("y", torch.randn(7, 3)), ("z", torch.randn(50)),
               ("b", torch.randn(60).to(torch.bfloat16)), ("w", torch.randn(70)), ("v", torch.randn(80)),
               ("e", torch.randn(300).to(torch.bfloat16))]
    plan = plan_buckets([spec_of(k, v) for k, v in weights], bucket_bytes=400)
    assert len(plan) == 6  # x | y z | b w | v | e[:400] | e[400:]: more buckets than buffers, and a cut tensor
    syncs = [weights, [(k, v * 2 + 1) for k, v in weights]]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out, port = m.dict(), free_port()
        queues = {name: m.Queue() for name in ("trainer", 1, 2)}
        procs = [ctx.Process(target=_ipc_trainer, args=(port, plan, syncs, queues["trainer"], out))]
        procs += [ctx.Process(target=_ipc_engine, args=(e, port, plan, len(syncs), queues[e], out)) for e in (1, 2)]
        for p in procs:
            p.start()
        handles = queues["trainer"].get(timeout=60)
        for e in (1, 2):
            queues[e].put(handles[e])
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        results = dict(out)
    payload = sum(s.nbytes for bucket in plan for s in bucket)
    assert results["names_left"] == []  # unlinked once mapped: a killed process leaves nothing in /dev/shm
    assert results["sent"] == [payload, payload]
    assert results["keys_left"] == 2  # every ready and ack key was deleted (the two left are this test's own)
    assert results["staging_bytes"] == 2 * max(bucket_nbytes(b) for b in plan)
    for engine in (1, 2):
        for got, want in zip(results[engine], syncs):
            assert list(got) == [k for k, _ in want]
            assert all(torch.equal(got[k], v) for k, v in want)


def test_a_cuda_handle_from_another_gpu_is_refused():
    """CUDA IPC handles carry the producer's GPU UUID: an engine whose device index names another GPU (a different
    CUDA_VISIBLE_DEVICES order) gets an error naming both, not a mapping of the wrong GPU's memory."""
    import pickle

    import pytest

    from rollout.sync.ipc import open_shared

    handle = pickle.dumps(("cuda", 0, "GPU-aaaa", b"never unpickled"))
    with pytest.raises(RuntimeError, match="GPU 0 = GPU-aaaa, but GPU 0 in this engine is GPU-bbbb"):
        open_shared(handle, local_uuid=lambda index: "GPU-bbbb")
