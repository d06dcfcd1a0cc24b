"""Engine-side memory during a weight sync: how far the vLLM engine process's RSS rises above its resting level while
it receives and reloads a full model (a copy held whole shows up as the model's size; a streamed reload stays near
the staging buckets).

    python benchmarks/sync_memory.py [--size 100M] [--channel ipc|broadcast] [--repeats 3]

The driver samples the engine actor's process tree (psutil, every 5 ms) during each sync; the table gives the
resting RSS, the median peak rise, and the model's size for scale.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, build, n_params, print_table  # noqa: E402
from common.remote import python_path  # noqa: E402


def rss(pids: list[int]) -> int:
    import psutil
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def peak_during(fn, pids: list[int]) -> int:
    """Run fn() while sampling the summed RSS of `pids`; returns the peak seen."""
    peak, done = [rss(pids)], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss(pids))
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return peak[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="100M", choices=list(SIZES))
    ap.add_argument("--channel", default="ipc", choices=["ipc", "broadcast"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    a = ap.parse_args()
    import ray

    from actors.policy import PolicyTrainer
    from common.remote import make_actor, ray_get
    from rlhf.config import TrainerConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync, sync_weights
    from rollout.sync.buckets import plan_buckets

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": python_path(os.getcwd())}})
    path = build(a.size)
    trainer = make_actor(PolicyTrainer, "trainer", {}, path, TrainerConfig(batch_size=8, micro_batch_size=8))
    group = RolloutGroup.create(1, dict(model_path=path, max_model_len=128, kv_cache_mb=16), engine_cls=VLLMEngine)
    specs = ray_get([trainer.weight_specs.remote()], 600, ["trainer"])[0]
    plan = plan_buckets(specs, a.bucket_mb << 20)
    if a.channel == "ipc":
        setup_sync("ipc", [trainer], group, plan)
        sync = lambda: sync_weights([trainer], group)  # noqa: E731
    else:
        setup_sync("broadcast", [trainer], group, plan)
        sync = lambda: sync_weights([trainer], group)  # noqa: E731
    pids = group.process_ids()[0]
    sync()  # warm-up: first-touch allocations are not the steady state
    time.sleep(1.0)
    rises, rest = [], rss(pids)
    for _ in range(a.repeats):
        rest = rss(pids)
        rises.append(peak_during(sync, pids) - rest)
        time.sleep(0.5)
    group.shutdown()
    ray.kill(trainer)
    ray.shutdown()
    model_mib = sum(s.nbytes for s in specs) / 2**20
    print_table(["size", "params", "channel", "bucket MiB", "model MiB", "engine RSS at rest MiB",
                 "median peak rise MiB", "rise / model"],
                [[a.size, f"{n_params(path) / 1e6:.0f}M", a.channel, a.bucket_mb, model_mib, rest / 2**20,
                  statistics.median(rises) / 2**20, statistics.median(rises) / 2**20 / model_mib]])


if __name__ == "__main__":
    main()
