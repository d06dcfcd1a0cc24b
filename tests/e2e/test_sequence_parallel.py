"""A GRPO run whose trainer splits each sequence over two ranks (trainer.sequence_parallel_size=2) takes the step a
one-rank run takes: the same rollout (the engine's seed), then the same loss and gradient norm."""
import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_a_two_rank_sequence_parallel_grpo_step_equals_the_one_rank_step(sft_model, tmp_path):
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}"
        res = run_cli("--config", "examples/sort_grpo.yaml", f"output_dir={out}", f"model.path={sft_model}",
                      "model.dtype=float32", f"trainer.world_size={world}", f"trainer.sequence_parallel_size={world}",
                      "trainer.max_steps=1", "eval.every=0", "rollout.prompts_per_step=16", "trainer.batch_size=128",
                      "checkpoint.every=0", timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        # said before the first step, at the longest rows the engines accept (rollout.max_model_len)
        assert "memory plan, policy trainer (trainer.plan_memory): on cpu, rows of 256 tokens:" in res.stdout
        runs[world] = read_metrics(str(out))[-1]
    one, split = runs[1], runs[2]
    assert split["step"] == one["step"] == 1
    assert split["rollout/reward_mean"] == one["rollout/reward_mean"]  # the same rollout to train on
    for key in ("policy/loss", "train/grad_norm", "policy/entropy"):
        assert split[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
