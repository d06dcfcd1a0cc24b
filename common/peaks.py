"""A device's peaks, to judge what a worker did against: dense matmul FLOP/s in the dtype it computes in, and memory
bytes/s. A GPU's come from its maker's data sheet (the table below); a CPU's are measured, once a process, by a
short matmul and copy probe with the threads the worker has (a CPU's peak depends on its vector units, its cores and
what else runs: no table can know it). A GPU not in the table has no peaks: its utilisation is not reported."""
from __future__ import annotations

import time
from typing import Optional

# name fragments (all in the name torch.cuda.get_device_name / NVML report) -> (16-bit dense tensor FLOP/s, fp32
# FLOP/s without TF32, memory bytes/s). Sources: NVIDIA's data sheets: H100 Tensor Core GPU (SXM5 / PCIe / NVL
# columns), H200 Tensor Core GPU (SXM / NVL), GH200 Grace Hopper Superchip (96 GB HBM3; the 144 GB HBM3e one reads
# 4.9 TB/s), A100 Tensor Core GPU (80GB SXM, 80GB PCIe, 40GB), L40S (dense, without sparsity). First match wins.
GPU_PEAKS: list[tuple[tuple[str, ...], tuple[float, float, float]]] = [
    (("GH200",), (989e12, 67e12, 4.0e12)),
    (("H200", "NVL"), (835e12, 60e12, 4.8e12)),
    (("H200",), (989e12, 67e12, 4.8e12)),
    (("H100", "NVL"), (835e12, 60e12, 3.9e12)),
    (("H100", "PCIe"), (756e12, 51e12, 2.0e12)),
    (("H100",), (989e12, 67e12, 3.35e12)),  # SXM5, "NVIDIA H100 80GB HBM3"
    (("A100", "80GB", "PCIe"), (312e12, 19.5e12, 1.935e12)),
    (("A100", "80GB"), (312e12, 19.5e12, 2.039e12)),  # SXM4
    (("A100",), (312e12, 19.5e12, 1.555e12)),  # 40GB
    (("L40S",), (362e12, 91.6e12, 0.864e12)),
]
PROBE_S = 0.25  # each of the CPU's two probes runs about this long
_measured: dict[str, Optional[dict]] = {}


def gpu_peaks(name: str, dtype: str) -> Optional[dict]:
    """The table's peaks for the GPU called `name` computing in `dtype`, or None for one it does not list."""
    if "MIG" in name:  # (a slice of the chip: the whole chip's peaks would flatter nothing and mislead)
        return None
    for fragments, (half, single, memory) in GPU_PEAKS:
        if all(f in name for f in fragments):
            return {"device": name, "flops": single if dtype == "float32" else half, "bytes_s": memory,
                    "source": "data sheet"}
    return None


def device_peaks(dtype: str) -> Optional[dict]:
    """This process's device: its table row on a GPU (None if unlisted), else the CPU's probe in `dtype`."""
    import torch

    if dtype not in _measured:  # (once a process: a GPU's name from NVML, or the CPU's probe)
        if torch.cuda.is_available():
            name = gpu_name()
            _measured[dtype] = gpu_peaks(name, dtype) if name else None
        else:
            _measured[dtype] = cpu_probe(dtype)
    return _measured[dtype]


def gpu_name() -> Optional[str]:
    """This process's GPU's name, without starting CUDA in a process that has not (an engine's host, whose engine
    core runs in a child: a CUDA context would take its memory): then NVML's, for the first visible device."""
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    nvml, handle = _nvml_device()
    if handle is None:
        return None
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else name


def gpu_memory() -> Optional[int]:
    """The first visible GPU's memory in bytes (NVML's: no CUDA context), None where there is none."""
    nvml, handle = _nvml_device()
    return None if handle is None else int(nvml.nvmlDeviceGetMemoryInfo(handle).total)


def _nvml_device():
    """(NVML, the first visible device's handle), or (None, None) without NVML or a device."""
    import os
    try:
        try:
            import pynvml
        except ImportError:  # (vLLM bundles its own)
            from vllm.utils.import_utils import import_pynvml
            pynvml = import_pynvml()
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        if visible == "" or visible == "-1":
            return None, None
        handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(visible)))
        return pynvml, handle
    except Exception:  # noqa: BLE001 — no NVML, or a device it does not know: nothing to say about it
        return None, None


def cpu_probe(dtype: str, seconds: float = PROBE_S) -> dict:
    """The CPU's matmul FLOP/s in `dtype` (512 x 512 products, the best of a few timings) and copy bytes/s (a
    64 MiB float32 tensor: read once, written once), with this process's torch threads."""
    import torch

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)
    n = 512
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    out = torch.mm(a, b)
    flops = 2 * n ** 3 / _best_time(lambda: torch.mm(a, b, out=out), seconds)
    src = torch.randn(16 * 2 ** 20)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    bytes_s = moved / _best_time(lambda: dst.copy_(src), seconds)
    return {"device": f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})",
            "flops": flops, "bytes_s": bytes_s, "source": "probe"}


def _best_time(fn, seconds: float) -> float:
    """The fastest of repeated calls of `fn` within about `seconds`: at least two (the first warms up), unless the
    first alone takes that long (bf16 on a CPU without bf16 units)."""
    times, start = [], time.perf_counter()
    while len(times) < 2 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) == 1 and times[0] >= seconds:
            break
    return max(min(times[1:] or times), 1e-9)
