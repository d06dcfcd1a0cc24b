"""`ray job submit --working-dir . -- python -m rlhf.run ...` against a Ray head the test starts, the way a
cluster user launches a run. (A file of its own: pytest-xdist hands out whole files, and this one is long.)"""
import os

import pytest

from rlhf.outputs.metrics import read_metrics


# The job test's run is also the check of these options (one run less: each run pays a whole start-up).
OVERSAMPLED = ["algorithm.dynamic_sampling=true", "algorithm.oversample=1.5",
               "trainer.batch_size=256",  # = the rollout batch: one update, old log-probs from its forward
               "rollout.sync_channel=broadcast",
               "rollout.verify_sync_every=1"]  # every sync checked through vLLM's worker: a difference exits 3


def check_oversampled_run(out, stdout: str) -> None:
    """48 prompts a round (oversample 1.5) for 32 groups a step, further rounds while fewer than 32 have signal;
    the start-up breakdown logged with step 0 and printed; every weight sync verified through vLLM's worker; the
    rollout's tokens counted over all its rounds."""
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
        # every round's generation is counted, in the rate and by the engines, not only the trained groups'
        assert r["perf/rollout_tokens_per_s"] * r["time/rollout"] == pytest.approx(r["rollout/generated_tokens"])
        assert r["rollout/sync_verified_tensors"] > 10  # every sync checked, each tensor of the model


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

    from tests.helpers import ROOT

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
    finally:  # SIGKILL: on SIGTERM `ray start --block` waits for its agents; the workers exit with the raylet
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
