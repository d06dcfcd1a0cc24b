"""rollout.tensor_parallel_size=2 end to end on CPU: each vLLM engine splits its weights over two workers (processes
of their own, one core each), and every sync reaches both. The learning rate is high enough that a worker left on
the old weights would put the engine ~1e-2 off the trainer after the first update; with verification on, each
sync's tensors are compared, worker by worker, with what the trainer sent."""
import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_a_grpo_run_with_two_tensor_parallel_workers_keeps_both_on_the_trainers_weights(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_grpo.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "model.dtype=float32", "rollout.tensor_parallel_size=2", "rollout.verify_sync_every=1",
                  "trainer.lr=1e-3", "trainer.max_steps=2", "eval.every=0", "rollout.prompts_per_step=16",
                  "trainer.batch_size=128", "checkpoint.every=0", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["rollout/logprob_diff"] < 1e-4, [r["rollout/logprob_diff"] for r in rows]  # after a sync
    assert all(r["train/grad_norm"] > 0 for r in rows[1:])
    assert all(r["rollout/sync_verified_tensors"] > 0 for r in rows[1:])  # each sync checked on both workers
    # (each engine's prefill FLOPs and decode bytes over its two workers' peaks: common.spans, rollout.engines.work)
    assert all(0 < r["perf/prefill_mfu"] < 1 and 0 < r["perf/decode_bw_util"] < 1 for r in rows[1:]), rows


@pytest.mark.slow
def test_a_lora_adapter_reaches_both_tensor_parallel_workers_while_they_generate_ahead(sft_model, tmp_path):
    """The adapter path (only the PEFT adapter travels, vLLM applies it in each worker to its shard) with requests
    kept in flight across syncs (rollout.max_staleness=1): the samples the current weights made agree with the
    trainer, the ones a sync overtook are one update old and no older."""
    res = run_cli("--config", "examples/sort_grpo_lora.yaml", f"output_dir={tmp_path}", f"model.path={sft_model}",
                  "model.dtype=float32", "rollout.tensor_parallel_size=2", "rollout.lora_sync=adapter",
                  "rollout.max_staleness=1", "trainer.lr=1e-2", "trainer.max_steps=3", "eval.every=0",
                  "rollout.prompts_per_step=16", "trainer.batch_size=128", "checkpoint.every=0", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["rollout/staleness_max"] for r in rows) == 1
    current = [r["rollout/logprob_diff"] for r in rows if r["rollout/staleness_max"] == 0]
    assert current and all(d < 1e-3 for d in current), [(r["rollout/staleness_max"], r["rollout/logprob_diff"])
                                                        for r in rows]
    assert rows[-1]["rollout/kl"] > 0  # the adapter moved away from the base
