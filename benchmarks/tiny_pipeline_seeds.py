"""The suite's tiny SFT -> GRPO pipeline (tests/e2e/test_pipeline.py) over seeds, with and without
trainer.chunked_logprobs: whether a change that is exact up to fp32 rounding moves what 16 steps learn, or only which
samples are drawn. One SFT run (the test's: examples/sort_sft.yaml, 150 steps) is shared; each (variant, seed) then
runs examples/sort_grpo.yaml for --steps steps and is scored by its own evaluations (64 held-out prompts).

    python benchmarks/tiny_pipeline_seeds.py [--variants full,chunked] [--seeds 0,1,2] [--steps 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table, run_recipe  # noqa: E402
from rlhf.outputs.metrics import read_metrics  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "tiny_pipeline_seeds")
VARIANTS = {"full": ["trainer.chunked_logprobs=false"], "chunked": ["trainer.chunked_logprobs=true"]}


def sft_model() -> str:
    out = os.path.join(CACHE, "sft")
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        run_recipe(["--config", "examples/sort_sft.yaml", f"output_dir={out}", "trainer.max_steps=150",
                    "eval.every=-1", "data.num_eval=64", "checkpoint.every=0"], ROOT)
    return os.path.join(out, "final")


def grpo(model: str, variant: str, seed: int, steps: int) -> tuple[float, float, float, float]:
    """(reward before, reward after, exact match before, after) from the run's evaluations."""
    out = os.path.join(CACHE, f"{variant}-s{seed}-{steps}")
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        run_recipe(["--config", "examples/sort_grpo.yaml", f"output_dir={out}", f"model.path={model}",
                    f"seed={seed}", f"trainer.max_steps={steps}", f"eval.every={steps}", "data.num_eval=64",
                    "checkpoint.every=0", *VARIANTS[variant]], ROOT)
    evals = [r for r in read_metrics(out) if "eval/reward_mean" in r]
    first, last = evals[0], evals[-1]
    return first["eval/reward_mean"], last["eval/reward_mean"], first["eval/exact_match"], last["eval/exact_match"]


def mean_sd(xs: list[float]) -> str:
    return f"{statistics.mean(xs):+.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:+.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="full,chunked")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    model, rows = sft_model(), []
    for variant in args.variants.split(","):
        got = {int(s): grpo(model, variant, int(s), args.steps) for s in args.seeds.split(",")}
        gains = [after - before for before, after, _, _ in got.values()]
        rows.append([variant, ", ".join(f"{g[0]:.3f} -> {g[1]:.3f}" for g in got.values()), mean_sd(gains),
                     sum(g > 0 for g in gains), mean_sd([g[3] - g[2] for g in got.values()])])
    print_table(["log-probs", "eval reward, seeds " + args.seeds, "reward gain mean ± sd", "seeds that rose",
                 "exact-match gain mean ± sd"], rows)


if __name__ == "__main__":
    main()
