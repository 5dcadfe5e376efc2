"""The single-device attention forward and backward, dispatched on `params.implementation`.

These are the per-shard bodies: `sharding.py` runs them on each device's block of the inputs,
so what runs here never sees a collective. The backward pass has not got its kernels yet: for
every backend it recomputes attention through the pure-JAX reference in float32 and takes its
VJP (`jax.vjp` of `reference.attention_reference`). Gradients are therefore correct but run at
reference speed and memory; `params.deterministic` holds trivially (the reference has no
atomics). Its inputs are already the ones the kernels will need: (q, k, v, out, lse) and the
two cotangents.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fa4_jax import ffi
from fa4_jax.params import AttentionParams
from fa4_jax.reference import attention_reference


def forward(q, k, v, params: AttentionParams):
    """(out, lse) of one device's inputs; shapes as `vjp.attention_op`."""
    if params.implementation == "cute":
        return ffi.forward(q, k, v, params)
    return _reference_fp32(q, k, v, params)


def backward(q, k, v, out, lse, d_out, d_lse, params: AttentionParams):
    """(dq, dk, dv) of one device's inputs, each in its input's dtype.

    Args:
      q, k, v, out, lse: the forward's inputs and outputs, shapes as `vjp.attention_op`.
      d_out: [batch, seqlen_q, heads_q, head_dim_v], the cotangent of out.
      d_lse: [batch, heads_q, seqlen_q] float32, the cotangent of lse.
    """
    del out, lse  # The reference recomputes them; the backward kernels will read them instead.
    _, reference_vjp = jax.vjp(lambda q, k, v: _reference_fp32(q, k, v, params), q, k, v)
    dq, dk, dv = reference_vjp((d_out, d_lse))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _reference_fp32(q, k, v, params):
    return attention_reference(
        q,
        k,
        v,
        softmax_scale=params.softmax_scale,
        causal=params.causal,
        window_left=params.window_left,
        window_right=params.window_right,
        softcap=params.softcap,
        compute_dtype=jnp.float32,
    )
