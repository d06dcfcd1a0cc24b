"""A mixture-of-experts policy end to end on CPU: the tiny kit's Qwen3-MoE through SFT, then GRPO with the real
vLLM engine. Each sync sends every expert under its checkpoint name (transformers holds them fused), and the engine
packs them for vLLM-CPU's expert kernel again; a reload that left them unpacked put the engine 0.06 off the trainer
in log-prob on unchanged weights, so agreement after a sync is what this checks."""
import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import check_trace, run_cli

TINY_MOE = ("model.tiny.num_experts=4", "model.tiny.intermediate_size=192")


@pytest.mark.slow
def test_sft_then_grpo_on_a_mixture_of_experts_keeps_the_engine_on_the_trainers_experts(tmp_path):
    sft = run_cli("--config", "examples/sort_moe_sft.yaml", f"output_dir={tmp_path / 'sft'}", *TINY_MOE,
                  "trainer.max_steps=40", "eval.every=0", "checkpoint.every=0", timeout=600)
    assert sft.returncode == 0, sft.stderr[-3000:]
    res = run_cli("--config", "examples/sort_moe_grpo.yaml", f"output_dir={tmp_path / 'grpo'}",
                  f"model.path={tmp_path / 'sft' / 'final'}", "model.dtype=float32", "rollout.verify_sync_every=1",
                  "trainer.lr=1e-3", "trainer.max_steps=2", "eval.every=0", "rollout.prompts_per_step=8",
                  "trainer.batch_size=64", "checkpoint.every=0", "algorithm.routing_replay=rollout", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path / "grpo"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["rollout/logprob_diff"] < 1e-4, [r.get("rollout/logprob_diff") for r in rows]  # after a sync
    assert all(r["train/grad_norm"] > 0 for r in rows[1:])
    # 2 layers x 4 experts x (gate, up, down) under their checkpoint names, each verified on arrival
    assert rows[2]["rollout/sync_verified_tensors"] >= 2 * 4 * 3
    # routing replay: the engine's routes reached the trainer, which (fp32 both sides) would have chosen the same
    assert all(r["moe/router_agreement"] >= 0.99 for r in rows[1:]), [r.get("moe/router_agreement") for r in rows]
    check_trace(tmp_path / "grpo", rows)  # (logging.trace, on by default)


def test_a_tiny_mixture_of_experts_config_the_engine_cannot_sync_is_refused_with_the_key(tmp_path):
    res = run_cli("--config", "examples/sort_moe_sft.yaml", f"output_dir={tmp_path}",
                  "model.tiny.intermediate_size=200", "model.tiny.experts_per_token=9", timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "model.tiny.intermediate_size" in res.stderr and "multiple of 32" in res.stderr
    assert "model.tiny.experts_per_token" in res.stderr
