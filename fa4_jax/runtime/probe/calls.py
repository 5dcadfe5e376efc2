"""A probe problem as a kernel launch: the operands, results, workspaces and Fa4Args scalars the
handlers pass for the same call (ffi/forward.cc, ffi/backward.cc), with the shapes that
`fa4_jax.runtime.ffi.forward_call` and `backward_call` give XLA.

Empty operands (a dense call's lengths, an absent d_lse) are zero-element arrays: the launch
passes them as null pointers, and so does the handler for a dense call's segment operands.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from fa4_jax.abi import routing
from fa4_jax.abi.workspace import BWD_SEMAPHORE_ROWS, BWD_SEQ_PAD
from fa4_jax.runtime.probe import problems
from fa4_jax.runtime.probe.cases import Case

# Segment operands in the order fa4_jax.runtime.segments / fa4_jax.runtime.mask_bits return them.
_SEGMENT_FIELDS = ("q_segment_ids", "kv_segment_ids", "row_spans", "key_spans", "mask_bits")


@dataclasses.dataclass
class KernelCall:
    """inputs: Fa4Args pointer field -> host array to upload. results: field -> (shape, dtype)
    to read back. workspaces: field -> (shape, dtype), neither uploaded nor read. scalars: the
    other Fa4Args fields."""

    inputs: dict
    results: dict
    workspaces: dict
    scalars: dict


def kernel_window(params, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The window bounds the kernels take (ffi/common.cc's KernelWindow): for a "local" call an
    unbounded side is max(sq, sk) and wider bounds are clamped to it, causal is a right bound of
    0; (0, 0) for the other mask kinds."""
    if routing.mask_kind(params.causal, params.window_left, params.window_right) != "local":
        return 0, 0
    unbounded = max(seqlen_q, seqlen_k)
    left = unbounded if params.window_left is None else min(params.window_left, unbounded)
    right = 0 if params.causal else unbounded if params.window_right is None else min(params.window_right, unbounded)
    return left, right


def _lengths(case: Case) -> dict:
    """seq_used_q, seq_used_k: int32 [b], or empty for a dense call."""
    ragged = case.problem.lengths is not None
    return {"seq_used_q": (case.inputs.q_len if ragged else np.zeros(0)).astype(np.int32),
            "seq_used_k": (case.inputs.kv_len if ragged else np.zeros(0)).astype(np.int32)}


def _segments(operands) -> tuple[dict, dict]:
    """The segment operands as Fa4Args fields, and their dims (ffi/common.cc's CheckSegments)."""
    if operands is None:
        return {}, {}
    q_ids, kv_ids, row_spans, key_spans, *bits = operands
    dims = {"b_segments": q_ids.shape[0], "q_chunks": row_spans.shape[1], "k_chunks": key_spans.shape[1]}
    if bits:
        dims.update(b_mask=bits[0].shape[0], k_words=bits[0].shape[2])
    return dict(zip(_SEGMENT_FIELDS, operands)), dims


def _common(case: Case, operands) -> tuple[dict, dict]:
    """The inputs and scalars both kinds pass: q, k, v, the lengths, the segment operands."""
    inputs = case.inputs
    b, sq, h, _ = inputs.q.shape
    sk, hk = inputs.k.shape[1:3]
    segment_inputs, segment_dims = _segments(operands)
    params = case.params
    left, right = kernel_window(params, sq, sk)
    lengths = _lengths(case)
    scalars = dict(b=b, seqlen_q=sq, seqlen_k=sk, heads=h, heads_k=hk,
                   b_lengths=lengths["seq_used_q"].shape[0], softmax_scale=params.softmax_scale,
                   softcap=params.softcap or 0.0, window_left=left, window_right=right,
                   top_left=int(params.top_left), **segment_dims)
    return {"q": inputs.q, "k": inputs.k, "v": inputs.v, **lengths, **segment_inputs}, scalars


def forward_call(case: Case) -> KernelCall:
    """Results out [b, sq, h, dv] (q's dtype), lse [b, h, sq] float32."""
    inputs, scalars = _common(case, case.operands)
    b, sq, h, _ = case.inputs.q.shape
    dv = case.inputs.v.shape[-1]
    results = {"out": ((b, sq, h, dv), case.inputs.q.dtype), "lse": ((b, h, sq), np.float32)}
    return KernelCall(inputs, results, {}, scalars)


def backward_call(case: Case, deterministic: bool, dq_copies: int, num_sms: int,
                  segments_tile_m: int) -> KernelCall:
    """Results dq, dk, dv (like q, k, v); the fp32 workspaces dq_accum [copies, b, h, sq_pad, d],
    dpsum and lse_log2 [b, h, sq_pad], semaphore int32 [copies, b, h, sq_pad / 64]. out and lse
    are the exact reference's (out in q's dtype), so the verdict does not depend on a forward
    kernel. A deterministic call with segment operands walks the key spans of
    `fa4_jax.runtime.segments.deterministic_walk` at the variant's query tile (`segments_tile_m`), as
    fa4_jax.runtime.dispatch passes them."""
    operands = case.operands
    if deterministic and operands is not None:
        operands = _deterministic_walk(operands, segments_tile_m)
    inputs, scalars = _common(case, operands)
    (out, lse), _ = case.forward()
    q, k, v = case.inputs.q, case.inputs.k, case.inputs.v
    b, sq, h, d = q.shape
    sq_pad = -(-sq // BWD_SEQ_PAD) * BWD_SEQ_PAD
    d_lse = case.inputs.d_lse
    inputs.update(out=out.astype(q.dtype), d_out=case.inputs.d_out, lse=lse.astype(np.float32),
                  d_lse=np.zeros((0, h, sq), np.float32) if d_lse is None else d_lse)
    results = {"dq": (q.shape, q.dtype), "dk": (k.shape, k.dtype), "dv": (v.shape, v.dtype)}
    workspaces = {"dq_accum": ((dq_copies, b, h, sq_pad, d), np.float32),
                  "dpsum": ((b, h, sq_pad), np.float32), "lse_log2": ((b, h, sq_pad), np.float32),
                  "semaphore": ((dq_copies, b, h, sq_pad // BWD_SEMAPHORE_ROWS), np.int32)}
    scalars.update(b_dlse=0 if d_lse is None else b, seqlen_q_pad=sq_pad,
                   semaphore_blocks=sq_pad // BWD_SEMAPHORE_ROWS, dq_copies=dq_copies,
                   deterministic=int(deterministic), num_sms=num_sms)
    return KernelCall(inputs, results, workspaces, scalars)


def _deterministic_walk(operands, tile_m: int):
    import jax.numpy as jnp

    from fa4_jax.runtime import segments

    q_ids, kv_ids, row_spans, key_spans, *bits = operands
    walk = segments.deterministic_walk(jnp.asarray(row_spans), jnp.asarray(key_spans), tile_m)
    return (q_ids, kv_ids, row_spans, np.asarray(walk, np.int32), *bits)


def dq_copies(manifest_rule: dict, variant: routing.Variant, problem: problems.Problem) -> int:
    """The dQ accumulators fa4_jax.runtime.dispatch gives this backward call (routing.dq_copies)."""
    return routing.dq_copies(manifest_rule.get(variant.arch, {}), variant.head_dim, problem.seqlen_k,
                             problem.deterministic)
