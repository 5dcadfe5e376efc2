"""The same kernels timed two ways: bench_attention's back-to-back loop, and one call at a time
after an L2 flush and an idle gap, the way FA4 upstream's figures in docs/anchors.md were taken
(`triton.testing.do_bench`: a 256 MB write before each call, CUDA events around it).

The H200 runs attention at its power limit (docs/perf-log.md: 620-683 W, SM clock 1650-1740 MHz
against 1980). A timer that lets the clock recover between calls can read a kernel faster than
one that keeps the GPU busy, and part of the gap to upstream's figures may be that. This measures
how much, for any peer of bench_attention, so a comparison across timers can be corrected.

"isolated": each sample writes a FLUSH_BYTES buffer, blocks, sleeps --gap-ms, then times one call
from dispatch to block_until_ready; the median of an empty jit'd call timed the same way (the
dispatch and synchronisation) is subtracted. Run on the H200:

    python -m benchmarks.timing_protocol --peers fa4_jax,cudnn --head-dims 128 --seqlens 4096,16384

and on the CPU, with tiny shapes and the reference backend, to test the harness:

    python -m benchmarks.timing_protocol --dry-run
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import bench_attention as bench

FLUSH_BYTES = 256 * 2**20  # triton.testing.do_bench's L2 flush buffer


def dispatch_s(samples: int) -> float:
    """Median wall time of an empty jit'd call: dispatch plus synchronisation."""
    empty = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8,), jnp.float32)
    jax.block_until_ready(empty(x))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        jax.block_until_ready(empty(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def isolated_ms(step, input_sets, samples: int, gap_s: float, flush_elems: int, overhead_s: float
                ) -> float:
    """Median of single calls, each after an L2 flush and an idle gap, less the dispatch time."""
    flush = jax.jit(lambda buffer, value: buffer + value)
    buffer = jnp.zeros((flush_elems,), jnp.float32)
    jax.block_until_ready(step(*input_sets[0]))
    times = []
    for i in range(samples):
        buffer = jax.block_until_ready(flush(buffer, jnp.float32(i)))
        time.sleep(gap_s)
        start = time.perf_counter()
        jax.block_until_ready(step(*input_sets[i % len(input_sets)]))
        times.append(time.perf_counter() - start)
    return max(statistics.median(times) - overhead_s, 1e-9) * 1e3


def main(argv=None) -> int:
    # The benchmark's own options (shapes, peers, tunings, presets), forward only, plus these.
    p = bench.make_parser(__doc__.split("\n")[0])
    p.set_defaults(peers=("fa4_jax", "cudnn"), causal="no")
    p.add_argument("--samples", type=int, default=30, help="isolated calls per case")
    p.add_argument("--gap-ms", type=float, default=5.0, help="idle time before each isolated call")
    args = bench.with_preset(p.parse_args(argv))
    settings = bench.settings_from(args)
    flush_elems = (FLUSH_BYTES if not args.dry_run else 2**20) // 4
    samples = args.samples if not args.dry_run else 3
    overhead_s = dispatch_s(samples)
    print(f"dispatch + sync of an empty call: {overhead_s * 1e6:.0f} us (subtracted from isolated)")
    print(f"{'case':40s} {'peer':12s} {'loop ms':>9s} {'TF/s':>6s} {'isolated ms':>12s} "
          f"{'TF/s':>6s} {'loop/isolated':>14s}")
    cases = bench.cases_in_priority_order(settings, ("fwd",), args.head_dims, args.seqlens,
                                          bench.causals_of(args))
    for case in cases:
        input_sets_of = bench.input_cache(case, seed=0)
        for peer in args.peers + tuple(bench.TUNING_PREFIX + t for t in args.fa4_tunings):
            try:
                candidate = bench.peer_candidates(peer)(case, settings)[0]
                step = bench.make_step(candidate.attend, case.mode)
                inputs = input_sets_of(candidate.dtype)
                loop = bench.time_step(step, inputs, settings).ms
                alone = isolated_ms(step, inputs, samples, args.gap_ms / 1e3, flush_elems,
                                    overhead_s)
            except bench.Skip as reason:
                print(f"{case.label():40s} {peer:12s} skipped: {reason}")
                continue
            except Exception as error:  # a peer that cannot run here (cuDNN on the CPU)
                print(f"{case.label():40s} {peer:12s} failed: {bench.short_error(error)}")
                continue
            print(f"{case.label():40s} {peer:12s} {loop:9.3f} {case.flops / loop / 1e9:6.0f} "
                  f"{alone:12.3f} {case.flops / alone / 1e9:6.0f} {loop / alone:14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
