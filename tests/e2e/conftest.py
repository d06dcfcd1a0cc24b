import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory):
    """A partly trained SFT checkpoint (about 25% exact match), shared by the RL and preference tests; its run
    folder's metrics are test_pipeline's SFT half."""
    out = tmp_path_factory.mktemp("sft")
    res = run_cli("--config", "examples/sort_sft.yaml", f"output_dir={out}", "trainer.max_steps=150",
                  "eval.every=75", "data.num_eval=64", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return out / "final"
