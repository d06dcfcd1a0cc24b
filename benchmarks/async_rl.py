"""Asynchronous RL (`rollout.max_staleness` K) against the synchronous loop (K = 0): the same recipe and steps, per
variant and seed, in one run on one machine.

    python benchmarks/async_rl.py --model tiny --steps 30                  # examples/sort_grpo.yaml, a cached SFT model
    python benchmarks/async_rl.py --model real --steps 10                  # examples/smollm2_math_grpo.yaml (SmolLM2)
    python benchmarks/async_rl.py --model real --max-new-tokens 512 --variants k0,k1,k2,k1-recompute,k1-chunked \\
        --seeds 0,1,2                                                       # the long-generation table

A variant is `k<K>` (in-flight, rollout.inflight_kv keep), `k<K>-recompute`, or `k<K>-chunked`: the design before
in-flight updates (every chunk_tokens each sequence left the engine and was sent back with its whole context), run
from a git worktree of CHUNKED_REF; it logs no driver or prefill counts ("-").

Per variant (seeds pooled; step medians leave out step 1, whose window holds the initial evaluation): seconds a step;
trained tokens/s; prompt/context tokens the engines computed per generated token (`rollout/prefill_per_token`, prefix-
cache hits not counted), and the same tokens over K = 0's runs of the same seeds; token ids the driver moved a step,
and its generator thread's CPU seconds a step; a sync's pause to resume, and of it the wait for the engine call in
flight; held-out greedy accuracy gain per step (mean ± sd over the seeds); staleness; the share of samples a sync
interrupted. Evaluation runs only before and after (outside the step times). `--extra` passes further overrides to
every run. `--report DIR ...` prints the table from finished runs' folders (each keeps its metrics), so a sweep can be
run a variant at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table, run_recipe  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "async_rl")
CHUNKED_REF = "0f35d20"  # main before in-flight updates: the chunked generator


def source_tree(ref: str) -> str:
    """A worktree of `ref` under the cache (made once), so the older design runs beside this one."""
    path = os.path.join(CACHE, f"src-{ref}")
    if not os.path.isdir(path):
        subprocess.run(["git", "worktree", "add", "--detach", path, ref], cwd=ROOT, check=True)
    return path


def recipe(model: str, max_new_tokens: int | None) -> list[str]:
    """The config and model overrides of `model` (tiny: the sort SFT checkpoint, trained once and cached)."""
    if model == "real":
        base = ["--config", "examples/smollm2_math_grpo.yaml", "logging.rollouts_every=0"]
    else:
        sft = os.path.join(CACHE, "sft")
        if not os.path.isdir(os.path.join(sft, "final")):
            run_recipe(["--config", "examples/sort_sft.yaml", f"output_dir={sft}"], ROOT)
        base = ["--config", "examples/sort_grpo.yaml", f"model.path={sft}/final", "data.num_eval=128"]
    if max_new_tokens:  # room for the prompt too, and the KV of every sample in flight
        base += [f"rollout.max_new_tokens={max_new_tokens}", f"rollout.max_model_len={max_new_tokens + 128}",
                 f"eval.max_new_tokens={max_new_tokens}", "rollout.kv_cache_mb=1024"]
    return base


def one(variant: str, seed: int, base: list[str], steps: int, extra: list[str]) -> dict:
    k, _, mode = variant[1:].partition("-")
    out = os.path.join(CACHE, f"{variant}-s{seed}-{time.strftime('%m%d-%H%M%S')}")
    args = [*base, f"output_dir={out}", f"trainer.max_steps={steps}", f"eval.every={steps}", "checkpoint.every=0",
            f"rollout.max_staleness={k}", f"seed={seed}", *extra]
    if mode == "recompute":
        args.append("rollout.inflight_kv=recompute")
    run_recipe(args, source_tree(CHUNKED_REF) if mode == "chunked" else ROOT)
    return load(out)


def load(out: str) -> dict:
    """One finished run's trained steps, accuracy gain per step and sampled tokens, from its folder."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "config.yaml")) as f:
        config = yaml.safe_load(f)  # the run's config as it ran
    rollout = config["rollout"]
    head = "eval/accuracy" if "eval/accuracy" in rows[0] else "eval/exact_match"
    trained = [r for r in rows if r["step"] > 0]
    return dict(rows=trained, gain=(rows[-1][head] - rows[0][head]) / len(trained), seed=config["seed"],
                prefill=sum(r["rollout/prefill_tokens"] for r in trained)  # (None: the chunked design's runs)
                if all("rollout/prefill_tokens" in r for r in trained) else None,
                tokens=sum(r["rollout/response_len"] * rollout["prompts_per_step"] * rollout["n_samples"]
                           for r in trained))


