"""The differentiable attention op: a custom VJP over the partitioned forward and backward ops.

Both passes go through `sharding.py`, so under `jax.jit` with sharded inputs each device runs
the single-device body of `backends.py` on its block (batch and heads), and under `jax.vmap`
the mapped axes fold into batch. The residuals are what the backward kernels need:
(q, k, v, out, lse), and a ragged batch's valid lengths.
"""
from __future__ import annotations

import functools

import jax

from fa4_jax import sharding
from fa4_jax.params import AttentionParams


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_op(q, k, v, params: AttentionParams, seq_lengths=None):
    """Attention of validated inputs on `params.implementation`.

    Args:
      q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
      v: [batch, seqlen_k, heads_kv, head_dim_v]; one dtype for all three.
      params: the static options (hashable, not differentiated).
      seq_lengths: None, or (q_len, kv_len) of a ragged batch: int32 [batch] each, values
        in [0, seqlen_q] and [0, seqlen_k]; integers, so their cotangent is None.

    Returns:
      out [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and lse [batch, heads_q,
      seqlen_q] float32. Both are differentiable (the lse cotangent is honoured).
    """
    return sharding.attention_forward(q, k, v, params, seq_lengths)


def _attention_op_fwd(q, k, v, params, seq_lengths):
    out, lse = sharding.attention_forward(q, k, v, params, seq_lengths)
    return (out, lse), (q, k, v, out, lse, seq_lengths)


def _attention_op_bwd(params, residuals, cotangents):
    *arrays, seq_lengths = residuals
    d_out, d_lse = cotangents
    grads = sharding.attention_backward(*arrays, d_out, d_lse, params, seq_lengths)
    return (*grads, None)


attention_op.defvjp(_attention_op_fwd, _attention_op_bwd)
