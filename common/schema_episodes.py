"""The configuration's sections for what an episode is beyond one completion: a multi-turn environment, the reward
function or service, and an agent played against the rollout's endpoint (sections of common.schema.RunConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common.schema_fields import one_of


@dataclass
class EnvConfig:
    """Multi-turn rollouts against an environment (rollout.env). `name` unset = single-turn completions."""

    name: Optional[str] = None  # package.module:ClassName, a rollout.env.Environment; one instance per trajectory
    max_turns: int = 4  # model turns per trajectory
    kwargs: dict = field(default_factory=dict)  # passed to the class's constructor
    timeout_s: float = 30.0  # per reset/step; a step over it (or one that raises) ends its trajectory, reward 0
    num_workers: int = 8  # threads stepping environments while the engines generate
    observation_role: str = one_of("user", "tool")  # observations' chat role (tool where the template has one)


@dataclass
class RewardConfig:
    fn: Optional[str] = None  # "package.module:function"; unset = the built-in task's verifiable reward
    model_path: Optional[str] = None  # stage rl: score rollouts with this reward model (an `rm` stage's final/)
    timeout_s: float = 600.0  # seconds one call of reward.fn (a step's completions) may take before the run stops
    # a reward service: POST {"prompts", "completions", "metadata"} -> {"rewards"} (rollout.rewards.http)
    url: Optional[str] = None
    url_batch: int = 32  # completions per request
    url_concurrency: int = 4  # requests in flight at once
    url_retries: int = 3  # retries of a request that failed to connect, timed out, or got 429 / 5xx


@dataclass
class AgentConfig:
    """An agent's own code played against the rollout's OpenAI-compatible endpoint (rollout.agents.runner). `fn` unset
    = no agent."""

    fn: Optional[str] = None  # package.module:function, run(row, client) -> reward; sync or async
    tool_parser: str = "hermes"  # vLLM's tool-call parser for the model family (hermes, llama3_json, pythonic, ...)
    max_calls: int = 8  # endpoint calls per episode; one more is answered 400 (max_calls_exceeded)
    timeout_s: float = 120.0  # per episode; an agent still running then ends with reward 0, its later calls 404
    concurrency: int = 32  # episodes running at once
    host: str = "127.0.0.1"  # where the endpoint listens
    port: int = 0  # 0 = a free port
