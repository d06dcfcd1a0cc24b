"""Learning per step on the real model, seeds apart: TRL's GRPO, ours as shipped before trainer.precision existed
(a git ref run from a worktree of its own), and ours under each trainer.precision; SmolLM2-135M-Instruct with the
settings of examples/smollm2_math_grpo.yaml (benchmarks/vs_trl_real.py pairs the two sides the same way).

    python benchmarks/learning_ablation.py --variants trl,shipped,bf16-true,bf16-mixed --seeds 0,1,2
    python benchmarks/learning_ablation.py --report          # the table from every result recorded so far
    python benchmarks/learning_ablation.py --one-update      # one step in each precision: what reaches the weights

Each finished run appends one JSON line to .cache/learning_ablation/results.jsonl (variant, seed, greedy accuracy
before and after, policy entropy at the first and last step, median step seconds, wall), so a sweep can be run in
pieces; the table gives mean ± sd over the seeds recorded for each variant, with their count. Every final model is
scored by the same code in its own process: greedy accuracy on the 128 held-out prompts (vLLM, bf16). Neither side
evaluates inside its run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table  # noqa: E402
from benchmarks.peak_memory import measure  # noqa: E402
from benchmarks.vs_trl_real import RECIPE, ordered_rows, run_trl, score  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "learning_ablation")
RESULTS = os.path.join(CACHE, "results.jsonl")
SHIPPED_REF = "c311020"  # main before trainer.precision: bf16 masters cloned from bf16, Adam's first step 0.74 lr
LORA_RECIPE = "examples/smollm2_math_grpo_lora.yaml"
# the LoRA recipe's adapter and settings on TRL's side (same PEFT config, KL to the adapter-disabled model)
TRL_LORA = ("--lora-rank", "16", "--lora-alpha", "32", "--beta", "0.01", "--lr", "5e-4")
# variant -> (what it is, overrides of the recipe); "shipped" runs SHIPPED_REF's code, "trl*" TRL, "lora*" the
# LoRA recipe
VARIANTS = {
    "trl": ("TRL 1.16 (fp32 weights, bf16 autocast, transformers generate)", None),
    "trl-lora": ("TRL 1.16 with the LoRA recipe's adapter (rank 16, alpha 32, all linear layers), lr 5e-4, KL "
                 "0.01", None),
    "lora": ("ours, examples/smollm2_math_grpo_lora.yaml (merged sync) in trainer.precision=bf16-true, as shipped "
             "until 2026-12-04", ["trainer.precision=bf16-true"]),
    "lora-bf16-mixed": ("ours, the LoRA recipe with trainer.precision=bf16-mixed (as shipped since 2026-12-04)",
                        ["trainer.precision=bf16-mixed"]),
    "shipped": (f"ours at {SHIPPED_REF}: the recipe as shipped before this benchmark", []),
    "bf16-true": ("ours, trainer.precision=bf16-true (masters from the file, Adam fixed)",
                  ["trainer.precision=bf16-true"]),
    "bf16-mixed": ("ours, trainer.precision=bf16-mixed", ["trainer.precision=bf16-mixed"]),
    "fp32": ("ours, trainer.precision=fp32 (engine bf16)", ["trainer.precision=fp32"]),
}


def source_tree(ref: str) -> str:
    """A worktree of `ref` under the cache (made once), so an older version runs beside this one."""
    path = os.path.join(CACHE, f"src-{ref}")
    if not os.path.isdir(path):
        subprocess.run(["git", "worktree", "add", "--detach", path, ref], cwd=ROOT, check=True)
    return path


def run_ours(variant: str, steps: int, seed: int) -> dict:
    src = source_tree(SHIPPED_REF) if variant == "shipped" else ROOT
    out = os.path.join(CACHE, f"{variant}-s{seed}-{time.strftime('%H%M%S')}")
    recipe = LORA_RECIPE if variant.startswith("lora") else RECIPE
    cmd = [sys.executable, "-m", "rlhf.run", "--config", recipe, f"output_dir={out}", f"trainer.max_steps={steps}",
           "eval.every=-1", "checkpoint.every=0", f"seed={seed}", *VARIANTS[variant][1]]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    code, _, wall = measure(cmd, cwd=src, env=dict(env, PYTHONPATH=src))
    assert code == 0, f"{variant} seed {seed} failed (exit {code}); see {out}"
    _, *rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return dict(wall=wall, steps=[r["time/step"] for r in rows], entropy=[r["policy/entropy"] for r in rows],
                model=os.path.join(out, "final"))


def run_trl_side(variant: str, steps: int, seed: int, model: str) -> dict:
    r = run_trl(model, ordered_rows(steps, seed), steps, len(os.sched_getaffinity(0)), seed,
                TRL_LORA if variant == "trl-lora" else ())
    log = [json.loads(line) for line in open(os.path.join(os.path.dirname(r["model"]), "steps.jsonl"))]
    return dict(wall=r["wall"], steps=r["steps"], entropy=[x["entropy"] for x in log if "entropy" in x],
                model=r["model"])


def run_one(variant: str, steps: int, seed: int, model: str, start: float) -> dict:
    r = run_trl_side(variant, steps, seed, model) if variant.startswith("trl") else run_ours(variant, steps, seed)
    after = score(r["model"], model, seed, samples=1)["eval/accuracy"]
    row = dict(variant=variant, seed=seed, steps=steps, before=start, after=after, gain=after - start,
               entropy_first=r["entropy"][0], entropy_last=r["entropy"][-1],
               step_s=statistics.median(r["steps"]), wall=r["wall"], date=time.strftime("%Y-%m-%d"))
    os.makedirs(CACHE, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def mean_sd(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def report() -> None:
    """Learning: mean ± sd over each variant's seeds. Time: each variant's fastest run (sharing the machine only
    slows a run, so the fastest is the one that shared it least; run one seed of each alone). Ratios against TRL
    (LoRA variants against TRL's LoRA run)."""
    by: dict[str, list[dict]] = {}
    for line in open(RESULTS):
        r = json.loads(line)
        by.setdefault(r["variant"], []).append(r)

    def gain(v: str) -> float:
        return statistics.mean(r["gain"] for r in by[v])

    def timed(v: str) -> dict:
        return min(by[v], key=lambda r: r["step_s"])

    def per_min(v: str) -> float:
        return gain(v) / (timed(v)["wall"] / 60)
    table = []
    for v in [v for v in VARIANTS if v in by]:
        base = "trl-lora" if v.startswith("lora") else "trl"
        ratios = ["-"] * 3
        if base in by and gain(base) > 0:
            ratios = [f"{gain(v) / gain(base):.2f}", f"{timed(v)['step_s'] / timed(base)['step_s']:.2f}",
                      f"{per_min(v) / per_min(base):.2f}"]
        table.append([v, ",".join(str(r["seed"]) for r in by[v]), mean_sd([r["gain"] for r in by[v]]),
                      mean_sd([r["entropy_last"] for r in by[v]]), timed(v)["step_s"], per_min(v), *ratios])
    print_table(["variant", "seeds", "greedy acc gain (mean ± sd)", "entropy at the end",
                 "median s/step (fastest seed)", "gain a minute (its wall)", "gain / TRL's", "step / TRL's",
                 "gain a minute / TRL's"], table)
    for v in by:
        print(f"  {v}: {VARIANTS[v][0]}")


def bf16_stored(model: str) -> str:
    """A copy of the checkpoint stored in bf16, as most Hugging Face releases are (made once under the cache)."""
    out = os.path.join(CACHE, "SmolLM2-135M-Instruct-bf16")
    if not os.path.isfile(os.path.join(out, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(out)
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def one_update(model: str, lr: float = 2e-5) -> None:
    """One optimizer step of the same 64 rows (held-out problems with their answers, SFT loss) in each precision,
    from the fp32 file and from a bf16-stored copy: how much of Adam's first step (±lr per weight) reaches the
    weights the forward pass and the engines see."""
    import json as js

    import torch

    from actors.policy import PolicyTrainer
    from rlhf.config import TrainerConfig
    from rlhf.stages.sft import tokenize_sft
    from rollout.render import PromptRenderer

    rows = [js.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))][:64]
    batch = tokenize_sft(PromptRenderer.from_pretrained(model), [
        {"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in rows])
    table = []
    for name, path in (("fp32 file", model), ("bf16-stored copy", bf16_stored(model))):
        for precision in ("bf16-true", "bf16-mixed"):
            tr = TrainerConfig(lr=lr, batch_size=64, micro_batch_size=16, warmup_steps=0, precision=precision)
            trainer = PolicyTrainer(path, tr, dtype="bfloat16")
            seen = {n: p.detach().to(torch.bfloat16).float() for n, p in trainer.model.named_parameters()}
            trainer.sft_step(batch)
            moved, reach, norms = [], [], []
            for n, p in trainer.model.named_parameters():
                delta = (p.detach().to(torch.bfloat16).float() - seen[n]).abs()  # what a bf16 engine receives
                moved.append((delta > 0).float().mean().item() * p.numel())
                reach.append((delta.sum() / lr).item())
                if "norm" in n:
                    norms.append((delta > 0).float().mean().item())
            total = sum(p.numel() for p in trainer.model.parameters())
            table.append([name, precision, sum(moved) / total, sum(reach) / total, statistics.mean(norms)])
            del trainer
    print_table(["checkpoint", "trainer.precision", "share of weights the engine sees move",
                 "mean |step| seen / lr", "share of norm gains that move"], table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="trl,shipped,bf16-true,bf16-mixed",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--report", action="store_true", help="only print the table of the results recorded so far")
    p.add_argument("--one-update", action="store_true", help="only the one-update comparison of precisions")
    a = p.parse_args()
    if a.one_update:
        from rlhf import smollm2
        return one_update(smollm2.provision())
    if not a.report:
        from rlhf import smollm2

        model = smollm2.provision()
        start = score(model, model, 0, samples=1)["eval/accuracy"]  # greedy: the same for every seed
        for seed in [int(s) for s in a.seeds.split(",")]:
            for variant in a.variants.split(","):
                run_one(variant, a.steps, seed, model, start)
    report()


if __name__ == "__main__":
    main()
