"""One attention call (forward, or with --backward its gradient), repeated, for a profiler to
attach to (scripts/profile_attention.sh).

    PYTHONPATH=. python scripts/profile_attention.py --peer fa4_jax --head-dim 128 --seqlen 16384 [--causal] [--backward]

--peer upstream calls FA4 upstream's exported kernels (forward, and its backward through the
benchmark's custom_vjp), from the library $FA4_UPSTREAM_LIB names (scripts/upstream_peer/).

Shapes follow the benchmark's grid (batch·seqlen = 16384 tokens, heads·head_dim = 2048, bf16).
The call runs --calls times after one compiling call; the profiler skips the first launches.
"""
import argparse
import os

import jax
import jax.numpy as jnp

import fa4_jax


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=("fa4_jax", "cudnn", "upstream"), default="fa4_jax")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="the gradient of sum(o) w.r.t. q, k, v")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    batch, heads = max(1, 16384 // args.seqlen), 2048 // args.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch, args.seqlen, heads, args.head_dim), jnp.bfloat16)
               for key in keys)
    if args.peer == "fa4_jax":
        attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=args.causal,
                                                           implementation="cute"))
    elif args.peer == "upstream":
        from benchmarks import bench_attention

        library = bench_attention.upstream_library(os.environ[bench_attention.UPSTREAM_LIB_ENV])
        attend = jax.jit(bench_attention.upstream_attention(library, args.causal))
    else:
        attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=args.causal, implementation="cudnn"))
    if args.backward:
        forward = attend
        attend = jax.jit(jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(),
                                  argnums=(0, 1, 2)))
    jax.block_until_ready(attend(q, k, v))
    for _ in range(args.calls):
        jax.block_until_ready(attend(q, k, v))
    print(f"{args.peer} d={args.head_dim} s={args.seqlen} b={batch} h={heads} "
          f"causal={args.causal} backward={args.backward}: {args.calls + 1} calls")


if __name__ == "__main__":
    main()
