"""Which of a rollout engine's GPU allocations are released between rollouts (vLLM's sleep mode), as a small state
machine the engine consults, so that every call that needs memory finds it resident and nothing is woken twice.

vLLM's tags: "weights" and "kv_cache". Level 1 keeps a host copy of the weights (an adapter sync needs the base
weights back); level 2 discards them, for a full-weight sync that overwrites them anyway (vLLM's documented use:
"update the model, where previous model weights are not needed"). Either level releases both tags.
"""
from __future__ import annotations

from typing import Optional

TAGS = ("weights", "kv_cache")


class SleepState:
    def __init__(self, enabled: bool, level: int):
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.enabled, self.level = enabled, level
        self.asleep: set[str] = set()
        self.weights_discarded = False  # level 2 slept and no weights were loaded since

    def sleep(self) -> Optional[int]:
        """The level to call `LLM.sleep` with, or None when there is nothing to release."""
        if not self.enabled or self.asleep:
            return None
        self.asleep = set(TAGS)
        self.weights_discarded = self.level == 2
        return self.level

    def wake(self, tags: Optional[list[str]] = None) -> Optional[list[str]]:
        """The tags to pass to `LLM.wake_up` (only those asleep), or None when all are resident already."""
        wanted = set(TAGS if tags is None else tags) & self.asleep
        if not wanted:
            return None
        self.asleep -= wanted
        return [t for t in TAGS if t in wanted]

    def loaded_weights(self) -> None:
        """A full weight sync wrote every weight: level 2's discarded weights are real again."""
        self.weights_discarded = False

    def check_can_generate(self) -> None:
        """vLLM schedules nothing until all its memory is resident (it would wait forever), and level 2's woken
        weights hold no values until a sync: say so instead."""
        if self.asleep:
            raise RuntimeError(f"generate() on a sleeping engine ({', '.join(sorted(self.asleep))} released): call "
                               "wake_up() first")
        if self.weights_discarded:
            raise RuntimeError("generate() after sleep level 2 without a weight sync: the weights were discarded")


class EngineMemory:
    """GPU colocation: the engines are awake for a step's rollout rounds and asleep again once nothing more will be
    generated (`release`, or leaving the block), so the reward and reference models and the trainers get the GPU.
    Generating ahead (rollout.max_staleness) they never sleep: a generation is always in flight."""

    def __init__(self, rollout, asleep_between_steps: bool):
        self.rollout, self.active, self.awake = rollout, asleep_between_steps, False

    def __enter__(self) -> "EngineMemory":
        if self.active:
            self.rollout.wake_up()
            self.awake = True
        return self

    def release(self) -> None:
        if self.awake:
            self.rollout.sleep()
            self.awake = False

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.release()
