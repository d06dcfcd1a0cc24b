"""Weight sync, the driver's API: the channel a placement gets (`sync_channel`), `setup_sync` once, `sync_weights`
after every update, `verify_sync` (rollout.verify_sync_every). The package's modules: `ends` (the trainer's
`WeightSender`, the engines' `WeightReceiver`), `buckets` (the format), one module per channel (`broadcast`, `ipc`;
`local` is the hybrid rank's hand-over by reference, in `ends`), and `check` (fingerprints).

The bucket plan (rollout.sync.buckets) travels once, at set-up, inside each end's `Endpoint`; a sync then carries
nothing but the weights. Channels: `broadcast` (a dedicated process group from trainer rank 0, rollout.sync.broadcast),
`ipc` (shared memory / CUDA IPC from each engine's feeding trainer rank, rollout.sync.ipc), and `local` (the hybrid
placement: each trainer rank hands its tensors to the engine in its own process, actors.hybrid).
"""
from __future__ import annotations

import time

from common.errors import UserError
from common.remote import WorkerDied, ray_get
from common.schema import cuda_ipc_reaches
from rollout.sync.buckets import TensorSpec, plan_to_plain
from rollout.sync.check import verify_sync
from rollout.sync.ends import WeightReceiver, WeightSender, drain
from rollout.sync.ipc import feeding_rank

__all__ = ["WeightReceiver", "WeightSender", "drain", "setup_sync", "sync_channel", "sync_weights", "verify_sync"]


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
               timeout_s: float = 300.0, verify: bool = False, workers: int = 1) -> str:
    """Form `channel` between the trainer ranks and every engine of `group` (a RolloutGroup), handing both ends the
    plan; returns the channel in use. An ipc engine on another node than its trainer rank is an error when ipc was
    asked for (`strict`), else the run falls back to broadcast. Called again after an engine restart. `verify`: both
    ends fingerprint what passes (rollout.sync.check.verify_sync compares them). `workers`: each engine's
    tensor-parallel workers (rollout.tensor_parallel_size), each of them a receiver."""
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
        refs = [t.open_sender.remote("broadcast", host, port, plan, world_size=1 + len(group.engines) * workers,
                                     verify=verify) for t in trainers]
        refs += [e.open_receiver.remote(dict(channel="broadcast", host=host, port=port, plan=plain, rank=i + 1,
                                             world_size=1 + len(group.engines), verify=verify, workers=workers))
                 for i, e in enumerate(group.engines)]
        ray_get(refs, timeout_s, roles + group.roles)
        return channel
    src = [feeding_rank(i, world) for i in range(len(group.engines))]
    handles: dict[int, list[bytes]] = {}
    done = False
    try:  # every rank's staging files are unlinked however set-up ends, a rank's own failure included
        for h in ray_get([t.open_sender.remote("ipc", host, port, plan, verify=verify, workers=workers,
                                               engines=[i for i, s in enumerate(src) if s == r])
                          for r, t in enumerate(trainers)], timeout_s, roles):
            handles.update(h)
        ray_get([e.open_receiver.remote(dict(channel="ipc", host=host, port=port, plan=plain, src=src[i], engine=i,
                                             handles=handles[i], verify=verify, workers=workers))
                 for i, e in enumerate(group.engines)],
                timeout_s, group.roles)
        done = True
    finally:
        try:
            ray_get([t.sender_opened.remote() for t in trainers], timeout_s, roles)
        except WorkerDied:
            if done:  # else the set-up's own error is the one to report
                raise
    return channel


def sync_weights(trainers: list, group, fingerprint: bool = True) -> int:
    """One full-weight sync over the channel `setup_sync` formed: every trainer rank exports (ZeRO-3 gathers are
    collective) and sends, every engine reloads and drops its prefix cache, at once (they block on each other).
    Returns the payload bytes of trainer rank 0. Engines hosted by the trainer ranks (`local`) receive inside
    their rank's send. `fingerprint`: with a channel formed to verify, whether this sync records fingerprints
    (only the syncs rollout.verify_sync_every compares need them)."""
    receivers = [] if group.in_trainers else group.engines
    from rollout.group import BASE_TIMEOUT_S, TIMEOUT_HINT
    sent = time.time()  # (the calls' spans in the run's timeline start here: common.timeline)
    refs = ([t.send_weights.remote(fingerprint) for t in trainers]
            + [e.receive_weights.remote(fingerprint) for e in receivers])
    return ray_get(refs, group.timeout_s or BASE_TIMEOUT_S, _trainer_roles(trainers) + group.roles[:len(receivers)],
                   TIMEOUT_HINT, since=sent)[0]
