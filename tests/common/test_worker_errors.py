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


def test_a_death_or_timeout_still_advises_a_rerun():
    said = worker_died(WorkerDied("policy trainer 1 died: gone", "policy trainer 1", died=True), "ckpt/step_2")
    assert "rerun the same command to resume" in said and "ckpt/step_2" in said
