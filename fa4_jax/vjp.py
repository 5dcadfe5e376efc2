"""The differentiable attention op: forward on the chosen backend, a custom VJP for the backward.

Backward today: the backward kernels have not landed, so the backward pass, whatever the
forward backend, recomputes attention through the pure-JAX reference in float32 and takes its
VJP (`jax.vjp` of `reference.attention_reference`). Gradients are therefore correct but run at
reference speed and memory; `params.deterministic` holds trivially (the reference has no
atomics). The residuals are already the ones the kernels will need: (q, k, v, out, lse).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fa4_jax import ffi
from fa4_jax.params import AttentionParams
from fa4_jax.reference import attention_reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_op(q, k, v, params: AttentionParams):
    """Attention of validated inputs on `params.implementation`.

    Args:
      q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
      v: [batch, seqlen_k, heads_kv, head_dim_v]; one dtype for all three.
      params: the static options (hashable, not differentiated).

    Returns:
      out [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and lse [batch, heads_q,
      seqlen_q] float32. Both are differentiable (the lse cotangent is honoured).
    """
    return _forward(q, k, v, params)


def _forward(q, k, v, params):
    if params.implementation == "cute":
        return ffi.forward(q, k, v, params)
    return _reference_fp32(q, k, v, params)


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


def _attention_op_fwd(q, k, v, params):
    out, lse = _forward(q, k, v, params)
    return (out, lse), (q, k, v, out, lse)


def _attention_op_bwd(params, residuals, cotangents):
    q, k, v, _, _ = residuals
    # Stand-in for the fa4_bwd kernels: recompute through the fp32 reference.
    _, reference_vjp = jax.vjp(lambda q, k, v: _reference_fp32(q, k, v, params), q, k, v)
    dq, dk, dv = reference_vjp(cotangents)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


attention_op.defvjp(_attention_op_fwd, _attention_op_bwd)
