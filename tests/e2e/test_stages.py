"""Every stage from the same CLI, chained like the recipes: SFT -> DPO, SFT -> RM -> PPO (critic) against the
reward model. Reduced sizes; each asserts what the stage must learn and log."""
import pytest

from rlhf.metrics import read_metrics
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    res = run_cli("--config", "examples/sort_sft.yaml", f"output_dir={out}", "trainer.max_steps=150", "eval.every=0",
                  "data.num_eval=32", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return out / "final"


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
                  timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(5))
    for r in rows[1:]:
        assert {"critic/loss", "critic/values_mean", "rollout/task_reward_mean", "rollout/kl"} <= set(r)
        assert r["rollout/logprob_diff"] < 1e-3
    assert rows[1]["rollout/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
