"""Asynchronous RL (`rollout.max_staleness` K) against the synchronous loop (K = 0): the same recipe, seed and steps,
once per K, in one run on one machine.

    python benchmarks/async_rl.py --model tiny --steps 30         # examples/sort_grpo.yaml from a cached SFT model
    python benchmarks/async_rl.py --model real --steps 10         # examples/smollm2_math_grpo.yaml (SmolLM2-135M)
    python benchmarks/async_rl.py --model real --ks 0,1 --extra placement.cpu_threads=2

Per K: median seconds a step; trained tokens/s (the sampled tokens of every step, over the steps' summed time);
steps a minute; held-out greedy accuracy before -> after; its gain per step and per minute of steps; mean and
largest staleness; the share of samples a sync interrupted. Evaluation runs only before and after (outside the
step times). Under K > 0 trainers and engines compute at the same time, so by default each gets half the cores
(placement.cpu_threads); `--extra` passes further overrides to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table, run_recipe  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "async_rl")


def run(args: list[str]) -> float:
    return run_recipe(args, ROOT)


def recipe(model: str) -> list[str]:
    """The config and model overrides of `model` (tiny: the sort SFT checkpoint, trained once and cached)."""
    if model == "real":
        return ["--config", "examples/smollm2_math_grpo.yaml", "logging.rollouts_every=0"]
    sft = os.path.join(CACHE, "sft")
    if not os.path.isdir(os.path.join(sft, "final")):
        run(["--config", "examples/sort_sft.yaml", f"output_dir={sft}"])
    return ["--config", "examples/sort_grpo.yaml", f"model.path={sft}/final", "data.num_eval=128"]


def one(k: int, base: list[str], steps: int, extra: list[str]) -> list:
    out = os.path.join(CACHE, f"k{k}-{time.strftime('%m%d-%H%M%S')}")
    wall = run([*base, f"output_dir={out}", f"trainer.max_steps={steps}", f"eval.every={steps}",
                "checkpoint.every=0", f"rollout.max_staleness={k}", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "config.yaml")) as f:
        rollout = yaml.safe_load(f)["rollout"]  # the run's config as it ran
    per_step, n = rollout["prompts_per_step"], rollout["n_samples"]
    head = "eval/accuracy" if "eval/accuracy" in rows[0] else "eval/exact_match"
    before, after = rows[0][head], rows[-1][head]
    trained = [r for r in rows if r["step"] > 0]
    seconds = sum(r["time/step"] for r in trained)
    tokens = sum(r["rollout/response_len"] * per_step * n for r in trained)
    stale = [r.get("rollout/staleness_mean", 0.0) for r in trained]
    return [k, statistics.median(r["time/step"] for r in trained), tokens / seconds, 60 * len(trained) / seconds,
            f"{before:.3f} -> {after:.3f}", (after - before) / len(trained), 60 * (after - before) / seconds,
            statistics.mean(stale), max(r.get("rollout/staleness_max", 0.0) for r in trained),
            statistics.mean(r.get("rollout/interrupted_frac", 0.0) for r in trained), wall]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "real"), default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ks", default="0,1,2,4", help="comma-separated max_staleness values")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run, key=value")
    a = p.parse_args()
    base = recipe(a.model)
    rows = [one(int(k), base, a.steps, a.extra) for k in a.ks.split(",")]
    k0 = next((r for r in rows if r[0] == 0), None)
    print_table(["K", "s/step (median)", "trained tok/s", "vs K=0", "steps/min", "accuracy", "gain/step",
                 "gain/min", "staleness mean", "max", "interrupted", "wall s"],
                [[r[0], r[1], r[2], r[2] / k0[2] if k0 else float("nan"), *r[3:]] for r in rows])


if __name__ == "__main__":
    main()
