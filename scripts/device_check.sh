#!/usr/bin/env bash
# One call on the H200 machine (built library carried, nothing built there): GPU tier, then the
# benchmark, logs under $OUT. Usage: bash scripts/device_check.sh [benchmark args...]
#
# At most 8 files come back from $OUT (the device tool's limit): this script writes 5-6
# (gpu.txt, gpu_tests.log, gpu_tests_summary.txt, bench.log, bench/results.json and a PNG per
# mode), so a second benchmark in the same call should delete the PNGs, or its results.json is
# the file left behind.
#
# The GPU tier's time is XLA compiling each test's small programs, so it runs as GPU_SHARDS
# pytest processes in parallel (`--shard K/N`), each allowed 1/GPU_SHARDS of the GPU memory,
# then the tests that start GPU processes of their own, alone. With XLA's autotuning off
# (tests/conftest.py), 12 shards ran the ~720 sharded tests in 4m23s on the 16-core H100
# machine (2026-12-07), where 8 shards needed more than 330 s each; the tests run apart took
# 71 s. The per-shard limit (GPU_TESTS_TIMEOUT) defaults to 420 s; it interrupts pytest (SIGINT)
# rather than killing it, so a shard cut off still prints its summary and slowest tests.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-.device_out}
shards=${GPU_SHARDS:-12}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # Per-shard logs outside $OUT (the device returns only a few files), joined at the end.
  logs=$(mktemp -d)
  fraction=$(python3 -c "print(round(0.9 / $shards, 3))")
  for ((k = 0; k < shards; k++)); do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction timeout -s INT -k 20 "${GPU_TESTS_TIMEOUT:-420}" \
      python3 -m pytest -m "gpu and not gpu_processes" -q -rfEs -p no:cacheprovider --durations=15 --shard "$k/$shards" \
      ${GPU_TESTS:-tests} > "$logs/$k.log" 2>&1 &
  done
  wait
  # Tests that start GPU processes of their own run after the shards, alone: beside shards that
  # hold 90% of the memory, a child JAX process found no usable device.
  timeout -s INT -k 20 "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -m "gpu and gpu_processes" -q -rfEs \
    -p no:cacheprovider ${GPU_TESTS:-tests} > "$logs/processes.log" 2>&1
  for k in $(seq 0 $((shards - 1))) processes; do
    echo "===== shard $k"; cat "$logs/$k.log"
  done > "$out/gpu_tests.log"
  for k in $(seq 0 $((shards - 1))) processes; do
    echo "shard $k: $(tail -1 "$logs/$k.log")"
    grep -E "^(FAILED|ERROR)" "$logs/$k.log" | head -20
  done | tee "$out/gpu_tests_summary.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.bench_attention --out "$out/bench" "$@" \
    2>&1 | tee "$out/bench.log" | tail -60
fi
