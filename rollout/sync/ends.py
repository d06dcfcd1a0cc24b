"""The two ends of a weight sync: the trainer rank's `WeightSender` (which `PolicyTrainer` composes) and the engine's
`WeightReceiver` (shared by the vLLM worker extension and the HF engine), each on the channel `setup_sync` chose."""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from rollout.sync.broadcast import SyncGroup, receive_weights, send_weights
from rollout.sync.buckets import TensorSpec, plan_from_plain
from rollout.sync.check import recorded
from rollout.sync.ipc import IpcReceiver, IpcSender, connect_store


def drain(named: Iterable) -> None:
    """Consume a weight export without keeping it: a rank that sends or saves nothing still takes part in every
    ZeRO-3 gather the export makes."""
    for _ in named:
        pass


def _device() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


class WeightSender:
    """Trainer rank `rank`'s end: broadcast (rank 0 sends, the others only take part in ZeRO-3 gathers), ipc (a
    rank feeds `engines` through two shared staging buffers) or local (`local_engine`, in this process, is handed
    the tensors by reference). `send` always consumes the whole export iterator, since its gathers are collective
    over the trainer ranks. With `verify`, each sync's sent tensors are fingerprinted (rollout.sync.check)."""

    def __init__(self, channel: str, rank: int, host: str, port: int, plan: list[list[TensorSpec]],
                 world_size: int = 0, engines: Iterable[int] = (), local_engine=None, verify: bool = False,
                 workers: int = 1):
        self.channel, self.plan, self.verify, self.fingerprints = channel, plan, verify, {}
        self.group, self.ipc, self.local = None, None, local_engine
        if channel == "broadcast" and rank == 0:
            self.group = SyncGroup(host, port, 0, world_size)
        elif channel == "ipc":
            store = connect_store(host, port, is_master=rank == 0)
            self.store = store  # rank 0 hosts the store every engine and rank connects to
            self.ipc = IpcSender(store, rank, list(engines), plan, _device(), workers) if engines else None

    def handles(self) -> dict[int, list[bytes]]:
        """ipc: per fed engine, the handles of its staging buffers."""
        return self.ipc.handles() if self.ipc is not None else {}

    def opened(self) -> None:
        """ipc: every engine mapped the buffers, their names can go."""
        if self.ipc is not None:
            self.ipc.opened()

    def send(self, named: Iterator[tuple[str, torch.Tensor]], fingerprint: bool = True) -> int:
        """Payload bytes sent (0 on a rank that feeds no engine). `fingerprint`: record this sync's fingerprints
        (when the channel verifies)."""
        self.fingerprints = {}
        if self.verify and fingerprint and (self.group is not None or self.ipc is not None):
            named = recorded(named, self.fingerprints)
        if self.group is not None:
            return send_weights(self.group, named, self.plan)
        if self.ipc is not None:
            return self.ipc.send(named, self.plan)
        if self.local is not None:
            sent = [0]

            def counted():
                for name, tensor in named:
                    sent[0] += tensor.numel() * tensor.element_size()
                    yield name, tensor
            self.local.update_weights(counted())
            drain(named)  # (left over only if the engine stopped early: the other ranks' gathers still need it)
            return sent[0]
        drain(named)
        return 0


class WeightReceiver:
    """An engine's end, built from a plain `endpoint` dict (it crosses vLLM's collective_rpc): channel, host, port,
    plan, and broadcast: rank, world_size; ipc: src (feeding trainer rank), engine, handles; optional verify, and
    for a tensor-parallel engine `workers` (its size) and `worker` (this one's rank): each worker receives the
    whole tensors (vLLM's loaders keep their own shard), so each is a receiver of its own."""

    def __init__(self, endpoint: dict):
        e = endpoint
        self.plan, self.verify, self.fingerprints = plan_from_plain(e["plan"]), e.get("verify", False), {}
        workers, worker = e.get("workers", 1), e.get("worker", 0)
        if e["channel"] == "broadcast":  # engine i's workers are ranks 1 + i * workers + worker
            rank, world = 1 + (e["rank"] - 1) * workers + worker, 1 + (e["world_size"] - 1) * workers
            self.group, self.ipc = SyncGroup(e["host"], e["port"], rank, world), None
        else:
            store = connect_store(e["host"], e["port"], is_master=False)
            self.group, self.ipc = None, IpcReceiver(store, e["src"], e["engine"], e["handles"], worker)

    def receive(self, fingerprint: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors of one sync, bucket by bucket as they arrive (in memory the consumer may keep);
        fingerprinted as they pass when verifying and `fingerprint`."""
        self.fingerprints = {}
        named = receive_weights(self.group, self.plan) if self.group is not None else self.ipc.receive(self.plan)
        return recorded(named, self.fingerprints) if self.verify and fingerprint else named
