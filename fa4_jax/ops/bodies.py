"""The single-device attention forward and backward, dispatched on `params.implementation`.

These are the per-shard bodies: `fa4_jax.ops.sharding` runs them on each device's block of the
inputs, so what runs here never sees a collective. With implementation "cute" the forward runs
the compiled kernels (`dispatch.forward`), and so does the backward unless the call's plan found
no backward kernel (`params.backward_reason`); the reference backward recomputes attention
through the pure-JAX reference in float32 and takes its VJP, honouring the same contract (see
`backward`). `params.deterministic` reaches the backward kernel as a static attribute; the
reference is deterministic anyway (no atomics).

`operands` (`KernelOperands`) hold what the call passes beside q, k and v: a ragged batch's
lengths, segment ids and their span tables, a mask's bits. The kernels read them all; the
reference masks with the lengths, the ids, and the bits unpacked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fa4_jax.core import notices
from fa4_jax.core.params import AttentionParams
from fa4_jax.fallbacks.reference import attention_reference
from fa4_jax.runtime import dispatch, mask_bits
from fa4_jax.runtime.operands import KernelOperands


def forward(q, k, v, params: AttentionParams, operands: KernelOperands = KernelOperands()):
    """(out, lse) of one device's inputs; shapes as `vjp.attention_op`."""
    if params.implementation == "cute":
        return dispatch.forward(q, k, v, params, operands)
    return _reference_fp32(q, k, v, params, operands)


def say_backward_fallback(q, v, params: AttentionParams) -> None:
    """Where the call's plan found no backward kernel for a forward that runs on the kernels:
    raised for implementation="cute", said once otherwise (when the call is differentiated)."""
    if params.implementation != "cute" or params.backward_reason is None:
        return
    if params.require_kernels:
        raise ValueError(f"implementation='cute' cannot run the backward of this call: {params.backward_reason}")
    notices.fallback("the reference backward (pure JAX, float32)", params.backward_reason,
                     notices.shape_class(q, v, params))


def backward(q, k, v, out, lse, d_out, d_lse, params: AttentionParams,
             operands: KernelOperands = KernelOperands()):
    """(dq, dk, dv) of one device's inputs, each in its input's dtype.

    FlashAttention's backward contract: `out` and `lse` are the softmax statistics the
    gradient is taken at, trusted rather than recomputed. They are this op's own outputs, or
    (ring attention) those of a longer key sequence of which k, v are one block; then the
    result is this block's share of the gradient, as the kernels compute it from
    P = exp(scores - lse) and D = rowsum(d_out * out).

    Args:
      q, k, v: the forward's inputs, shapes as `vjp.attention_op`.
      out: [batch, seqlen_q, heads_q, head_dim_v]; lse: [batch, heads_q, seqlen_q] float32.
      d_out: the cotangent of out, like out; d_lse: the cotangent of lse, like lse, or None
        when lse is not differentiated (zero).
      operands: as for the forward; the ring contract holds per entry of a ragged batch (rows
        past its query length have block lse -inf, so weight 0 and zero gradient).
    """
    if params.implementation == "cute" and params.backward_reason is None:
        return dispatch.backward(q, k, v, out, lse, d_out, d_lse, params, operands)
    return _reference_backward(q, k, v, out, lse, d_out, d_lse, params, operands)


def _reference_backward(q, k, v, out, lse, d_out, d_lse, params, operands):
    # The VJP of the fp32 reference on this block, whose own
    # (block_out, block_lse) enter the given statistics as out = Σ_blocks w · block_out,
    # lse = log Σ_blocks exp(block_lse), with w = exp(block_lse - lse). The chain rule maps
    # the cotangents onto the block: w · d_out, and w · (d_lse + <d_out, block_out - out>).
    # For the op's own statistics w = 1 and the inner product is 0.
    (block_out, block_lse), reference_vjp = jax.vjp(
        lambda q, k, v: _reference_fp32(q, k, v, params, operands), q, k, v
    )
    weight = jnp.where(block_lse == -jnp.inf, 0.0, jnp.exp(block_lse - lse))
    weight_by_row = jnp.swapaxes(weight, 1, 2)[..., None]  # out's layout
    d_out_f32 = d_out.astype(jnp.float32)
    own_share = jnp.sum(d_out_f32 * (block_out.astype(jnp.float32) - out), axis=-1)
    d_block_out = (weight_by_row * d_out_f32).astype(d_out.dtype)
    d_block_lse = weight * (jnp.swapaxes(own_share, 1, 2) + (0.0 if d_lse is None else d_lse))
    dq, dk, dv = reference_vjp((d_block_out, d_block_lse))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _reference_fp32(q, k, v, params, operands: KernelOperands):
    mask = None
    if operands.mask_array:
        mask = mask_bits.unpack(operands.mask_bits, k.shape[1])[:, None]
    return attention_reference(
        q,
        k,
        v,
        softmax_scale=params.softmax_scale,
        causal=params.causal,
        window_left=params.window_left,
        window_right=params.window_right,
        softcap=params.softcap,
        top_left=params.top_left,
        query_seq_lengths=operands.query_lengths,
        key_value_seq_lengths=operands.key_lengths,
        query_segment_ids=operands.query_segment_ids,
        kv_segment_ids=operands.kv_segment_ids,
        mask=mask,
        compute_dtype=jnp.float32,
    )
