"""Multi-turn rollouts with a slow environment: trajectories per second when environments step while the engine
generates other trajectories' turns (rollout.multiturn.trajectory's default) against turn-synchronous rollouts (every
trajectory's turn generated, then every environment stepped, then the next turn), the same work in both.

    python benchmarks/env_overlap.py [--size 1M] [--rows 32] [--n 4] [--sleep 0.5] [--workers 64] [--repeats 3]

The environment is the number-guessing game (rollout.multiturn.guess) with a fixed sleep in every step, as a tool call
or a sandbox would take. One vLLM engine in a Ray actor; the modes alternate, the table gives medians and the ratio.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, build, print_table  # noqa: E402
from common.remote import python_path  # noqa: E402
from rollout.multiturn.guess import GuessNumber  # noqa: E402


class SlowGuess(GuessNumber):
    def __init__(self, sleep_s: float = 0.2):
        self.sleep_s = sleep_s

    def step(self, action: str):
        time.sleep(self.sleep_s)
        return super().step(action)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1M", choices=sorted(SIZES))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="trajectories per row")
    p.add_argument("--sleep", type=float, default=0.5, help="seconds per environment step")
    p.add_argument("--workers", type=int, default=64, help="env.num_workers (both modes)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import ray

    from common.schema import EnvConfig
    from rollout.engine import SamplingConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.multiturn.trajectory import TrajectoryRunner
    from rollout.render import PromptRenderer

    model = build(args.size)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {
                 "PYTHONPATH": python_path(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}})
    group = RolloutGroup.create(1, dict(model_path=model, dtype="float32", max_model_len=256, kv_cache_mb=32),
                                engine_cls=VLLMEngine)
    renderer = PromptRenderer.from_pretrained(model)
    rng = random.Random(0)
    rows = [{"secret": rng.randint(1, 15), "high": 15} for _ in range(args.rows)]
    cfg = EnvConfig(name="benchmarks.env_overlap:SlowGuess", max_turns=args.turns, kwargs={"sleep_s": args.sleep},
                    timeout_s=60.0, num_workers=args.workers)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, n=args.n)
    runners = {"stepped alongside generation": TrajectoryRunner(group, renderer, SlowGuess, cfg, 256),
               "turn-synchronous": TrajectoryRunner(group, renderer, SlowGuess, cfg, 256, barrier=True)}
    times: dict[str, list[float]] = {k: [] for k in runners}
    steps: dict[str, list[int]] = {k: [] for k in runners}
    runners["stepped alongside generation"].run(rows[:4], sampling)  # warm-up
    for _ in range(args.repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            samples = runner.run(rows, sampling)
            times[name].append(time.perf_counter() - start)
            steps[name].append(sum(s.env.turns for s in samples))
    group.shutdown()
    n_traj = args.rows * args.n
    base = statistics.median(times["turn-synchronous"])
    table = []
    for name in runners:
        med = statistics.median(times[name])
        table.append([name, med, n_traj / med, statistics.median(steps[name]), base / med])
    print(f"{n_traj} trajectories, up to {args.turns} turns, {args.sleep} s per environment step, "
          f"{args.workers} environment threads, {args.size} model, median of {args.repeats}:")
    print_table(["mode", "median s", "trajectories/s", "env steps", "speed-up"], table)


if __name__ == "__main__":
    main()
