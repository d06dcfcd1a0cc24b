"""The `RolloutEngine` protocol every generation backend implements, and the types it speaks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np


@dataclass
class SamplingConfig:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    # per-prompt seeds (prompt i gets seed + i): samples independent of batching and engine count; None = the
    # engine's own RNG (on GPUs vLLM's fast batched sampler; a per-request seed sends it down a per-row path)
    seed: Optional[int] = 0
    stop_token_ids: tuple[int, ...] = ()  # ends a completion (kept as its last token), besides the engine's eos
    # per prompt, its own max_new_tokens (a continued generation's remaining budget); None = max_new_tokens for all
    budgets: Optional[tuple[int, ...]] = None

    def budget(self, prompt: int) -> int:
        return self.max_new_tokens if self.budgets is None else self.budgets[prompt]


@dataclass
class Sample:
    """One generated completion: token ids, the engine's per-token log-probs, and why it stopped."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    # the engine's log-prob of each completion id, (len(completion_ids),) float32: a numpy array crosses processes
    # compactly (a Python float list, or a small torch tensor with its pickling overhead, is several times larger)
    rollout_logprobs: np.ndarray
    finish_reason: str  # "stop" (an eos or stop token, kept as the last completion id) or "length"
    # multi-turn (rollout.multiturn.trajectory): true on the completion ids the model sampled, false on the observations
    # between its turns (their rollout_logprobs are 0); None = every completion id was sampled
    completion_mask: Optional[list[bool]] = None
    env: Optional["EnvOutcome"] = None  # multi-turn: what the environment gave
    # rollout.max_staleness > 0: the policy version (updates applied) that sampled each completion id, (T,) int32;
    # None = all by the weights of the step that trains it
    versions: Optional[np.ndarray] = None
    # an agent episode whose calls broke its history (rollout.agents.episode): where each later context starts in
    # prompt_ids + completion_ids; each context is its own sequence (positions restart, it sees only itself)
    segments: Optional[list[int]] = None
    # algorithm.routing_replay: the experts each MoE layer routed each token to in the engine, (P + C - 1, MoE layers,
    # top-k) uint8 (rollout.engines.routes; the last token is never computed); None = not recorded
    routes: Optional[np.ndarray] = None


@dataclass
class EnvOutcome:
    """A trajectory's account from its environment: summed reward, model turns, seconds spent in reset/step, and
    whether it ended on an environment error or timeout (then reward 0); for an agent (rollout.agents.runner): its
    reward, its calls, its seconds, and how many times it rewrote its history (rollout.agents.episode)."""

    reward: float
    turns: int
    env_time: float
    error: bool = False
    breaks: int = 0


@dataclass
class Request:
    """One sample an engine keeps from its prompt to its end, across weight syncs (rollout.engines.inflight)."""

    key: int  # the caller's name for it, unique among the engine's live requests
    prompt_ids: list[int]
    max_tokens: int
    seed: Optional[int] = None  # its own sampler seed; None = the engine's RNG
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Delta:
    """What one kept request produced since the last `advance`: new token ids with their log-probs, and once it has
    ended, why ("stop" or "length": its max_tokens, or the engine's max_model_len)."""

    key: int
    ids: list[int]
    logprobs: list[float]
    finish: Optional[str] = None
    routes: Optional[np.ndarray] = None  # once ended, under algorithm.routing_replay: as Sample.routes


@dataclass
class Advanced:
    """An `advance` call's answer: each kept request's `Delta`, and the engine's token counts for its kept requests
    since it started: prompt tokens computed (prefix-cache hits not counted; a context computed again is counted
    again) and tokens generated. vLLM counts a sample's prompt and tokens when the sample ends, and leaves out what
    `generate` computed (an evaluation beside the kept requests); the transformers engine counts every call it made."""

    deltas: list[Delta]
    prefill_tokens: int
    generated_tokens: int


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int] | str | list[dict]], sampling: SamplingConfig) -> list[Sample]:
        """`n` samples per prompt (token ids, or a text / message-list prompt the engine renders with
        `rollout.render.PromptRenderer`), in prompt order (all samples of prompt 0, then prompt 1, ...)."""

    def update_weights(self, named_tensors) -> None:
        """Load new weights (Hugging Face names) into the running engine and drop any cached KV."""

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (no-op where unsupported, e.g. vLLM on CPU)."""

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-allocate what sleep() freed: ["weights"] before a sync, ["kv_cache"] before generating, None = all."""

    def shutdown(self) -> None:
        ...
