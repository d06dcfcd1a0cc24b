"""Every stage from the same CLI, chained like the recipes: SFT -> DPO, SFT -> RM -> PPO (critic) against the
reward model. Reduced sizes; each asserts what the stage must learn and log."""
import os

import pytest

from rlhf.metrics import read_metrics
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def reward_model(sft_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    res = run_cli("--config", "examples/sort_rm.yaml", f"output_dir={out}", f"model.path={sft_model}",
                  "trainer.max_steps=60", "eval.every=30", "data.num_train=2048", "data.num_eval=128", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [r for r in read_metrics(str(out)) if "eval/pair_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert evals[-1]["eval/pair_accuracy"] > 0.8 > evals[0]["eval/pair_accuracy"]
    return out / "final"


@pytest.mark.slow
def test_rm_stage_saves_a_sequence_classifier(reward_model):
    from transformers import AutoModelForSequenceClassification
    assert AutoModelForSequenceClassification.from_pretrained(reward_model).config.num_labels == 1


@pytest.mark.slow
def test_dpo_stage_learns_the_pairs(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_dpo.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "trainer.max_steps=20", "eval.every=10", "data.num_train=1024", "data.num_eval=64", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(21))
    assert all({"train/loss", "dpo/reward_accuracy", "dpo/reward_margin"} <= set(r) for r in rows[1:])
    assert rows[0]["eval/pair_accuracy"] == 0.0  # policy == reference before the first update
    assert rows[-1]["eval/pair_accuracy"] > 0.8 and rows[-1]["eval/margin"] > 0


@pytest.mark.slow
def test_ppo_with_critic_against_the_reward_model(sft_model, reward_model, tmp_path):
    res = run_cli("--config", "examples/sort_ppo_rm.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  f"reward.model_path={reward_model}", "trainer.max_steps=4", "eval.every=0", "data.num_eval=32",
                  # policy and critic hand their ZeRO states to CPU during every rollout, reload to train
                  "trainer.zero_stage=2", "trainer.offload=true", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(5))
    for r in rows[1:]:
        assert {"critic/loss", "critic/values_mean", "rollout/task_reward_mean", "rollout/kl",
                "time/offload"} <= set(r)
        assert r["rollout/logprob_diff"] < 1e-3
    assert rows[1]["rollout/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update


# The job test's run is also the check of these options (one run less; each costs ~15 s of start-up).
OVERSAMPLED = ["algorithm.dynamic_sampling=true", "algorithm.oversample=1.5",
               "trainer.batch_size=256",  # = the rollout batch: one update, old log-probs from its forward
               "rollout.sync_channel=broadcast"]


def check_oversampled_run(out, stdout: str) -> None:
    """48 prompts a round (oversample 1.5) for 32 groups a step, further rounds while fewer than 32 have signal;
    the start-up breakdown logged with step 0 and printed."""
    assert "weight sync: broadcast" in stdout
    first, *rows = read_metrics(str(out))
    launch = first["time/start_since_launch"]
    assert 0 < first["time/start_ray_tokenizer"] < launch and 0 < first["time/start_trainers"] < launch
    assert f"start-up {launch:.1f} s since launch: inputs" in stdout
    for r in rows:
        assert 0 < r["rollout/kept_group_frac"] <= 1 and 1 <= r["rollout/fill_rounds"] <= 4
        generated = 48 * r["rollout/fill_rounds"]  # every group with signal is kept, up to 32
        assert r["rollout/kept_group_frac"] == pytest.approx(min(1.0, r["rollout/informative_frac"] * generated / 32))
        assert r["rollout/logprob_diff"] < 1e-3


@pytest.mark.slow
def test_grpo_lora_syncs_only_the_adapter(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_grpo_lora.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "trainer.max_steps=3", "eval.every=0", "data.num_eval=16", "rollout.prompts_per_step=16",
                  "trainer.lr=1e-2", "rollout.lora_sync=adapter", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))[1:]
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows)  # the engine generated with the synced adapter
    assert rows[-1]["rollout/kl"] > 0  # the adapter moved away from the base (the reference)
    assert os.path.isfile(tmp_path / "final_adapter" / "adapter_model.safetensors")


def _free_port() -> int:
    from common.net import free_port
    return free_port()


@pytest.mark.slow
def test_ray_job_submit_against_a_local_head(sft_model, tmp_path):
    """`ray job submit --working-dir . -- python -m rlhf.run ...` against a head this test starts on free
    127.0.0.1 ports and then kills by its own process group (never `ray stop`, which kills every Ray on the host).
    The job's run is GRPO with over-sampling and dynamic sampling (check_oversampled_run)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    import shutil
    import tempfile

    bin_dir = os.path.dirname(sys.executable)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Unix socket paths under it must stay < 108 chars
    # `make test` does not activate the venv: put its bin first, and name its python in the job's entrypoint, or
    # the job would run the system python (no torch). Token auth: the RAY_AUTH_* of tests/conftest.py.
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    gcs, dash = _free_port(), _free_port()
    # Every port free, the agents' too: the session's Ray (tests/conftest.py) holds the default ones.
    agents = [f"--{name}-port={_free_port()}" for name in ("dashboard-agent-listen", "dashboard-agent-grpc",
                                                           "runtime-env-agent", "metrics-export")]
    head = subprocess.Popen(
        [os.path.join(bin_dir, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4",
         f"--temp-dir={ray_tmp}", *agents],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = tmp_path / "job"
        cmd = [os.path.join(bin_dir, "ray"), "job", "submit", f"--address=http://127.0.0.1:{dash}",
               "--working-dir", ".", "--", sys.executable, "-m", "rlhf.run", "--config", "examples/sort_grpo.yaml",
               f"model.path={sft_model}", f"output_dir={out}", "trainer.max_steps=2", "eval.every=0",
               "data.num_eval=16", *OVERSAMPLED]
        # A new head answers in stages (dashboard, then its job agent); on a loaded machine that takes a while.
        not_ready = ("Connection refused", "Failed to connect", "No available agent", "try again later")
        deadline, res = time.time() + 180, None
        while time.time() < deadline:
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if not any(s in res.stdout + res.stderr for s in not_ready):
                break
            time.sleep(3)
        assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
        assert "succeeded" in res.stdout
        assert [r["step"] for r in read_metrics(str(out))] == [0, 1, 2]
        check_oversampled_run(out, res.stdout)
    finally:  # SIGKILL: on SIGTERM `ray start --block` waits ~30 s for its agents; the workers exit with the raylet
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_overlapped_rollout_is_one_step_off_policy_and_resumable(sft_model, tmp_path):
    """rollout.overlap: step t trains on the rollout generated during step t-1; a checkpoint records the data
    position before the rollout in flight, so a resumed run regenerates it rather than skipping its prompts."""
    import json
    res = run_cli("--config", "examples/sort_grpo.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "rollout.overlap=true", "algorithm.tis_cap=2.0", "trainer.max_steps=4", "eval.every=0",
                  "data.num_eval=16", "checkpoint.every=2", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["rollout/off_policy_steps"] for r in rows[1:]] == [0, 1, 1, 1]
    # Step 1 is on-policy (engine and trainer agree); later rollouts come from the weights one update old.
    assert rows[1]["rollout/logprob_diff"] < 1e-3 < rows[2]["rollout/logprob_diff"]
    per_step = 32  # examples/sort_grpo.yaml rollout.prompts_per_step
    for step in (2, 4):
        with open(tmp_path / "checkpoints" / f"step_{step:06d}" / "driver.json") as f:
            assert json.load(f)["prompts"]["index"] == step * per_step
