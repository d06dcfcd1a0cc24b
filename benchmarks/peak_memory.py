"""Peak memory of a command and everything it starts (a local Ray head and its actors are its descendants).

    python benchmarks/peak_memory.py -- make run

Samples the summed RSS of the process tree every 0.2 s and prints the peak. Shared pages are counted once per
process, so this overestimates slightly (an upper bound).
"""
from __future__ import annotations

import subprocess
import sys
import time

import psutil


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for p in [root] + root.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], **popen_kwargs) -> tuple[int, int, float]:
    """Run `cmd` to the end; returns (exit code, peak summed RSS of its process tree in bytes, wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen_kwargs)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, tree_rss(root))
        except psutil.Error:
            pass
        time.sleep(0.2)
    return proc.returncode, peak, time.perf_counter() - start


def main() -> int:
    cmd = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    code, peak, wall = measure(cmd)
    print(f"peak RSS of the process tree: {peak / 2**30:.2f} GiB; wall {wall:.0f} s; exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
