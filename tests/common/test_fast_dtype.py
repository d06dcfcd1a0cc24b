"""model.dtype: auto. The choice is a pure function of (device, probe numbers, the user's value); the probe measures
this machine; the config resolves `auto` once, with the trainer's bf16 form following it."""
import json

import pytest

from common.fast_dtype import Device, choose_dtype, cpu_device, cpu_key, probe_cpu, trainer_precision
from rlhf.config import load_config

AVX2 = Device("cpu", bf16_gflops=0.7, fp32_gflops=65.0, isa="AVX2", threads=2)  # the EPYC
AVX512_NO_AMX = Device("cpu", bf16_gflops=147.0, fp32_gflops=292.0, isa="AVX512", threads=2)
AMX = Device("cpu", bf16_gflops=375.0, fp32_gflops=150.0, isa="AMX", threads=2)
EVEN = Device("cpu", bf16_gflops=100.0, fp32_gflops=100.0, isa="AVX512", threads=2)
H100, V100, UNSEEN_GPU = Device("cuda", capability=(9, 0)), Device("cuda", capability=(7, 0)), Device("cuda")


def force_probe(tmp_path, monkeypatch, threads: int, device: Device) -> None:
    """This machine's probe on `threads` threads read as `device`'s, through the probe's own cache file."""
    cache = tmp_path / "probe.json"
    entry = {k: getattr(device, k) for k in ("bf16_gflops", "fp32_gflops", "isa", "threads")}
    cache.write_text(json.dumps({cpu_key(threads): entry}))
    monkeypatch.setenv("RLHF_BF16_PROBE", str(cache))


@pytest.mark.parametrize("requested, device, uses_bf16, dtype, warns", [
    ("auto", AVX2, False, "float32", False),
    ("auto", AVX512_NO_AMX, False, "float32", False),
    ("auto", AMX, False, "bfloat16", False),
    ("auto", EVEN, False, "bfloat16", False),  # no slower: half the memory traffic wins
    ("auto", H100, False, "bfloat16", False),
    ("auto", V100, False, "float32", False),
    ("auto", UNSEEN_GPU, False, "bfloat16", False),
    ("bfloat16", AVX2, False, "bfloat16", True),  # kept, with a warning
    ("bfloat16", AMX, False, "bfloat16", False),
    ("bfloat16", V100, False, "bfloat16", True),
    ("float32", AVX2, False, "float32", False),
    ("float32", AVX2, True, "float32", True),  # fp32 weights under bf16-mixed's autocast: bf16 matmuls
    ("float32", AMX, True, "float32", False),
    ("float16", AVX2, False, "float16", False),
])
def test_the_dtype_choice_by_device_and_request(requested, device, uses_bf16, dtype, warns):
    choice = choose_dtype(requested, device, uses_bf16)
    assert choice.dtype == dtype
    assert (choice.warning is not None) == warns
    if warns:
        assert choice.warning.endswith("Set model.dtype=auto or float32" if requested == "bfloat16"
                                       else "Set trainer.precision=fp32")


def test_the_reason_names_what_was_measured():
    assert choose_dtype("auto", AVX2).why == ("bf16 matmuls run 1/93 of fp32's on this CPU (AVX2, 2 thread(s): 0.7 "
                                              "against 65.0 GFLOP/s)")
    assert "0.50x" in choose_dtype("auto", AVX512_NO_AMX).why and "2.50x" in choose_dtype("auto", AMX).why
    assert "compute capability 7.0 lacks bf16 units" in choose_dtype("auto", V100).why
    assert "sees no GPU" in choose_dtype("auto", UNSEEN_GPU).why


@pytest.mark.parametrize("precision, requested, dtype, out", [
    ("bf16-mixed", "auto", "float32", "fp32"),
    ("bf16-true", "auto", "float32", "fp32"),
    ("bf16-mixed", "auto", "bfloat16", "bf16-mixed"),
    (None, "auto", "float32", None),  # null follows model.dtype later
    ("bf16-mixed", "float32", "float32", "bf16-mixed"),  # not auto: the user's value
    ("fp16-true", "auto", "float32", "fp16-true"),
])
def test_the_trainer_precision_follows_an_auto_dtype(precision, requested, dtype, out):
    assert trainer_precision(precision, requested, dtype) == out


def test_the_probe_measures_both_dtypes_and_is_cached_per_machine(tmp_path, monkeypatch):
    measured = probe_cpu(1, n=64, seconds=0.01)
    assert measured.bf16_gflops > 0 and measured.fp32_gflops > 0 and measured.threads == 1 and measured.isa
    cache = tmp_path / "probe.json"
    monkeypatch.setenv("RLHF_BF16_PROBE", str(cache))
    first = cpu_device(1)
    assert json.loads(cache.read_text())[cpu_key(1)]["fp32_gflops"] == first.fp32_gflops
    cache.write_text(json.dumps({cpu_key(1): {**json.loads(cache.read_text())[cpu_key(1)], "bf16_gflops": 0.5}}))
    assert cpu_device(1).bf16_gflops == 0.5  # read back, not measured again: the same choice every run
    cache.write_text("{not json")
    assert cpu_device(1).fp32_gflops > 0  # a damaged cache is measured over


@pytest.mark.parametrize("probe, dtype, precision", [(AVX2, "float32", "fp32"), (AMX, "bfloat16", "bf16-mixed")])
def test_the_config_resolves_auto_once_and_saves_what_runs(tmp_path, monkeypatch, probe, dtype, precision):
    force_probe(tmp_path, monkeypatch, 2, probe)
    cfg = load_config("examples/smollm2_math_grpo_lora.yaml", ["placement.cpu_threads=2"])
    assert (cfg.model.dtype, cfg.trainer.precision) == (dtype, precision)
    plain = load_config("examples/smollm2_math_grpo.yaml", ["placement.cpu_threads=2"])
    assert (plain.model.dtype, plain.trainer.precision) == (dtype, "bf16-true" if dtype == "bfloat16" else "fp32")
    assert plain.rollout.logprob_diff_warn == (5e-2 if dtype == "bfloat16" else 1e-3)


def test_the_agent_server_picks_its_engine_dtype_the_same_way(tmp_path, monkeypatch, capsys):
    import os

    from rlhf.agent_serve import engine_dtype
    force_probe(tmp_path, monkeypatch, os.cpu_count() or 1, AVX2)
    assert engine_dtype("auto") == "float32" and capsys.readouterr().err == ""
    assert engine_dtype("bfloat16") == "bfloat16"
    assert "warning: --dtype=bfloat16 will run slowly" in capsys.readouterr().err
