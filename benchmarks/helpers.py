"""Helpers shared by the benchmark scripts: model sizes, timing, and table printing. (Not `common.py`: run as
`python benchmarks/x.py`, the script folder comes first on sys.path, and that name would hide the `common` package.)"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from rlhf.config import TinyModelConfig

# name -> tiny config; parameter counts are printed by the benchmarks themselves.
SIZES = {
    "1M": TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "10M": TinyModelConfig(hidden_size=320, num_layers=6, num_heads=10, num_kv_heads=2, intermediate_size=1280),
    "100M": TinyModelConfig(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072),
}


def build(size: str, root: str | None = None) -> str:
    from rlhf.weights.tiny import save_tiny_model
    root = root or tempfile.mkdtemp(prefix="rlhf-bench-")
    path = os.path.join(root, f"model-{size}")
    if not os.path.exists(os.path.join(path, "config.json")):
        save_tiny_model(SIZES[size], path)
    return path


def n_params(path: str) -> int:
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def run_recipe(args: list[str], root: str) -> float:
    """`python -m rlhf.run <args>` in `root`; its wall seconds, or the end of its stderr as the exit message."""
    import subprocess
    import sys

    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rlhf.run", *args], cwd=root, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"rlhf.run {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return time.perf_counter() - start
