"""The real model's four costs in one process, each against what the machine or plain vLLM does with the same work:
SmolLM2-135M-Instruct (python -m rlhf.smollm2) on the word problems of examples/smollm2_math_grpo.yaml.

    python benchmarks/real_model.py [--dtype bfloat16] [--threads 2] [--prompts 16] [--n 4] [--repeats 3]

train:    PolicyTrainer.rl_step (DeepSpeed) on one GRPO batch of real rollouts, padded and with trainer.shared_prefix
          (each prompt computed once for its group), against a bare PyTorch loop (the HF model, AdamW, the same
          micro-batches and loss) and against the machine's bf16/fp32 matmul rate: MFU counts 6 x parameters x the
          rows' real tokens per second (with shared_prefix fewer are computed, so its figure is an effective one).
rollout:  VLLMEngine.generate (per-prompt seeds, log-probs, token ids) against the same engine's `vllm.LLM.generate`
          with plain sampling parameters, the same prompts: generated tokens/s.
sync:     VLLMEngine.update_weights of every trainer tensor (a hybrid rank's local channel: vLLM's reload, then the
          prefix-cache reset) against a plain copy of the same bytes (GB/s) and against vLLM-CPU's repacking of
          the linear weights for its kernels alone (what every load on CPU must redo).
eval:     rollout.episodes.evaluate_completions, greedy, on the 128 held-out prompts (the recipe's eval without its
pass@k).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import median_time, print_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matmul_rate(dtype, n: int = 2048) -> float:
    import torch
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, 10) / 1e9


def rollout_batch(samples, group: int):
    """The trainer's rows from real samples: prompt + completion, GRPO advantages from random 0/1 rewards."""
    import torch

    from common.batch import pack_sequences
    batch = pack_sequences([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id=2)
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (len(samples) // group, group), generator=g).float()
    adv = (rewards - rewards.mean(1, keepdim=True)).view(-1, 1)
    batch["advantages"] = adv * batch["loss_mask"]
    return batch


def bench_rollout(engine, ids: list[list[int]], sampling, repeats: int) -> tuple[list, list]:
    from vllm import SamplingParams
    plain = SamplingParams(n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_new_tokens,
                           stop_token_ids=list(sampling.stop_token_ids))
    inputs = [{"prompt_token_ids": list(p)} for p in ids]
    samples = engine.generate(ids, sampling)
    raw_out = engine.llm.generate(inputs, plain, use_tqdm=False)
    ours_t, raw_t = [], []
    for _ in range(repeats):  # interleaved: the machine's load moves between rounds (rollout_cost.py has the parts)
        ours_t.append(median_time(lambda: engine.generate(ids, sampling), 1))
        raw_t.append(median_time(lambda: engine.llm.generate(inputs, plain, use_tqdm=False), 1))
    ours, raw = statistics.median(ours_t), statistics.median(raw_t)
    ours_tokens = sum(len(s.completion_ids) for s in samples)
    raw_tokens = sum(len(c.token_ids) for o in raw_out for c in o.outputs)
    ratio = (ours_tokens / ours) / (raw_tokens / raw)
    return samples, [["VLLMEngine.generate", ours, ours_tokens / ours, ratio],
                     ["vllm.LLM.generate, plain params", raw, raw_tokens / raw, ""]]


def bench_sync(engine, trainer, repeats: int) -> list:
    import torch
    tensors = list(trainer.ds.module.named_parameters(remove_duplicate=False))
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    targets = [torch.empty_like(t) for _, t in tensors]

    def copy():
        for (_, t), out in zip(tensors, targets):
            out.copy_(t.detach())
    sync = median_time(lambda: engine.update_weights(tensors), repeats)
    plain = median_time(copy, repeats)
    repack = statistics.median(repack_seconds(tensors) for _ in range(repeats))
    return [["update_weights (reload + prefix reset)", sync, nbytes / sync / 1e9, plain / sync],
            ["plain copy of the same bytes", plain, nbytes / plain / 1e9, ""],
            ["vLLM-CPU's repacking of the linear weights alone", repack, nbytes / repack / 1e9, plain / repack]]


def repack_seconds(tensors) -> float:
    """What vLLM-CPU does to every linear weight after a load, and so on every sync, timed alone: its GEMM dispatch
    packs the weight for its kernels (oneDNN or sgl) and drops the plain one. The floor under `update_weights` here."""
    import time

    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    layers = []
    for name, t in tensors:
        if t.dim() == 2 and ("proj" in name or "embed_tokens" in name):  # vLLM keeps a tied head as its own linear
            layers.append(torch.nn.Module())
            layers[-1].weight = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
    start = time.perf_counter()
    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return time.perf_counter() - start


def bench_train(path: str, batch: dict, args) -> tuple[object, dict[str, float]]:
    """Median seconds of one update on `batch`: ours, ours with trainer.shared_prefix, and a bare PyTorch loop,
    interleaved so a noisy neighbour hits all three alike. Returns our trainer too (the sync is timed from it)."""
    import torch

    from actors.policy import PolicyTrainer
    from benchmarks.train_phase import BareLoop
    from common.dtypes import DTYPES
    from common.schema import AlgorithmConfig, TrainerConfig

    tr = TrainerConfig(lr=1e-6, batch_size=len(batch["input_ids"]), micro_batch_size=16, warmup_steps=0,
                       grad_clip=1.0)
    trainer = PolicyTrainer(path, tr, dtype=args.dtype)
    shared_trainer = PolicyTrainer(path, dataclasses.replace(tr, shared_prefix=True), dtype=args.dtype)
    bare = BareLoop(path, 1e-6, 16, dtype=DTYPES[args.dtype])
    torch.set_num_threads(args.threads)
    fns = {"PolicyTrainer.rl_step": lambda: trainer.rl_step(dict(batch), AlgorithmConfig()),
           "same, trainer.shared_prefix": lambda: shared_trainer.rl_step(dict(batch), AlgorithmConfig()),
           "bare PyTorch loop": lambda: bare.step(batch)}
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(median_time(fn, 1))
    return trainer, {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from common.dtypes import DTYPES
    from rlhf import smollm2
    from rlhf.config import EvalConfig
    from rollout.engine import SamplingConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.episodes import evaluate_completions
    from rollout.render import PromptRenderer
    from rollout.rewards import math_reward

    torch.set_num_threads(args.threads)
    path, dtype = smollm2.provision(), DTYPES[args.dtype]
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))]
    evals = [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
    renderer = PromptRenderer.from_pretrained(path)
    engine = VLLMEngine(path, dtype=args.dtype, max_model_len=256, kv_cache_mb=256)
    sampling = SamplingConfig(max_new_tokens=64, temperature=0.6, n=args.n, seed=0,
                              stop_token_ids=renderer.stop_ids([r["prompt"] for r in evals]))
    prompts = [renderer.prompt_ids(r["prompt"]) for r in evals[:args.prompts]]
    samples, rollout_rows = bench_rollout(engine, prompts, sampling, args.repeats)
    eval_cfg = EvalConfig(max_new_tokens=64)
    eval_s = median_time(lambda: evaluate_completions(engine, renderer, evals, math_reward, eval_cfg), 1)

    batch = rollout_batch(samples, args.n)
    rows_n = len(samples)
    trainer, times = bench_train(path, batch, args)
    plain = times["bare PyTorch loop"]
    tokens, trained = int(batch["attention_mask"].sum()), int(batch["loss_mask"].sum())
    flops = 6 * sum(t.numel() for t in trainer.ds.module.parameters()) * tokens
    peak = matmul_rate(dtype)
    sync_rows = bench_sync(engine, trainer, args.repeats)

    print(f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads, {args.prompts} prompts x {args.n} "
          f"samples (<= 64 new tokens, temperature 0.6), median of {args.repeats}; 2048^2 {args.dtype} matmul "
          f"{peak:.0f} GFLOP/s")
    print(f"\ntrain: {rows_n} rows, {tokens} tokens ({trained} trained), micro-batches of 16")
    print_table(["update", "s", "tokens/s", "trained tokens/s", "GFLOP/s", "MFU", "ratio to bare"],
                [[name, s, tokens / s, trained / s, flops / s / 1e9, flops / s / 1e9 / peak, s / plain]
                 for name, s in times.items()])
    print("\nrollout (generated tokens):")
    print_table(["generate", "s", "tokens/s", "ours / plain"], rollout_rows)
    print("\nsync:")
    print_table(["what", "s", "GB/s", "of copy"], sync_rows)
    print(f"vLLM-CPU's repacking is {sync_rows[2][1] / sync_rows[0][1]:.0%} of update_weights' time")
    print(f"\neval: {len(evals)} prompts greedy, <= 64 new tokens: {eval_s:.1f} s")


if __name__ == "__main__":
    main()
