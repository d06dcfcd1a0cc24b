"""Generate when asked (`rollout.max_staleness: 0`): a step's prompts are drawn and generated when the step wants
them, by the weights of the step before."""
from __future__ import annotations

from typing import Callable

from rollout.engine import Sample, SamplingConfig
from rollout.engines.sleep import EngineMemory
from rollout.sources.queue import DriverStats


class GenerateNow:
    """The step's prompts drawn from `prompts` (rlhf.stages.data.BatchIterator) and generated as `episodes`
    (rollout.episodes) through `engines` (a rollout.group.RolloutGroup)."""

    def __init__(self, engines, prompts, episodes, sampling: Callable[[int, int], SamplingConfig]):
        self.engines, self.prompts, self.episodes, self.sampling = engines, prompts, episodes, sampling
        self.stats = DriverStats(len(engines.engines))

    def generate(self, step: int, attempt: int) -> tuple[list[int], list[Sample], dict[str, float]]:
        """(with, for completions, the round's rollout/driver_tokens and rollout/prefill_per_token: the tokens the
        driver sent and received, and the engines' prefill per token)"""
        row_ids = self.prompts.next_ids()
        rows, sampling = [self.prompts.rows[i] for i in row_ids], self.sampling(step, attempt)
        if self.episodes.whole:  # (turn by turn: the driver's account is the runner's, rollout/turns and the rest)
            return row_ids, self.episodes.run(rows, sampling, self.engines), {}
        self.stats.rebase(self.engines.counters())
        samples = self.episodes.run(rows, sampling, self.engines)
        prompts = {s.prompt_index: len(s.prompt_ids) for s in samples}  # (a group's samples share its prompt)
        self.stats.moved(sum(prompts.values()) + sum(len(s.completion_ids) for s in samples))
        self.stats.counted(self.engines.counters())
        return row_ids, samples, self.stats.read(ahead=False)

    def trained(self, samples: list[Sample], step: int) -> dict[str, float]:
        return {}

    def engine_memory(self) -> EngineMemory:
        return EngineMemory(self.engines, asleep_between_steps=True)

    def phase_metrics(self, tokens: float, seconds: float) -> dict[str, float]:
        return {"perf/rollout_tokens_per_s": tokens / max(seconds, 1e-9)}

    def synced(self, push: Callable[[], None], version: int) -> None:
        push()

    def on_restart(self, engine: int, resync: Callable[[int], None]) -> None:
        resync(engine)  # (found by the controller's own call)

    def state(self) -> dict:
        return {"prompts": self.prompts.state()}

    def restore(self, state: dict, step: int) -> None:
        self.prompts.load_state(state["prompts"])

    def close(self) -> None:
        pass
