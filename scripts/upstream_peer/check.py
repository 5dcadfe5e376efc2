"""Device check of bench_attention's "upstream" column: FA4 upstream's exported forward and
backward (libupstream_peer.so, built by build.py), called exactly as the benchmark calls them,
against fa4_jax's float32 reference on the same bf16 inputs. Needs an sm_90 GPU.

    FA4_UPSTREAM_LIB=build/upstream_peer/libupstream_peer.so python scripts/upstream_peer/check.py

For each head dim (64, 128, 256), mask (full, causal) and shape (b=2, h=4, s=1024 and the odd
s=1000, which leaves the backward's workspace rows padded past seqlen at every tile) it compares
out, lse (the forward's second result, which the backward reads) and dq, dk, dv (jax.vjp through
the column's custom_vjp, under a random bf16 output cotangent). Each is run twice, so a dQ
accumulator the preprocess did not zero would show as a doubled dq on the second call (XLA may
hand the call the first call's memory); the error printed is the larger of the two calls'.

A tensor passes when max|x - ref| <= TOLERANCE * max(1, max|ref|): TOLERANCE absolute while
the tensor's values stay within 1, relative beyond (bf16 keeps 8 bits of mantissa; a causal
d128 output reaches 3-4 here, where one bf16 step is 1.6e-2). Prints every error, one PASS/FAIL
line per case and a final one; exits 1 on any failure.
"""
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import bench_attention as bench  # noqa: E402
from fa4_jax.fallbacks.reference import attention_reference  # noqa: E402

TOLERANCE = 2e-2
SHAPES = ((2, 1024, 4), (2, 1000, 4))  # (batch, seqlen, heads)
NAMES = ("out", "lse", "dq", "dk", "dv")


def upstream_step(case: bench.Case, settings: bench.Settings):
    """(out, lse, dq, dk, dv) through the column's attend, as the benchmark's step calls it."""
    attend = bench.upstream_candidates(case, settings)[0].attend

    def step(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        lse = bench.upstream_forward(q, k, v, case.causal)[1]
        return (out, lse, *vjp(d_out))

    return jax.jit(step)


def reference_step(causal: bool, seqlen: int):
    """The same in float32 through fa4_jax.fallbacks.reference (one chunk: these shapes fit)."""
    def step(q, k, v, d_out):
        def attend(q, k, v):
            return attention_reference(q, k, v, causal=causal, chunk_size=seqlen)

        (out, lse), vjp = jax.vjp(attend, *(x.astype(jnp.float32) for x in (q, k, v)))
        return (out, lse, *vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse))))

    return jax.jit(step)


def check(head_dim: int, causal: bool, batch: int, seqlen: int, heads: int,
          settings: bench.Settings) -> bool:
    start = time.perf_counter()
    case = bench.Case("fwd_bwd", head_dim, seqlen, causal, batch, heads)
    keys = jax.random.split(jax.random.key(head_dim * 10_000 + seqlen * 2 + causal), 4)
    inputs = [jax.random.normal(key, case.shape, jnp.float32).astype(jnp.bfloat16) for key in keys]
    try:
        upstream = upstream_step(case, settings)
    except bench.Skip as skip:
        print(f"d{head_dim} {'causal' if causal else 'full'} s{seqlen}: the column skips it "
              f"({skip}) FAIL", flush=True)
        return False
    runs = [[x.astype(jnp.float32) for x in upstream(*inputs)] for _ in range(2)]
    want = reference_step(causal, seqlen)(*inputs)
    ok, parts = True, []
    for name, first, second, ref in zip(NAMES, *runs, want):
        error = max(float(jnp.max(jnp.abs(got - ref))) for got in (first, second))
        scale = float(jnp.max(jnp.abs(ref)))
        passed = error <= TOLERANCE * max(1.0, scale)  # False for NaN
        ok &= passed
        parts.append(f"{name} {error:.2e}/{scale:.2f}" + ("" if passed else " (!)"))
    tile_m = bench.upstream_library(os.environ[bench.UPSTREAM_LIB_ENV]).UpstreamBwdTileM(
        head_dim, causal)
    print(f"d{head_dim:<3d} {'causal' if causal else 'full  '} b{batch} s{seqlen:<4d} h{heads} "
          f"(bwd tile_m {tile_m:>3d})  max|err|/max|ref|: {'  '.join(parts)}  "
          f"{'PASS' if ok else 'FAIL'}  {time.perf_counter() - start:.1f} s", flush=True)
    return ok


def main() -> int:
    if not os.environ.get(bench.UPSTREAM_LIB_ENV):
        print(f"FAIL: set {bench.UPSTREAM_LIB_ENV} to build.py's libupstream_peer.so", flush=True)
        return 1
    if jax.default_backend() != "gpu":
        print(f"FAIL: needs an sm_90 GPU; JAX's backend is {jax.default_backend()}", flush=True)
        return 1
    print(f"{jax.devices()[0].device_kind}; {os.environ[bench.UPSTREAM_LIB_ENV]}; tolerance "
          f"{TOLERANCE} x max(1, max|ref|)", flush=True)
    start = time.perf_counter()
    settings = bench.settings_from(bench.with_preset(bench.make_parser().parse_args([])))
    results = [check(head_dim, causal, batch, seqlen, heads, settings)
               for head_dim in bench.UPSTREAM_HEAD_DIMS for causal in (False, True)
               for batch, seqlen, heads in SHAPES]
    print(f"{'PASS' if all(results) else 'FAIL'}: {sum(results)} of {len(results)} cases within "
          f"tolerance ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
