"""`ActorGroup`: N ranks of a DeepSpeed worker (PolicyTrainer, Critic) as Ray actors forming one torch.distributed
group. Its methods are explicit: each splits the batch into per-rank shards (a pure function), calls every rank,
and gathers. Every wait has a timeout; a dead rank is reported by role and rank.

With sequence parallelism (P = trainer.sequence_parallel_size) the N ranks are N/P data-parallel groups of P
consecutive ranks: a batch is cut into N/P shards, each group's ranks get the same one (each then trains its own
part of every sequence: actors/sequence_parallel.py), and per-row results come from each group's first rank."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from actors.batching.packing import deal_by_length
from common.batch import Batch, compact, even_spans, shards
from common.net import LOOPBACK, free_port, node_host, release_port, reserve_port
from common.remote import Shipped, make_actor, ray_get, ship


class ActorGroup:
    def __init__(self, cls: type, role: str, world_size: int, options: Optional[Sequence[dict]] = None,
                 timeout_s: float = 1800.0, sequence_parallel: int = 1, **kwargs):
        """Start `world_size` actors of `cls(..., rank=i, world_size=N, master_addr=..., master_port=...)`.
        `options[i]` are rank i's Ray options (placement bundle, resources). `sequence_parallel`: the ranks that
        share each shard of rows (trainer.sequence_parallel_size)."""
        import ray

        options = list(options or [{}] * world_size)
        probe = ray.remote(_rendezvous).options(num_cpus=0, **_placement_only(options[0]))
        addr, port = ray_get([probe.remote()], timeout_s, [f"{role} 0 address probe"])[0]
        held = port is None  # one node: the driver is on it, and holds the port until rank 0 listens on it
        port = reserve_port() if held else port
        self.role, self.world_size, self.timeout_s = role, world_size, timeout_s
        self.split, self.data_parallel = sequence_parallel, world_size // sequence_parallel
        self.roles = [f"{role} {i}" for i in range(world_size)]
        try:
            self.actors = [make_actor(cls, self.roles[i], options[i], rank=i, world_size=world_size,
                                      master_addr=addr, master_port=port, **kwargs) for i in range(world_size)]
            self._wait([a.__ray_ready__.remote() for a in self.actors])
        finally:
            if held:
                release_port(port)

    def _wait(self, refs: list) -> list:
        return ray_get(refs, self.timeout_s, self.roles)

    def _shards(self, batch: Batch | Shipped) -> list:
        """One shard per rank: a Shipped batch's references, else the batch cut here (one per data-parallel group,
        the same for each of its ranks)."""
        parts = batch.refs if isinstance(batch, Shipped) else shards(batch, self.data_parallel)
        if len(parts) != self.data_parallel:
            raise ValueError(f"a batch shipped in {len(parts)} shards for {self.data_parallel} {self.role} "
                             "data-parallel groups")
        return [parts[i // self.split] for i in range(self.world_size)]

    def _scatter(self, call: Callable, batch: Batch | Shipped) -> list:
        """Per-row results of every data-parallel group, in row order (a group's first rank's)."""
        got = self._wait([call(a, shard) for a, shard in zip(self.actors, self._shards(batch))])
        return got[::self.split]

    def _all(self, call: Callable) -> list:
        return self._wait([call(a) for a in self.actors])

    # ---- typed methods ----
    def ship(self, batch: Batch) -> Shipped:
        """`batch` in the object store, one shard per rank, for every call of a step (common.remote.ship)."""
        return ship(batch, self.data_parallel)

    def train_step(self, batch: Batch | Shipped, algo=None, mini_batches: int = 0,
                   extra: Optional[Batch] = None) -> dict[str, float]:
        """One update on the whole batch (each rank trains on its shard): the workers' `train_step`, i.e. the RL
        policy loss (PolicyTrainer with `algo`), SFT (PolicyTrainer without), or the value loss (Critic). `extra`:
        per-row tensors computed after the batch was shipped (advantages, old log-probs), cut like it and merged
        into it by each rank. With `mini_batches` = n > 0 (token-budget micro-batches), the rows of each of the n
        mini-batches are dealt to the ranks by length (actors/batching/packing.py: deal_by_length), so no rank waits
        for one that got the long rows."""
        extra = extra or {}
        if mini_batches and self.data_parallel > 1:
            rows = {**(batch.batch if isinstance(batch, Shipped) else batch), **extra}
            order = deal_by_length(rows["attention_mask"].sum(1), self.data_parallel, mini_batches)
            batch, extra = {k: v[order] for k, v in rows.items()}, {}
        extras = shards(extra, self.data_parallel) if extra else [None] * self.data_parallel
        return self._wait([a.train_step.remote(shard, algo, extras[i // self.split])
                           for i, (a, shard) in enumerate(zip(self.actors, self._shards(batch)))])[0]

    def compute_logprobs(self, batch: Batch | Shipped) -> torch.Tensor:
        return torch.cat(self._scatter(lambda a, b: a.compute_logprobs.remote(b), batch))

    def compute_ref_logprobs(self, batch: Batch | Shipped) -> torch.Tensor:
        return torch.cat(self._scatter(lambda a, b: a.compute_ref_logprobs.remote(b), batch))

    def compute_values(self, batch: Batch | Shipped) -> torch.Tensor:
        return torch.cat(self._scatter(lambda a, b: a.compute_values.remote(b), batch))

    def memory_plan(self, tokens: int) -> Optional[str]:
        """Rank 0's memory plan for rows of `tokens` tokens (trainer.plan_memory), before any step; None when off."""
        return self._wait([self.actors[0].memory_plan.remote(tokens)])[0]

    def offload(self) -> None:
        """Every rank moves its DeepSpeed states to CPU until its next call (trainer.offload)."""
        self._all(lambda a: a.offload.remote())

    def export_adapter(self) -> dict[str, bytes]:
        return self._all(lambda a: a.export_adapter.remote())[0]

    def matmul_dtypes(self) -> list[str]:
        return self._all(lambda a: a.matmul_dtype.remote())

    def weight_specs(self) -> list:
        return self._wait([self.actors[0].weight_specs.remote()])[0]

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Full weights through the driver (tests and small models; syncs use send_weights)."""
        return self._all(lambda a: a.export_weights.remote())[0]

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None, merged: bool = True) -> None:
        self._all(lambda a: a.save_hf.remote(out_dir, tokenizer_path, merged))

    def save_checkpoint(self, path: str) -> None:
        self._all(lambda a: a.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> None:
        self._all(lambda a: a.load_checkpoint.remote(path))

    def kill(self) -> None:
        kill_actors(self.actors)
        self.actors = []


class Replicas:
    """Independent copies of a frozen scorer (ReferenceModel, RewardModel), one per entry of `options` (under
    colocation: one per GPU bundle, beside each trainer rank). A batch is split into contiguous row ranges, one per
    copy, scored at once and concatenated in order."""

    def __init__(self, cls: type, role: str, options: Sequence[dict], *args, timeout_s: float = 1800.0, **kwargs):
        self.timeout_s = timeout_s
        self.roles = [f"{role} {i}" for i in range(len(options))]
        self.actors = [make_actor(cls, r, o, *args, **kwargs) for r, o in zip(self.roles, options)]

    def ready(self) -> None:
        ray_get([a.__ray_ready__.remote() for a in self.actors], self.timeout_s, self.roles)

    def compute_logprobs(self, batch: Batch | Shipped) -> torch.Tensor:
        """ReferenceModel copies: (B, L-1) log-probs of the batch's rows."""
        return self._map(lambda a, rows: a.compute_logprobs.remote(rows), batch)

    def score(self, batch: Batch | Shipped) -> torch.Tensor:
        """RewardModel copies: (B,) one score a row."""
        return self._map(lambda a, rows: a.score.remote(rows), batch)

    def _map(self, call: Callable, batch: Batch | Shipped) -> torch.Tensor:
        """`call(copy, rows)` -> ObjectRef on each copy's share of the batch's rows, results concatenated along
        dim 0. A Shipped batch cut into one shard per copy (a copy beside each trainer rank) is passed by its
        references."""
        if isinstance(batch, Shipped) and len(batch.refs) == len(self.actors):
            refs = [call(a, shard) for a, shard in zip(self.actors, batch.refs)]
            return torch.cat(ray_get(refs, self.timeout_s, self.roles))
        batch = batch.batch if isinstance(batch, Shipped) else batch
        spans = even_spans(len(next(iter(batch.values()))), len(self.actors))
        refs = [call(self.actors[i], compact({k: v[lo:hi] for k, v in batch.items()})) for i, lo, hi in spans]
        return torch.cat(ray_get(refs, self.timeout_s, [self.roles[i] for i, _, _ in spans]))

    def kill(self) -> None:
        kill_actors(self.actors)
        self.actors = []


def kill_actors(actors: list) -> None:
    """End every actor of `actors` (no restart: `ray.kill` is final)."""
    import ray
    for a in actors:
        ray.kill(a)


def _placement_only(options: dict) -> dict:
    """The placement part of a rank's options, for a zero-resource task that must land on the same node."""
    return {k: v for k, v in options.items() if k == "scheduling_strategy"}


def _rendezvous() -> tuple[str, Optional[int]]:
    """Run on rank 0's node: where its group's store listens, and a free port there; no port when the cluster is
    this one node (the driver, on it too, then holds one: common.net.reserve_port)."""
    host = node_host()
    return host, (None if host == LOOPBACK else free_port())
