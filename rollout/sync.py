"""Weight sync in one place: the channel a placement gets (`sync_channel`), the trainer's end (`WeightSender`, which
`PolicyTrainer` composes), the engines' end (`WeightReceiver`, shared by the vLLM worker extension and the HF
engine), and the driver's two calls (`setup_sync` once, `sync_weights` after every update).

The bucket plan (rollout.weight_sync) travels once, at set-up, inside each end's `Endpoint`; a sync then carries
nothing but the weights. Channels: `broadcast` (a dedicated process group from trainer rank 0, rollout.weight_sync),
`ipc` (shared memory / CUDA IPC from each engine's feeding trainer rank, rollout.ipc_sync), and `local` (the hybrid
placement: each trainer rank hands its tensors to the engine in its own process, actors.hybrid).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from common.errors import UserError
from common.remote import ray_get
from rollout.ipc_sync import IpcReceiver, IpcSender, connect_store, feeding_rank
from rollout.sync_check import recorded
from rollout.weight_sync import SyncGroup, TensorSpec, receive_weights, send_weights


def sync_channel(requested: str, mode: str, num_gpus: int, num_engines: int, world_size: int) -> str:
    """The weight-sync channel for a placement. `hybrid` (engines inside the trainer ranks) is always `local`.
    Otherwise `auto` takes `ipc` where every engine can map its feeding trainer rank's memory: on a CPU host always
    (actors on other nodes fall back at set-up), on GPUs only when engine i shares its GPU with trainer rank i
    (colocate, engines <= ranks). Otherwise `broadcast`."""
    if mode == "hybrid":
        return "local"
    if requested != "auto":
        return requested
    return "ipc" if num_gpus == 0 or cuda_ipc_reaches(mode, num_engines, world_size) else "broadcast"


def cuda_ipc_reaches(mode: str, num_engines: int, world_size: int) -> bool:
    """Engine i shares its GPU with trainer rank i, which feeds it (rollout.ipc_sync.feeding_rank)."""
    return mode == "colocate" and num_engines <= world_size


def plan_to_plain(plan: list[list[TensorSpec]]) -> list:
    """Lists and strings only: what vLLM's collective_rpc carries to a multiprocess engine core unchanged."""
    return [[[s.name, list(s.shape), s.dtype, list(s.part) if s.part else None] for s in bucket] for bucket in plan]


def plan_from_plain(plain: list) -> list[list[TensorSpec]]:
    return [[TensorSpec(name, tuple(shape), dtype, tuple(part) if part else None)
             for name, shape, dtype, part in bucket] for bucket in plain]


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
    over the trainer ranks. With `verify`, each sync's sent tensors are fingerprinted (rollout.sync_check)."""

    def __init__(self, channel: str, rank: int, host: str, port: int, plan: list[list[TensorSpec]],
                 world_size: int = 0, engines: Iterable[int] = (), local_engine=None, verify: bool = False):
        self.channel, self.plan, self.verify, self.fingerprints = channel, plan, verify, {}
        self.group, self.ipc, self.local = None, None, local_engine
        if channel == "broadcast" and rank == 0:
            self.group = SyncGroup(host, port, 0, world_size)
        elif channel == "ipc":
            store = connect_store(host, port, is_master=rank == 0)
            self.store = store  # rank 0 hosts the store every engine and rank connects to
            self.ipc = IpcSender(store, rank, list(engines), plan, _device()) if engines else None

    def handles(self) -> dict[int, list[bytes]]:
        """ipc: per fed engine, the handles of its staging buffers."""
        return self.ipc.handles() if self.ipc is not None else {}

    def opened(self) -> None:
        """ipc: every engine mapped the buffers, their names can go."""
        if self.ipc is not None:
            self.ipc.opened()

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Payload bytes sent (0 on a rank that feeds no engine)."""
        self.fingerprints = {}
        if self.verify and (self.group is not None or self.ipc is not None):
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
    plan, and broadcast: rank, world_size; ipc: src (feeding trainer rank), engine, handles; optional verify."""

    def __init__(self, endpoint: dict):
        e = endpoint
        self.plan, self.verify, self.fingerprints = plan_from_plain(e["plan"]), e.get("verify", False), {}
        if e["channel"] == "broadcast":
            self.group, self.ipc = SyncGroup(e["host"], e["port"], e["rank"], e["world_size"]), None
        else:
            store = connect_store(e["host"], e["port"], is_master=False)
            self.group, self.ipc = None, IpcReceiver(store, e["src"], e["engine"], e["handles"])

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors of one sync, bucket by bucket as they arrive (in memory the consumer may keep);
        fingerprinted as they pass when verifying."""
        self.fingerprints = {}
        named = receive_weights(self.group, self.plan) if self.group is not None else self.ipc.receive(self.plan)
        return recorded(named, self.fingerprints) if self.verify else named


# ---- the driver's side ----
def _node_of(_actor_self) -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def off_node_engines(trainers: list, group, timeout_s: float = 300.0) -> list[int]:
    """Engines that are not on their feeding trainer rank's node (shared memory cannot reach them)."""
    roles = _trainer_roles(trainers) + group.roles
    nodes = ray_get([a.__ray_call__.remote(_node_of) for a in trainers + group.engines], timeout_s, roles)
    world = len(trainers)
    return [i for i in range(len(group.engines)) if nodes[world + i] != nodes[feeding_rank(i, world)]]


