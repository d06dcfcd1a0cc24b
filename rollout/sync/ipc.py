"""The `ipc` weight-sync channel: engines on the trainer's own device read its memory directly. On a GPU the handles
are CUDA IPC handles (the engine maps the trainer's buffer; nothing goes through the host); on a CPU host they name
a /dev/shm file both sides map. Only `allocate_shared`/`share`/`open_shared` know the difference.

Each feeding trainer rank owns two staging buffers of one bucket each, whose handles go to its engines once, at
set-up. Per bucket the trainer fills a buffer and posts a tiny "ready" key in a TCPStore; each engine copies the
bucket out and posts an ack; the buffer is refilled (two buckets later) only after every ack. Trainer memory stays
at two buckets whatever the model size, and the engine side yields named tensors exactly like the broadcast channel.
"""
from __future__ import annotations

import os
import pickle
import uuid
from typing import Callable, Iterable, Iterator, Optional

import torch

from common.net import tcp_store
from rollout.sync.buckets import TensorSpec, bucket_contents, bucket_nbytes, bucket_tensors, unpack_bucket

SHM_DIR = "/dev/shm"


def allocate_shared(nbytes: int, device=None) -> tuple[torch.Tensor, Optional[str]]:
    """A uint8 buffer other processes on this host can map, and (CPU) the /dev/shm file behind it. On a CPU host the
    file is ours, not torch's: `unlink_file` removes its name once every engine has mapped it, so a killed process
    cannot leave it behind (the memory lives until the last mapping goes)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None
    path = f"{SHM_DIR}/rlhf-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # ours alone (0600 whatever the umask: the synced weights are not for other users to read or change), and a
    # new file (O_EXCL), its pages reserved now: a full /dev/shm fails here, by name, not as a SIGBUS at first write
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.unlink(path)
        free = os.statvfs(SHM_DIR)
        raise RuntimeError(f"weight sync (ipc): cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR} ({e.strerror}; "
                           f"{free.f_bavail * free.f_frsize >> 20} MiB free). Give the container more shared memory "
                           f"(docker run --shm-size=2g), lower rollout.sync_bucket_mb (two buckets per trainer rank "
                           f"live there), or set rollout.sync_channel=broadcast") from None
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path


def share(t: torch.Tensor, path: Optional[str]) -> bytes:
    """A handle (no data inside) that another process on this host opens with `open_shared`, once per handle. A
    CUDA handle carries the GPU's UUID: device indices are per-process (CUDA_VISIBLE_DEVICES), UUIDs are not."""
    if t.is_cuda:
        from multiprocessing.reduction import ForkingPickler
        index = t.device.index
        # a CUDA IPC handle, with torch's own reference counting
        return pickle.dumps(("cuda", index, gpu_uuid(index), bytes(ForkingPickler.dumps(t))))
    return pickle.dumps(("file", path, t.numel()))


def open_shared(handle: bytes, local_uuid: Optional[Callable[[int], str]] = None) -> torch.Tensor:
    """The buffer behind a `share` handle, mapped (not copied) into this process. CUDA: the producer's device index
    must name the same GPU here (true for Ray actors in one GPU bundle); checked by UUID, not assumed."""
    obj = pickle.loads(handle)
    if obj[0] == "file":
        return torch.from_file(obj[1], shared=True, size=obj[2], dtype=torch.uint8)
    _, index, want, data = obj
    here = (local_uuid or gpu_uuid)(index)
    if here != want:
        raise RuntimeError(f"weight sync (ipc): the trainer's buffer is on GPU {index} = {want}, but GPU {index} in "
                           f"this engine is {here} (the two processes see different CUDA_VISIBLE_DEVICES orders); "
                           "set rollout.sync_channel=broadcast, or give both the same visible devices")
    return pickle.loads(data)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def unlink_file(path: Optional[str]) -> None:
    if path is not None and os.path.exists(path):
        os.unlink(path)


def connect_store(host: str, port: int, is_master: bool, timeout_s: float = 300.0):
    return tcp_store(host, port, is_master, timeout_s=timeout_s)


