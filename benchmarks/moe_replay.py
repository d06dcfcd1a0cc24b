"""The tiny mixture-of-experts sort recipe with and without routing replay, over seeds: what each step's engine and
trainer disagree on (rollout/logprob_diff, moe/router_agreement) and what 40 GRPO steps learn. One SFT run
(examples/sort_moe_sft.yaml) is shared; each (variant, dtype, seed) then runs examples/sort_moe_grpo.yaml.
`measure` records the engine's routes and only compares them, `rollout` replays them.

    python benchmarks/moe_replay.py [--variants measure,rollout] [--dtypes bfloat16] [--seeds 0,1,2] [--steps 40]
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

CACHE = os.path.join(ROOT, ".cache", "moe_replay")


def sft_model() -> str:
    out = os.path.join(CACHE, "sft")
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        run_recipe(["--config", "examples/sort_moe_sft.yaml", f"output_dir={out}", "eval.every=-1",
                    "checkpoint.every=0", "model.dtype=float32"], ROOT)
    return os.path.join(out, "final")


def grpo(model: str, variant: str, dtype: str, seed: int, steps: int) -> dict[str, float]:
    """The run's eval exact match before and after, and its per-step means of the engine-trainer metrics."""
    out = os.path.join(CACHE, f"{variant}-{dtype}-s{seed}-{steps}")
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        run_recipe(["--config", "examples/sort_moe_grpo.yaml", f"output_dir={out}", f"model.path={model}",
                    f"seed={seed}", f"model.dtype={dtype}", f"trainer.max_steps={steps}", f"eval.every={steps}",
                    "checkpoint.every=0", f"algorithm.routing_replay={variant}"], ROOT)
    rows = read_metrics(out)
    evals = [r for r in rows if "eval/exact_match" in r]
    steps_ = [r for r in rows if "moe/router_agreement" in r]
    return {"before": evals[0]["eval/exact_match"], "after": evals[-1]["eval/exact_match"],
            "diff": statistics.mean(r["rollout/logprob_diff"] for r in steps_),
            "agree": statistics.mean(r["moe/router_agreement"] for r in steps_)}


def mean_sd(xs: list[float], fmt: str = "{:+.3f}") -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.mean(xs))} ± {fmt.format(sd).lstrip('+')}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="measure,rollout")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    model, rows = sft_model(), []
    for dtype in args.dtypes.split(","):
        for variant in args.variants.split(","):
            got = [grpo(model, variant, dtype, int(s), args.steps) for s in args.seeds.split(",")]
            rows.append([variant, dtype, ", ".join(f"{g['before']:.3f} -> {g['after']:.3f}" for g in got),
                         mean_sd([g["after"] - g["before"] for g in got]),
                         mean_sd([g["diff"] for g in got], "{:.2e}"), mean_sd([g["agree"] for g in got], "{:.4f}")])
    print_table(["routing_replay", "dtype", "eval exact match, seeds " + args.seeds, "gain mean ± sd",
                 "rollout/logprob_diff (step mean)", "moe/router_agreement (step mean)"], rows)


if __name__ == "__main__":
    main()
