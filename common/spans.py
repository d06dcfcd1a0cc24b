"""What a worker did inside the driver's calls: spans its own process records (forward, backward, optimizer,
generate, receive, sleep, ...), each with what it computed (`flops`, `tokens`, bytes read), and its device's peaks
to judge them by (common.peaks). Nothing is kept until the driver turns recording on (logging.trace: the run's
first step); the driver then collects each worker's spans at every step's end (rlhf.outputs.worker_spans), with a
call Ray runs on the actor (`take`).

A span on an accelerator is timed by CUDA events, not by the host: kernels run after the host queued them, so the
host's clock would put a forward's time into whatever synchronises next. The events are read when the spans are
taken (one synchronisation a step). Nothing here imports torch until a device span asks for it."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Optional

MAX_KEPT = 20000  # spans held between two collections at most (a driver that stopped asking: the oldest go)

_lock = threading.Lock()
_kept: list[tuple] = []  # (name, start, end, args): seconds since the epoch, or CUDA events until `take`
_on = False
matmul_dtype = "float32"  # what this worker's matmuls run in: the CPU peak is probed in it (set by the worker)


def recording() -> bool:
    return _on


def start(_actor: Any = None) -> bool:
    """Keep spans from now on (called on the actor through Ray's __ray_call__, hence the unused instance)."""
    global _on
    _on = True
    return True


def probe(_actor: Any = None) -> Optional[dict]:
    """This device's peaks, measured now on a CPU (common.peaks): the driver asks each worker in turn while all are
    idle, so no probe competes with another for the cores."""
    from common.peaks import device_peaks
    return device_peaks(matmul_dtype)


def _cuda(device) -> bool:
    return device is not None and getattr(device, "type", device) == "cuda"


@contextmanager
def span(name: str, device=None, **args):
    """Record the body as a span `name` with `args`; the body may add to the dict it is given (counts known only at
    its end). `device`: a CUDA device times the body by its events (what the device did between the points the host
    queued), anything else by the host's clock."""
    if not _on:
        yield dict(args)
        return
    extra = dict(args)
    if _cuda(device):
        import torch
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield extra
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            _keep((name, begin, end, extra))
        return
    begin_s = time.time()
    try:
        yield extra
    finally:
        _keep((name, begin_s, time.time(), extra))


def add(name: str, begin: float, end: float, **args) -> None:
    """A span timed by the caller (host seconds since the epoch)."""
    if _on:
        _keep((name, begin, end, args))


def _keep(entry: tuple) -> None:
    with _lock:
        _kept.append(entry)
        if len(_kept) > MAX_KEPT:
            del _kept[: len(_kept) - MAX_KEPT]


def take(_actor: Any = None) -> dict:
    """The spans kept since the last call, as (name, start, end, args) in host seconds, and this device's peaks
    (common.peaks.device_peaks: measured once, on the first call, on a CPU)."""
    from common.peaks import device_peaks

    with _lock:
        kept, _kept[:] = list(_kept), []
    return {"spans": _on_host_clock(kept), "peaks": device_peaks(matmul_dtype)}


def _on_host_clock(kept: list[tuple]) -> list[tuple]:
    """CUDA events as host seconds: each event's distance to one recorded now, once the device is idle."""
    if not any(not isinstance(s, float) for _, s, _, _ in kept):
        return kept
    import torch
    torch.cuda.synchronize()
    now_event = torch.cuda.Event(enable_timing=True)
    now_event.record()
    torch.cuda.synchronize()
    now = time.time()

    def host(t) -> float:
        return t if isinstance(t, float) else now - t.elapsed_time(now_event) / 1e3
    return [(name, host(s), host(e), args) for name, s, e, args in kept]


def stop_for_tests() -> None:
    """Recording off and nothing kept (a test that turned it on in this process)."""
    global _on
    _on = False
    with _lock:
        _kept.clear()


def sum_args(spans: list[tuple], names: tuple[str, ...], key: str) -> float:
    return float(sum(args.get(key, 0.0) for name, _, _, args in spans if name in names))


def seconds(spans: list[tuple], names: tuple[str, ...]) -> float:
    """Seconds in spans named `names`."""
    return float(sum(end - begin for name, begin, end, _ in spans if name in names))
