#!/usr/bin/env bash
# The whole GPU check as one device call of at most 8 minutes (../shared/device/README.md):
#   bash ../shared/device/make-wheels.sh                                          # here, once: wheels into .whl/
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=540)
#   run(command="bash benchmarks/gpu_run.sh sp", carry=[".whl"], timeout_s=300)  # two GPUs or more: its own call
# Each part writes its rows to $OUT as it finishes them (gpu_check.json, the logs), so a part cut by its time limit
# still leaves what it measured. tests/benchmarks/test_device_script.py rehearses this script's import path on CPU
# (packages on PYTHONPATH, an interpreter without the project's venv). vLLM is not on the device (its CUDA wheel is
# too big to carry): what needs it, tensor-parallel engines included, runs on CPU.
set -euo pipefail
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "no wheels in .whl/: run 'bash ../shared/device/make-wheels.sh' in the checkout, then carry [\".whl\"]" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # Ray keeps its token authentication (its default)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PARTS=${1:-check,long}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# ZeRO-2/ZeRO-3 steps (ZeRO-3's FusedAdam is built here first, ~1-2 min), CUDA IPC and hybrid syncs, the rules
if [[ ,$PARTS, == *,check,* ]]; then
  timeout 330 python3 benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" || true
  rm -rf "$OUT/models"  # the 0.5B-shaped weights need not come back
fi
# long completions: max_memory_allocated and seconds, full logits against chunked log-probs (+ checkpointing)
if [[ ,$PARTS, == *,long,* ]]; then
  timeout 110 python3 benchmarks/long_sequences.py --models tiny-152k --lengths 4096,16384 \
    --paths full,chunked,chunked+gc \
    2>&1 | tee "$OUT/long_sequences.log" || true
fi
# sequence parallelism at 32k (#62): one completion split over 2 ranks against one rank, a GPU a rank (whole GPUs
# counted, not MIG slices). The lent kinds have one GPU and NCCL refuses two ranks on one: there it measures nothing.
if [[ ,$PARTS, == *,sp,* ]]; then
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  if (( gpus >= 2 )); then
    timeout 240 python3 benchmarks/long_sequences.py --models tiny-152k --lengths 32768 --group 1 \
      --paths chunked+gc,chunked+gc+sp2 2>&1 | tee "$OUT/sequence_parallel.log" || true
  else
    echo "sp: SP=2 needs 2 GPUs, this machine has $gpus: not measured" | tee "$OUT/sequence_parallel.log"
  fi
fi
