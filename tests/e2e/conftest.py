import pytest

from tests.helpers import run_cli


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, worker_id):
    """A partly trained SFT checkpoint (about 25% exact match), shared by the RL and preference tests; its run
    folder's metrics are test_pipeline's SFT half. Trained once per test run: under pytest-xdist the first worker
    to ask trains it in the run's shared temp folder while the others wait on a file lock."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out = shared / "sft"
    with FileLock(str(shared / "sft.lock")):
        if not (out / "final" / "config.json").is_file():
            res = run_cli("--config", "examples/sort_sft.yaml", f"output_dir={out}", "trainer.max_steps=150",
                          "eval.every=75", "data.num_eval=64", timeout=900)
            assert res.returncode == 0, res.stderr[-3000:]
    return out / "final"
