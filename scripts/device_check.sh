#!/usr/bin/env bash
# One call on the H200 machine (built library carried, nothing built there): GPU tier, then the
# benchmark, logs under $OUT. Usage: bash scripts/device_check.sh [benchmark args...]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-.device_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    ${GPU_TESTS:-tests} 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.bench_attention --out "$out/bench" "$@" \
    2>&1 | tee "$out/bench.log" | tail -60
fi
