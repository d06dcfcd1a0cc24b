"""A run whose updates keep coming out NaN stops itself with exit code 3 and a message, after logging each skipped
step, and leaves its last checkpoint intact (the skipped updates never touched the weights)."""
import pytest
from safetensors.torch import load_file

from rlhf import checkpoint
from rlhf.metrics import read_metrics
from tests.conftest import run_cli


@pytest.mark.slow
def test_consecutive_nan_steps_stop_the_run_and_keep_the_checkpoint(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={sft_model}", f"output_dir={tmp_path}",
                  "reward.fn=tests.e2e.nan_reward:always_nan", "trainer.max_steps=5", "trainer.max_bad_steps=2",
                  "checkpoint.every=1", "eval.every=0", "data.num_eval=16", "rollout.prompts_per_step=16",
                  "trainer.batch_size=64", "trainer.micro_batch_size=32", timeout=600)
    assert res.returncode == 3, res.stderr[-3000:]
    assert "2 consecutive steps had a NaN or Inf loss" in res.stderr and "Traceback" not in res.stderr
    assert "warning: step 1: update skipped" in res.stdout

    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train/skipped_steps"] for r in rows[1:]] == [1.0, 2.0]
    assert all(r["policy/loss"] is None for r in rows[1:])  # NaN is written as JSON null
    last = checkpoint.latest(str(tmp_path))
    assert last is not None and last.endswith("step_000001") and "step_000001" in res.stderr
    saved, start = load_file(f"{last}/policy_hf/model.safetensors"), load_file(f"{sft_model}/model.safetensors")
    assert saved.keys() == start.keys() and all((saved[k] == start[k]).all() for k in start)
