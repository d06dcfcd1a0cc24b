"""Rollout throughput: VLLMEngine vs HFEngine on the same model and prompts, with 1 and 2 engines (Ray actors).

    python benchmarks/rollout_bench.py [--sizes 1M 10M] [--prompts 64] [--n 8] [--tokens 16] [--repeats 3]

Tokens/s counts generated tokens (EOS included) per wall-clock second of RolloutGroup.generate, median of repeats
after one warm-up call. Start is the time until every engine of the group answered.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, build, n_params, print_table  # noqa: E402


def bench(engine: str, n_engines: int, path: str, prompts, sampling, repeats: int) -> list:
    from rollout.group import RolloutGroup
    if engine == "vllm":
        from rollout.engines.vllm import VLLMEngine as cls
        kwargs = dict(model_path=path, max_model_len=128, kv_cache_mb=64)
    else:
        from rollout.engines.hf import HFEngine as cls
        kwargs = dict(model_path=path)
    start = time.perf_counter()
    group = RolloutGroup.create(n_engines, kwargs, engine_cls=cls)
    started = time.perf_counter() - start
    group.generate(prompts, sampling)  # warm-up (compiles, allocations)
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        samples = group.generate(prompts, sampling)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(s.completion_ids) for s in samples)
    group.shutdown()
    med = statistics.median(times)
    return [engine, n_engines, started, med, tokens, tokens / med]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1M", "10M"], choices=list(SIZES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray
    from transformers import AutoTokenizer

    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows
    from rollout.engine import SamplingConfig

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    sampling = SamplingConfig(max_new_tokens=args.tokens, temperature=1.0, n=args.n, seed=0)
    rows = []
    for size in args.sizes:
        path = build(size)
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok(r["prompt"]).input_ids for r in make_rows(DataConfig(num_train=args.prompts), "train", 0)]
        for engine in ("vllm", "hf"):
            for n_engines in (1, 2):
                rows.append([f"{size} ({n_params(path) / 1e6:.1f}M)"] + bench(engine, n_engines, path, prompts,
                                                                             sampling, args.repeats))
    ray.shutdown()
    print(f"{args.prompts} prompts x {args.n} samples x <= {args.tokens} new tokens, temperature 1, fp32, "
          f"{os.cpu_count()} CPUs")
    print_table(["model", "engine", "engines", "start s", "median s", "tokens", "tokens/s"], rows)


if __name__ == "__main__":
    main()
