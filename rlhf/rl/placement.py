"""Where each role's actors run. `colocate`: every role shares the same GPU bundles through fractional GPU requests
(phases time-slice the GPUs). `hybrid`: as colocate, with each rollout engine inside its policy rank's process
(actors.hybrid; no rollout role of its own). `split`: each role gets whole GPUs of its own. With
`placement.num_gpus: 0` actors only ask for a fraction of a CPU. On a CPU host, `ray.init(num_gpus=k)` makes logical
GPUs, so the same logic runs (and is tested) without CUDA."""
from __future__ import annotations

from typing import Optional

from common.errors import UserError


def plan_placement(mode: str, num_gpus: int, ranks: dict[str, int],
                   gpus_per_rank: Optional[dict[str, int]] = None) -> tuple[list[dict], dict[str, list[tuple]]]:
    """Bundles for one placement group and, per role, each rank's (bundle index, GPUs it asks for).

    ranks: role -> number of actors, e.g. {"policy": 2, "rollout": 2}. `gpus_per_rank` (split only): a role whose
    actors each take several whole GPUs (a tensor-parallel engine: rollout -> its size). Pure: no Ray calls.
    """
    per = {role: (gpus_per_rank or {}).get(role, 1) for role in ranks}
    if mode in ("colocate", "hybrid"):
        if max(ranks.values()) > num_gpus:
            raise UserError(f"placement.num_gpus = {num_gpus}: {mode} needs one GPU per rank of the largest "
                            f"role ({max(ranks, key=ranks.get)} has {max(ranks.values())}); raise num_gpus or use "
                            "placement.mode=split")
        share = 1.0 / len(ranks)
        share = int(share * 1000) / 1000  # fractions must add up to <= 1 per bundle
        return ([{"GPU": 1, "CPU": 0.5 * len(ranks)} for _ in range(num_gpus)],
                {role: [(i, share) for i in range(n)] for role, n in ranks.items()})
    if mode == "split":
        need = sum(n * per[role] for role, n in ranks.items())
        if need > num_gpus:
            layout = ", ".join(f"{n} {role}" + (f" x {per[role]} GPUs" if per[role] > 1 else "")
                               for role, n in ranks.items())
            raise UserError(f"placement.num_gpus = {num_gpus}: split placement needs whole GPUs for every rank of "
                            f"every role ({need} for {layout}); raise num_gpus, or lower the ranks, engines or "
                            "rollout.tensor_parallel_size")
        out, bundles = {}, []
        for role, n in ranks.items():
            out[role] = [(len(bundles) + i, float(per[role])) for i in range(n)]
            bundles += [{"GPU": per[role], "CPU": 0.5} for _ in range(n)]
        return bundles, out
    raise UserError(f"placement.mode = {mode!r}: must be colocate, hybrid or split")


def describe_placement(mode: str, num_gpus: int, ranks: dict[str, int], gpus_per_rank: dict[str, int],
                       workers: dict[str, int]) -> str:
    """The start-up's one line on where the roles run: per role its actors, the GPUs each asks for, and the
    processes each runs (a tensor-parallel engine's workers)."""
    parts = []
    for role, n in ranks.items():
        per, proc = gpus_per_rank.get(role, 1), workers.get(role, 1)
        gpus = "" if num_gpus == 0 else (f" x {per} GPUs" if mode == "split" and per > 1 else
                                         " x 1 GPU" if mode == "split" else " (sharing GPUs)")
        parts.append(f"{n} {role}{gpus}" + (f", {proc} workers each" if proc > 1 else ""))
    where = f"{mode} on {num_gpus} GPUs" if num_gpus else "CPU only"
    return f"placement: {where}: " + "; ".join(parts)


def check_cpu_capacity(ranks: dict[str, int]) -> None:
    """A CPU-only run's actors must all fit the cluster's CPUs at once (each asks CPU_PER_ACTOR); otherwise some
    would wait unscheduled until a deadline, then be blamed for a hang. Raises UserError naming the demand."""
    import ray

    from common.remote import CPU_PER_ACTOR
    need, have = CPU_PER_ACTOR * sum(ranks.values()), ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        roles = ", ".join(f"{n} {role}" for role, n in ranks.items())
        raise UserError(f"placement: this run starts {sum(ranks.values())} actors ({roles}), {CPU_PER_ACTOR:g} CPU "
                        f"each in Ray = {need:g}, and the cluster has {have:g}; they could never all run. Lower "
                        "trainer.world_size or rollout.num_engines, or give Ray more CPUs (ray start --num-cpus)")


class Placement:
    """Ray options for every rank of every role, backed by one placement group (or none on CPU-only runs)."""

    def __init__(self, mode: str, num_gpus: int, ranks: dict[str, int], timeout_s: float = 120.0,
                 threads: int = 1, gpus_per_rank: Optional[dict[str, int]] = None):
        self.pg = None
        env = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
        self.options: dict[str, list[dict]] = {role: [dict(env) for _ in range(n)] for role, n in ranks.items()}
        if num_gpus == 0:
            check_cpu_capacity(ranks)
            return
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles, assignment = plan_placement(mode, num_gpus, ranks, gpus_per_rank)
        self.pg = ray.util.placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            have = ray.cluster_resources().get("GPU", 0)
            ray.util.remove_placement_group(self.pg)
            raise UserError(f"placement: {len(bundles)} GPU bundles ({mode}) could not be reserved within "
                            f"{timeout_s:.0f} s; the cluster has {have:g} GPUs. Lower placement.num_gpus or the "
                            "number of ranks/engines") from None
        for role, slots in assignment.items():
            self.options[role] = [{
                **env, "num_gpus": frac, "num_cpus": 0.25,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=b),
            } for b, frac in slots]

    def remove(self) -> None:
        if self.pg is not None:
            import ray
            ray.util.remove_placement_group(self.pg)
            self.pg = None
