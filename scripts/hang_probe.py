"""Runs one attention case's forward and backward in this process, printing each stage as it
completes, so a caller with a timeout sees which kernel did not return. Usage:
python scripts/hang_probe.py B SQ SK H HK D CAUSAL(0/1) [TUNING]"""
import sys

import jax
import jax.numpy as jnp

from fa4_jax import ffi
from fa4_jax.api import attention_params

b, sq, sk, h, hk, d, causal = map(int, sys.argv[1:8])
tuning = sys.argv[8] if len(sys.argv) > 8 else "default"
keys = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(keys[0], (b, sq, h, d), jnp.bfloat16)
k = jax.random.normal(keys[1], (b, sk, hk, d), jnp.bfloat16)
v = jax.random.normal(keys[2], (b, sk, hk, d), jnp.bfloat16)
params = attention_params(q, k, v, causal=bool(causal), implementation="cute")
out, lse = jax.block_until_ready(jax.jit(lambda q, k, v: ffi.forward(q, k, v, params, tuning=tuning))(q, k, v))
print("fwd ok", flush=True)
if tuning == "default":
    d_out = jax.random.normal(keys[3], out.shape, jnp.bfloat16)
    grads = jax.block_until_ready(jax.jit(lambda *x: ffi.backward(*x, params))(
        q, k, v, out, lse, d_out, jnp.zeros_like(lse)))
    print("bwd ok", flush=True)
