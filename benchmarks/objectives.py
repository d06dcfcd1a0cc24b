"""The policy surrogates side by side on the tiny sort task: examples/sort_grpo.yaml from the same SFT checkpoint,
the same seed and steps, once per `algorithm.policy_loss`, in one run on one machine.

    python benchmarks/objectives.py                   # clip, gspo, gspo_token, cispo; 40 steps each
    python benchmarks/objectives.py --steps 20 --only clip,cispo

One on-policy optimizer step per rollout makes every ratio 1, where the surrogates differ only in how they weight
tokens; so each run takes 4 optimizer steps per rollout (trainer.batch_size 64 of 256 samples), where the later
ones are off-policy and the clipping differs. Each surrogate runs with its paper's settings: clip as the recipe
ships (0.2 / 0.28, token-mean); GSPO and GSPO-token with clip 3e-4 / 4e-4 and a per-sequence mean; CISPO with the
lower side open (clip_low 1.0) and clip_high 0.28, token-mean. Prints greedy exact match before and after, the
last five steps' sampled reward, the clipped fraction and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table, run_recipe  # noqa: E402

GSPO = ["algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4", "algorithm.loss_agg=seq-mean-token-mean"]
SETTINGS = {"clip": [], "gspo": GSPO, "gspo_token": GSPO,
            "cispo": ["algorithm.clip_low=1.0", "algorithm.clip_high=0.28"]}
CACHE = os.path.join(ROOT, ".cache", "objectives")


def sft_checkpoint() -> str:
    """The sort SFT model every run starts from (trained once, cached)."""
    out = os.path.join(CACHE, "sft")
    if not os.path.isdir(os.path.join(out, "final")):
        run(["--config", "examples/sort_sft.yaml", f"output_dir={out}"])
    return os.path.join(out, "final")


def run(args: list[str]) -> float:
    return run_recipe(args, ROOT)


def one(surrogate: str, model: str, steps: int, seed: int) -> list:
    out = os.path.join(CACHE, f"{surrogate}-{time.strftime('%H%M%S')}")
    wall = run(["--config", "examples/sort_grpo.yaml", f"output_dir={out}", f"model.path={model}", f"seed={seed}",
                f"trainer.max_steps={steps}", "trainer.batch_size=64", f"eval.every={steps}", "checkpoint.every=0",
                f"algorithm.policy_loss={surrogate}", *SETTINGS[surrogate]])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    steps_rows = [r for r in rows if "policy/clip_frac" in r]
    return [surrogate, evals[0], evals[-1], statistics.mean(r["rollout/reward_mean"] for r in steps_rows[-5:]),
            statistics.mean(r["policy/clip_frac"] for r in steps_rows), wall]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=",".join(SETTINGS), help="comma-separated surrogates")
    a = p.parse_args()
    model = sft_checkpoint()
    rows = [one(s, model, a.steps, a.seed) for s in a.only.split(",")]
    print_table(["policy_loss", "exact match before", "after", "reward (last 5 steps)", "clip frac", "wall s"], rows)


if __name__ == "__main__":
    main()
