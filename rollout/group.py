"""`RolloutGroup`: several rollout engines (data parallel, each a Ray actor) behind one object. Prompts are split
across engines and results come back in input order; weight syncs go to every engine at once."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from actors.remote import make_actor, ray_get
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

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Sample]:
        """Contiguous chunks per engine; per-prompt seeds are offset by the chunk start, so the samples are the same
        whatever the number of engines."""
        n = len(self.engines)
        bounds = [len(prompt_ids) * i // n for i in range(n + 1)]
        spans = [(e, lo, hi) for e, lo, hi in zip(self.engines, bounds, bounds[1:]) if hi > lo]
        refs = [e.generate.remote(prompt_ids[lo:hi], replace(sampling, seed=sampling.seed + lo)) for e, lo, hi in spans]
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
    refs = [t.send_weights.remote(plan) for t in trainers] + [e.receive_broadcast.remote(plan) for e in group.engines]
    roles = [f"policy trainer {i}" for i in range(len(trainers))] + group.roles
    return ray_get(refs, timeout_s, roles)[0]
