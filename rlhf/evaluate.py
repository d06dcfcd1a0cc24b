"""Greedy evaluation on held-out prompts: `eval/reward_mean` and `eval/exact_match`."""
from __future__ import annotations

from rollout.engine import SamplingConfig
from rollout.rewards import RewardFn, score


def evaluate(engine, tokenizer, rows: list[dict], reward_fn: RewardFn, max_new_tokens: int) -> dict[str, float]:
    """Exact match compares the stripped completion with the row's `answer` (a reward of 1.0 where there is none)."""
    prompts = [r["prompt"] for r in rows]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    samples = engine.generate(ids, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0))
    completions = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    metadata = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
    rewards = score(reward_fn, prompts, completions, metadata)
    exact = [c.strip() == r["answer"].strip() if "answer" in r else rw >= 1.0
             for c, r, rw in zip(completions, rows, rewards)]
    return {"eval/reward_mean": sum(rewards) / len(rewards), "eval/exact_match": sum(exact) / len(exact)}
