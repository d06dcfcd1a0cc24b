"""torch.distributed / DeepSpeed process-group set-up, shared by every worker (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import os
from typing import Optional

from common.net import LOOPBACK, cache_root, free_port, tcp_store


def extensions_dir() -> str:
    """A project-owned folder for DeepSpeed's C++ op builds, so they are compiled once and stale locks are ours;
    one per torch version (the ops are built against its headers, and the cache outlives a virtualenv)."""
    import torch
    return os.path.join(cache_root(), "torch_extensions", torch.__version__)


def clear_stale_locks(folder: str, max_age_s: float = 900.0) -> None:
    """A process killed mid-compile leaves `lock` behind and every later build waits on it forever."""
    import time
    for dirpath, _, files in os.walk(folder):
        if "lock" in files:
            path = os.path.join(dirpath, "lock")
            if time.time() - os.path.getmtime(path) > max_age_s:
                os.remove(path)


def skip_shm_allreduce_build() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op (`deepspeed_shm_comm`) when it starts, a g++
    build of tens of seconds on each new machine (benchmarks/results/startup.md). Only DeepSpeed's inference tensor
    parallelism calls it (`inference_all_reduce`); training reduces through torch.distributed (gloo). Marking it
    unavailable is the flag DeepSpeed's own `build_shm_op` reads, so the backend starts without it: no method is
    replaced."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_deepspeed_distributed(rank: int, world_size: int, master_addr: str, master_port: Optional[int]) -> None:
    """Join (or create) the default process group through DeepSpeed, which needs the env:// variables even for
    one process (otherwise it looks for mpi4py)."""
    import deepspeed
    import torch

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    os.makedirs(os.environ["TORCH_EXTENSIONS_DIR"], exist_ok=True)
    clear_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    if world_size > 1 and torch.cuda.is_available() and torch.cuda.device_count() != 1:
        # LOCAL_RANK 0 on every rank would put them all on one GPU, which NCCL rejects ("Duplicate GPU detected").
        raise RuntimeError(f"trainer rank {rank} of {world_size} sees {torch.cuda.device_count()} GPUs; each rank must "
                           "see exactly its own (Ray sets CUDA_VISIBLE_DEVICES for actors that request a GPU: set "
                           "placement.num_gpus)")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank) if not torch.cuda.is_available() else "0",
                      WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                      # Never an inherited MASTER_PORT: a parent that trained in-process exports its own port,
                      # and every child would then try to bind the port the parent still holds.
                      MASTER_PORT=str(master_port or free_port()))
    if not torch.cuda.is_available():  # also when a process group exists already (an in-process vLLM engine's):
        skip_shm_allreduce_build()     # DeepSpeed still builds the op when it first wraps that group
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        if world_size == 1:  # no peer to meet: a store in this process, no port (none to lose to a racing process)
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        elif master_addr == LOOPBACK:  # one host: the group's store listens on loopback alone (common.net.tcp_store)
            from torch.distributed.constants import default_pg_timeout
            store = tcp_store(master_addr, int(os.environ["MASTER_PORT"]), rank == 0, world_size,
                              default_pg_timeout.total_seconds())
            torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                                 timeout=default_pg_timeout)
        deepspeed.init_distributed(dist_backend=backend)  # on a group made above: only DeepSpeed's own set-up


def releases_gpu_cache(method):
    """For an actor method that runs a model on a GPU the rollout engines share (colocation): afterwards, PyTorch's
    cached free blocks go back to the driver. vLLM re-creates its whole fixed budget when it wakes and counts other
    processes' reserved memory as used, so blocks cached here would make that wake run out of memory."""
    import functools

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    wrapper.releases_gpu_cache = True
    return wrapper
