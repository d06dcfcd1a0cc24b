"""Agent RL through `python -m rlhf.run`: an agent written with the official openai client (tests/fixtures/agents.py)
plays the sort task over two calls against the rollout's endpoint, generated ahead of the trainer
(rollout.max_staleness=1); each episode trains as one stitched sample whose engine log-probs agree with the
trainer's (where nothing was generated ahead), the evaluation scores the agent's reward, and rollouts.jsonl shows
both calls."""
import json

import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_grpo_trains_an_openai_client_agent_ahead_of_the_trainer(sft_model, tmp_path):
    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows

    rows = make_rows(DataConfig(task="sort", num_train=128, max_items=4, max_value=49), "train", 0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "run"
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={sft_model}", f"output_dir={out}",
                  "data.task=null", f"data.train_path={data}", f"data.eval_path={data}", "reward.fn=null",
                  "agent.fn=tests.fixtures.agents:sort_twice", "agent.max_calls=2", "trainer.max_steps=3",
                  "eval.every=0", "rollout.prompts_per_step=16", "trainer.batch_size=128", "rollout.max_staleness=1",
                  "rollout.max_model_len=128", "logging.rollouts_every=1", "logging.rollouts_per_step=2",
                  "rollout.tensor_parallel_size=2",  # the endpoint in front of a tensor-parallel engine
                  timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "agent endpoint: http://127.0.0.1:" in res.stdout
    logged = read_metrics(str(out))
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    for r in logged[1:]:
        assert r["rollout/turns"] == 2 and r["rollout/env_errors"] == 0 and r["rollout/history_breaks"] == 0
        if r["rollout/staleness_max"] == 0:  # (ahead, the difference holds the update since they were sampled)
            assert r["rollout/logprob_diff"] < 1e-3  # over both calls' sampled tokens
        assert 0 < r["rollout/sampled_tokens"] < r["rollout/response_len"]  # the "again" turn is not trained on
        assert r["train/skipped_steps"] == 0
    assert logged[1]["rollout/staleness_max"] == 0 and max(r["rollout/staleness_max"] for r in logged[1:]) == 1
    assert {"eval/reward_mean", "eval/accuracy", "eval/turns"} <= set(logged[0]) and logged[-1]["eval/turns"] == 2
    with open(out / "rollouts.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    assert dumped and all(d["turns"] == 2 and "<|im_start|>user\nagain<|im_end|>" in d["completion"] for d in dumped)


@pytest.mark.slow
def test_a_lora_agent_run_resumes_in_its_own_folder(sft_model, tmp_path):
    """LoRA (only the adapter synced into vLLM) with an agent whose every episode breaks its history (two fresh
    conversations): the run checkpoints every step; the same command with more steps, into the folder that now
    holds it, resumes from its checkpoint and logs each step once. Both contexts of each episode are trained, and
    the engine's log-probs of both agree with the trainer's forward of the joined row."""
    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows

    rows = make_rows(DataConfig(task="sort", num_train=64, max_items=4, max_value=49), "train", 0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["--config", "examples/sort_grpo.yaml", f"model.path={sft_model}", f"output_dir={out}", "data.task=null",
            f"data.train_path={data}", f"data.eval_path={data}", "reward.fn=null", "model.lora.rank=8",
            "trainer.lr=1e-3", "agent.fn=tests.fixtures.agents:sort_afresh", "agent.max_calls=2", "eval.every=-1",
            "rollout.prompts_per_step=8", "trainer.batch_size=64", "rollout.max_model_len=128",
            "checkpoint.every=1"]
    first = run_cli(*args, "trainer.max_steps=2", timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "final_adapter").is_dir()
    second = run_cli(*args, "trainer.max_steps=3", timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "(step 2)" in second.stdout, second.stdout[-2000:]
    logged = [r for r in read_metrics(str(out)) if r["step"] > 0]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(r["rollout/turns"] == 2 and r["rollout/env_errors"] == 0 for r in logged)
    assert all(r["rollout/history_breaks"] == 8 * 8 for r in logged)  # 8 prompts x 8 episodes, one break each
    # over both contexts' sampled ids: the resumed engines run the checkpoint's adapter, and the trainer scores the
    # second context as a sequence of its own
    assert logged[-1]["rollout/logprob_diff"] < 1e-3
