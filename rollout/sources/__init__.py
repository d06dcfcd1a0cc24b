"""Where a step's samples come from: the controller's one rollout seam, chosen once when the run starts.

`GenerateNow` (`rollout.max_staleness: 0`, sources/now.py) draws a step's prompts and generates them when the step
asks; `AsyncRollout` (K > 0, sources/ahead.py) has been generating them ahead, in the engines, while earlier steps
trained. Both answer the same calls, so the controller's step carries no mode checks. What a sample is (a
completion, an environment's trajectory, an agent's episode) is the run's rollout/episodes.py kind, which either
source generates through."""
from __future__ import annotations

from typing import Callable, Protocol

from rollout.engine import Sample, SamplingConfig
from rollout.engines.sleep import EngineMemory

Sampling = Callable[[int, int], SamplingConfig]  # (step, attempt) -> the round's sampling (the episodes add stops)


class RolloutSource(Protocol):
    def generate(self, step: int, attempt: int) -> tuple[list[int], list[Sample], dict[str, float]]:
        """(dataset rows, their samples, metrics) of step `step`'s rollout round `attempt` (0, then dynamic
        sampling's further rounds of new prompts)."""

    def trained(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Metrics of the samples step `step` trains on, over all its rounds."""

    def engine_memory(self) -> EngineMemory:
        """How the engines hold GPU memory around a step's rounds (colocated: awake for them only)."""

    def phase_metrics(self, tokens: float, seconds: float) -> dict[str, float]:
        """The rollout phase's rate, where there is such a phase (`tokens` sampled in `seconds`)."""

    def synced(self, push: Callable[[], None], version: int) -> None:
        """Run `push`, the weight sync after update `version` (or a resume from it), where it may run."""

    def on_restart(self, engine: int, resync: Callable[[int], None]) -> None:
        """Ray restarted `engine`; `resync(engine)` re-forms its sync channel and pushes the trainer's weights into
        it, on the thread that talks to the trainer ranks (the controller's), before the engine is used again."""

    def state(self) -> dict:
        """What a checkpoint records of it: the data position, and whatever is in flight."""

    def restore(self, state: dict, step: int) -> None:
        """A checkpoint's `state`, saved after step `step`."""

    def close(self) -> None:
        ...


def rollout_source(engines, prompts, episodes, sampling: Sampling, *, max_staleness: int, chunk_tokens: int,
                   last_step: int) -> RolloutSource:
    """The run's source: generating when asked at max_staleness 0, else generating ahead (its thread starts on first
    use). `engines`: a rollout.group.RolloutGroup; `prompts`: the run's rlhf.stages.data.BatchIterator; `episodes`:
    the run's rollout.episodes.Episodes, started."""
    if max_staleness == 0:
        from rollout.sources.now import GenerateNow
        return GenerateNow(engines, prompts, episodes, sampling)
    from rollout.sources.ahead import AsyncRollout
    return AsyncRollout(engines, prompts, episodes, sampling(0, 0), max_staleness=max_staleness,
                        chunk_tokens=chunk_tokens, last_step=last_step)
