"""Weight-sync cost per channel and model size: seconds (median) and GB/s, trainer -> vLLM engine(s).

    python benchmarks/sync_bench.py [--sizes 1M 10M 100M] [--repeats 3] [--engines 1]

broadcast:  trainer actor (rank 0) -> engine actors over the dedicated gloo group, 64 MiB buckets, plus reload
ipc:        trainer actor -> engine actors on the same host through two shared 64 MiB staging buffers (/dev/shm
            here; CUDA IPC on a GPU), plus reload
in_process: trainer and engine in one actor, tensors handed over directly, plus reload
All include vLLM's reload_weights and the prefix-cache reset, i.e. what a training step waits for.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, build, median_time, n_params, print_table  # noqa: E402
from common.remote import python_path  # noqa: E402


class Hybrid:
    """Trainer and engine in one process (the in-process channel)."""

    def __init__(self, path: str, engine_kwargs: dict):
        from actors.policy import PolicyTrainer
        from rlhf.config import TrainerConfig
        from rollout.engines.vllm import VLLMEngine
        self.trainer = PolicyTrainer(path, TrainerConfig(batch_size=8, micro_batch_size=8))
        self.engine = VLLMEngine(path, **engine_kwargs)

    def timed_sync(self, repeats: int) -> float:
        return median_time(lambda: self.engine.update_weights(self.trainer.iter_weights()), repeats)


def bench_size(size: str, repeats: int, n_engines: int) -> list[list]:
    import ray

    from actors.policy import PolicyTrainer
    from common.remote import make_actor, ray_get
    from rlhf.config import TrainerConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync, sync_weights
    from rollout.sync.buckets import plan_buckets

    path = build(size)
    engine_kwargs = dict(model_path=path, max_model_len=128, kv_cache_mb=16)
    trainer = make_actor(PolicyTrainer, "trainer", {}, path, TrainerConfig(batch_size=8, micro_batch_size=8))
    group = RolloutGroup.create(n_engines, engine_kwargs, engine_cls=VLLMEngine)
    specs = ray_get([trainer.weight_specs.remote()], 600, ["trainer"])[0]
    nbytes = sum(s.nbytes for s in specs)
    plan = plan_buckets(specs, 64 << 20)
    setup_sync("broadcast", [trainer], group, plan)
    sync_weights([trainer], group)  # warm-up
    bcast = median_time(lambda: sync_weights([trainer], group), repeats)
    setup_sync("ipc", [trainer], group, plan)
    sync_weights([trainer], group)  # warm-up
    ipc = median_time(lambda: sync_weights([trainer], group), repeats)
    group.shutdown()
    ray.kill(trainer)

    hybrid = make_actor(Hybrid, "hybrid", {}, path, {k: v for k, v in engine_kwargs.items() if k != "model_path"})
    ray_get([hybrid.timed_sync.remote(1)], 600, ["hybrid"])  # warm-up
    inproc = ray_get([hybrid.timed_sync.remote(repeats)], 1200, ["hybrid"])[0]
    ray.kill(hybrid)
    head = [size, f"{n_params(path) / 1e6:.1f}M", f"{nbytes / 2**20:.0f}"]
    return [head + ["broadcast", n_engines, bcast, nbytes / bcast / 1e9],
            head + ["ipc", n_engines, ipc, nbytes / ipc / 1e9],
            head + ["in_process", 1, inproc, nbytes / inproc / 1e9]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", type=int, default=1)
    args = parser.parse_args()
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": python_path(os.getcwd())}})
    rows = []
    for size in args.sizes:
        rows += bench_size(size, args.repeats, args.engines)
    ray.shutdown()
    print_table(["size", "params", "MiB sent", "channel", "engines", "median s", "GB/s"], rows)


if __name__ == "__main__":
    main()