def _sync_device(t: torch.Tensor) -> None:
    if t.is_cuda:  # the other process reads (or we refill) this memory outside our CUDA stream
        torch.cuda.current_stream(t.device).synchronize()


def _ready_key(src: int, sync: int, k: int) -> str:
    return f"ipc/{src}/{sync}/{k}"


def _ack_key(src: int, sync: int, k: int, engine: int, worker: int) -> str:
    return f"ipc/{src}/{sync}/{k}/ack/{engine}.{worker}"


class IpcSender:
    """Trainer rank `src`: feeds `engines` (their indices) through two shared staging buffers; a bucket's buffer is
    refilled once each of every engine's `workers` (tensor-parallel workers, each loading the whole tensors) has
    copied it out."""

    def __init__(self, store, src: int, engines: list[int], plan: list[list[TensorSpec]], device=None,
                 workers: int = 1):
        self.store, self.src, self.engines, self.sync, self.workers = store, src, engines, 0, workers
        size = max(bucket_nbytes(b) for b in plan)
        made: list = []
        try:
            for _ in range(2):
                made.append(allocate_shared(size, device))
        except Exception:
            for _, path in made:  # the first buffer's file, when the second cannot be had
                unlink_file(path)
            raise
        self.buffers, self.paths = zip(*made)

    def handles(self) -> dict[int, list[bytes]]:
        """Per engine, the handles of both buffers (one `share` per opener)."""
        return {e: [share(b, p) for b, p in zip(self.buffers, self.paths)] for e in self.engines}

    def opened(self) -> None:
        """Every engine has mapped the buffers: their names are no longer needed."""
        for path in self.paths:
            unlink_file(path)

    def send(self, named: Iterable[tuple[str, torch.Tensor]], plan: list[list[TensorSpec]]) -> int:
        """Stream every bucket of the plan; returns the payload bytes. Tensors must come in plan order."""
        sent = 0
        for k, (bucket, tensors) in enumerate(bucket_tensors(named, plan)):
            if k >= 2:
                self._wait_acks(k - 2)
            for (_, view), tensor in zip(unpack_bucket(self.buffers[k % 2], bucket), tensors):
                view.copy_(tensor)
            _sync_device(self.buffers[k % 2])
            self.store.set(_ready_key(self.src, self.sync, k), b"1")
            sent += sum(s.nbytes for s in bucket)
        for k in range(max(0, len(plan) - 2), len(plan)):
            self._wait_acks(k)
        self.sync += 1
        return sent

    def _wait_acks(self, k: int) -> None:
        keys = [_ack_key(self.src, self.sync, k, e, w) for e in self.engines for w in range(self.workers)]
        self.store.wait(keys)
        for key in keys + [_ready_key(self.src, self.sync, k)]:
            self.store.delete_key(key)


class IpcReceiver:
    """Engine `engine` (its tensor-parallel worker `worker`), fed by trainer rank `src`: opens the two staging buffers
    once, then copies each bucket out."""

    def __init__(self, store, src: int, engine: int, handles: list[bytes], worker: int = 0):
        self.store, self.src, self.engine, self.sync, self.worker = store, src, engine, 0, worker
        self.buffers = [open_shared(h) for h in handles]

    def receive(self, plan: list[list[TensorSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Named tensors bucket by bucket, as each becomes ready (in fresh memory: the consumer may keep views)."""
        sync, self.sync = self.sync, self.sync + 1

        def arrived():
            for k, bucket in enumerate(plan):
                self.store.get(_ready_key(self.src, sync, k))  # blocks until the trainer has filled the buffer
                own = self.buffers[k % 2][:bucket_nbytes(bucket)].clone()
                _sync_device(own)
                self.store.set(_ack_key(self.src, sync, k, self.engine, self.worker), b"1")
                yield bucket, own
        return bucket_contents(arrived())


def feeding_rank(engine: int, world_size: int) -> int:
    """The trainer rank that feeds engine `engine`: under colocation engine i shares GPU bundle i with trainer rank i
    (every rank holds full weights at export time, gathered under ZeRO-3)."""
    return engine % world_size
