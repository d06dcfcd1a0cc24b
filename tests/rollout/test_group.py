"""RolloutGroup's restart accounting with a real Ray actor that dies (`kill -9`). The engine is a small class, not
vLLM: what is under test is the group's bookkeeping when two generations are in flight on a dead engine."""
import os
import signal
import time

from rollout.engine import Sample, SamplingConfig


class SlowEngine:
    """Answers each prompt with its own ids after a pause, so two generations can be in flight when it dies."""

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts, sampling):
        time.sleep(1.0)
        return [Sample(i, list(p), list(p), [0.0] * len(p), "stop") for i, p in enumerate(prompts)]


def test_a_death_seen_by_two_generations_in_flight_restarts_once(ray_local):
    from rollout.group import RolloutGroup

    group = RolloutGroup.create(2, {}, engine_cls=SlowEngine, max_restarts=2, timeout_s=120)
    pushed = []
    group.on_restart = pushed.append
    pid = ray_local.get(group.engines[1].pid.remote())
    first = group.submit([[1], [2], [3], [4]], SamplingConfig())
    second = group.submit([[5], [6], [7], [8]], SamplingConfig())  # two generations in flight at once
    os.kill(pid, signal.SIGKILL)
    assert [s.completion_ids for s in group.collect(first)] == [[1], [2], [3], [4]]
    assert [s.completion_ids for s in group.collect(second)] == [[5], [6], [7], [8]]
    assert group.restarts == 1 and pushed == [1]  # counted once, weights pushed once
    pid = ray_local.get(group.engines[1].pid.remote())
    third = group.submit([[9], [10]], SamplingConfig())
    os.kill(pid, signal.SIGKILL)  # a later death is a new one
    assert [s.completion_ids for s in group.collect(third)] == [[9], [10]]
    assert group.restarts == 2 and pushed == [1, 1]
