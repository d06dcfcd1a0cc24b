"""Before GPU engines load: does each engine worker's share of its GPU (rollout.gpu_memory_utilization) hold its share
of the weights (rollout.tensor_parallel_size) and the KV cache of one whole rollout.max_model_len sequence, which
vLLM needs to start? Without this check an engine too large for its share loads its weights for minutes and then
fails inside vLLM's memory profiling. The check counts in bytes, from the model folder's weight files and config and
the GPU's memory (NVML: nothing is started on it); it refuses only what cannot fit, and says which tensor-parallel
size, memory share or length would."""
from __future__ import annotations

import glob
import os
from typing import Optional

GIB = 2**30
WORKSET = 1.5 * GIB  # vLLM's own beside weights and cache, inside its share: activations at its profiling batch,
# CUDA graphs, sampler buffers (an estimate for 7B-72B models; smaller models need less, so the check errs lenient)
SIZES = (1, 2, 4, 8)  # the tensor-parallel sizes suggested (within one node)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_file_bytes(folder: str) -> Optional[int]:
    """Bytes of the model folder's weight files (safetensors, else PyTorch .bin), None if it has neither."""
    files = glob.glob(os.path.join(folder, "*.safetensors")) or glob.glob(os.path.join(folder, "*.bin"))
    return sum(os.path.getsize(f) for f in files) if files else None


def worker_need(weights: float, config, tp: int, max_len: int, cache_bytes: int) -> tuple[float, float]:
    """(weights, KV cache of one max_len sequence) in bytes on each of an engine's `tp` workers: the weights split
    `tp` ways, the key/value heads too (each worker keeps at least one: fewer heads than workers are copied)."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * layers * max(1, kv_heads // tp) * head_dim * cache_bytes
    return weights / tp, float(per_token * max_len)


def engine_problem(weights: float, config, tp: int, share: float, device: float, max_len: int,
                   cache_bytes: int) -> Optional[str]:
    """What is wrong with an engine of `tp` workers on GPUs of `device` bytes at `share`, or None if it fits."""
    w, kv = worker_need(weights, config, tp, max_len, cache_bytes)
    budget = share * device
    if w + kv + WORKSET <= budget:
        return None
    heads = config.num_attention_heads
    fits = [n for n in SIZES if heads % n == 0 and sum(worker_need(weights, config, n, max_len, cache_bytes))
            + WORKSET <= budget]
    fixes = [f"rollout.tensor_parallel_size={fits[0]}"] if fits and fits[0] > tp else []
    wanted = (w + kv + WORKSET) / device
    if wanted <= 0.95:
        fixes.append(f"rollout.gpu_memory_utilization={wanted + 0.01:.2f} (with placement.mode=split, where the "
                     "engines have their GPUs to themselves)")
    if w + WORKSET < budget:  # (a shorter longest sequence would do)
        fixes.append(f"rollout.max_model_len <= {int((budget - w - WORKSET) / kv * max_len)}")
    fix = "; or ".join(fixes) or "a GPU with more memory"
    return (f"each of an engine's {tp} worker(s) needs about {(w + kv + WORKSET) / GIB:.1f} GiB of its GPU "
            f"({w / GIB:.1f} GiB of weights, {kv / GIB:.1f} GiB of KV cache for one {max_len}-token sequence, about "
            f"{WORKSET / GIB:.1f} GiB beside), more than its share: rollout.gpu_memory_utilization {share:g} x "
            f"{device / GIB:.0f} GiB = {budget / GIB:.1f} GiB. What would fit: {fix}")


def check_engine_memory(cfg, p, config, device: Optional[float] = None) -> None:
    """The check above for a run's GPU engines of the model `config` (its transformers config; None: unreadable).
    `device`: its GPUs' bytes, read from NVML where not given. No GPU visible to the driver, or a model folder
    without weight files or config: nothing to check."""
    r, pl = cfg.rollout, cfg.placement
    if pl.num_gpus == 0 or r.engine != "vllm" or cfg.model.path is None:
        return
    from common.peaks import gpu_memory

    device = device or gpu_memory()
    files = weight_file_bytes(cfg.model.path)
    if not device or files is None or config is None or not hasattr(config, "num_hidden_layers"):
        return
    config = getattr(config, "text_config", None) or config
    held = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16")
    dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
    weights = files * BYTES.get(dtype, 2) / BYTES.get(held.removeprefix("torch."), 2)
    share = r.gpu_memory_utilization or (0.9 if pl.mode == "split" else 0.5)
    why = engine_problem(weights, config, r.tensor_parallel_size, share, device, r.max_model_len, BYTES.get(dtype, 2))
    if why is not None:
        p.bad("rollout.tensor_parallel_size", r.tensor_parallel_size, why)
