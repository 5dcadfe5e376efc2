"""Ring attention (context parallelism) scaling: issue #7's table, on every GPU of one host.

For each global sequence length S and mask, three measurements in one process:

- ring: `fa4_jax.ring_attention` over all n devices on a "seq" mesh axis, batch 1, inputs already
  in the zig-zag layout (as a model keeps them between layers), forward or forward+backward.
  Reported as TF/s per GPU: the attention's FLOPs over S, divided by time and by n.
- local: one device's share of the ring's work with no communication, on a single device: S/n
  query rows against S keys without a mask, or against S/2 keys for a causal ring (each zig-zag
  shard does half of its rows' keys on average; same FLOPs, a different mask). The share of time
  in communication is estimated as 1 − local / ring: what the ring adds over its compute, merges
  of the partial results included.
- single: plain `fa4_jax.attention` on one device at the largest of S, S/2, S/4, ... that fits
  in its memory, for the per-GPU comparison.

On the GPU machine (all devices of the host):

    python -m benchmarks.bench_ring --out .bench_ring

and on any machine, on 8 fake CPU devices with tiny shapes, to test the harness itself:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.bench_ring --dry-run

The timer is bench_attention's (`time_step`); FLOPs as there: forward 4·b·h·S²·d, halved when
causal, forward+backward 3.5×.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fa4_jax
from benchmarks.bench_attention import DTYPES, FWD_BWD_FLOP_FACTOR, MODES, Settings, make_step, time_step

PRESETS = {
    "gpu": dict(seqlens=(65536, 131072), head_dim=128, hidden=2048, calls=5, repeats=3,
                warmup_s=0.3, implementation="cute"),
    "dry_run": dict(seqlens=(256, 512), head_dim=16, hidden=64, calls=2, repeats=2, warmup_s=0.0,
                    implementation="reference"),
}


@dataclasses.dataclass(frozen=True)
class RingCase:
    mode: str
    seqlen: int  # global, over all devices
    causal: bool
    heads: int
    head_dim: int

    def flops(self, seqlen_q: int | None = None, seqlen_k: int | None = None, causal=None) -> float:
        seqlen_q = self.seqlen if seqlen_q is None else seqlen_q
        seqlen_k = self.seqlen if seqlen_k is None else seqlen_k
        causal = self.causal if causal is None else causal
        forward = 4 * self.heads * seqlen_q * seqlen_k * self.head_dim / (2 if causal else 1)
        return forward * (FWD_BWD_FLOP_FACTOR if self.mode == "fwd_bwd" else 1)


def _inputs(shape_q, shape_kv, dtype, seed, sharding=None):
    """Two (q, k, v, do) sets of standard-normal values, placed with `sharding` if given."""
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    sets = []
    for _ in range(2):
        q, k, v, do = (jax.random.normal(next(keys), s, jnp.float32).astype(dtype)
                       for s in (shape_q, shape_kv, shape_kv, shape_q))
        if sharding is not None:
            q, k, v, do = (jax.device_put(x, sharding) for x in (q, k, v, do))
        sets.append((q, k, v, do))
    jax.block_until_ready(sets)
    return sets


def time_ring(case: RingCase, mesh, dtype, settings: Settings, implementation: str):
    n = mesh.shape["seq"]
    per_device = jax.shard_map(
        lambda q, k, v: fa4_jax.ring_attention(q, k, v, mesh_axis="seq", causal=case.causal,
                                               implementation=implementation),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    shape = (1, case.seqlen, case.heads, case.head_dim)
    assert case.seqlen % (2 * n) == 0, "the zig-zag layout cuts the sequence into 2n chunks"
    inputs = _inputs(shape, shape, dtype, 0, NamedSharding(mesh, P(None, "seq")))
    return time_step(make_step(per_device, case.mode), inputs, settings)


def time_local(case: RingCase, n: int, dtype, settings: Settings, implementation: str):
    """One device's share of the ring's FLOPs, without communication (module docstring)."""
    seqlen_k = case.seqlen // 2 if case.causal else case.seqlen
    inputs = _inputs((1, case.seqlen // n, case.heads, case.head_dim),
                     (1, seqlen_k, case.heads, case.head_dim), dtype, 1)
    attend = lambda q, k, v: fa4_jax.attention(q, k, v, implementation=implementation)  # noqa: E731
    return time_step(make_step(attend, case.mode), inputs, settings)


def time_single(case: RingCase, dtype, settings: Settings, implementation: str):
    """(seqlen, timing) of one device at the largest of S, S/2, ... whose call fits."""
    seqlen = case.seqlen
    while seqlen >= 1:
        try:
            shape = (1, seqlen, case.heads, case.head_dim)
            inputs = _inputs(shape, shape, dtype, 2)
            attend = lambda q, k, v: fa4_jax.attention(  # noqa: E731
                q, k, v, causal=case.causal, implementation=implementation)
            return seqlen, time_step(make_step(attend, case.mode), inputs, settings)
        except Exception as error:  # noqa: BLE001 - only out-of-memory halves the length
            if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
                raise
            seqlen //= 2
    return None, None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU devices, tiny shapes")
    p.add_argument("--seqlens", type=lambda t: tuple(int(x) for x in t.split(",")),
                   help="global sequence lengths (65536,131072)")
    p.add_argument("--modes", type=lambda t: tuple(t.split(",")), default=MODES)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--hidden", type=int, help="heads · head_dim (2048)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--calls", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup-s", type=float)
    p.add_argument("--implementation")
    p.add_argument("--out", default=".bench_ring")
    args = p.parse_args(argv)
    for name, value in PRESETS["dry_run" if args.dry_run else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    n = jax.device_count()
    if n < 2:
        print(f"bench_ring needs 2 or more devices, jax sees {n}", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    dtype = DTYPES[args.dtype]
    settings = Settings(tokens=0, hidden=args.hidden, dtype=args.dtype, calls=args.calls,
                        repeats=args.repeats, max_call_s=60.0, max_case_s=60.0,
                        warmup_s=args.warmup_s, max_xla_seqlen=0,
                        fa4_implementation=args.implementation)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    print(f"ring over {n} x {jax.devices()[0].device_kind}; d={args.head_dim}, "
          f"heads={args.hidden // args.head_dim}, {args.dtype}", flush=True)
    rows = []
    for seqlen in args.seqlens:
        for causal in causals:
            for mode in args.modes:
                case = RingCase(mode, seqlen, causal, args.hidden // args.head_dim, args.head_dim)
                ring = time_ring(case, mesh, dtype, settings, args.implementation)
                local = time_local(case, n, dtype, settings, args.implementation)
                single_seqlen, single = time_single(case, dtype, settings, args.implementation)
                row = dict(
                    mode=mode, seqlen=seqlen, causal=causal, devices=n, ring_ms=ring.ms,
                    ring_tflops_per_gpu=case.flops() / (ring.ms * 1e-3) / n / 1e12,
                    local_ms=local.ms,
                    communication_share=max(0.0, 1.0 - local.ms / ring.ms),
                    single_seqlen=single_seqlen,
                    single_ms=single.ms if single else None,
                    single_tflops=(case.flops(single_seqlen, single_seqlen) / (single.ms * 1e-3)
                                   / 1e12 if single else None),
                )
                rows.append(row)
                print(_format_row(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ring_results.json")
    with open(path, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, devices=n, argv=sys.argv[1:],
                       settings=dataclasses.asdict(settings), rows=rows,
                       started_unix=time.time()), f, indent=1)
    print(f"wrote {path}")
    return 0


def _format_row(row) -> str:
    single = (f"1 GPU at {row['single_seqlen']}: {row['single_tflops']:.3g} TF/s"
              if row["single_ms"] is not None else "1 GPU: nothing fits")
    return (f"{row['mode']:<7} S={row['seqlen']:<7} {'causal' if row['causal'] else 'full':<6} "
            f"ring {row['ring_ms']:9.3f} ms {row['ring_tflops_per_gpu']:7.3g} TF/s per GPU | "
            f"local share {row['local_ms']:9.3f} ms, communication {row['communication_share']:.0%}"
            f" | {single}")


if __name__ == "__main__":
    sys.exit(main())
