"""What the utilisation metrics divide (common.flops, common.peaks, common.spans, rollout.engines.work,
rlhf.outputs.worker_spans): a forward's FLOPs agree with torch's own count on a real model, the device table and
the CPU probe give peaks, spans are kept only while recording and come back once, and the fractions are the work
over the peak-seconds it had."""
from types import SimpleNamespace

import pytest
import torch

from common import spans
from common.flops import backward_flops, decode_bytes, forward_flops, forward_parts, model_shape
from common.peaks import cpu_probe, gpu_peaks
from rlhf.outputs.worker_spans import perf_metrics
from rollout.engines.work import generate_work, phase_spans


def test_a_forwards_flops_are_what_torch_counts_on_the_model(tiny_model_dir):
    """torch's FlopCounterMode counts every matmul of a real forward, attention as a full s x s product (the
    causal half included); our count is causal, so the two differ by exactly the masked half."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    shape = model_shape(model.config, ((n, p.numel()) for n, p in model.named_parameters()), 0.0, 4)
    lengths = [7, 19]
    counted = 0
    for s in lengths:
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 100, (1, s)))
        counted += counter.get_total_flops()
    masked = sum(2 * shape.layers * shape.query_width * (s * s - s) for s in lengths)
    assert forward_flops(shape, lengths) + masked == pytest.approx(counted, rel=0.02)
    # a prefix-cache hit is not computed again, only attended to
    assert forward_flops(shape, [19], cached=[19]) == 0.0
    assert 0 < forward_flops(shape, [19], cached=[7]) < forward_flops(shape, [19])


def test_a_mixture_of_experts_counts_its_routed_share_and_a_decode_reads_weights_and_cache():
    config = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_experts": 4, "num_experts_per_tok": 1, "tie_word_embeddings": False}
    numels = [("model.embed_tokens.weight", 800), ("model.layers.0.mlp.experts.0.up.weight", 400),
              ("model.layers.0.self_attn.q_proj.weight", 64), ("lm_head.weight", 800)]
    shape = model_shape(config, numels, weight_bytes=1000.0, cache_bytes=2)
    assert (shape.matmul_params, shape.head_params) == (100 + 64, 800)  # (the embedding a lookup, a quarter of
    # the experts); the head only where logits are computed, and a frozen base's backward only for its inputs
    assert forward_flops(shape, [5], logits=[1]) == forward_flops(shape, [5]) - 2 * 800 * 4
    matmul, attention = forward_parts(shape, [5])
    assert backward_flops(matmul, attention) == 2 * (matmul + attention)
    assert backward_flops(matmul, attention, trainable=0.01) == pytest.approx(2 * attention + 1.01 * matmul)
    assert shape.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2  # (k and v, layers, kv heads, head dim, bytes)
    # one sequence: prompt 3, 4 tokens generated, 3 of them by decode steps reading 4, 5 and 6 cached tokens
    assert decode_bytes(shape, 3, [(3, 4)]) == 3 * 1000.0 + (4 + 5 + 6) * shape.kv_bytes_per_token
    assert model_shape({"n_layer": 2}, [], 0.0, 2) is None  # (a config without the usual names: nothing counted)
    assert model_shape(None, [], 0.0, 2) is None  # (a module without a config)
    tied_outside = {"text_config": {k: v for k, v in config.items() if k != "tie_word_embeddings"},
                    "tie_word_embeddings": True}  # (a multimodal config: tying said on the outer one)
    shape = model_shape(tied_outside, numels[:3] + [("model.vision_tower.proj.weight", 999)], 0.0, 2)
    assert (shape.matmul_params, shape.head_params) == (164, 800)  # (the tower's weights meet no text token)


def test_the_device_table_and_the_cpu_probe():
    assert gpu_peaks("NVIDIA H100 80GB HBM3", "bfloat16")["flops"] == 989e12
    assert gpu_peaks("NVIDIA H100 PCIe", "bfloat16")["bytes_s"] == 2.0e12
    assert gpu_peaks("NVIDIA H200", "float32")["flops"] == 67e12
    assert gpu_peaks("NVIDIA A100-SXM4-40GB", "bfloat16")["bytes_s"] == 1.555e12
    assert gpu_peaks("NVIDIA GeForce GTX 1080", "bfloat16") is None
    assert gpu_peaks("NVIDIA H200 NVL", "bfloat16")["flops"] == 835e12
    assert gpu_peaks("NVIDIA GH200 480GB", "bfloat16")["bytes_s"] == 4.0e12
    assert gpu_peaks("NVIDIA A100-SXM-80GB", "bfloat16")["bytes_s"] == 2.039e12
    assert gpu_peaks("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bfloat16") is None  # (a slice: not the chip's peaks)
    probe = cpu_probe("float32", seconds=0.05)
    assert probe["source"] == "probe" and probe["flops"] > 1e8 and probe["bytes_s"] > 1e8


def test_spans_are_kept_only_while_recording_and_taken_once():
    spans.stop_for_tests()
    try:
        with spans.span("forward", flops=1.0):
            pass
        assert spans.take()["spans"] == []
        spans.start()
        with spans.span("update"):
            with spans.span("forward", flops=2.0) as args:
                args["tokens"] = 5
        taken = spans.take()
        assert [s[0] for s in taken["spans"]] == ["forward", "update"]  # (each kept as it ends)
        (_, f0, f1, fargs), (_, u0, u1, _) = taken["spans"]
        assert u0 <= f0 <= f1 <= u1 and fargs == {"flops": 2.0, "tokens": 5}
        assert taken["peaks"]["flops"] > 0 and spans.take()["spans"] == []
    finally:
        spans.stop_for_tests()


def test_utilisation_is_the_work_over_the_peak_seconds_it_had():
    peak = {"flops": 100.0, "bytes_s": 10.0}
    collected = {
        "policy trainer 0": {"peaks": peak, "spans": [("update", 0.0, 2.0, {}), ("forward", 0.0, 0.5, {"flops": 40}),
                                                      ("backward", 0.5, 1.5, {"flops": 80}),
                                                      ("forward", 3.0, 4.0, {"flops": 999, "grad": False})]},
        "policy trainer 1": {"peaks": peak, "spans": [("update", 0.0, 2.0, {}), ("forward", 0.0, 1.0, {"flops": 20})]},
        "rollout engine 0": {"peaks": peak, "spans": [("generate", 0, 9, {"prefill_flops": 50, "prefill_s": 1.0,
                                                                         "decode_bytes": 30, "decode_s": 2.0,
                                                                         "devices": 2})]},
        "reward model 0": {"peaks": None, "spans": [("update", 0.0, 1.0, {}), ("forward", 0, 1, {"flops": 5})]},
    }
    perf = perf_metrics(collected)
    assert perf["perf/policy_trainer_mfu"] == pytest.approx((40 + 80 + 20) / (4.0 * 100))
    assert perf["perf/prefill_mfu"] == pytest.approx(50 / (1.0 * 100 * 2))
    assert perf["perf/decode_bw_util"] == pytest.approx(30 / (2.0 * 10 * 2))
    assert "perf/reward_model_mfu" not in perf  # (a device without peaks)
    assert perf["perf/rollout_engine_peak_tflops"] == 1e-10 and perf["perf/policy_trainer_peak_gb_s"] == 1e-8


def test_a_generate_calls_prefill_and_decode_seconds_come_from_vllms_request_times():
    stats = [SimpleNamespace(scheduled_ts=10.0, first_token_ts=10.5, last_token_ts=14.0),
             SimpleNamespace(scheduled_ts=10.0, first_token_ts=10.4, last_token_ts=12.0)]
    outputs = [SimpleNamespace(prompt_token_ids=[1] * 6, num_cached_tokens=2, metrics=m,
                               outputs=[SimpleNamespace(token_ids=[7] * n)]) for m, n in zip(stats, (9, 4))]
    shape = model_shape({"num_hidden_layers": 1, "hidden_size": 4, "num_attention_heads": 1},
                        [("w", 16), ("lm_head.weight", 40)], 64.0, 4)
    work = generate_work(outputs, shape, devices=1, computed=8)  # (the engine's counters: prompt tokens computed)
    assert work["prefill_tokens"] == 8 and work["generated"] == 13 and work["sequences"] == 2
    assert work["prefill_s"] == pytest.approx(0.5) and work["decode_s"] == pytest.approx(3.5)
    # the matmuls for the 8 tokens computed, logits for each sample's last, attention for 8 of the 12 prompt tokens
    assert work["prefill_flops"] == 2 * 16 * 8 + 2 * 40 * 2 + forward_parts(shape, [6, 6])[1] * 8 / 12
    assert work["decode_bytes"] == decode_bytes(shape, 8, [(6, 9), (6, 4)])
    assert phase_spans(outputs, clock_offset=100.0) == [("prefill", 110.0, 110.5), ("decode", 110.5, 114.0)]
