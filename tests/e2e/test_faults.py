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


@pytest.mark.slow
def test_a_killed_engine_ends_the_run_with_one_paragraph(sft_model, tmp_path):
    """`kill -9` of the vLLM engine's process mid-run: exit code 3 and one paragraph naming the worker, the last
    checkpoint and how to resume; no traceback (shutting down the dead engine used to raise again in close())."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import ROOT

    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.run", "--config", "examples/sort_grpo.yaml", f"model.path={sft_model}",
         f"output_dir={tmp_path}", "trainer.max_steps=30", "checkpoint.every=1", "eval.every=0", "data.num_eval=16",
         "rollout.prompts_per_step=16", "trainer.batch_size=64", "trainer.micro_batch_size=32"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and checkpoint.latest(str(tmp_path)) is None:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        engines = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "VLLMEngine" in " ".join(p.cmdline())]
        assert len(engines) == 1, [p.cmdline() for p in engines]
        engines[0].send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3, err[-3000:]
    assert "rollout engine 0 died" in err and "rerun the same command to resume" in err, err[-3000:]
    assert "checkpoints/step_" in err and "Traceback" not in err, err[-3000:]
