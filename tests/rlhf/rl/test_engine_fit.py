"""The start-up memory check for GPU engines (rlhf.rl.engine_fit): in bytes, from a model folder's safetensors
headers and config and the GPU's memory, before anything loads. Shapes are the published configs of Qwen2.5-7B and
-72B; each weight file is a real safetensors header over a sparse file of the weights' size (nothing is written)."""
import json
import struct
from types import SimpleNamespace

from transformers import AutoConfig

from common.schema import RunConfig
from rlhf.config.problems import Problems
from rlhf.rl.engine_fit import GIB, cache_per_token, check_engine_memory, engine_problem, weight_bytes

QWEN_7B = SimpleNamespace(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
QWEN_72B = {"model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
            "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064, "torch_dtype": "bfloat16"}
H100 = 79.6 * GIB  # (what NVML reports for an H100 SXM: 81,559 MiB)


def weights_file(path, nbytes: int, dtype: str = "BF16") -> None:
    """A safetensors file holding one tensor of `nbytes` (its data a hole in a sparse file)."""
    n = nbytes // (4 if dtype == "F32" else 2)
    header = json.dumps({"w": {"dtype": dtype, "shape": [n], "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)


def _qwen7b_heads(n):
    return cache_per_token(QWEN_7B, n, 2) if 28 % n == 0 else None


def test_a_7b_engine_fits_beside_its_trainer_and_a_share_too_small_says_what_would():
    weights, per_token = 15.2e9, cache_per_token(QWEN_7B, 1, 2)
    assert per_token == 2 * 28 * 4 * 128 * 2  # (k and v, layers, kv heads, head dim, bf16)
    assert engine_problem(weights, per_token, _qwen7b_heads, 1, 0.5, H100, 4096) is None
    why = engine_problem(weights, per_token, _qwen7b_heads, 1, 0.15, H100, 4096)  # 11.9 GiB: not even the weights
    assert "rollout.tensor_parallel_size=2" in why and "rollout.gpu_memory_utilization=0.2" in why
    assert "14.2 GiB of weights" in why and "0.15 x 80 GiB" in why
    long = engine_problem(weights, per_token, _qwen7b_heads, 1, 0.5, H100, 1_000_000)  # a million-token cache
    assert "rollout.max_model_len <= " in long and "rollout.tensor_parallel_size=" in long


def test_only_the_layers_that_keep_every_token_are_weighed_and_a_cache_it_cannot_weigh_is_left_alone():
    gemma = SimpleNamespace(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=16, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    assert cache_per_token(gemma, 1, 2) == 2 * 1 * 1 * 16 * 2  # (one full-attention layer of six)
    mistral = SimpleNamespace(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, sliding_window=4096)
    assert cache_per_token(mistral, 1, 2) == 0.0  # (every layer a window)
    assert cache_per_token(SimpleNamespace(num_hidden_layers=4, hidden_size=64), 1, 2) is None  # (Mamba: no heads)
    assert cache_per_token(SimpleNamespace(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                           kv_lora_rank=512), 1, 2) is None  # (a compressed cache, MLA)


def test_weights_are_read_from_the_files_the_index_names_in_the_engines_dtype(tmp_path):
    weights_file(tmp_path / "model-00001-of-00002.safetensors", 1000)
    weights_file(tmp_path / "model-00002-of-00002.safetensors", 600, dtype="F32")
    weights_file(tmp_path / "consolidated.safetensors", 1300)  # (a second copy some folders ship: not counted)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert weight_bytes(str(tmp_path), "bfloat16", quantized=False) == 1000 + 300
    assert weight_bytes(str(tmp_path), "float32", quantized=False) == 2000 + 600
    assert weight_bytes(str(tmp_path), "float32", quantized=True) == 1600  # (as stored)
    assert weight_bytes(str(tmp_path / "missing"), "bfloat16", quantized=False) is None


def test_a_72b_folder_on_one_h100_a_worker_is_refused_before_loading_with_the_size_that_fits(tmp_path):
    folder = tmp_path / "qwen72b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_72B))
    weights_file(folder / "model.safetensors", 145_400_000_000)  # (72.7B bf16 weights)
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
    cfg.model.dtype = "float32"  # (the engine would hold the bf16 weights in fp32: twice the bytes)
    check_engine_memory(cfg, p, config, device=H100)
    assert "rollout.tensor_parallel_size=4" in p.found[0]
    cfg.placement.num_gpus = 0  # (engines on the CPU: vLLM-CPU's cache is rollout.kv_cache_mb, nothing to weigh)
    p = Problems()
    check_engine_memory(cfg, p, config, device=H100)
    assert p.found == []
