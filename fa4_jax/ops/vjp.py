"""The differentiable attention op: a custom VJP over the partitioned forward and backward ops.

Both passes go through `sharding.py`, so under `jax.jit` with sharded inputs each device runs
the single-device body of `backends.py` on its block (batch and heads), and under `jax.vmap`
the mapped axes fold into batch. The residuals are what the backward kernels need:
(q, k, v, out, lse), and a ragged batch's valid lengths and the segment ids when given.

The rules see symbolic zeros (`symbolic_zeros=True`): most callers differentiate out only, and
lse's cotangent then reaches the backward as None instead of a b·h·sq fp32 array of zeros that
XLA would build with a broadcast kernel before every backward and the kernels would read
(docs/perf-log.md, "the dLSE cotangent as a symbolic zero").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from fa4_jax.ops import bodies, sharding
from fa4_jax.core.params import AttentionParams


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_op(q, k, v, params: AttentionParams, seq_lengths=None, segment_ids=None):
    """Attention of validated inputs on `params.implementation`.

    Args:
      q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
      v: [batch, seqlen_k, heads_kv, head_dim_v]; one dtype for all three.
      params: the static options (hashable, not differentiated).
      seq_lengths: None, or (q_len, kv_len) of a ragged batch: int32 [batch] each, values
        in [0, seqlen_q] and [0, seqlen_k]; integers, so their cotangent is None.
      segment_ids: None, or the four segment operands (`fa4_jax.runtime.segments.operands`: q_ids
        [batch, seqlen_q], kv_ids [batch, seqlen_k] int32 and their span tables, computed once
        for both passes): a row sees only the keys of its own id; or those and a boolean mask's
        bits (`fa4_jax.runtime.mask_bits.operands`: the mask, with the causal and window rules folded
        in, for ids all 0); integers, so their cotangent is None.

    Returns:
      out [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and lse [batch, heads_q,
      seqlen_q] float32. Both are differentiable (the lse cotangent is honoured).
    """
    return sharding.attention_forward(q, k, v, params, seq_lengths, segment_ids)


def _attention_op_fwd(q, k, v, params, seq_lengths, segment_ids):
    # Each array comes wrapped with whether it is differentiated (symbolic_zeros=True).
    q, k, v, seq_lengths, segment_ids = jax.tree.map(lambda primal: primal.value,
                                                     (q, k, v, seq_lengths, segment_ids))
    # This rule runs only when the call is differentiated: where the forward's kernels have no
    # backward twin, say so now (raise, for implementation="cute") rather than inside jax.grad.
    bodies.backward_unsupported_reason(q, k, v, params, segment_ids)
    out, lse = sharding.attention_forward(q, k, v, params, seq_lengths, segment_ids)
    return (out, lse), (q, k, v, out, lse, seq_lengths, segment_ids)


def _attention_op_bwd(params, residuals, cotangents):
    *arrays, seq_lengths, segment_ids = residuals
    d_out, d_lse = backward_cotangents(cotangents)
    grads = sharding.attention_backward(*arrays, d_out, d_lse, params, seq_lengths, segment_ids)
    return (*grads, None, None)


def backward_cotangents(cotangents):
    """(d_out, d_lse) for the backward ops from a symbolic-zeros rule's (out, lse) cotangents:
    d_out an array (zeros when only lse is differentiated, rare), d_lse None when lse is not
    differentiated."""
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    return d_out, None if isinstance(d_lse, SymbolicZero) else d_lse


attention_op.defvjp(_attention_op_fwd, _attention_op_bwd, symbolic_zeros=True)
