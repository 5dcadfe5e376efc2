"""The single-device attention forward and backward, dispatched on `params.implementation`.

These are the per-shard bodies: `sharding.py` runs them on each device's block of the inputs,
so what runs here never sees a collective. With implementation "cute" both passes run the
compiled kernels (`dispatch.forward`, `dispatch.backward`); the reference backward recomputes
attention through the pure-JAX reference in float32 and takes its VJP, honouring the same
contract (see `backward`). `params.deterministic` reaches the backward kernel as a static
attribute; the reference is deterministic anyway (no atomics).

`seq_lengths` is None, or (q_len, kv_len): int32 [batch] valid lengths of a ragged batch
(semantics in `AttentionParams`). Both backends take them: the kernels through their
seq_used_q / seq_used_k operands, the reference through its masks. `segment_ids` is None, or
the four segment operands (`fa4_jax.runtime.segments.operands`: q_ids [batch, seqlen_q], kv_ids
[batch, seqlen_k] int32 and their span tables): a row sees only the keys of its own id; the
kernels read all four (the segments variants), the reference masks with the ids. With a fifth,
a boolean mask's bits (`fa4_jax.runtime.mask_bits.operands`), the mask_array variants read all five and
the reference masks with the bits unpacked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fa4_jax.runtime import dispatch, mask_bits
from fa4_jax.core import notices
from fa4_jax.core.params import AttentionParams
from fa4_jax.fallbacks.reference import attention_reference


def forward(q, k, v, params: AttentionParams, seq_lengths=None, segment_ids=None):
    """(out, lse) of one device's inputs; shapes as `vjp.attention_op`."""
    if params.implementation == "cute":
        return dispatch.forward(q, k, v, params, seq_lengths, segment_ids)
    return _reference_fp32(q, k, v, params, seq_lengths, segment_ids)


def backward_unsupported_reason(q, k, v, params: AttentionParams, segment_ids=None) -> str | None:
    """Why a call whose forward runs on the kernels would have to take the reference backward:
    raised for implementation="cute", said once otherwise; None when the kernels serve it.
    segment_ids: the call's segment operands, or None."""
    if params.implementation != "cute":
        return None
    segments, mask_array = dispatch.filter_kinds(segment_ids)
    reason = dispatch.unsupported_reason(q, k, v, params, "bwd", segments=segments, mask_array=mask_array)
    if reason is None:
        return None
    if params.require_kernels:
        raise ValueError(f"implementation='cute' cannot run the backward of this call: {reason}")
    notices.fallback("the reference backward (pure JAX, float32)", reason, notices.shape_class(q, v, params))
    return reason


def backward(q, k, v, out, lse, d_out, d_lse, params: AttentionParams, seq_lengths=None,
             segment_ids=None):
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
      seq_lengths: None or (q_len, kv_len), as for the forward; the ring contract holds per
        entry (rows past q_len have block lse -inf, so weight 0 and zero gradient).
      segment_ids: None or the segment operands, as for the forward.
    """
    segments, mask_array = dispatch.filter_kinds(segment_ids)
    if (params.implementation == "cute"
            and dispatch.unsupported_reason(q, k, v, params, "bwd", segments=segments,
                                            mask_array=mask_array) is None):
        return dispatch.backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths, segment_ids)
    return _reference_backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths, segment_ids)


def _reference_backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths, segment_ids=None):
    # The VJP of the fp32 reference on this block, whose own
    # (block_out, block_lse) enter the given statistics as out = Σ_blocks w · block_out,
    # lse = log Σ_blocks exp(block_lse), with w = exp(block_lse - lse). The chain rule maps
    # the cotangents onto the block: w · d_out, and w · (d_lse + <d_out, block_out - out>).
    # For the op's own statistics w = 1 and the inner product is 0.
    (block_out, block_lse), reference_vjp = jax.vjp(
        lambda q, k, v: _reference_fp32(q, k, v, params, seq_lengths, segment_ids), q, k, v
    )
    weight = jnp.where(block_lse == -jnp.inf, 0.0, jnp.exp(block_lse - lse))
    weight_by_row = jnp.swapaxes(weight, 1, 2)[..., None]  # out's layout
    d_out_f32 = d_out.astype(jnp.float32)
    own_share = jnp.sum(d_out_f32 * (block_out.astype(jnp.float32) - out), axis=-1)
    d_block_out = (weight_by_row * d_out_f32).astype(d_out.dtype)
    d_block_lse = weight * (jnp.swapaxes(own_share, 1, 2) + (0.0 if d_lse is None else d_lse))
    dq, dk, dv = reference_vjp((d_block_out, d_block_lse))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _reference_fp32(q, k, v, params, seq_lengths, segment_ids=None):
    q_len, kv_len = (None, None) if seq_lengths is None else seq_lengths
    q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids[:2]
    mask = None
    if dispatch.filter_kinds(segment_ids)[1]:
        mask = mask_bits.unpack(segment_ids[-1], k.shape[1])[:, None]
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
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
        query_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        mask=mask,
        compute_dtype=jnp.float32,
    )
