"""What recording the run's timeline costs (logging.trace): the tiny GRPO recipe's step time with it on and off,
runs alternating, the median step of each run and the median over runs. Each run starts from the tiny kit's model
(no SFT: the step's work is the same either way) and skips evaluation and checkpoints.

    python benchmarks/trace_cost.py [--runs 3] [--steps 12] [--recipe examples/sort_grpo.yaml]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table, run_recipe  # noqa: E402
from rlhf.outputs.metrics import read_metrics  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "trace_cost")


def run(recipe: str, trace: bool, index: int, steps: int) -> tuple[float, float]:
    """The run's median step seconds and median `time/trace` (collecting and writing the spans after each step),
    its first step left out (warm-up; the CPU's peak is probed in each worker then)."""
    out = os.path.join(CACHE, f"{'on' if trace else 'off'}-{index}")
    shutil.rmtree(out, ignore_errors=True)
    run_recipe(["--config", recipe, f"output_dir={out}", f"trainer.max_steps={steps}", "eval.every=-1",
                "checkpoint.every=0", f"logging.trace={str(trace).lower()}", "model.path=null"], ROOT)
    rows = [r for r in read_metrics(out) if "time/step" in r][1:]
    return statistics.median(r["time/step"] for r in rows), statistics.median(r.get("time/trace", 0.0) for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--recipe", default="examples/sort_grpo.yaml")
    args = p.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.runs):
        for trace in (False, True):
            got[trace].append(run(args.recipe, trace, i, args.steps))
    off = statistics.median(t for t, _ in got[False])
    rows = []
    for trace in (False, True):
        step = statistics.median(t for t, _ in got[trace])
        after = statistics.median(a for _, a in got[trace])
        rows.append([str(trace).lower(), ", ".join(f"{t:.3f}" for t, _ in got[trace]), f"{step:.3f}",
                     f"{step / off:.3f}", f"{after * 1e3:.1f}", f"{(step + after) / off:.3f}"])
    print_table(["logging.trace", "median step s per run", "median", "vs off", "time/trace ms", "with it, vs off"],
                rows)

if __name__ == "__main__":
    main()
