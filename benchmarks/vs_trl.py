"""This project vs Hugging Face TRL on identical inputs, in one run on one machine.

    python benchmarks/vs_trl.py                          # GRPO, tiny sort model, 50 steps, TRL on every core
    python benchmarks/vs_trl.py --seed 1                 # another seed for both sides (the eval gain is noisy)
    python benchmarks/vs_trl.py --trl-threads 1 --ours 1x1   # one thread each
    python benchmarks/vs_trl.py --algo dpo
    python benchmarks/vs_trl.py --size 25M --steps 5 --ours 1x1,2x2   # a bigger model (generation-heavy on CPU)
    python benchmarks/vs_trl.py --ours 1x1,1x1o    # o: rollout.max_staleness=1 (asynchronous, K = 1)
    python benchmarks/vs_trl.py --ours 2x2,2x2s1.5   # s1.5: algorithm.oversample=1.5 (informative groups kept)
    python benchmarks/vs_trl.py --ours 2x2,2x2h      # h: placement.mode=hybrid (each engine in its rank's process)
    python benchmarks/vs_trl.py --ours 2x2h,2x2hf    # f: rollout.engine=hf (transformers generate, as TRL's)

Both sides start from the same SFT checkpoint (trained once with examples/sort_sft.yaml and cached in
.cache/vs_trl/), use fp32, the same prompts in the same order, the same reward function, constant LR, no KL, clip
0.2, one optimizer step per step. Each of our processes (trainer ranks, engines) has one torch thread; TRL has
`--trl-threads` (default: the machine's cores, which our `--equal` configuration's processes share). GRPO: 64
prompts x 8 samples, <= 16 new tokens, temperature 1, lr 5e-4. DPO: 64 pairs per step, beta 0.1 plus the chosen
NLL on both sides (TRL's loss_type [sigmoid, sft]; ours algorithm.dpo_nll_coef=1), lr 1e-4 (the DPO recipe's; 5e-4
unlearns the task). TRL lives in its own virtualenv (.cache/trl-venv, pinned below), created on first use.

Prints: median seconds per step, generated tokens/s (completion tokens / step time), peak RSS of all processes
together, start-up seconds, the whole run's wall time (start-up, steps, evaluation, saving), greedy eval
exact-match of both final models (scored by the same code), the eval gain per minute of wall time, our phase
breakdown, and per configuration `ratio: <ours/TRL a step>, <the whole run>, <the eval gain a minute>`, the
equal-cores one last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import n_params, print_table  # noqa: E402
from common.remote import python_path  # noqa: E402
from benchmarks.peak_memory import measure  # noqa: E402

TRL_PINS = ["trl==1.16.0", "transformers==5.19.0", "accelerate==1.16.0", "torch==2.13.0", "datasets==5.2.0",
            "tokenizers==0.23.3", "requests==2.34.2",  # trl imports requests without requiring it
            "math-verify==0.9.0",  # the math reward (vs_trl_real.py), the same pin as the project's
            "peft==0.21.2"]  # LoRA runs (learning_ablation.py), the project's pin
CACHE = os.path.join(ROOT, ".cache", "vs_trl")
TRL_VENV = os.path.join(ROOT, ".cache", "trl-venv")
# "1M" is the recipes' tiny model; "25M" is wider and deeper (generation-heavy on CPU).
MODEL_OVERRIDES = {"1M": [], "25M": ["model.tiny.hidden_size=512", "model.tiny.num_layers=6",
                                     "model.tiny.num_heads=8", "model.tiny.num_kv_heads=2",
                                     "model.tiny.intermediate_size=2048"]}
SFT_STEPS = {"1M": 300, "25M": 150}  # 25M: fewer, its steps are far slower
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def sh(cmd: list[str], **kw) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def trl_python() -> str:
    """TRL's own virtualenv with pinned versions; created once, never shared with the project's."""
    stamp = os.path.join(TRL_VENV, ".pins")
    if not os.path.isfile(stamp) or open(stamp).read() != "\n".join(TRL_PINS):
        sh([sys.executable, "-m", "venv", TRL_VENV])
        sh([os.path.join(TRL_VENV, "bin", "pip"), "install", "-q", *TRL_PINS])
        with open(stamp, "w") as f:
            f.write("\n".join(TRL_PINS))
    return os.path.join(TRL_VENV, "bin", "python")


def run_env() -> dict:
    return dict(os.environ, PYTHONPATH=python_path(ROOT), **ONE_THREAD)


def sft_checkpoint(size: str) -> str:
    out = os.path.join(CACHE, f"sft-{size}")
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        sh([sys.executable, "-m", "rlhf.run", "--config", "examples/sort_sft.yaml", f"output_dir={out}",
            f"trainer.max_steps={SFT_STEPS[size]}", "eval.every=0", "checkpoint.every=0",
            *MODEL_OVERRIDES[size]], cwd=ROOT, env=run_env())
    return os.path.join(out, "final")


def recipe(algo: str, model: str, out: str, steps: int, ranks: int = 1, engines: int = 1,
           oversample: float = 1.0, seed: int = 0) -> tuple[str, list[str]]:
    """Our recipe and overrides that pin every setting the comparison shares; `ranks` trainer processes (data
    parallel) and `engines` vLLM engines, each one torch thread. `oversample` 1 is TRL's algorithm; more generates
    extra prompts and keeps the groups with signal (named in the table)."""
    common = [f"trainer.world_size={ranks}" if algo == "grpo" else "trainer.world_size=1", f"model.path={model}",
              f"output_dir={out}", f"trainer.max_steps={steps}", "trainer.warmup_steps=0",
              "trainer.grad_clip=1.0", "trainer.weight_decay=0.0", "eval.every=0", "checkpoint.every=0",
              "logging.tensorboard=false", f"data.num_train={steps * 64}", f"seed={seed}"]
    if algo == "dpo":
        return "examples/sort_dpo.yaml", common + [
            "trainer.lr=1e-4", "trainer.batch_size=128", "trainer.micro_batch_size=128", "algorithm.beta=0.1",
            "algorithm.dpo_loss=sigmoid", "algorithm.dpo_nll_coef=1.0", "algorithm.label_smoothing=0.0"]
    return "examples/sort_grpo.yaml", common + [
        "trainer.lr=5e-4", "trainer.batch_size=512", "trainer.micro_batch_size=64", "rollout.prompts_per_step=64",
        "rollout.n_samples=8", "rollout.max_new_tokens=16", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.num_engines={engines}", "algorithm.name=grpo", f"algorithm.oversample={oversample}",
        "algorithm.kl_coef=0.0", "algorithm.clip_low=0.2",
        "algorithm.clip_high=0.2", "algorithm.loss_agg=seq-mean-token-mean", "algorithm.scale_by_std=true",
        "algorithm.ppo_epochs=1"]


def inputs(algo: str, model: str, steps: int, seed: int = 0) -> tuple[object, list[dict]]:
    """Our resolved config, and the rows our loop will draw, in its order (what TRL is fed, unshuffled)."""
    from rlhf.config import load_config
    from rlhf.stages.data import BatchIterator, preference_rows, prompt_rows

    path, overrides = recipe(algo, model, os.path.join(CACHE, "probe"), steps, seed=seed)
    cfg = load_config(os.path.join(ROOT, path), overrides)
    rows = (preference_rows if algo == "dpo" else prompt_rows)(cfg.data, "train", cfg.seed)
    it = BatchIterator(rows, 64, cfg.seed)
    return cfg, [r for _ in range(steps) for r in it.next()]


def run_ours(algo: str, model: str, steps: int, ranks: int, engines: int, overlap: bool = False,
             oversample: float = 1.0, hybrid: bool = False, seed: int = 0, hf: bool = False,
             extra: tuple[str, ...] = ()) -> dict:
    out = os.path.join(CACHE, f"ours-{algo}-{ranks}x{engines}{'o' * overlap}{'h' * hybrid}{'f' * hf}s{oversample}-"
                              f"{time.strftime('%H%M%S')}")
    path, overrides = recipe(algo, model, out, steps, ranks, engines, oversample, seed)
    if overlap:  # asynchronous, one update ahead: not the same algorithm as TRL's any more, so it is named in the table
        overrides += ["rollout.max_staleness=1"]  # its off-policy correction on by default
    if hybrid:
        overrides += ["placement.mode=hybrid"]
    if hf:
        overrides += ["rollout.engine=hf"]
    overrides += list(extra)
    code, peak, wall = measure([sys.executable, "-m", "rlhf.run", "--config", path, *overrides], cwd=ROOT,
                               env=run_env())
    assert code == 0, f"our run failed (exit {code}); see {out}"
    first, *rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    step_s = [r["time/step"] for r in rows]
    tokens = [r.get("rollout/response_len", 0.0) * 512 for r in rows]
    phases = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/") and k != "time/step"}
    phases.update({k: v for k, v in first.items() if k.startswith("time/start")})  # once, before step 1
    name = f"ours ({ranks} trainer rank{'s' * (ranks > 1)}, {engines} engine{'s' * (engines > 1)}" + \
        (", asynchronous K=1" if overlap else "") + (", hybrid" if hybrid else "") + \
        (", HF generate" if hf else "") + (f", oversample {oversample:g})" if oversample != 1 else ")")
    return dict(name=name if algo == "grpo" else "ours", wall=wall, peak=peak, steps=step_s,
                tokens=tokens, startup=wall - sum(step_s), model=os.path.join(out, "final"), phases=phases,
                evals=sum(r.get("time/eval", 0.0) for r in (first, *rows)))  # before and after training


def run_trl(algo: str, model: str, rows: list[dict], steps: int, threads: int = 1, seed: int = 0) -> dict:
    out = os.path.join(CACHE, f"trl-{algo}-{time.strftime('%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "rows.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    python = trl_python()
    code, peak, wall = measure([python, os.path.join(ROOT, "benchmarks", "trl_side.py"), algo, "--model", model,
                                "--data", data, "--out", out, "--steps", str(steps),
                                "--lr", "1e-4" if algo == "dpo" else "5e-4", "--threads", str(threads),
                                "--seed", str(seed)],
                               cwd=out, env=dict(run_env(), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)))
    assert code == 0, f"TRL run failed (exit {code}); see {out}"
    log = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
    step_rows = [r for r in log if "step" in r]
    step_s = [r["seconds"] for r in step_rows]
    tokens = [r.get("completions/mean_length", 0.0) * 512 for r in step_rows]
    name = f"TRL 1.16 ({threads} thread{'s' * (threads > 1)})"
    return dict(name=name, wall=wall, peak=peak, steps=step_s, tokens=tokens, startup=wall - sum(step_s),
                model=os.path.join(out, "final"), phases={}, evals=0.0)  # trl_side.py evaluates nothing


def exact_match(cfg, model_dir: str) -> float:
    """Greedy eval of a final model on our held-out prompts, by the same code for both sides."""
    import torch

    from rlhf.stages.data import make_renderer, prompt_rows
    from rollout.engines.hf import HFEngine
    from rollout.episodes import evaluate_completions
    from rollout.rewards import resolve_reward_fn

    torch.set_num_threads(1)
    rows, reward_fn = prompt_rows(cfg.data, "eval", cfg.seed), resolve_reward_fn(cfg.reward.fn, cfg.data.task)
    return evaluate_completions(HFEngine(model_dir), make_renderer(cfg, model_dir), rows, reward_fn, cfg.eval,
                                cfg.seed)["eval/exact_match"]


def report(results: list[dict], start_em: float, algo: str) -> None:
    rows = []
    for r in results:
        med = statistics.median(r["steps"])
        tok_s = statistics.median(t / s for t, s in zip(r["tokens"], r["steps"])) if algo == "grpo" else "-"
        r["gain"] = (r["em"] - start_em) / (r["wall"] / 60)
        rows.append([r["name"], med, tok_s, r["peak"] / 2**30, r["startup"], r["evals"], r["wall"], start_em,
                     r["em"], r["gain"]])
    # both final models are scored below, outside the runs; evaluations inside a run are part of its wall time
    print_table(["system", "median s/step", "gen tok/s", "peak RSS GiB", "other s (start, evals, save, exit)",
                 "of which evals", "wall s", "eval EM before", "eval EM after", "EM gain / min"], rows)
    for r in results:
        if r["phases"]:
            print(f"\n{r['name']}: median seconds per phase (start_*: once, before step 1)")
            print_table(list(r["phases"]), [list(r["phases"].values())])
    trl, *ours = results
    print()
    for r in ours:  # the equal-cores configuration (--equal) is printed last
        step = statistics.median(r["steps"]) / statistics.median(trl["steps"])
        gain = f"{r['gain'] / trl['gain']:.2f}" if trl["gain"] > 0 else "n/a (TRL gained nothing)"
        print(f"ratio: {step:.2f} a step, {r['wall'] / trl['wall']:.2f} the whole run, {gain} the eval gain a minute  "
              f"(ours / {trl['name']}; "
              f"{r['name']}{', equal cores' if r.get('equal') else ''})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["grpo", "dpo"], default="grpo")
    p.add_argument("--size", choices=list(MODEL_OVERRIDES), default="1M")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ours", default="1x1,2x2h",
                   help="our configurations to run, RANKSxENGINES[o][h][f][sF] (o: rollout.max_staleness=1; h: "
                        "placement.mode=hybrid; f: rollout.engine=hf; sF: algorithm.oversample=F; grpo; dpo "
                        "runs 1x1)")
    p.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads for TRL: the cores our --equal configuration's processes share")
    p.add_argument("--equal", default=None, help="which of --ours has TRL's cores (default: the last one)")
    p.add_argument("--seed", type=int, default=0, help="both sides' seed: sampling, the prompts' order, the eval "
                                                        "set (one run's eval gain is noisy: compare several)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more overrides for every one of our runs, e.g. rollout.seed_per_prompt=true")
    a = p.parse_args()

    os.environ.update(ONE_THREAD)
    model = sft_checkpoint(a.size)
    cfg, rows = inputs(a.algo, model, a.steps, a.seed)
    print(f"{a.algo}, {a.size} model ({n_params(model) / 1e6:.1f}M parameters), {a.steps} steps", flush=True)
    results = [run_trl(a.algo, model, rows, a.steps, a.trl_threads, a.seed)]
    configs = ["1x1"] if a.algo == "dpo" else a.ours.split(",")
    equal = a.equal or configs[-1]
    for config in sorted(configs, key=lambda c: c == equal):  # the equal-cores one last
        m = re.fullmatch(r"(\d+)x(\d+)(o?)(h?)(f?)(?:s([\d.]+))?", config)
        if m is None:
            p.error(f"--ours {config!r}: write RANKSxENGINES, optionally followed by o, h, f and/or sF "
                    "(e.g. 2x2hs1.5)")
        results.append(run_ours(a.algo, model, a.steps, int(m[1]), int(m[2]), overlap=m[3] == "o",
                                hybrid=m[4] == "h", oversample=float(m[6] or 1), seed=a.seed, hf=m[5] == "f",
                                extra=tuple(a.set)))
        results[-1]["equal"] = config == equal
    for r in results:
        r["em"] = exact_match(cfg, r["model"])
    report(results, exact_match(cfg, model), a.algo)


if __name__ == "__main__":
    main()
