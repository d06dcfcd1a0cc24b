"""`model.dtype: auto`: bf16 only where the machine runs it fast. On CUDA that is compute capability 8.0 and up; on a
CPU it is measured (bf16 against fp32 matmuls on the run's threads, a fraction of a second, cached per machine),
since CPUs without bf16 units emulate it ~90x slower than fp32 and CPUs with them run it up to ~5x faster.

The choice itself (`choose_dtype`) is a pure function of what was measured and what the user asked for."""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Optional

# bf16 is chosen where its matmuls run at least this fast against fp32's. Weights and KV in bf16 halve the memory
# traffic, which a generation step is bound by more than its matmuls, so "no slower" is the bar, not "faster".
FAST_BF16 = 1.0
PROBE_SIZE = 256  # square matmuls: a bf16-emulating CPU (~0.7 GFLOP/s) still takes ~50 ms a call
PROBE_SECONDS = 0.1  # per dtype, after a warm-up call


@dataclass(frozen=True)
class Device:
    """What the choice reads of the machine: a CUDA GPU's compute capability, or a CPU probe's matmul rates."""

    kind: str  # "cpu" | "cuda"
    capability: Optional[tuple[int, int]] = None  # cuda; None: the driver sees no GPU to ask
    bf16_gflops: Optional[float] = None  # cpu: the probe's rates on the run's threads
    fp32_gflops: Optional[float] = None
    isa: str = ""  # cpu: torch.backends.cpu.get_cpu_capability(), e.g. AVX2, AVX512, AMX
    threads: int = 0  # cpu: the threads the probe ran on

    @property
    def bf16_ratio(self) -> Optional[float]:
        if self.bf16_gflops is None or not self.fp32_gflops:
            return None
        return self.bf16_gflops / self.fp32_gflops


@dataclass(frozen=True)
class Choice:
    dtype: str  # model.dtype as it will run
    why: str  # one clause: what the machine does with bf16
    warning: Optional[str] = None  # an explicit bf16 where it runs slowly


def bf16_is_fast(device: Device) -> bool:
    if device.kind == "cuda":
        return device.capability is None or tuple(device.capability) >= (8, 0)
    ratio = device.bf16_ratio
    return ratio is not None and ratio >= FAST_BF16


def why(device: Device) -> str:
    """What the machine does with bf16, in a clause: 'bf16 matmuls run 0.01x fp32 on this CPU (AVX2, 2 threads)'."""
    if device.kind == "cuda":
        if device.capability is None:
            return "bf16 assumed: this driver sees no GPU to ask (GPUs before compute capability 8.0 want float32)"
        cc = ".".join(map(str, device.capability))
        return f"CUDA compute capability {cc} {'has' if bf16_is_fast(device) else 'lacks'} bf16 units (8.0+ has)"
    ratio = device.bf16_ratio
    if ratio is None:
        return "this CPU's bf16 speed was not measured"
    return (f"bf16 matmuls run {_times(ratio)} fp32's on this CPU ({device.isa}, {device.threads} thread(s): "
            f"{device.bf16_gflops:.1f} against {device.fp32_gflops:.1f} GFLOP/s)")


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"1/{1 / ratio:.0f} of"


def choose_dtype(requested: str, device: Device, uses_bf16: bool = False, key: str = "model.dtype") -> Choice:
    """model.dtype as it runs: `auto` is bfloat16 where the device runs bf16 fast, else float32; any other value is
    kept, with a warning when it (or `uses_bf16`: a bf16-mixed trainer) puts bf16 matmuls on a device that runs
    them slowly. `key`: the setting the warning names (a command's --dtype)."""
    fast = bf16_is_fast(device)
    if requested == "auto":
        return Choice("bfloat16" if fast else "float32", why(device))
    if (requested == "bfloat16" or uses_bf16) and not fast:
        what = f"{key}=bfloat16" if requested == "bfloat16" else "trainer.precision=bf16-mixed"
        fix = f"{key}=auto or float32" if requested == "bfloat16" else "trainer.precision=fp32"
        return Choice(requested, why(device), f"{what} will run slowly: {why(device)}. Set {fix}")
    return Choice(requested, why(device))


def trainer_precision(precision: Optional[str], requested_dtype: str, dtype: str) -> Optional[str]:
    """trainer.precision under `model.dtype: auto`: a bf16 form the recipe names (bf16-true, bf16-mixed) says how to
    train *when* bf16 is chosen; where auto chose float32 it is fp32. Otherwise the user's value, unchanged."""
    if requested_dtype == "auto" and dtype == "float32" and precision in ("bf16-true", "bf16-mixed"):
        return "fp32"
    return precision


# ---- measuring the machine ----

def cache_file() -> str:
    """Where probes are kept: $RLHF_BF16_PROBE, else the project's cache folder. One entry per `cpu_key`; a probe
    that misjudges a machine can be corrected there (or model.dtype set)."""
    from common.net import cache_root
    return os.environ.get("RLHF_BF16_PROBE") or os.path.join(cache_root(), "bf16-probe.json")


def cpu_key(threads: int) -> str:
    """One probe per CPU model, instruction set, thread count and torch build: what the rates depend on."""
    import torch
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}|{torch.backends.cpu.get_cpu_capability()}|{threads} threads|torch {torch.__version__}"


def _rate(torch, dtype, n: int, seconds: float) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # (oneDNN builds its kernel on the first call)
    count, begin = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - begin < seconds:
        a @ b
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - begin) / 1e9


def probe_cpu(threads: int, n: int = PROBE_SIZE, seconds: float = PROBE_SECONDS) -> Device:
    """bf16 and fp32 matmul rates on `threads` torch threads (this process's thread count is put back)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32, bf16 = (_rate(torch, dt, n, seconds) for dt in (torch.float32, torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    return Device("cpu", bf16_gflops=round(bf16, 2), fp32_gflops=round(fp32, 2),
                  isa=torch.backends.cpu.get_cpu_capability(), threads=threads)


def cpu_device(threads: int) -> Device:
    """This CPU's probe on `threads` threads, from the cache when this machine measured it before (the same choice
    every run, which a resumed run needs), else measured now and cached."""
    key, path = cpu_key(threads), cache_file()
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), dict):
        try:
            return Device(**{**cached[key], "kind": "cpu"})
        except TypeError:
            pass  # written by another version: measure again
    device = probe_cpu(threads)
    cached[key] = {k: v for k, v in asdict(device).items() if k not in ("kind", "capability")}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cached, f, indent=1)
    os.replace(tmp, path)
    return device


def run_device(num_gpus: int, threads: int) -> Device:
    """The device a run's models compute on: GPU 0's capability when the run takes GPUs (a driver without a GPU
    assumes an 8.0+ one: it cannot look; an older GPU wants model.dtype set), else this CPU's probe."""
    if num_gpus > 0:
        import torch
        if torch.cuda.is_available():
            return Device("cuda", capability=torch.cuda.get_device_capability(0))
        return Device("cuda")
    return cpu_device(threads)
