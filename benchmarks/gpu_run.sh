#!/usr/bin/env bash
# The whole GPU check as one device call (see ../shared/device/README.md):
#   bash ../shared/device/make-wheels.sh          # here, once: Python 3.12 wheels into .whl/
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=540)          # check + long (default)
#   run(command="bash benchmarks/gpu_run.sh async", carry=[".whl"], timeout_s=300)    # a second call, if time is left
# Results (table, JSON, log) land in $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # Ray keeps its token authentication (its default)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PARTS=${1:-check,long}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if [[ ,$PARTS, == *,check,* ]]; then
  timeout 420 python3 benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" || true
  rm -rf "$OUT/models"  # the 0.5B-shaped weights need not come back
fi
# long completions on the GPU: max_memory_allocated and seconds, full logits against chunked log-probs (+ checkpointing)
if [[ ,$PARTS, == *,long,* ]]; then
  timeout 100 python3 benchmarks/long_sequences.py --models tiny-152k --lengths 4096,16384 \
    --paths full,chunked,chunked+gc \
    2>&1 | tee "$OUT/long_sequences.log" || true
fi
# asynchronous RL with in-flight weight updates (rollout.max_staleness): the sort recipe, K = 0 against K = 1, 256-token
# completions; prefill per generated token, sync pause-to-resume, seconds a step
if [[ ,$PARTS, == *,async,* ]]; then
  timeout 270 python3 benchmarks/async_rl.py --model tiny --steps 6 --variants k0,k1 --max-new-tokens 256 \
    2>&1 | tee "$OUT/async_rl.log" || true
fi
