"""`placement.mode: hybrid` end to end: each trainer rank hosts its vLLM engine in its own process (actors.hybrid)
and a sync hands the engine the rank's tensors by reference (rollout.sync's `local` channel). Two ZeRO-3 ranks,
so every sync is a collective gather streamed into each rank's engine; the learning rate is high enough that an
engine left on the old weights would disagree with the trainer by ~1e-2 after the first update."""
import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_two_hybrid_zero3_ranks_keep_their_engines_on_the_trainers_weights(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_grpo.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "placement.mode=hybrid", "trainer.world_size=2", "rollout.num_engines=2", "trainer.zero_stage=3",
                  "trainer.lr=1e-3", "trainer.max_steps=3", "eval.every=3", "data.num_eval=16",
                  "rollout.prompts_per_step=16", "trainer.batch_size=128", "checkpoint.every=0",
                  "algorithm.overlong_buffer=12", timeout=600)  # DAPO's penalty over the last 12 of 16 tokens
    assert res.returncode == 0, res.stderr[-3000:]
    assert "weight sync: local" in res.stdout
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # steps 2 and 3 generate after a sync: an engine that missed it would be ~1e-2 off
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in rows[1:]), [r["rollout/logprob_diff"] for r in rows]
    assert all(r["train/grad_norm"] > 0 and r["train/skipped_updates"] == 0 for r in rows[1:])
    # completions longer than 4 tokens lose part of their reward, none more than the whole
    assert all(-1.0 <= r["rollout/overlong_penalty_mean"] < 0 for r in rows[1:]), rows[1:]
    assert rows[0]["time/start_engines"] < 1.0  # the engines started inside the ranks, nothing was left to wait for
    assert "eval/exact_match" in rows[-1]
