"""A worker that raises is reported by its own exception and where it was raised, on the real Ray; "rerun" is
advised only for a worker that died or timed out, since one that raised would raise again."""
import pytest

from common.remote import WorkerDied, make_actor, ray_get
from rlhf.stages.loop import worker_died


class Engine:
    def generate(self, n: int) -> int:
        if n > 100:
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 38.00 GiB")
        if n > 8:
            raise ValueError(f"the prompt ({n} tokens) is longer than the maximum model length (8)")
        return n


def test_a_raised_error_names_its_cause_and_advises_no_rerun(ray_local):
    actor = make_actor(Engine, "rollout engine 0", None)
    try:
        assert ray_get([actor.generate.remote(3)], 60, ["rollout engine 0"]) == [3]
        with pytest.raises(WorkerDied) as e:
            ray_get([actor.generate.remote(12)], 60, ["rollout engine 0"])
        assert e.value.raised and not e.value.died
        text = str(e.value)
        assert text.startswith("rollout engine 0 raised ValueError: the prompt (12 tokens) is longer than the "
                               "maximum model length (8)")
        assert "test_worker_errors.py:" in text and "in generate" in text
        said = worker_died(e.value, None)
        assert "longer than the maximum model length" in said and "fix its cause first" in said
        assert "out of memory" not in said
        with pytest.raises(WorkerDied) as e:  # running out of memory names what lowers it
            ray_get([actor.generate.remote(1000)], 60, ["rollout engine 0"])
        assert "OutOfMemoryError: CUDA out of memory" in str(e.value)
        assert "trainer.max_tokens_per_micro_batch" in str(e.value) and "gradient_checkpointing" in str(e.value)
    finally:
        ray_local.kill(actor)


class Trainer:
    def __init__(self, port: int):
        raise OSError(f"the port {port} is taken (EADDRINUSE)")

    def step(self) -> int:
        return 1


def test_a_worker_whose_start_raised_is_reported_by_its_own_error_not_as_a_death(ray_local):
    """Ray reports an actor whose __init__ raised as dead ("an error raised in its creation task"); the run says
    the worker's own error and where, and does not advise a rerun as it would for a crash."""
    actor = make_actor(Trainer, "policy trainer 0", None, 29500)
    with pytest.raises(WorkerDied) as e:
        ray_get([actor.step.remote()], 60, ["policy trainer 0"])
    assert e.value.raised and e.value.start_failed and not e.value.died  # gone for good: no retry, no restart
    assert str(e.value).startswith("policy trainer 0 raised OSError: the port 29500 is taken (EADDRINUSE)")
    assert "test_worker_errors.py:" in str(e.value) and "in __init__" in str(e.value)
    said = worker_died(e.value, None)
    assert "fix its cause first" in said and "ran out of memory" not in said


def test_a_death_or_timeout_still_advises_a_rerun():
    said = worker_died(WorkerDied("policy trainer 1 died: gone", "policy trainer 1", died=True), "ckpt/step_2")
    assert "rerun the same command to resume" in said and "ckpt/step_2" in said


RAY_OOM = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
           "detail: Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.7, ID: "
           "8c5a14) where the task (actor ID: 41617b, name=PolicyTrainer.__init__, pid=548, memory used=20.21GB) "
           "was running was 22.80GB / 24.00GB (0.95), which exceeds the memory usage threshold of 0.95. Ray "
           "killed this worker (ID: 0f7695) because it was the most recently scheduled task; to see more "
           "information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.7`.\nTop 10 memory "
           "users:\nPID\tMEM(GB)\tCOMMAND\n548\t20.21\tray::PolicyTrainer.train_step\n549\t1.90\tray::VLLMEngine\n")


def test_a_worker_the_memory_monitor_killed_ends_the_run_in_one_line_with_its_peak_the_step_and_the_keys():
    """Ray's own report (its format in Ray's docs, as Ray 2.x prints it) is a paragraph and a process table; the run
    ends on one line instead: the actor, what it held, the node, the step's rows x tokens, what lowers it."""
    from common.remote import memory_hint, memory_kill
    assert memory_kill("The actor died unexpectedly before finishing this task.") is None
    killed = memory_kill(RAY_OOM)
    assert killed == ("killed by Ray's memory monitor when it held 20.21GB and the node 22.80GB of 24.00GB "
                      "(out of memory)")
    error = WorkerDied(memory_hint(f"policy trainer 0 died: {killed}"), "policy trainer 0", died=True)
    said = worker_died(error, "runs/x/checkpoints/step_4", "128 rows x 2112 tokens")
    assert "\n" not in said and "Top 10" not in said and "PID" not in said
    assert said.startswith("policy trainer 0 died: killed by Ray's memory monitor when it held 20.21GB")
    for key in ("trainer.max_tokens_per_micro_batch", "trainer.gradient_checkpointing", "rollout.max_new_tokens",
                "trainer.sequence_parallel_size", "The step held 128 rows x 2112 tokens",
                "runs/x/checkpoints/step_4, is intact", "rerun the same command to resume from it"):
        assert key in said, key
