"""What the driver ships to the workers and pulls back each RL step, and the driver's own CPU seconds, on a recipe
(default: the real model's, examples/smollm2_math_grpo.yaml; python -m rlhf.smollm2 first).

    python benchmarks/driver_io.py [--config examples/smollm2_math_grpo.yaml] [--steps 3] [key=value ...]

The controller runs in this process; every actor call's arguments (`ActorMethod.remote`), every `ray.put` and
every result `ray.get` returns are sized as pickled bytes (an object reference counts as nothing: the object store
moves it once, and its `ray.put` is counted), per method name. Driver CPU seconds: this process's CPU time in a
step, less the time this measurement itself took. Prints per step and, per call, the median step's bytes.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table  # noqa: E402


class Meter:
    """Pickled bytes by (direction, call) for the step in progress, and the seconds spent measuring them."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.overhead = 0.0

    def add(self, key: str, obj) -> None:
        start = time.process_time()
        self.bytes[key] += size_of(obj)
        self.overhead += time.process_time() - start

    def take(self) -> tuple[dict[str, int], float]:
        out, spent = dict(self.bytes), self.overhead
        self.bytes.clear()
        self.overhead = 0.0
        return out, spent


def size_of(obj) -> int:
    import ray
    if isinstance(obj, ray.ObjectRef):
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(size_of(x) for x in obj)
    if isinstance(obj, dict):
        return sum(size_of(k) + size_of(v) for k, v in obj.items())
    try:
        return len(pickle.dumps(obj, protocol=5))
    except Exception:  # noqa: BLE001 - an unpicklable argument (a handle): not data
        return 0


def instrument(meter: Meter) -> None:
    """Count what crosses the driver's boundary: call arguments, explicit puts, and fetched results."""
    import ray
    from ray.actor import ActorMethod

    remote = ActorMethod.remote

    def counted_remote(self, *args, **kwargs):
        meter.add(f"send {self._method_name}", (args, kwargs))
        return remote(self, *args, **kwargs)
    ActorMethod.remote = counted_remote
    put, get = ray.put, ray.get

    def counted_put(value, *args, **kwargs):
        meter.add("put", value)
        return put(value, *args, **kwargs)

    def counted_get(refs, *args, **kwargs):
        out = get(refs, *args, **kwargs)
        if isinstance(refs, list):  # common.remote.ray_get's last, whole-list get (its per-ref gets only wait)
            meter.add("get", out)
        return out
    ray.put, ray.get = counted_put, counted_get


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/smollm2_math_grpo.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    os.chdir(ROOT)
    from rlhf.config import load_config
    from rlhf.rl.controller import RLController

    out = os.path.join(ROOT, ".cache", "driver_io", time.strftime("%H%M%S"))
    cfg = load_config(a.config, [f"output_dir={out}", f"trainer.max_steps={a.steps}", "eval.every=0",
                                 "checkpoint.every=0", *a.overrides])
    meter, rows = Meter(), []
    instrument(meter)
    step = RLController.step

    def measured_step(self, n):
        meter.take()
        cpu, wall = time.process_time(), time.perf_counter()
        metrics = step(self, n)
        shipped, spent = meter.take()
        rows.append((n, shipped, time.process_time() - cpu - spent, time.perf_counter() - wall))
        return metrics
    RLController.step = measured_step
    controller = RLController(cfg)
    try:
        controller.fit()
    finally:
        controller.close()
    report(rows)


def report(rows: list) -> None:
    print_table(["step", "sent MB", "fetched MB", "driver CPU s", "step s"],
                [[n, sum(v for k, v in b.items() if not k.startswith("get")) / 1e6, b.get("get", 0) / 1e6, cpu, s]
                 for n, b, cpu, s in rows])
    later = rows[1:] or rows  # the first step warms up
    keys = sorted({k for _, b, _, _ in later for k in b})
    print("\nmedian over steps 2.. (MB):")
    print_table(keys, [[statistics.median(b.get(k, 0) for _, b, _, _ in later) / 1e6 for k in keys]])
    total = [sum(b.values()) / 1e6 for _, b, _, _ in later]
    print(f"\nmedian MB moved a step: {statistics.median(total):.2f}; median driver CPU s a step: "
          f"{statistics.median(c for _, _, c, _ in later):.3f}")


if __name__ == "__main__":
    main()
