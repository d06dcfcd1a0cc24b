"""What one sample is, chosen once per run (`episodes_for`): a completion of a dataset prompt, an environment's
trajectory (env.name, rollout/multiturn/) or an agent's episode through the endpoint (agent.fn, rollout/agents/).
Every kind generates through the engines it is handed, scores, evaluates and closes the same way, so neither the RL
controller nor the rollout sources ask which one a run has.

Two facts differ and are said once, here: `needs_prompt` (the rows carry the prompt; otherwise the environment's
reset() or the agent writes the first message) and `whole` (an episode is generated whole through the engines
in one call, turn by turn; otherwise it is one prompt's tokens, which a source may generate a chunk at a time)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Protocol, Sequence

import torch

from algorithms.evaluation import pass_at_k, pass_at_k_levels
from common.schema import AgentConfig, EnvConfig, EvalConfig, RunConfig
from rollout.engine import Sample, SamplingConfig
from rollout.render import PromptRenderer
from rollout.rewards import RewardFn, final_answer, reward_fn_for, score_rows


class Episodes(Protocol):
    needs_prompt: bool
    whole: bool

    def start(self, engines, renderer: PromptRenderer, reward_model=None) -> None:
        """Bind the run's engines (a rollout.group.RolloutGroup), its renderer and its reward model (None: the
        reward function scores), once they are up."""

    def run(self, rows: Sequence[dict], sampling: SamplingConfig, engines=None) -> list[Sample]:
        """`sampling.n` samples per row, in row order, through `engines` (by default the bound ones)."""

    def score(self, rows: Sequence[dict], samples: list[Sample], batch) -> tuple[torch.Tensor, dict[str, float]]:
        """(rewards (len(samples),), metrics); `batch` is the samples packed (common.batch.samples_to_batch)."""

    def evaluate(self, rows: list[dict], cfg: EvalConfig, seed: int) -> dict[str, float]:
        """Held-out metrics from greedy samples (and pass@k where cfg.n_samples > 1)."""

    def notice(self) -> Optional[str]:
        """A line for the console when the run starts, or None."""

    def close(self) -> None:
        ...


def episodes_for(cfg: RunConfig) -> Episodes:
    """The run's kind: an agent (agent.fn), else an environment (env.name), else completions scored by reward.fn
    (or the task's reward). User code loads here, so a bad name fails before any worker starts."""
    if cfg.agent.fn is not None:
        return Agents(cfg.agent, cfg.rollout.max_model_len)
    if cfg.env.name is not None:
        from rollout.env import load_environment
        return Trajectories(load_environment(cfg.env.name), cfg.env, cfg.rollout.max_model_len)
    return Completions(reward_fn_for(cfg.reward, cfg.data.task))


class Completions:
    """One completion per sample of a rendered dataset prompt, scored by the reward model when there is one (the
    reward function's score is then only logged), else by the reward function."""

    needs_prompt, whole = True, False

    def __init__(self, reward_fn: RewardFn):
        self.reward_fn, self.engines, self.renderer, self.reward_model = reward_fn, None, None, None

    def start(self, engines, renderer: PromptRenderer, reward_model=None) -> None:
        self.engines, self.renderer, self.reward_model = engines, renderer, reward_model

    def encode(self, rows: Sequence[dict]) -> tuple[list[list[int]], tuple[int, ...]]:
        """(the rows' prompt ids, the stop ids their template ends a turn with)."""
        prompts = [r["prompt"] for r in rows]
        return [self.renderer.prompt_ids(p) for p in prompts], self.renderer.stop_ids(prompts)

    def run(self, rows: Sequence[dict], sampling: SamplingConfig, engines=None) -> list[Sample]:
        ids, stops = self.encode(rows)
        return (engines or self.engines).generate(ids, replace(sampling, stop_token_ids=stops))

    def score(self, rows: Sequence[dict], samples: list[Sample], batch) -> tuple[torch.Tensor, dict[str, float]]:
        completions = [self.renderer.decode(s.completion_ids) for s in samples]
        task = torch.tensor(score_rows(self.reward_fn, [rows[s.prompt_index] for s in samples], completions))
        if self.reward_model is None:
            return task, {}
        return self.reward_model.score({k: batch[k] for k in ("input_ids", "attention_mask")}), {
            "rollout/task_reward_mean": task.mean().item()}

    def evaluate(self, rows: list[dict], cfg: EvalConfig, seed: int) -> dict[str, float]:
        return evaluate_completions(self.engines, self.renderer, rows, self.reward_fn, cfg, seed)

    def notice(self) -> Optional[str]:
        return None

    def close(self) -> None:
        pass


class Played:
    """Episodes a runner plays turn by turn (rollout.multiturn.trajectory.TrajectoryRunner,
    rollout.agents.runner.AgentRunner): the reward is the environment's (or the agent's) own."""

    needs_prompt, whole = False, True

    def __init__(self, max_model_len: int):
        self.max_model_len, self.runner = max_model_len, None

    def run(self, rows: Sequence[dict], sampling: SamplingConfig, engines=None) -> list[Sample]:
        return self.runner.run(rows, sampling, engines)

    def score(self, rows: Sequence[dict], samples: list[Sample], batch) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.tensor([s.env.reward for s in samples]), episode_metrics(samples)

    def evaluate(self, rows: list[dict], cfg: EvalConfig, seed: int) -> dict[str, float]:
        """One greedy episode per held-out row. `eval/accuracy`: the share whose summed reward reaches 1.0;
        `eval/turns`: model turns per episode."""
        samples = self.runner.run(rows, SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0))
        rewards = [s.env.reward for s in samples]
        return {"eval/reward_mean": sum(rewards) / len(rewards),
                "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                "eval/turns": sum(s.env.turns for s in samples) / len(samples)}

    def notice(self) -> Optional[str]:
        return None

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class Trajectories(Played):
    def __init__(self, env_cls: type, cfg: EnvConfig, max_model_len: int):
        super().__init__(max_model_len)
        self.env_cls, self.cfg = env_cls, cfg

    def start(self, engines, renderer: PromptRenderer, reward_model=None) -> None:
        from rollout.multiturn.trajectory import TrajectoryRunner
        self.runner = TrajectoryRunner(engines, renderer, self.env_cls, self.cfg, self.max_model_len)


class Agents(Played):
    def __init__(self, cfg: AgentConfig, max_model_len: int):
        super().__init__(max_model_len)
        self.cfg = cfg

    def start(self, engines, renderer: PromptRenderer, reward_model=None) -> None:
        from rollout.agents.runner import AgentRunner
        self.runner = AgentRunner(engines, renderer, self.cfg, self.max_model_len)

    def notice(self) -> Optional[str]:
        return f"agent endpoint: {self.runner.endpoint.url('<episode>')}"


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """A multi-turn rollout's account: turns, seconds in the environment and sampled tokens per episode, and how
    many an environment error or timeout ended."""
    n = len(samples)
    return {"rollout/turns": sum(s.env.turns for s in samples) / n,
            "rollout/env_time": sum(s.env.env_time for s in samples) / n,
            "rollout/env_errors": float(sum(s.env.error for s in samples)),
            "rollout/history_breaks": float(sum(s.env.breaks for s in samples)),
            "rollout/sampled_tokens": sum(sum(s.completion_mask) for s in samples) / n}


def evaluate_completions(engines, renderer: PromptRenderer, rows: list[dict], reward_fn: RewardFn, cfg: EvalConfig,
                         seed: int = 0) -> dict[str, float]:
    """Held-out prompts rendered exactly as in training: greedy `eval/reward_mean`, `eval/accuracy` (reward 1.0) and
    `eval/exact_match` (the stripped completion against the row's answer, its `#### x` part for GSM8K-style answers;
    a row without one counts as matched when its reward is 1.0); with `eval.n_samples` > 1, also `eval/pass@k`
    from that many samples per prompt at `eval.temperature`. Also the SFT and DPO stages' evaluation."""
    prompts = [r["prompt"] for r in rows]
    ids, stops = [renderer.prompt_ids(p) for p in prompts], renderer.stop_ids(prompts)
    greedy = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop_token_ids=stops)
    rewards, completions = _rewards(engines.generate(ids, greedy), renderer, rows, reward_fn, 1)
    exact = [c.strip() == final_answer(r["answer"]) if "answer" in r else rw >= 1.0
             for c, r, rw in zip(completions, rows, rewards)]
    out = {"eval/reward_mean": sum(rewards) / len(rewards), "eval/accuracy": sum(rw >= 1.0 for rw in rewards) /
           len(rewards), "eval/exact_match": sum(exact) / len(exact)}
    if cfg.n_samples > 1:
        n = cfg.n_samples
        sampled = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, n=n,
                                 seed=seed + 7919, stop_token_ids=stops)
        sample_rewards, _ = _rewards(engines.generate(ids, sampled), renderer, rows, reward_fn, n)
        correct = (torch.tensor(sample_rewards).view(len(rows), n) >= 1.0).sum(1)
        out.update({f"eval/pass@{k}": pass_at_k(correct, n, k).mean().item() for k in pass_at_k_levels(n)})
    return out


def _rewards(samples: list[Sample], renderer: PromptRenderer, rows: list[dict], reward_fn: RewardFn, n: int):
    """Rewards of `n` samples per row, in row order (prompts as the dataset holds them, metadata columns aligned)."""
    completions = [renderer.decode(s.completion_ids) for s in samples]
    return score_rows(reward_fn, [r for r in rows for _ in range(n)], completions), completions
