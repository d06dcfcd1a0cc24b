"""Multi-turn GRPO through `python -m rlhf.run` on an environment written outside the package (tests/fixtures/envs.py):
every trajectory has its two turns, the engine's log-probs agree with the trainer's over whole trajectories at every
step, and rollouts.jsonl shows the whole conversation."""
import json

import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_grpo_trains_on_an_environment_from_outside_the_package(sft_model, tmp_path):
    """From a file of rows the environment reads (`question`, `answer`: no prompt column, no reward.fn)."""
    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows

    rows = make_rows(DataConfig(task="sort", num_train=128, max_items=4, max_value=49), "train", 0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "run"
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={sft_model}", f"output_dir={out}",
                  "data.task=null", f"data.train_path={data}", f"data.eval_path={data}",
                  "env.name=tests.fixtures.envs:SortTwice", "env.max_turns=3", "trainer.max_steps=3", "eval.every=0",
                  "rollout.prompts_per_step=16", "trainer.batch_size=128",
                  "rollout.max_model_len=128", "logging.rollouts_every=1", "logging.rollouts_per_step=2",
                  # the engine in the trainer's process: trajectories' turns reach it one call at a time
                  "placement.mode=hybrid", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["rollout/turns"] == 2 and r["rollout/env_errors"] == 0  # the env ends after its second turn
        assert r["rollout/logprob_diff"] < 1e-3  # over both turns' sampled tokens
        assert 0 < r["rollout/sampled_tokens"] < r["rollout/response_len"]  # the observation is not trained on
        assert r["policy/loss"] is not None and r["train/skipped_steps"] == 0
    assert {"eval/reward_mean", "eval/accuracy", "eval/turns"} <= set(rows[0])
    with open(out / "rollouts.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    assert dumped and all(d["turns"] == 2 and "<|im_start|>user\nagain<|im_end|>" in d["completion"] for d in dumped)
