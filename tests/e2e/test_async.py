"""Asynchronous RL end to end (rollout.max_staleness, the real engines): the staleness bound holds on every step and
is reached, generations interrupted by a sync continue under the new weights and are corrected, over-sampling
chooses among the groups generated ahead; `kill -9` during a generation, a training step and a sync, each time
followed by the same command, trains every prompt of the epoch exactly once (trained_rows.jsonl)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import ROOT, check_trace, child_commands, logged_rows, run_cli

PER_STEP, STEPS = 16, 8  # one epoch of PER_STEP x STEPS rows


def _args(model, out, *extra):
    return ["--config", "examples/sort_grpo.yaml", f"model.path={model}", f"output_dir={out}", "eval.every=0",
            "data.num_eval=16", f"rollout.prompts_per_step={PER_STEP}", "trainer.batch_size=64",
            "trainer.micro_batch_size=32", f"data.num_train={PER_STEP * STEPS}", f"trainer.max_steps={STEPS}",
            "checkpoint.every=1", "checkpoint.keep_last=2", *extra]


def _trained_rows(out) -> dict[int, list[int]]:
    with open(out / "trained_rows.jsonl") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in lines]
    assert len(steps) == len(set(steps)), steps  # one line a step, even across resumes
    return {r["step"]: r["rows"] for r in lines}


@pytest.mark.slow
def test_generating_ahead_stays_within_max_staleness_and_is_corrected(sft_model, tmp_path):
    res = run_cli(*_args(sft_model, tmp_path, "rollout.max_staleness=2", "rollout.chunk_tokens=1",
                         "trainer.max_steps=6", "checkpoint.every=0", "algorithm.oversample=1.5"), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))[1:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/staleness_max"] <= 2 for r in rows), [r["rollout/staleness_max"] for r in rows]
    assert max(r["rollout/staleness_max"] for r in rows) == 2  # the engines did run ahead, as far as allowed
    assert rows[0]["rollout/staleness_max"] == 0  # step 1: the starting weights train their own samples
    # (every step allowed is generated at once, so on this model a step's samples are done before the next sync:
    # a sync landing mid-generation is tested in tests/rollout/test_async_rollout.py, on the real engine)
    # the off-policy correction is on by default (tis_cap 2, IcePop's mask [0.5, 5]) and acts on older samples
    assert all("policy/tis_capped_frac" in r and "policy/tis_masked_frac" in r for r in rows)
    assert rows[0]["rollout/logprob_diff"] < 1e-3 < rows[-1]["rollout/logprob_diff"]
    # over-sampling chooses among what arrived: 24 prompts generated a step, the 16 most informative trained
    assert all(r["rollout/fill_rounds"] == 1 and "rollout/kept_group_frac" in r for r in rows)
    trained = _trained_rows(tmp_path)
    assert sorted(trained) == [1, 2, 3, 4, 5, 6] and all(len(set(r)) == PER_STEP for r in trained.values())
    check_trace(tmp_path, rows)  # (the generator's calls overlap the trainer's: each on its engine's track)
    config = (tmp_path / "config.yaml").read_text()
    assert "tis_cap: 2.0" in config and "tis_mask_low: 0.5" in config and "tis_mask_high: 5.0" in config


@pytest.mark.slow
def test_dynamic_sampling_refills_a_step_generated_ahead_with_new_prompts(sft_model, tmp_path):
    # near-greedy samples: a group's rewards are mostly all equal, so steps need further rounds
    res = run_cli(*_args(sft_model, tmp_path, "rollout.max_staleness=1", "algorithm.dynamic_sampling=true",
                         "rollout.temperature=0.05", "trainer.max_steps=3", "checkpoint.every=0",
                         "data.num_train=512"), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))[1:]
    assert any(r["rollout/fill_rounds"] > 1 for r in rows), [r["rollout/fill_rounds"] for r in rows]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    trained = [i for step_rows in _trained_rows(tmp_path).values() for i in step_rows]
    assert len(trained) == 3 * PER_STEP and len(set(trained)) == len(trained)  # refills drew new prompts


def _run_until_killed(args, out, titles: tuple[str, ...], min_rows: int, timeout_s: float = 600.0) -> None:
    """Start the run; once metrics.jsonl has `min_rows` rows, `kill -9` its whole process group the moment one of
    its processes has one of `titles` (Ray's `ray::Class.method` while a call runs)."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.run", *args], cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline:
            assert proc.poll() is None, f"the run ended before the kill ({titles}): {proc.stderr.read()[-3000:]}"
            logged = logged_rows(out)
            if logged >= min_rows and any(t in cmd for _, cmd in child_commands(proc.pid) for t in titles):
                return
            time.sleep(0.001 if logged >= min_rows else 0.2)
        raise AssertionError(f"no process titled {titles} within {timeout_s:.0f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):  # a run that ended on its own has no group left to kill
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_kill_9_during_generation_training_and_sync_trains_each_prompt_once(sft_model, tmp_path):
    args = _args(sft_model, tmp_path, "rollout.max_staleness=1", "rollout.chunk_tokens=2")
    _run_until_killed(args, tmp_path, ("VLLMEngine.advance",), min_rows=2)
    _run_until_killed(args, tmp_path, ("PolicyTrainer.train_step",), min_rows=3)
    # a sync is short on the tiny model: either end of it, and every step's sync from the third on, is a chance
    _run_until_killed(args, tmp_path, ("VLLMEngine.receive_weights", "PolicyTrainer.send_weights"), min_rows=4)
    res = run_cli(*args, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(STEPS + 1))
    trained = _trained_rows(tmp_path)
    assert sorted(trained) == list(range(1, STEPS + 1)) and all(len(r) == PER_STEP for r in trained.values())
    every = sorted(i for rows in trained.values() for i in rows)
    assert every == list(range(PER_STEP * STEPS))  # the epoch's every prompt, each trained exactly once


@pytest.mark.slow
def test_multi_turn_trajectories_generated_ahead_resume_after_kill_9_with_each_prompt_once(sft_model, tmp_path):
    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows

    steps = 6  # after step 2 the generations of steps 4-6 remain: three windows to catch, not one short one
    rows = make_rows(DataConfig(task="sort", num_train=PER_STEP * steps, max_items=4, max_value=49), "train", 0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "run"
    args = _args(sft_model, out, "rollout.max_staleness=1", "data.task=null", f"data.train_path={data}",
                 f"data.eval_path={data}", "env.name=tests.fixtures.envs:SortTwice", "env.max_turns=3",
                 "rollout.max_model_len=128", f"trainer.max_steps={steps}", "eval.every=-1")
    # step 2 logged (so step 1's checkpoint is complete), trajectories in flight
    _run_until_killed(args, out, ("VLLMEngine.generate",), min_rows=3)
    res = run_cli(*args, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "not evaluated (eval.every=-1)" in res.stdout
    logged = read_metrics(str(out))
    assert [r["step"] for r in logged] == list(range(steps + 1)) and not any("eval/accuracy" in r for r in logged)
    for r in logged[1:]:
        assert r["rollout/turns"] == 2 and r["rollout/env_errors"] == 0 and r["rollout/staleness_max"] <= 1
    assert max(r["rollout/staleness_max"] for r in logged[1:]) == 1  # trajectories were generated ahead
    every = sorted(i for step_rows in _trained_rows(out).values() for i in step_rows)
    assert every == list(range(PER_STEP * steps))  # each prompt trained exactly once across the kill
