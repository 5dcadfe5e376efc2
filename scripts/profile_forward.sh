#!/usr/bin/env bash
# Nsight Compute on the forward kernels of fa4_jax and cuDNN, one call each, on the H200 (built
# library carried). Tests docs/perf-log.md's open hypotheses on the forward's fixed cost: L2 and
# DRAM throughput against peak, tensor-pipe activity, and the stall reasons. ncu reads hardware
# counters only on the Firecracker runtime (/work/.library/device/KINDS.md); --clock-control none
# leaves the clocks alone. Reports (text) under $OUT/ncu.
#   usage: bash scripts/profile_forward.sh ["d s causal" ...]   default: "128 16384 0" "128 1024 1"
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-.device_out}/ncu
mkdir -p "$out"
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=("128 16384 0" "128 1024 1")
for case in "${cases[@]}"; do
  read -r d s causal <<< "$case"
  flag=""; [ "$causal" = 1 ] && flag="--causal"
  for peer in fa4_jax cudnn; do
    name="${peer}_d${d}_s${s}_c${causal}"
    # The attention kernel is the longest launch of the call; the filter keeps the preprocess
    # of other peers' graphs out. Skip the compiling call's launch.
    timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --launch-skip 1 --launch-count 1 \
      --kernel-name-base demangled -k "regex:FlashAttentionForwardSm90|sdpa|fmha|flash|attention" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section Occupancy \
      python3 scripts/profile_forward.py --peer "$peer" --head-dim "$d" --seqlen "$s" $flag \
      > "$out/$name.txt" 2>&1
    echo "== $name: $(grep -m1 -E 'Duration' "$out/$name.txt" | tr -s ' ')"
    grep -E "Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy" \
      "$out/$name.txt" | tr -s ' ' | head -8
  done
done
