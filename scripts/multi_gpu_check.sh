#!/usr/bin/env bash
# One call on a multi-GPU machine (nvidia-h200-x2 or larger; built library carried, nothing
# built there): issue #7's three parts, logs under $OUT.
#   1. the multi-GPU tests (tests/test_multi_device.py, tests/gpu/test_partitioned_lowering.py);
#   2. the Flax demo on all GPUs (data parallel x head parallel mesh, fa4_jax.tools.demo.make_mesh);
#   3. ring attention scaling at 64k and 128k tokens (benchmarks/bench_ring.py).
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: on these shared hosts a program using
# it can take the GPUs out of service (the device notes, KINDS.md).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-.device_out}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv | tee "$out/gpus.txt"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
  tests/test_multi_device.py tests/gpu/test_partitioned_lowering.py > "$out/multi_gpu_tests.log" 2>&1
tail -1 "$out/multi_gpu_tests.log" | tee "$out/multi_gpu_tests_summary.txt"
grep -E "^(FAILED|ERROR)" "$out/multi_gpu_tests.log" | head -20
timeout "${DEMO_TIMEOUT:-240}" python3 -m fa4_jax demo --out "$out/demo_loss.png" > "$out/demo.log" 2>&1
grep -E "^(fa4_jax|baseline|loss agreement|[0-9]+ x )" "$out/demo.log"
timeout "${RING_TIMEOUT:-300}" python3 -m benchmarks.bench_ring --out "$out/ring" "$@" 2>&1 \
  | tee "$out/ring.log" | tail -20
