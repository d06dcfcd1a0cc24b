"""RolloutGroup's restart accounting with a real Ray actor that dies (`kill -9`), and its shutdown of an engine hung
in a call. The engine is a small class, not vLLM: what is under test is the group's bookkeeping."""
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


class HungEngine:
    """A generation that never returns: the engine (one call at a time) cannot take its shutdown call."""

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts, sampling):
        time.sleep(3600)

    def shutdown(self) -> None:
        pass


def test_shutdown_kills_an_engine_hung_in_a_call_instead_of_waiting_its_deadline(ray_local, monkeypatch, capsys):
    from rollout import group as group_module
    from rollout.group import RolloutGroup

    monkeypatch.setattr(group_module, "SHUTDOWN_TIMEOUT_S", 2.0)
    group = RolloutGroup.create(1, {}, engine_cls=HungEngine, max_restarts=0, timeout_s=1000)
    pid = ray_local.get(group.engines[0].pid.remote())
    group.submit([[1]], SamplingConfig())  # hangs
    start = time.monotonic()
    group.shutdown()
    assert time.monotonic() - start < 30 and group.engines == []
    assert "did not answer within 2 s" in capsys.readouterr().err
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break  # the hung process is gone
        time.sleep(0.2)
    else:
        raise AssertionError(f"engine process {pid} still alive after its shutdown")


class PidEngine:
    """Answers each prompt with its ids and this engine's pid (which engine served it)."""

    def generate(self, prompts, sampling):
        return [Sample(i, list(p), [*p, os.getpid()], [0.0] * (len(p) + 1), "stop") for i, p in enumerate(prompts)]

    def shutdown(self) -> None:
        pass


def test_prompts_sent_to_chosen_engines_come_back_in_prompt_order(ray_local):
    import pytest

    from rollout.group import RolloutGroup
    group = RolloutGroup.create(2, {}, engine_cls=PidEngine, timeout_s=60)
    try:
        unseeded = SamplingConfig(seed=None, budgets=(1, 2, 3, 4, 5))
        samples = group.collect(group.submit([[1], [2], [3], [4], [5]], unseeded, engines=[1, 0, 1, 1, 0]))
        assert [s.prompt_index for s in samples] == [0, 1, 2, 3, 4]
        assert [s.completion_ids[0] for s in samples] == [1, 2, 3, 4, 5]
        pids = [s.completion_ids[1] for s in samples]
        assert pids[0] == pids[2] == pids[3] != pids[1] == pids[4]
        with pytest.raises(ValueError, match="seed=None"):  # per-prompt seeds follow contiguous chunks
            group.submit([[1]], SamplingConfig(seed=0), engines=[0])
    finally:
        group.shutdown()