def median(runs: list[dict], key: str, fmt: str = "{:.3g}") -> str:
    xs = [r[key] for run in runs for r in run["rows"][1:] if key in r]
    return fmt.format(statistics.median(xs)) if xs else "-"


def prefill(runs: list[dict]) -> str:
    """Prompt/context tokens the engines computed per generated token, pooled over every step of every run (one
    step's window of a run ahead may end no sample, or many); the median of the steps' ratios where the runs did
    not log the counts."""
    pairs = [(r["rollout/prefill_tokens"], r["rollout/generated_tokens"]) for run in runs for r in run["rows"]
             if "rollout/prefill_tokens" in r]
    if not pairs:
        m = median(runs, "rollout/prefill_per_token")
        return m if m == "-" else m + " (median)"
    return f"{sum(p for p, _ in pairs) / max(sum(g for _, g in pairs), 1):.3g}"


def against_k0(runs: list[dict], k0: dict[int, float]) -> str:
    """The prompt/context tokens the engines computed in these runs over K = 0's with the same seeds (the same
    prompts each step): 1 where no context is computed twice, whatever the completions' lengths."""
    pairs = [(r["prefill"], k0[r["seed"]]) for r in runs if r["seed"] in k0 and r["prefill"] is not None]
    return f"{sum(a for a, _ in pairs) / sum(b for _, b in pairs):.4f}" if pairs else "-"


def row(variant: str, runs: list[dict], k0: dict[int, float]) -> list:
    gains = [r["gain"] for r in runs]
    gain = f"{statistics.mean(gains):.4f}" + (f" ± {statistics.stdev(gains):.4f}" if len(gains) > 1 else "")
    seconds = sum(r["time/step"] for run in runs for r in run["rows"])
    pooled = [r for run in runs for r in run["rows"]]
    return [variant, len(runs), median(runs, "time/step"), f"{sum(r['tokens'] for r in runs) / seconds:.1f}",
            prefill(runs), against_k0(runs, k0), median(runs, "rollout/driver_tokens", "{:.0f}"),
            median(runs, "rollout/driver_cpu_s"), median(runs, "rollout/sync_pause_s"),
            median(runs, "rollout/sync_wait_s"), gain,
            f"{statistics.mean(r.get('rollout/staleness_mean', 0.0) for r in pooled):.2f}",
            f"{statistics.mean(r.get('rollout/interrupted_frac', 0.0) for r in pooled):.2f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "real"), default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="k0,k1,k2", help="comma-separated: k<K>, k<K>-recompute, k<K>-chunked")
    p.add_argument("--seeds", default="0")
    p.add_argument("--max-new-tokens", type=int, default=None, help="the completions' budget (and eval's)")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run, key=value")
    p.add_argument("--report", nargs="*", metavar="RUN_DIR",
                   help="no runs: the table from finished run folders (.cache/async_rl/<variant>-s<seed>-...)")
    a = p.parse_args()
    if a.report is not None:
        by_variant: dict[str, list] = {}
        for out in a.report:
            by_variant.setdefault(os.path.basename(out.rstrip("/")).rsplit("-s", 1)[0], []).append(load(out))
    else:
        base = recipe(a.model, a.max_new_tokens)
        seeds = [int(s) for s in a.seeds.split(",")]
        by_variant = {v: [one(v, s, base, a.steps, a.extra) for s in seeds] for v in a.variants.split(",")}
    k0 = {r["seed"]: r["prefill"] for r in by_variant.get("k0", []) if r["prefill"] is not None}
    table = [row(v, runs, k0) for v, runs in by_variant.items()]
    print_table(["variant", "seeds", "s/step", "trained tok/s", "prefill/generated", "prefill vs K=0",
                 "driver tokens/step", "driver CPU s/step", "sync pause s", "of it waiting s", "acc gain/step",
                 "staleness", "interrupted"], table)


if __name__ == "__main__":
    main()
