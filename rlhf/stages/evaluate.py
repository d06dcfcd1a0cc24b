"""Evaluation on held-out prompts, rendered exactly as in training: greedy `eval/reward_mean`, `eval/accuracy`
(reward 1.0) and `eval/exact_match`; with `eval.n_samples` > 1, also `eval/pass@k` from that many samples per
prompt at `eval.temperature`."""
from __future__ import annotations

import torch

from algorithms.evaluation import pass_at_k, pass_at_k_levels
from rlhf.config import EvalConfig
from rollout.engine import SamplingConfig
from rollout.render import PromptRenderer
from rollout.rewards import RewardFn, final_answer, score_rows


def evaluate(engine, renderer: PromptRenderer, rows: list[dict], reward_fn: RewardFn, cfg: EvalConfig,
             seed: int = 0) -> dict[str, float]:
    """Exact match compares the stripped completion with the row's answer (its `#### x` part for GSM8K-style
    answers); a row without one counts as matched when its reward is 1.0, the same rule as `eval/accuracy`."""
    prompts = [r["prompt"] for r in rows]
    ids = [renderer.prompt_ids(p) for p in prompts]
    stops = renderer.stop_ids(prompts)
    greedy = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop_token_ids=stops)
    rewards, completions = _score(engine.generate(ids, greedy), renderer, rows, reward_fn, 1)
    exact = [c.strip() == final_answer(r["answer"]) if "answer" in r else rw >= 1.0
             for c, r, rw in zip(completions, rows, rewards)]
    out = {"eval/reward_mean": sum(rewards) / len(rewards), "eval/accuracy": sum(rw >= 1.0 for rw in rewards) /
           len(rewards), "eval/exact_match": sum(exact) / len(exact)}
    if cfg.n_samples > 1:
        n = cfg.n_samples
        sampled = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, n=n,
                                 seed=seed + 7919, stop_token_ids=stops)
        sample_rewards, _ = _score(engine.generate(ids, sampled), renderer, rows, reward_fn, n)
        correct = (torch.tensor(sample_rewards).view(len(rows), n) >= 1.0).sum(1)
        out.update({f"eval/pass@{k}": pass_at_k(correct, n, k).mean().item() for k in pass_at_k_levels(n)})
    return out


def _score(samples, renderer: PromptRenderer, rows: list[dict], reward_fn: RewardFn, n: int):
    """Rewards of `n` samples per row, in row order (prompts as the dataset holds them, metadata columns aligned)."""
    completions = [renderer.decode(s.completion_ids) for s in samples]
    return score_rows(reward_fn, [r for r in rows for _ in range(n)], completions), completions


def evaluate_env(runner, rows: list[dict], cfg: EvalConfig) -> dict[str, float]:
    """Multi-turn: one greedy trajectory per held-out row (rollout.multiturn.trajectory.TrajectoryRunner). `eval/accuracy`:
    the share whose summed reward reaches 1.0; `eval/turns`: model turns per trajectory."""
    samples = runner.run(rows, SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0))
    rewards = [s.env.reward for s in samples]
    return {"eval/reward_mean": sum(rewards) / len(rewards),
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/turns": sum(s.env.turns for s in samples) / len(samples)}


def env_metrics(samples) -> dict[str, float]:
    """A multi-turn rollout's account: turns, seconds in the environment and sampled tokens per trajectory, and
    how many trajectories an environment error or timeout ended."""
    n = len(samples)
    return {"rollout/turns": sum(s.env.turns for s in samples) / n,
            "rollout/env_time": sum(s.env.env_time for s in samples) / n,
            "rollout/env_errors": float(sum(s.env.error for s in samples)),
            "rollout/history_breaks": float(sum(s.env.breaks for s in samples)),
            "rollout/sampled_tokens": sum(sum(s.completion_mask) for s in samples) / n}
