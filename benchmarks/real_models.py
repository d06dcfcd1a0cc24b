"""Engine–trainer agreement on every real model (python -m rlhf.models NAME): does vLLM serve it as the trainer
computes it, and does a weight sync reach every tensor (an untied 152k-row head, QKV biases, sliding windows)?

    python benchmarks/real_models.py [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m]

For each converted model: VLLMEngine (bf16, as the recipes run it) samples 2 completions of <= 32 tokens for 8 word
problems (through the chat template where the model has one, as plain "Question: ... Answer:" text where it has
none) and for one long prompt of several problems (longer than Gemma-3's 512-token sliding window, so the window
binds); PolicyTrainer (DeepSpeed, the recipe's bf16 and shared-prefix forward) computes the log-probs of the same
tokens. Then one update at a high learning rate, a weight sync of every trainer tensor (VLLMEngine.update_weights,
the hybrid path), and the same comparison on fresh samples; "unsynced" is the updated trainer against the
engine's samples before the sync: the size of the change a missed tensor would leave. Mean |engine − trainer|
log-prob per completion token.
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

LONG_PROBLEMS = 24  # problems in the long prompt: ~700 tokens with any of the three tokenizers


def prompts(renderer, n: int) -> tuple[list[list[int]], list[int]]:
    """`n` short prompts and one long one, as token ids; the model's chat template where it has one."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))]
    texts = [r["prompt"][0]["content"] for r in rows]
    long_text = "Solve each problem in turn.\n" + "\n".join(texts[n:n + LONG_PROBLEMS])
    if renderer.tokenizer.chat_template:
        short = [renderer.prompt_ids([{"role": "user", "content": t}]) for t in texts[:n]]
        return short, renderer.prompt_ids([{"role": "user", "content": long_text}])
    short = [renderer.prompt_ids(f"Question: {t}\nAnswer:") for t in texts[:n]]
    return short, renderer.prompt_ids(f"{long_text}\nAnswer to the first:")


def as_batch(samples):
    from common.batch import pack_sequences
    return pack_sequences([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id=0)


def gaps(trainer, samples, mine=None) -> tuple[float, float]:
    """Mean |engine − trainer| log-prob per completion token: over the short prompts' samples, the long one's.
    `mine`: the trainer's log-probs of as_batch(samples) when already computed."""
    import torch

    mine = trainer.compute_logprobs(as_batch(samples)) if mine is None else mine
    diffs = []
    for b, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        theirs = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32)
        diffs.append((mine[b, start:start + len(theirs)] - theirs).abs().mean().item())
    return statistics.mean(diffs[:-2]), statistics.mean(diffs[-2:])  # the long prompt's 2 samples come last


def one_model(name: str, lr: float) -> list:
    import torch

    from actors.policy import PolicyTrainer
    from common.schema import AlgorithmConfig, TrainerConfig
    from rlhf import models
    from rollout.engine import SamplingConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.render import PromptRenderer

    path = models.provision(name)
    renderer = PromptRenderer.from_pretrained(path)
    short, long_ids = prompts(renderer, 8)
    start = time.perf_counter()
    engine = VLLMEngine(path, dtype="bfloat16", max_model_len=len(long_ids) + 64, kv_cache_mb=1024)
    started = time.perf_counter() - start
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, n=2, seed=0, stop_token_ids=renderer.stop_ids())
    tr = TrainerConfig(lr=lr, batch_size=18, micro_batch_size=6, warmup_steps=0, shared_prefix=True)
    trainer = PolicyTrainer(path, tr, dtype="bfloat16")
    before = engine.generate(short + [long_ids], sampling)
    batch = as_batch(before)
    old = trainer.compute_logprobs(batch)
    agree = gaps(trainer, before, old)  # the same forward gives the update's old log-probs

    adv = torch.randn(len(before), 1, generator=torch.Generator().manual_seed(0))
    batch.update(advantages=adv * batch["loss_mask"], old_logprobs=old)
    trainer.rl_step(batch, AlgorithmConfig(name="grpo"))
    unsynced = gaps(trainer, before)
    engine.update_weights(list(trainer.ds.module.named_parameters(remove_duplicate=False)))
    synced = gaps(trainer, engine.generate(short + [long_ids], sampling))
    engine.shutdown()
    tokens = statistics.mean(len(s.completion_ids) for s in before)
    return [[name, len(long_ids), f"{tokens:.1f}", f"{started:.0f}", *(f"{x:.4f}" for x in agree + unsynced + synced)]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m")
    p.add_argument("--lr", type=float, default=1e-4, help="the one update's learning rate")
    a = p.parse_args()
    rows = []
    for name in a.models.split(","):
        rows += one_model(name, a.lr)
    print_table(["model", "long prompt tokens", "mean new tokens", "engine start s", "short: gap", "long: gap",
                 "short: unsynced", "long: unsynced", "short: synced", "long: synced"], rows)


if __name__ == "__main__":
    main()
