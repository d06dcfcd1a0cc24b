"""Where a run's device-hours go (issue #66), on a real run: a GRPO run that decodes a few sequences at a time,
long ones, is told so after its first steps and at its end with the keys that address it; its workers' own spans
(forward, backward, optimizer, generate) sit inside the driver's calls in the trace; the console shows the
trainer's MFU; the last row holds the run's device-hours and its gain per device-hour."""
from rlhf.outputs.metrics import read_metrics
from tests.helpers import check_trace, run_cli


def test_a_run_that_decodes_few_sequences_is_advised_to_decode_more_at_once(tiny_model_dir, tmp_path):
    res = run_cli("--config", "examples/sort_grpo.yaml", f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                  "model.dtype=float32", "trainer.max_steps=6", "rollout.prompts_per_step=2", "rollout.n_samples=4",
                  "rollout.max_new_tokens=48", "trainer.batch_size=8", "trainer.micro_batch_size=8",
                  "data.num_eval=8", "eval.every=0", "checkpoint.every=0", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    advice = [line for line in res.stdout.splitlines() if line.startswith("advice: decoding read")]
    assert len(advice) == 2 and advice[0].endswith("(from the first 5 steps)"), res.stdout[-3000:]
    assert "8 sequences at a time" in advice[1] and "rollout.prompts_per_step" in advice[1]
    assert any(line.startswith("step 6/6") and " mfu " in line for line in res.stdout.splitlines())
    rows = read_metrics(str(tmp_path))
    assert rows[-1]["perf/device_hours"] > 0 and "perf/gain_per_device_hour" in rows[-1]
    assert all(0 < r["perf/decode_bw_util"] < 0.1 and r["perf/decode_seqs"] == 8 for r in rows[1:])
    check_trace(tmp_path, rows)
