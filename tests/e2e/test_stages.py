"""Every stage from the same CLI, chained like the recipes: SFT -> DPO, SFT -> RM -> PPO (critic) against the
reward model. Reduced sizes; each asserts what the stage must learn and log."""
import os

import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


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
                  "trainer.zero_stage=2", "trainer.offload=true",
                  "placement.mode=hybrid",  # critic, reward model and reference beside hybrid ranks
                  "rollout.temperature=0.8", timeout=900)  # engine, trainer and reference all at T 0.8
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(5))
    for r in rows[1:]:
        assert {"critic/loss", "critic/values_mean", "rollout/task_reward_mean", "rollout/kl",
                "time/offload"} <= set(r)
        assert r["rollout/logprob_diff"] < 1e-3  # vLLM's processed log-probs = the trainer's tempered ones
    # policy == reference (both tempered the same) before any update
    assert rows[1]["rollout/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_grpo_lora_syncs_only_the_adapter_and_resumes_from_a_checkpoint_without_the_base(sft_model, tmp_path):
    args = ["--config", "examples/sort_grpo_lora.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
            "eval.every=0", "data.num_eval=16", "rollout.prompts_per_step=16", "trainer.lr=1e-2",
            "rollout.lora_sync=adapter", "placement.mode=hybrid"]  # the adapter handed to the engine in the rank
    res = run_cli(*args, "trainer.max_steps=3", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))[1:]
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows)  # the engine generated with the synced adapter
    assert rows[-1]["rollout/kl"] > 0  # the adapter moved away from the base (the reference)
    assert os.path.isfile(tmp_path / "final_adapter" / "adapter_model.safetensors")
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_000003")) == [
        "COMPLETE", "driver.json", "latest", "policy", "policy_hf_adapter"]  # no merged copy of the base
    # one more step from that checkpoint: the base read from model.path again, the adapter and its moments restored
    res = run_cli(*args, "trainer.max_steps=4", timeout=900)
    assert res.returncode == 0 and "resumed from" in res.stdout + res.stderr, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["rollout/kl"] > 0  # the restored adapter is the trained one, not a fresh zero one
    assert rows[-1]["rollout/logprob_diff"] < 1e-3  # and the engine samples with it


