"""`python -m rlhf.run` end to end on the SFT recipe, at reduced size: it trains with DeepSpeed, logs every step,
learns, and saves a Hugging Face model that transformers loads."""
import pytest

from rlhf.metrics import read_metrics
from tests.conftest import run_cli


@pytest.mark.slow
def test_sft_recipe_learns_and_logs_every_step(tmp_path):
    out = tmp_path / "run"
    res = run_cli("--config", "examples/sort_sft.yaml", f"output_dir={out}", "trainer.max_steps=120",
                  "eval.every=60", "data.num_eval=32", "logging.console_every=20", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == list(range(0, 121))
    for r in rows[1:]:
        assert {"train/loss", "train/grad_norm", "train/lr", "time/step"} <= set(r)
    evals = [r for r in rows if "eval/exact_match" in r]
    assert [r["step"] for r in evals] == [0, 60, 120]
    assert rows[-1]["train/loss"] < 0.5 * rows[1]["train/loss"]
    assert evals[-1]["eval/reward_mean"] > evals[0]["eval/reward_mean"] + 0.2
    assert "sft done: eval/exact_match" in res.stdout
    assert (out / "config.yaml").read_text().startswith("stage: sft")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.vocab_size == len(tok)
