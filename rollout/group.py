"""`RolloutGroup`: several rollout engines (data parallel, each a Ray actor) behind one object. Prompts are split
across engines and results come back in input order; weight syncs go to every engine at once."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from actors.remote import make_actor, ray_get
from rlhf.errors import UserError
from rollout.engine import Sample, SamplingConfig


class RolloutGroup:
    def __init__(self, engines: list, timeout_s: float = 600.0):
        self.engines, self.timeout_s = engines, timeout_s
        self.roles = [f"rollout engine {i}" for i in range(len(engines))]

    @classmethod
    def create(cls, num_engines: int, engine_kwargs: dict, actor_options: list[dict] | None = None,
               engine_cls: type | None = None, timeout_s: float = 600.0) -> "RolloutGroup":
        if engine_cls is None:
            from rollout.vllm_engine import VLLMEngine as engine_cls
        options = actor_options or [{}] * num_engines
        engines = [make_actor(engine_cls, f"rollout engine {i}", options[i], **engine_kwargs)
                   for i in range(num_engines)]
        group = cls(engines, timeout_s)
        group.call("__ray_ready__")
        return group

    def call(self, method: str, *args, **kwargs) -> list:
        return ray_get([getattr(e, method).remote(*args, **kwargs) for e in self.engines], self.timeout_s, self.roles)

    def generate(self, prompt_ids: Sequence[Sequence[int] | str], sampling: SamplingConfig) -> list[Sample]:
        return self.collect(self.submit(prompt_ids, sampling))

    def submit(self, prompt_ids: Sequence[Sequence[int] | str], sampling: SamplingConfig) -> tuple:
        """Start generating without waiting (`collect` waits). Contiguous chunks per engine; per-prompt seeds are
        offset by the chunk start, so the samples are the same whatever the number of engines."""
        n = len(self.engines)
        bounds = [len(prompt_ids) * i // n for i in range(n + 1)]
        spans = [(e, lo, hi) for e, lo, hi in zip(self.engines, bounds, bounds[1:]) if hi > lo]
        return spans, [e.generate.remote(prompt_ids[lo:hi], replace(sampling, seed=sampling.seed + lo))
                       for e, lo, hi in spans]

    def collect(self, submitted: tuple) -> list[Sample]:
        """The samples of a `submit`, in prompt order."""
        spans, refs = submitted
        chunks = ray_get(refs, self.timeout_s, self.roles)
        out = []
        for (_, lo, _), chunk in zip(spans, chunks):
            for s in chunk:
                s.prompt_index += lo
            out += chunk
        return out

    def shutdown(self) -> None:
        """Stop each engine's core cleanly, then the actors."""
        import ray
        try:
            self.call("shutdown")
        finally:
            for e in self.engines:
                ray.kill(e)
            self.engines = []


def setup_broadcast(trainers: list, group: RolloutGroup, timeout_s: float = 300.0) -> None:
    """Form the sync process group: trainer rank 0 is its rank 0, engine i is rank i + 1."""
    host, port = ray_get([trainers[0].sync_address.remote()], timeout_s, ["policy trainer 0"])[0]
    world = 1 + len(group.engines)
    refs = [t.init_sync_group.remote(host, port, world) for t in trainers]
    refs += [e.init_sync_group.remote(host, port, i + 1, world) for i, e in enumerate(group.engines)]
    ray_get(refs, timeout_s, [f"policy trainer {i}" for i in range(len(trainers))] + group.roles)


def broadcast_weights(trainers: list, group: RolloutGroup, plan, timeout_s: float = 600.0) -> int:
    """Every trainer rank exports (ZeRO-3 gathers are collective), rank 0 broadcasts, every engine reloads and drops
    its prefix cache. Returns the bytes sent."""
    return _push(trainers, group, "send_weights", "receive_broadcast", plan, timeout_s)


def _node_of(_actor_self) -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def off_node_engines(trainers: list, group: RolloutGroup, timeout_s: float = 300.0) -> list[int]:
    """Engines that are not on their feeding trainer rank's node (shared memory cannot reach them)."""
    from rollout.ipc_sync import feeding_rank

    roles = [f"policy trainer {i}" for i in range(len(trainers))] + group.roles
    nodes = ray_get([a.__ray_call__.remote(_node_of) for a in trainers + group.engines], timeout_s, roles)
    world = len(trainers)
    return [i for i in range(len(group.engines)) if nodes[world + i] != nodes[feeding_rank(i, world)]]


def setup_ipc(trainers: list, group: RolloutGroup, plan, timeout_s: float = 300.0) -> None:
    """`ipc` channel: engine i is fed by trainer rank i mod world size (its GPU neighbour under colocation), which
    shares two staging buffers with it. Each engine must be on its trainer rank's node (`setup_sync` checks)."""
    from rollout.ipc_sync import feeding_rank

    world, roles = len(trainers), [f"policy trainer {i}" for i in range(len(trainers))]
    src = [feeding_rank(i, world) for i in range(len(group.engines))]
    host, port = ray_get([trainers[0].sync_address.remote()], timeout_s, roles[:1])[0]
    feeds = [[i for i, s in enumerate(src) if s == r] for r in range(world)]
    handles = {}
    for h in ray_get([t.init_ipc.remote(host, port, feeds[r], plan) for r, t in enumerate(trainers)], timeout_s,
                     roles):
        handles.update(h)
    try:
        ray_get([e.init_ipc.remote(host, port, src[i], i, handles[i]) for i, e in enumerate(group.engines)],
                timeout_s, group.roles)
    finally:
        ray_get([t.ipc_opened.remote() for t in trainers], timeout_s, roles)


def setup_sync(channel: str, trainers: list, group: RolloutGroup, plan, strict: bool) -> str:
    """Set up `channel` (from `rlhf.placement.sync_channel`) and return the one in use. An ipc engine on another
    node than its trainer rank is an error when ipc was asked for (`strict`), else the run falls back to broadcast."""
    from rollout.ipc_sync import feeding_rank

    off_node = off_node_engines(trainers, group) if channel == "ipc" else []
    if off_node and strict:
        i = off_node[0]
        raise UserError(f"rollout.sync_channel = 'ipc': rollout engine {i} runs on another node than policy trainer "
                        f"{feeding_rank(i, len(trainers))}, and shared memory does not cross nodes; set "
                        "rollout.sync_channel=broadcast (or auto), or placement.mode=colocate")
    if channel == "ipc" and not off_node:
        setup_ipc(trainers, group, plan)
        return "ipc"
    setup_broadcast(trainers, group)
    return "broadcast"


def sync_weights(channel: str, trainers: list, group: RolloutGroup, plan) -> int:
    return (ipc_weights if channel == "ipc" else broadcast_weights)(trainers, group, plan)


def ipc_weights(trainers: list, group: RolloutGroup, plan, timeout_s: float = 600.0) -> int:
    """Every trainer rank exports (ZeRO-3 gathers are collective) and feeds its engines through shared memory; every
    engine reloads and drops its prefix cache. Returns the bytes each engine received."""
    return _push(trainers, group, "send_ipc", "receive_ipc", plan, timeout_s)


def _push(trainers: list, group: RolloutGroup, send: str, receive: str, plan, timeout_s: float) -> int:
    """Both ends of a full-weight sync at once (they block on each other); returns trainer rank 0's byte count."""
    refs = [getattr(t, send).remote(plan) for t in trainers] + [getattr(e, receive).remote(plan) for e in group.engines]
    roles = [f"policy trainer {i}" for i in range(len(trainers))] + group.roles
    return ray_get(refs, timeout_s, roles)[0]
