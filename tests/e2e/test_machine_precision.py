"""`model.dtype: auto` end to end: the probe's verdict (forced through its cache file, as a machine without bf16
units and one with them would measure) decides what the engines load and the trainers compute in, and the first
metrics row records it."""
import json

import pytest

from common.fast_dtype import cpu_key
from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli

# what the issue measured on an AVX2-only EPYC (2 threads, 1024^2), and an AMX Xeon's rates
SLOW_BF16 = {"bf16_gflops": 0.7, "fp32_gflops": 65.0, "isa": "AVX2", "threads": 1}
FAST_BF16 = {"bf16_gflops": 375.0, "fp32_gflops": 150.0, "isa": "AMX", "threads": 1}


@pytest.mark.parametrize("probe, dtype, precision, matmuls", [
    (SLOW_BF16, "float32", "fp32", "float32"),
    (FAST_BF16, "bfloat16", "bf16-mixed", "bfloat16")])
def test_auto_precision_loads_engines_and_trainers_in_the_dtype_the_probe_chose(tmp_path, tiny_model_dir, probe, dtype,
                                                                                precision, matmuls):
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({cpu_key(1): probe}))
    out = tmp_path / "run"
    # the LoRA recipe's form: bf16-mixed where bf16 is chosen, fp32 where it is not
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={tiny_model_dir}", f"output_dir={out}",
                  "model.dtype=auto", "trainer.precision=bf16-mixed", "placement.cpu_threads=1",
                  "trainer.max_steps=1", "eval.every=-1", "checkpoint.every=0", "rollout.prompts_per_step=4",
                  "rollout.n_samples=2", "trainer.batch_size=8", "trainer.micro_batch_size=8",
                  env={"RLHF_BF16_PROBE": str(cache)}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"precision: model.dtype {dtype}, trainer.precision {precision} (bf16 matmuls run" in res.stdout
    assert "warning: " not in res.stderr.replace("warning: rollout/", "")
    first = read_metrics(str(out))[0]
    assert (first["run/dtype"], first["run/precision"]) == (dtype, precision)
    assert (first["run/engine_dtype"], first["run/trainer_dtype"]) == (dtype, matmuls)
    assert (first["run/bf16_gflops"], first["run/cpu_isa"]) == (probe["bf16_gflops"], probe["isa"])
    saved = (out / "config.yaml").read_text()
    assert f"dtype: {dtype}" in saved and f"precision: {precision}" in saved  # what ran, not "auto"


def test_an_explicit_bf16_on_a_cpu_that_runs_it_slowly_runs_and_says_how_to_fix_it(tmp_path, tiny_model_dir):
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({cpu_key(1): SLOW_BF16}))
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                  "model.dtype=bfloat16", "placement.cpu_threads=1", "--print-config",
                  env={"RLHF_BF16_PROBE": str(cache)}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dtype: bfloat16" in res.stdout  # kept as set
    assert ("warning: model.dtype=bfloat16 will run slowly: bf16 matmuls run 1/93 of fp32's on this CPU (AVX2, 1 "
            "thread(s): 0.7 against 65.0 GFLOP/s). Set model.dtype=auto or float32") in res.stderr
