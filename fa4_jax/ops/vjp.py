"""The differentiable attention op: a custom VJP over the partitioned forward and backward ops.

Both passes go through `sharding.py`, so under `jax.jit` with sharded inputs each device runs
the single-device body of `bodies.py` on its block (batch and heads), and under `jax.vmap`
the mapped axes fold into batch. The residuals are what the backward kernels need:
(q, k, v, out, lse) and the call's `KernelOperands` (lengths, segment ids, span tables, a
mask's bits: whichever it passes).

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

from fa4_jax.core.params import AttentionParams
from fa4_jax.ops import bodies, sharding
from fa4_jax.runtime.operands import KernelOperands


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_op(q, k, v, params: AttentionParams, operands: KernelOperands = KernelOperands()):
    """Attention of validated inputs on `params.implementation`.

    Args:
      q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
      v: [batch, seqlen_k, heads_kv, head_dim_v]; one dtype for all three.
      params: the static options (hashable, not differentiated), as the call's plan resolved
        them (`fa4_jax.ops.plan`).
      operands: the arrays the kernels read beside q, k and v (`KernelOperands`: a ragged
        batch's lengths, segment ids and their span tables, a mask's bits), computed once for
        both passes; integers, so their cotangent is None.

    Returns:
      out [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and lse [batch, heads_q,
      seqlen_q] float32. Both are differentiable (the lse cotangent is honoured).
    """
    return sharding.attention_forward(q, k, v, params, operands)


def _attention_op_fwd(q, k, v, params, operands):
    # Each array comes wrapped with whether it is differentiated (symbolic_zeros=True).
    q, k, v, operands = jax.tree.map(lambda primal: primal.value, (q, k, v, operands))
    # This rule runs only when the call is differentiated: where the forward's kernels have no
    # backward twin, say so now (raise, for implementation="cute") rather than inside jax.grad.
    bodies.say_backward_fallback(q, v, params)
    out, lse = sharding.attention_forward(q, k, v, params, operands)
    return (out, lse), (q, k, v, out, lse, operands)


def _attention_op_bwd(params, residuals, cotangents):
    *arrays, operands = residuals
    d_out, d_lse = backward_cotangents(cotangents)
    grads = sharding.attention_backward(*arrays, d_out, d_lse, params, operands)
    return (*grads, None)


def backward_cotangents(cotangents):
    """(d_out, d_lse) for the backward ops from a symbolic-zeros rule's (out, lse) cotangents:
    d_out an array (zeros when only lse is differentiated, rare), d_lse None when lse is not
    differentiated."""
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    return d_out, None if isinstance(d_lse, SymbolicZero) else d_lse


attention_op.defvjp(_attention_op_fwd, _attention_op_bwd, symbolic_zeros=True)