def _trainer_roles(trainers: list) -> list[str]:
    return [f"policy trainer {i}" for i in range(len(trainers))]


def setup_sync(channel: str, trainers: list, group, plan: list[list[TensorSpec]], strict: bool = False,
               timeout_s: float = 300.0, verify: bool = False) -> str:
    """Form `channel` between the trainer ranks and every engine of `group` (a RolloutGroup), handing both ends the
    plan; returns the channel in use. An ipc engine on another node than its trainer rank is an error when ipc was
    asked for (`strict`), else the run falls back to broadcast. Called again after an engine restart. `verify`: both
    ends fingerprint what passes (rollout.sync_check.verify_sync compares them)."""
    off_node = off_node_engines(trainers, group) if channel == "ipc" else []
    if off_node and strict:
        i = off_node[0]
        raise UserError(f"rollout.sync_channel = 'ipc': rollout engine {i} runs on another node than policy trainer "
                        f"{feeding_rank(i, len(trainers))}, and shared memory does not cross nodes; set "
                        "rollout.sync_channel=broadcast (or auto), or placement.mode=colocate")
    channel = "broadcast" if off_node else channel
    roles = _trainer_roles(trainers)
    if channel == "local":  # each rank's engine is in its own process: nothing to connect, no address to ask for
        ray_get([t.open_sender.remote("local", "", 0, plan) for t in trainers], timeout_s, roles)
        return channel
    host, port = ray_get([trainers[0].sync_address.remote()], timeout_s, roles[:1])[0]
    world, plain = len(trainers), plan_to_plain(plan)
    if channel == "broadcast":
        refs = [t.open_sender.remote("broadcast", host, port, plan, world_size=1 + len(group.engines), verify=verify)
                for t in trainers]
        refs += [e.open_receiver.remote(dict(channel="broadcast", host=host, port=port, plan=plain, rank=i + 1,
                                             world_size=1 + len(group.engines), verify=verify))
                 for i, e in enumerate(group.engines)]
        ray_get(refs, timeout_s, roles + group.roles)
        return channel
    src = [feeding_rank(i, world) for i in range(len(group.engines))]
    handles: dict[int, list[bytes]] = {}
    for h in ray_get([t.open_sender.remote("ipc", host, port, plan, engines=[i for i, s in enumerate(src) if s == r],
                                           verify=verify) for r, t in enumerate(trainers)], timeout_s, roles):
        handles.update(h)
    try:
        ray_get([e.open_receiver.remote(dict(channel="ipc", host=host, port=port, plan=plain, src=src[i], engine=i,
                                             handles=handles[i], verify=verify)) for i, e in enumerate(group.engines)],
                timeout_s, group.roles)
    finally:
        ray_get([t.sender_opened.remote() for t in trainers], timeout_s, roles)
    return channel


def sync_weights(trainers: list, group) -> int:
    """One full-weight sync over the channel `setup_sync` formed: every trainer rank exports (ZeRO-3 gathers are
    collective) and sends, every engine reloads and drops its prefix cache, at once (they block on each other).
    Returns the payload bytes of trainer rank 0. Engines hosted by the trainer ranks (`local`) receive inside
    their rank's send."""
    receivers = [] if group.in_trainers else group.engines
    from rollout.group import BASE_TIMEOUT_S, TIMEOUT_HINT
    refs = [t.send_weights.remote() for t in trainers] + [e.receive_weights.remote() for e in receivers]
    return ray_get(refs, group.timeout_s or BASE_TIMEOUT_S, _trainer_roles(trainers) + group.roles[:len(receivers)],
                   TIMEOUT_HINT)[0]
