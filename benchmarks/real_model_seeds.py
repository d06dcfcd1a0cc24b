"""Learning on the real models, seeds apart: each recipe of docs/real-model.md (and the agent recipe of
docs/agents.md) run as a user runs it, for several seeds, greedy accuracy on the held-out prompts before → after
(each run's own evaluations), seconds a step and the peak memory of the run's process tree.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table  # noqa: E402
from benchmarks.peak_memory import measure  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "real_model_seeds")
RESULTS = os.path.join(CACHE, "results.jsonl")
QWEN = "examples/qwen2.5_math_grpo_lora.yaml"
# recipe -> [(stage, config, overrides)]; "{prev}" is the previous stage's run folder
RECIPES = {
    "gemma": [("sft", "examples/gemma3_math_sft.yaml", []),
              ("grpo", "examples/gemma3_math_grpo.yaml", ["model.path={prev}/final"])],
    "qwen-lora": [("grpo", QWEN, [])],
    # full fine-tuning of every weight: SmolLM2's full-FT precision and examples/gpu's Qwen2.5-0.5B rate
    "qwen-full": [("grpo", QWEN, ["model.lora.rank=0", "trainer.lr=1.0e-6", "trainer.precision=bf16-true",
                                  "algorithm.kl_coef=0.0"])],
    # the default example's recipe (make run: --steps 16)
    "smollm2": [("grpo", "examples/smollm2_math_grpo.yaml", [])],
    # SmolLM2 answering through the OpenAI-compatible endpoint (agent.fn), docs/agents.md
    "smollm2-agent": [("grpo", "examples/smollm2_math_agent.yaml", [])],
}


def run_stage(recipe: str, seed: int, stage: str, config: str, overrides: list[str], prev: str | None,
              extra: list[str]) -> dict:
    tag = "".join("-" + o.split(".")[-1].replace("=", "") for o in extra if not o.startswith("eval.every"))
    out = os.path.join(CACHE, f"{recipe}-{stage}-s{seed}{tag}")
    peak = None
    if not os.path.isdir(os.path.join(out, "final")):
        cmd = [sys.executable, "-m", "rlhf.run", "--config", config, f"output_dir={out}", f"seed={seed}",
               "checkpoint.every=0", *[o.format(prev=prev) for o in overrides], *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        with open(out + ".log", "w") as log:
            code, peak, _ = measure(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        if code != 0:
            raise SystemExit(f"{recipe} {stage} seed {seed} failed (exit {code}); see {out}.log")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return dict(recipe=recipe, seed=seed, stage=stage, out=out, before=evals[0]["eval/accuracy"],
                after=evals[-1]["eval/accuracy"], after_step=evals[-1]["step"], step_s=statistics.median(steps),
                peak_gib=None if peak is None else peak / 2**30, extra=extra)


def drop_weights(out: str, last: bool) -> None:
    """A finished run's resume checkpoints (a few GiB each for these models) are never read again, nor is the
    last stage's model: left in place, a 3-seed sweep of two settings filled 50 GiB of a disk shared with CI.
    A first stage's final model stays: the next stage starts from it."""
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    if last:
        for name in os.listdir(os.path.join(out, "final")):
            if name.endswith((".safetensors", ".bin")):
                os.remove(os.path.join(out, "final", name))


def recorded() -> set[str]:
    return {json.loads(line)["out"] for line in open(RESULTS)} if os.path.exists(RESULTS) else set()


def report() -> None:
    groups: dict[tuple, list[dict]] = {}
    for line in open(RESULTS):
        r = json.loads(line)
        groups.setdefault((r["recipe"], r["stage"], " ".join(r["extra"])), []).append(r)
    rows = []
    for (recipe, stage, extra), rs in groups.items():
        gains = [r["after"] - r["before"] for r in rs]
        sd = statistics.stdev(gains) if len(rs) > 1 else float("nan")
        peaks = [r["peak_gib"] for r in rs if r["peak_gib"]]
        rows.append([recipe, stage, extra or "-", len(rs), ", ".join(str(r["seed"]) for r in rs),
                     f"{statistics.mean(r['before'] for r in rs):.3f}",
                     ", ".join(f"{r['after']:.3f}" for r in rs), f"{statistics.mean(gains):+.3f} ± {sd:.3f}",
                     rs[0]["after_step"], f"{min(r['step_s'] for r in rs):.1f}",
                     f"{max(peaks):.1f}" if peaks else "-"])
    print_table(["recipe", "stage", "overrides", "runs", "seeds", "before", "after", "gain mean ± sd", "steps",
                 "s/step (fastest run)", "peak GiB"], rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="gemma", help=f"comma-separated, of {sorted(RECIPES)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="trainer.max_steps of the last stage (0: the recipe's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the last stage's recipe (its run folder is named by it)")
    p.add_argument("--report", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep each run's checkpoints and last-stage weights")
    args = p.parse_args()
    if not args.report:
        os.makedirs(CACHE, exist_ok=True)
        for recipe in args.recipes.split(","):
            for seed in map(int, args.seeds.split(",")):
                prev = None
                for i, (stage, config, overrides) in enumerate(RECIPES[recipe]):
                    last = i == len(RECIPES[recipe]) - 1
                    extra = ([f"trainer.max_steps={args.steps}", f"eval.every={args.steps}"] if args.steps else [])
                    extra = extra + args.set if last else []
                    result = run_stage(recipe, seed, stage, config, overrides, prev, extra)
                    if result["out"] not in recorded():
                        with open(RESULTS, "a") as f:
                            f.write(json.dumps(result) + "\n")
                    if not args.keep:
                        drop_weights(result["out"], last)
                    prev = result["out"]
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
