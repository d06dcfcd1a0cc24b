"""What `model.dtype: auto` sees on this machine: bf16 against fp32 matmul rates at the probe's size and at larger
ones, median of a few repeats each, and the choice the probe's own measurement makes (docs/precision.md).

    python benchmarks/machine_precision.py [--threads 2] [--sizes 256,512,1024,2048] [--repeats 5]

The probe (common.fast_dtype.probe_cpu) runs 256^2 matmuls for 0.1 s a dtype; the larger sizes say whether that
small size ranks the two dtypes as a model's matmuls would.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import print_table  # noqa: E402
from common.fast_dtype import choose_dtype, probe_cpu  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="256,512,1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), torch {torch.__version__}, "
          f"median of {args.repeats}")
    rows, probe = [], None
    for n in (int(s) for s in args.sizes.split(",")):
        runs = [probe_cpu(args.threads, n=n, seconds=0.1 if n <= 512 else 0.3) for _ in range(args.repeats)]
        bf16, fp32 = (statistics.median(getattr(r, k) for r in runs) for k in ("bf16_gflops", "fp32_gflops"))
        rows.append([f"{n}^2", round(bf16, 1), round(fp32, 1), round(bf16 / fp32, 3)])
        probe = probe or runs[len(runs) // 2]
    print_table(["matmul", "bf16 GFLOP/s", "fp32 GFLOP/s", "bf16 / fp32"], rows)
    choice = choose_dtype("auto", probe)
    print(f"model.dtype auto -> {choice.dtype}: {choice.why}")


if __name__ == "__main__":
    main()
