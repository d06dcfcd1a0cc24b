"""A run killed with SIGKILL at a random moment and rerun with the same command continues from its newest complete
checkpoint, logs every step exactly once, and matches an uninterrupted run step for step: GRPO (Ray actors, the vLLM
engine inside the trainer rank) and SFT (the in-process loop the sft/dpo/rm stages share)."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from rlhf.outputs import checkpoint
from rlhf.outputs.metrics import read_metrics
from tests.helpers import ROOT, run_cli

STEPS = 6


def args(model, out):
    return ["--config", "examples/sort_grpo.yaml", f"model.path={model}", f"output_dir={out}",
            f"trainer.max_steps={STEPS}", "checkpoint.every=2", "checkpoint.keep_last=2", "eval.every=3",
            "data.num_eval=16", "rollout.prompts_per_step=16", "trainer.batch_size=64", "trainer.micro_batch_size=32",
            "logging.rollouts_every=1", "logging.rollouts_per_step=2",
            "placement.mode=hybrid"]  # a resume pushes the checkpoint's weights over the in-process channel


def kill_at_random_moment(cmd_args, out, rng, last_target: int = STEPS - 1) -> int:
    """Start the run in its own session, wait until it has logged a random step (plus a random delay), then SIGKILL
    the whole process group (driver, local Ray, actors). Returns the last step logged before the kill."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.run", *cmd_args], cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    target, deadline = rng.randint(2, last_target), time.time() + 900
    last = -1
    while proc.poll() is None and time.time() < deadline:
        if os.path.isfile(out / "metrics.jsonl"):
            rows = [r for r in open(out / "metrics.jsonl").read().splitlines() if r.strip()]
            last = len(rows) - 1
            if last >= target:
                break
        time.sleep(0.2)
    time.sleep(rng.uniform(0.0, 2.0))
    assert proc.poll() is None, "the run ended before the kill: the test must kill it mid-run"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return last


def assert_same_metrics(ref_out, out, steps: int) -> None:
    """Every step logged exactly once, and every metric but wall times (time/*, perf/* rates, util/* fractions)
    equal to the uninterrupted run's."""
    ref, got = read_metrics(str(ref_out)), read_metrics(str(out))
    assert [r["step"] for r in got] == list(range(steps + 1))
    for a, b in zip(ref, got):
        for key, value in a.items():
            if isinstance(value, str):  # what the run computes in (run/dtype, ...)
                assert b[key] == value, (a["step"], key)
            elif not key.startswith(("time/", "perf/", "util/")):
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(sft_model, tmp_path):
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "killed"
    res = run_cli(*args(sft_model, ref_out), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]

    rng = random.Random(int(os.environ.get("RESUME_TEST_SEED", time.time())))
    killed_after = kill_at_random_moment(args(sft_model, out), out, rng)
    assert 0 <= killed_after < STEPS
    resumable = checkpoint.latest(str(out))  # None if killed before (or while) writing the first checkpoint
    res = run_cli(*args(sft_model, out), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("resumed from" in res.stdout) == (resumable is not None)

    assert_same_metrics(ref_out, out, STEPS)
    # rollouts.jsonl too: dumps after the checkpoint were dropped and redone, each step's samples exactly once
    assert (out / "rollouts.jsonl").read_text() == (ref_out / "rollouts.jsonl").read_text()
    checkpoints = sorted(os.listdir(out / "checkpoints"))
    assert checkpoints == ["step_000004", "step_000006"]  # keep_last=2, no temp folders left behind


SFT_STEPS = 30


@pytest.mark.slow
def test_sft_kill_and_resume_matches_uninterrupted_run(tmp_path):
    def sft_args(out):
        return ["--config", "examples/sort_sft.yaml", f"output_dir={out}", f"trainer.max_steps={SFT_STEPS}",
                "checkpoint.every=5", "checkpoint.keep_last=2", "eval.every=10", "data.num_eval=16",
                "data.num_train=4000", "trainer.warmup_steps=5"]

    ref_out, out = tmp_path / "uninterrupted", tmp_path / "killed"
    res = run_cli(*sft_args(ref_out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rng = random.Random(int(os.environ.get("RESUME_TEST_SEED", time.time())))
    killed_after = kill_at_random_moment(sft_args(out), out, rng, last_target=SFT_STEPS - 10)
    resumable = checkpoint.latest(str(out))
    assert 0 <= killed_after < SFT_STEPS
    res = run_cli(*sft_args(out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("resumed from" in res.stdout) == (resumable is not None)
    assert_same_metrics(ref_out, out, SFT_STEPS)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000025", "step_000030"]
    assert os.path.isfile(out / "checkpoints" / "step_000030" / "model_hf" / "model.safetensors")


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_a_clean_metrics_file(tmp_path):
    """No checkpoint to resume from: the rerun starts over, so must its metrics.jsonl (it once appended, and held
    the first steps twice)."""
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "train/loss": 9.0}}\n' for i in range(4)) +
                                            '{"step": 4, "train/lo')  # the killed run's rows, the last one cut
    res = run_cli("--config", "examples/sort_sft.yaml", f"output_dir={tmp_path}", "trainer.max_steps=2",
                  "eval.every=0", "data.num_eval=8", "data.num_train=256", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r.get("train/loss") != 9.0 for r in rows)


def test_a_checkpoint_that_does_not_load_is_named_and_the_one_before_restored(tmp_path):
    """Same size, wrong content (what the file-size manifest cannot see): DeepSpeed's load fails, the checkpoint is
    named, the one before it restored, and the steps after it redone and logged once."""
    def sft_args(steps):
        return ["--config", "examples/sort_sft.yaml", f"output_dir={tmp_path}", f"trainer.max_steps={steps}",
                "checkpoint.every=1", "checkpoint.keep_last=2", "eval.every=0", "data.num_eval=8",
                "data.num_train=256"]

    res = run_cli(*sft_args(2), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    newest = checkpoint.latest(str(tmp_path))
    states = [os.path.join(d, f) for d, _, files in os.walk(newest) for f in files if f.endswith("model_states.pt")]
    assert states, os.listdir(newest)
    size = os.path.getsize(states[0])
    with open(states[0], "wb") as f:
        f.write(random.Random(0).randbytes(size))
    res = run_cli(*sft_args(3), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint {newest} does not load" in res.stderr and "step_000001 instead" in res.stderr, res.stderr
    assert "resumed from" in res.stdout and "step 1)" in res.stdout, res.stdout
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
