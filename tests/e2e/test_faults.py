"""A run whose updates keep coming out NaN stops itself with exit code 3 and a message, after logging each skipped
step, and leaves its last checkpoint intact (the skipped updates never touched the weights)."""
import pytest
from safetensors.torch import load_file

from rlhf.outputs import checkpoint
from rlhf.outputs.metrics import read_metrics
from tests.helpers import child_commands, logged_rows, run_cli


@pytest.mark.slow
def test_consecutive_nan_steps_stop_the_run_and_keep_the_checkpoint(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={sft_model}", f"output_dir={tmp_path}",
                  "reward.fn=tests.fixtures.nan_reward:always_nan", "trainer.max_steps=5", "trainer.max_bad_steps=2",
                  "checkpoint.every=1", "eval.every=0", "data.num_eval=16", "rollout.prompts_per_step=16",
                  "trainer.batch_size=64", "trainer.micro_batch_size=32",
                  "placement.mode=hybrid", timeout=600)  # one process fewer; colocate has its own fault tests below
    assert res.returncode == 3, res.stderr[-3000:]
    assert "2 consecutive steps had a NaN or Inf loss" in res.stderr and "Traceback" not in res.stderr
    assert "WARNING step 1: update skipped" in res.stdout

    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train/skipped_steps"] for r in rows[1:]] == [1.0, 2.0]
    assert all(r["policy/loss"] is None for r in rows[1:])  # NaN is written as JSON null
    last = checkpoint.latest(str(tmp_path))
    assert last is not None and last.endswith("step_000001") and "step_000001" in res.stderr
    saved, start = load_file(f"{last}/policy_hf/model.safetensors"), load_file(f"{sft_model}/model.safetensors")
    assert saved.keys() == start.keys() and all((saved[k] == start[k]).all() for k in start)


def _start_run(sft_model, tmp_path, *overrides):
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    return subprocess.Popen(
        [sys.executable, "-m", "rlhf.run", "--config", "examples/sort_grpo.yaml", f"model.path={sft_model}",
         f"output_dir={tmp_path}", "eval.every=0", "data.num_eval=16", "rollout.prompts_per_step=16",
         "trainer.batch_size=64", "trainer.micro_batch_size=32", *overrides],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _kill_when(proc, ready, title: str, timeout_s: float = 600.0) -> None:
    """Once `ready()`, `kill -9` the run's one process whose title (Ray's `ray::Class.method`) contains `title`."""
    import signal
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if ready():
            found = [(p, cmd) for p, cmd in child_commands(proc.pid) if title in cmd]
            if found:
                assert len(found) == 1, [cmd for _, cmd in found]
                found[0][0].send_signal(signal.SIGKILL)
                return
        time.sleep(0.05)
    raise AssertionError(f"no process titled {title!r} within {timeout_s:.0f} s")


def _finish(proc, timeout_s: float = 600.0) -> tuple[str, str]:
    """The run's stdout and stderr, once it ended."""
    import os
    import signal

    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_killed_engine_is_restarted_and_the_run_goes_on(sft_model, tmp_path, tp):
    """`kill -9` of the vLLM engine's process while it generates step 3's rollout (after two updates): Ray restarts
    it, the trained weights are pushed into it (the restarted engine's log-probs agree with the trainer's, which they
    could not with the weights it starts from), its generation is redone and the run finishes, counting one
    restart. At rollout.tensor_parallel_size=2 the killed process's two workers are ended by its successor, which
    starts two of its own and syncs both."""
    proc = _start_run(sft_model, tmp_path, "trainer.max_steps=4", "checkpoint.every=0",
                      f"rollout.tensor_parallel_size={tp}")
    _kill_when(proc, lambda: logged_rows(tmp_path) >= 3, "VLLMEngine.generate")  # rows for steps 0-2
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout engine 0 died and Ray restarted it" in out, out[-3000:]
    rows = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert rows[2]["rollout/engine_restarts"] == 0 and rows[4]["rollout/engine_restarts"] == 1, rows
    assert all(rows[s]["rollout/logprob_diff"] < 1e-3 for s in (3, 4)), [rows[s] for s in (3, 4)]


@pytest.mark.slow
def test_a_killed_engine_under_async_rl_is_restarted_and_every_prompt_still_trained_once(sft_model, tmp_path):
    """The same kill under rollout.max_staleness 1, while the engine advances the samples it keeps (generating ahead
    for a thread of the driver's own while the trainer trains): Ray restarts it, the current weights are pushed into
    it, the samples it held start again there from their tokens so far, and the run finishes with every step's 16
    prompts trained (none lost, none twice) and the staleness bound kept."""
    import json

    proc = _start_run(sft_model, tmp_path, "trainer.max_steps=4", "checkpoint.every=0", "rollout.max_staleness=1")
    _kill_when(proc, lambda: logged_rows(tmp_path) >= 3, "VLLMEngine.advance")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout engine 0 died and Ray restarted it" in out, out[-3000:]
    rows = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert sorted(rows) == [0, 1, 2, 3, 4] and rows[4]["rollout/engine_restarts"] == 1, rows
    assert all(rows[s]["rollout/staleness_max"] <= 1 for s in range(1, 5)), rows
    trained = [json.loads(line) for line in open(tmp_path / "trained_rows.jsonl")]
    assert [t["step"] for t in trained] == [1, 2, 3, 4]
    every = [r for t in trained for r in t["rows"]]
    assert all(len(t["rows"]) == 16 for t in trained) and len(set(every)) == len(every) == 64


@pytest.mark.slow
def test_a_killed_trainer_rank_ends_the_run_with_one_paragraph(sft_model, tmp_path):
    """`kill -9` of the trainer's process mid-run: exit code 3 and one paragraph naming the worker, the last
    checkpoint and how to resume; no traceback (shutting down the dead worker must not raise again in close())."""
    proc = _start_run(sft_model, tmp_path, "trainer.max_steps=30", "checkpoint.every=1")
    _kill_when(proc, lambda: checkpoint.latest(str(tmp_path)) is not None, "PolicyTrainer")
    _, err = _finish(proc, 300)
    assert proc.returncode == 3, err[-3000:]
    assert "policy trainer 0 died" in err and "rerun the same command to resume" in err, err[-3000:]
    assert "checkpoints/step_" in err and "Traceback" not in err, err[-3000:]
