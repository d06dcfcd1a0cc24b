"""Before GPU engines load: does each engine worker's share of its GPU (rollout.gpu_memory_utilization) hold its share
of the weights (rollout.tensor_parallel_size) and the KV cache of one whole rollout.max_model_len sequence, which
vLLM needs to start? Without this check an engine too large for its share loads its weights for minutes and then
fails inside vLLM's memory profiling. The check counts bytes: the weights from the model folder's safetensors
headers (the files its index names), the cache of its full-attention layers from its config, the GPU's memory from
NVML (nothing is started on it). A refusal is worse than a miss, so it refuses only what cannot fit even without
vLLM's own working memory, and leaves alone what it cannot weigh (no safetensors, no attention heads, a compressed
cache); it names the tensor-parallel size, share or length that would fit."""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Optional

GIB = 2**30
WORKSET = 1.5 * GIB  # vLLM's own beside weights and cache (activations at its profiling batch, CUDA graphs): an
# estimate, used only to choose what to suggest, never to refuse
SIZES = (1, 2, 4, 8)  # the tensor-parallel sizes suggested (within one node)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STORED = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors' names of the floating dtypes an engine casts


def weight_bytes(folder: str, dtype: str, quantized: bool) -> Optional[float]:
    """Bytes of the folder's weights as an engine of `dtype` holds them (floating tensors in `dtype`; quantized
    checkpoints, and integer tensors, as stored), from the safetensors headers; None without safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):  # (only the files it names: some folders also hold a consolidated copy)
        with open(index, encoding="utf-8") as f:
            files = sorted({os.path.join(folder, n) for n in json.load(f)["weight_map"].values()})
    else:
        single = os.path.join(folder, "model.safetensors")
        files = [single] if os.path.exists(single) else glob.glob(os.path.join(folder, "*.safetensors"))
    if not files:
        return None
    total = 0.0
    for path in files:
        for name, t in _header(path).items():
            if name == "__metadata__":
                continue
            stored = t["data_offsets"][1] - t["data_offsets"][0]
            floating = not quantized and t["dtype"] in STORED
            total += stored * BYTES[dtype] / STORED[t["dtype"]] if floating else stored
    return total


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def cache_per_token(config, tp: int, cache_bytes: int) -> Optional[float]:
    """Bytes of keys and values a token takes on each of `tp` workers, in the layers that keep every token (full
    attention; sliding-window and linear layers keep a bounded amount, not counted); None where the config says a
    cache this cannot weigh (compressed, no attention heads)."""
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers or getattr(config, "kv_lora_rank", None):
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds:
        full = sum(k == "full_attention" for k in kinds)
    else:
        full = 0 if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) else layers
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2.0 * full * max(1, kv_heads // tp) * head_dim * cache_bytes


def engine_problem(weights: float, per_token: float, heads_of, tp: int, share: float, device: float,
                   max_len: int) -> Optional[str]:
    """What is wrong with an engine of `tp` workers on GPUs of `device` bytes at `share`, or None if it fits.
    `per_token`: cache bytes a token (one worker of one); `heads_of(n)`: the per-token bytes on each of n workers,
    or None where n does not divide the heads."""
    w, kv = weights / tp, per_token * max_len
    budget = share * device
    if w + kv <= budget:
        return None
    fits = [n for n in SIZES if n > tp and heads_of(n) is not None and weights / n + heads_of(n) * max_len + WORKSET
            <= budget]
    fixes = [f"rollout.tensor_parallel_size={fits[0]}"] if fits else []
    wanted = (w + kv + WORKSET) / device
    if wanted <= 0.95:
        fixes.append(f"rollout.gpu_memory_utilization={wanted + 0.01:.2f} (with placement.mode=split, where the "
                     "engines have their GPUs to themselves)")
    if kv and w + WORKSET < budget:  # (a shorter longest sequence would do)
        fixes.append(f"rollout.max_model_len <= {int((budget - w - WORKSET) / per_token)}")
    fix = "; or ".join(fixes) or "a GPU with more memory"
    return (f"each of an engine's {tp} worker(s) needs over {(w + kv) / GIB:.1f} GiB of its GPU ({w / GIB:.1f} GiB "
            f"of weights, {kv / GIB:.1f} GiB of KV cache for one {max_len}-token sequence, and vLLM's own working "
            f"memory beside), more than its share: rollout.gpu_memory_utilization {share:g} x {device / GIB:.0f} GiB "
            f"= {budget / GIB:.1f} GiB. What would fit: {fix}")


def check_engine_memory(cfg, p, config, device: Optional[float] = None) -> None:
    """The check above for a run's GPU engines of the model `config` (its transformers config; None: unreadable).
    `device`: its GPUs' bytes, read from NVML where not given. No GPU visible to the driver, or a model this cannot
    weigh: nothing to check."""
    r, pl = cfg.rollout, cfg.placement
    if pl.num_gpus == 0 or r.engine != "vllm" or cfg.model.path is None or config is None:
        return
    from common.peaks import gpu_memory

    device = device or gpu_memory()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = cfg.model.dtype if cfg.model.dtype in BYTES else "bfloat16"
    weights = weight_bytes(cfg.model.path, dtype, getattr(config, "quantization_config", None) is not None)
    per_token = cache_per_token(text, r.tensor_parallel_size, BYTES[dtype])
    if not device or weights is None or per_token is None:
        return
    heads = text.num_attention_heads

    def heads_of(n: int) -> Optional[float]:
        return cache_per_token(text, n, BYTES[dtype]) if heads % n == 0 else None
    share = r.gpu_memory_utilization or (0.9 if pl.mode == "split" else 0.5)
    why = engine_problem(weights, per_token, heads_of, r.tensor_parallel_size, share, device, r.max_model_len)
    if why is not None:
        p.bad("rollout.tensor_parallel_size", r.tensor_parallel_size, why)
