#!/usr/bin/env bash
# Nsight Compute on the attention kernels of fa4_jax and cuDNN, one call each, on the H200 (built
# library carried): L2 and DRAM throughput against peak, tensor-pipe activity, and the stall
# reasons (sampled per instruction: SourceCounters, which the WarpStateStats section alone does
# not break down). A case's fourth field 1 profiles the backward's main kernel instead of the
# forward. ncu reads hardware counters only on the Firecracker runtime
# (the device tool's notes); --clock-control none leaves the clocks alone. Reports (text)
# go into one file, $OUT/ncu/reports.txt: the device returns only a few files per call.
#   usage: bash scripts/profile_attention.sh ["d s causal [backward]" ...]
#   default: "128 16384 0" "128 1024 1"; NCU_PEERS="fa4_jax" profiles ours only, "fa4_jax upstream"
#   ours against FA4 upstream's exported kernels ($FA4_UPSTREAM_LIB, scripts/upstream_peer/)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-.device_out}/ncu
mkdir -p "$out"
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=("128 16384 0" "128 1024 1")
for case in "${cases[@]}"; do
  read -r d s causal backward <<< "$case"
  flag=""; [ "$causal" = 1 ] && flag="--causal"
  # The main kernel is the call's longest launch; the filters keep pre/postprocess kernels out.
  kernels="regex:FlashAttentionForwardSm90|sdpa|fmha|flash|attention"; pass=fwd
  if [ "${backward:-0}" = 1 ]; then
    flag="$flag --backward"; kernels="regex:FlashAttentionBackwardSm90_|bprop|dgrad|bwd"; pass=bwd
  fi
  for peer in ${NCU_PEERS:-fa4_jax cudnn}; do
    # Upstream's preprocess and postprocess kernels have "bwd" in their names too.
    peer_kernels=$kernels
    [ "$peer" = upstream ] && [ "$pass" = bwd ] && peer_kernels="regex:FlashAttentionBackwardSm90_"
    name="${peer}_${pass}_d${d}_s${s}_c${causal}"
    # Skip the compiling call's launch. The report is kept for its source page (per-instruction
    # stall samples), which goes back summarized: the whole page is thousands of rows.
    report=$(mktemp -d)/$name
    timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --launch-skip 1 --launch-count 1 \
      --kernel-name-base demangled -k "$peer_kernels" -o "$report" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters --section Occupancy \
      python3 scripts/profile_attention.py --peer "$peer" --head-dim "$d" --seqlen "$s" $flag \
      > "$out/$name.txt" 2>&1
    ncu -i "$report.ncu-rep" --print-details all >> "$out/$name.txt" 2>&1
    ncu -i "$report.ncu-rep" --page source --csv --print-source sass 2>&1 \
      | python3 scripts/ncu_source_summary.py --top "${NCU_TOP:-40}" >> "$out/$name.txt" 2>&1
    echo "== $name: $(grep -m1 -E 'Duration' "$out/$name.txt" | tr -s ' ')"
    grep -E "Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy" \
      "$out/$name.txt" | tr -s ' ' | head -10
    { echo "===== $name"; cat "$out/$name.txt"; } >> "$out/reports.txt"
    rm "$out/$name.txt"
  done
done
