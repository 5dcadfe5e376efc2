"""`attention`, the full-featured entry point, and `explain`, what a call would run.

A call is validated and described once (`fa4_jax.api.validation`: its `AttentionParams` and its
`Visibility`), planned once (`fa4_jax.ops.plan`: which backend, and why), then run: on the
kernels through the differentiable op with the operands they read computed once
(`fa4_jax.runtime.operands`), or on cuDNN, or on the reference. `explain` follows the same
description and plan and reports the forward's kernel plan (`fa4_jax.runtime.dispatch`).
"""
from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp

from fa4_jax.api import validation
from fa4_jax.core import notices
from fa4_jax.core.params import AttentionParams
from fa4_jax.core.visibility import Visibility
from fa4_jax.fallbacks import cudnn
from fa4_jax.fallbacks.reference import attention_reference
from fa4_jax.ops import plan as planning
from fa4_jax.ops.vjp import attention_op
from fa4_jax.runtime import dispatch
from fa4_jax.runtime.operands import kernel_operands, kernel_view


def attention(
    query,
    key,
    value,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(None, None),
    softcap=None,
    deterministic=False,
    return_lse=False,
    implementation=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    kv_segment_ids=None,
    mask=None,
):
    """FlashAttention: `softmax(mask(softcap(scale · q kᵀ))) v`, without materialising `q kᵀ`.

    Works under `jax.jit`, `jax.grad` (a custom VJP; `lse` is differentiable too) and `jax.vmap`.
    All arguments but the arrays (query, key, value and the sequence lengths) are static Python
    values, validated when the call is traced.

    Args:
      query: [batch, seqlen_q, heads_q, head_dim].
      key: [batch, seqlen_k, heads_kv, head_dim]. heads_q must be a multiple of heads_kv
        (grouped-query attention; heads_kv == 1 is multi-query attention): query head i
        attends with kv head i // (heads_q // heads_kv).
      value: [batch, seqlen_k, heads_kv, head_dim_v]; head_dim_v may differ from head_dim.
        query, key and value share one dtype: bfloat16 or float16 (kernels or reference), or
        float32 (reference only). head_dim and head_dim_v are multiples of 8, at most 256;
        the kernels run a dim without a kernel of its own zero-padded to the narrowest wider
        compiled one (`explain` says which), the scale still 1 / sqrt(the true head_dim).
      causal: query row i sees key j when j <= i + (seqlen_k - seqlen_q), i.e. the mask is
        aligned to the bottom-right corner when seqlen_q != seqlen_k (as in FlashAttention).
        The same as window_size=(None, 0).
      softmax_scale: positive finite number multiplying q·k; None means 1 / sqrt(head_dim).
      window_size: (left, right) sliding window, each None (unbounded) or an int >= 0: row i
        sees key j when i + offset - left <= j <= i + offset + right, offset as for causal.
        With causal=True, right must be None or 0.
      softcap: None, or a positive number c: scores become c * tanh(scores / c) after the scale.
      deterministic: make the backward pass bitwise reproducible, run to run and process to
        process on one GPU model (a fixed dQ summation order, a function of the shapes and the
        SM count). Measured on an H200, forward+backward runs within 3% of the default mode at
        head dims 64 and 96, within 4.5% at 128, within 4% at 256 up to 4k keys (6% at 16k
        causal) and 3-8% behind at 192. At 192 and 256 with up to 8k keys it keeps two fp32 dQ
        accumulators, so the backward's dQ workspace (b * h * seqlen_q * head_dim * 4 bytes)
        doubles. The default adds dQ in whatever order the GPU reaches it: gradients may then
        differ in their last bits between runs. The forward is deterministic either way.
      return_lse: also return the logsumexp of each row.
      implementation: None (the kernels when they serve this call, else cuDNN where its
        semantics are this call's, else the reference, with a FallbackWarning saying why, once
        per kind of call; `explain` answers without running), "cute" (the
        CuTe-DSL kernels; a ValueError says why when they cannot serve the call) or
        "reference" (pure JAX, chunked, float32 math; any platform).
      query_seq_lengths, key_value_seq_lengths: a ragged (padded) batch. None, or an integer
        array [batch] (traced values are fine: new values need no retrace): batch entry b holds
        only its first query_seq_lengths[b] query rows and key_value_seq_lengths[b] keys, the
        rest is padding. The result is that of attending each entry on its own, truncated to
        its lengths: masks (causal, window) are bottom-right aligned to the valid lengths
        (offset = key_value_seq_lengths[b] - query_seq_lengths[b]); padded rows have out 0 and
        lse -inf and padded keys get zero gradient. Either may be given alone (the other means
        the full length). Values are clamped to [0, seqlen_q] and [0, seqlen_k]. The kernels
        serve ragged calls (they read each entry's lengths); the padding may hold anything,
        NaN included: it is zeroed before the kernels see it, one extra pass over q, k, v (and
        d_out in the backward). For packed sequences see `varlen_attention`.
      query_segment_ids, kv_segment_ids: None, or integer arrays [batch, seqlen_q] and
        [batch, seqlen_k] (both or neither; traced values are fine): documents packed into
        one row, as MaxText and Levanter pack them. Query row i sees key j only when their ids
        are equal, on top of every other mask (causal and windows keep their alignment to the
        whole row). Segments need not be contiguous. Padding is a segment that matches nothing:
        give padding queries and keys ids no real token has (e.g. -1 and -2); a row that sees
        no key has out 0 and lse -inf. The kernels read the ids (forward and backward): key
        blocks that share no segment with a query tile are skipped, and only the blocks at
        segment boundaries compare ids. The skipping assumes each id's keys (and queries) form
        one run, as packing gives them; non-contiguous segments are correct, and slower.
      mask: None, or a bool array broadcastable to [batch, heads_q, seqlen_q, seqlen_k] (each
        axis that size or 1; True: the pair is visible), on top of every other mask. One shared
        by all heads (axis 1 of size 1) runs on the kernels: they read it packed to 32 keys a
        word, skip the key blocks it hides from a whole query tile, run those it shows whole
        unmasked, and read bits only on the rest (`fa4_jax.runtime.mask_bits`); so does a per-head
        mask, each (batch, head) run as an entry of its own (a copy of q, k, v and out, kv heads
        repeated to the query heads'). Unlike `dot_product_attention`, a row the mask hides entirely has out 0
        and lse -inf, like every row that sees no key here.

    Returns:
      out: [batch, seqlen_q, heads_q, head_dim_v] in the input dtype; and, when return_lse,
      lse: [batch, heads_q, seqlen_q] float32, natural log of the sum of exp(scores) over the
      visible keys. A row that sees no key (causal with seqlen_q > seqlen_k, a window, a padded
      row) has out 0 and lse -inf, and contributes no gradient.

    Raises:
      TypeError / ValueError naming the offending argument and the rule it breaks.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (2, 1024, 8, 128), jnp.bfloat16)
      >>> kv = jax.random.normal(jax.random.key(1), (2, 1024, 2, 128), jnp.bfloat16)
      >>> out, lse = attention(q, kv, kv, causal=True, return_lse=True)
      >>> out.shape, lse.shape
      ((2, 1024, 8, 128), (2, 8, 1024))
    """
    return run(
        query, key, value, return_lse=return_lse, implementation=implementation, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        deterministic=deterministic, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, query_segment_ids=query_segment_ids,
        kv_segment_ids=kv_segment_ids, mask=mask)


def run(query, key, value, *, return_lse, implementation, bias=None, top_left=False, **options):
    """`attention` (its keywords in `options`), with the masks aligned top-left when `top_left`
    (the drop-in's rule) and an additive `bias` (the drop-in's and Flax's; the reference runs
    it): out, or (out, lse) when return_lse."""
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    validation.check_bool("return_lse", return_lse)
    params, visibility = validation.describe_call(query, key, value, implementation=implementation,
                                                  top_left=top_left, **options)
    bias = validation.check_score_array("bias", query, key, bias)
    plan = planning.plan(query, key, value, params, visibility, implementation=implementation,
                         return_lse=return_lse, bias=bias)
    out, lse = _run(query, key, value, plan, visibility, bias)
    return (out, lse) if return_lse else out


def _run(query, key, value, plan: planning.Plan, visibility: Visibility, bias):
    """(out, lse) of a planned call; lse None on cuDNN (planned only when lse is not returned)."""
    params = plan.params
    if 0 in (query.shape[0], query.shape[1], key.shape[1]):
        # An empty batch, no rows, or no keys (every row then sees none: out 0, lse -inf, no
        # gradient, as jax.nn.dot_product_attention gives zeros): no kernel or reference tiles
        # an empty axis.
        out = jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype)
        return out, jnp.full((query.shape[0], query.shape[2], query.shape[1]), -jnp.inf, jnp.float32)
    if plan.reason is not None:
        notices.fallback(planning.BACKEND_NAMES[plan.backend], plan.reason,
                         notices.shape_class(query, value, params))
    if plan.backend == "cudnn":
        return cudnn.attention(query, key, value, params), None
    if plan.backend == "reference" and (bias is not None or visibility.segmented or visibility.masked):
        return _reference_with_arrays(query, key, value, params, visibility, bias)
    if visibility.per_head_mask:
        return _per_head_mask_attention(query, key, value, params, visibility)
    # The span tables (and a mask's bits) once, for the forward and its backward.
    kernel_params, operands = kernel_operands(visibility, params, *query.shape[:2], key.shape[1])
    return attention_op(query, key, value, kernel_params, operands)


def _per_head_mask_attention(query, key, value, params: AttentionParams, visibility: Visibility):
    """(out, lse) of a call whose mask differs between heads, on the kernels: the kernels read one
    mask per batch entry, so each (batch, head) becomes an entry of its own, [b · h, s, 1, d]
    (kv heads repeated to the query heads', segment ids and lengths to each head), and the
    results are put back. The price is a copy of q, k, v and out (and of their gradients)
    around kernels that skip what the mask hides, where the reference computes every score in
    float32."""
    batch, seqlen_q, heads, _ = query.shape
    head_dim_v = value.shape[-1]

    def fold(x):
        if x.shape[2] != heads:
            x = jnp.repeat(x, heads // x.shape[2], axis=2)
        return x.transpose(0, 2, 1, 3).reshape(batch * heads, x.shape[1], 1, x.shape[3])

    def per_head(x):
        return None if x is None else jnp.repeat(x, heads, axis=0)

    mask = jnp.broadcast_to(visibility.mask, (batch, heads) + visibility.mask.shape[2:])
    folded = dataclasses.replace(
        visibility, mask=mask.reshape((batch * heads, 1) + mask.shape[2:]),
        query_segment_ids=per_head(visibility.query_segment_ids),
        kv_segment_ids=per_head(visibility.kv_segment_ids),
        query_lengths=per_head(visibility.query_lengths), key_lengths=per_head(visibility.key_lengths))
    query, key, value = fold(query), fold(key), fold(value)
    kernel_params, operands = kernel_operands(folded, params, batch * heads, seqlen_q, key.shape[1])
    out, lse = attention_op(query, key, value, kernel_params, operands)
    out = out.reshape(batch, heads, seqlen_q, head_dim_v).transpose(0, 2, 1, 3)
    return out, lse.reshape(batch, heads, seqlen_q)


def _reference_with_arrays(query, key, value, params: AttentionParams, visibility: Visibility, bias):
    """(out, lse) of a call with a mask, bias or segment ids, on the chunked reference in
    float32, differentiated as it is (it never holds more than one score tile per chunk)."""
    return attention_reference(
        query, key, value, softmax_scale=params.softmax_scale, causal=params.causal,
        window_left=params.window_left, window_right=params.window_right, softcap=params.softcap,
        top_left=params.top_left, mask=visibility.mask, bias=bias,
        query_segment_ids=visibility.query_segment_ids, kv_segment_ids=visibility.kv_segment_ids,
        query_seq_lengths=visibility.query_lengths, key_value_seq_lengths=visibility.key_lengths,
        compute_dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `attention` does with a call, from `explain`.

    backend: "cute" (fa4_jax's kernels), "cudnn" or "reference".
    reason: why not the kernels (the FallbackWarning's text), None when they run it or when
      implementation="reference" asked for the reference.
    forward_variant, backward_variant: the compiled kernels' names, when the kernels run it
      (the backward's for the call's own shapes; None when it would fall back).
    head_dims: the (head_dim, head_dim_v) of those kernels: the call's own, or (padded=True)
      the narrowest wider compiled ones, which run it zero-padded on the head-dim axis.
    split_kv, pack_gqa: the forward runs the keys as this many chunks, the query heads of each
      key/value head as one tile's rows (decode-sized calls).
    """

    backend: str
    reason: str | None = None
    forward_variant: str | None = None
    backward_variant: str | None = None
    head_dims: tuple[int, int] | None = None
    padded: bool = False
    split_kv: int = 1
    pack_gqa: bool = False

    def __str__(self) -> str:
        if self.backend != "cute":
            return f"{self.backend}: {self.reason or 'asked for'}"
        padded = ""
        if self.padded:
            padded = f", zero-padded to head dims {self.head_dims[0]}/{self.head_dims[1]}"
        chunks = f", keys split in {self.split_kv}" if self.split_kv > 1 else ""
        packed = ", GQA-packed" if self.pack_gqa else ""
        backward = self.backward_variant or "the reference backward"
        return f"cute: {self.forward_variant} (backward {backward}){padded}{chunks}{packed}"


def explain(query, key, value, **options) -> Explanation:
    """Which backend and kernels `attention` with these arguments runs, and why, without
    running it.

    Arguments are `attention`'s (a TypeError names one it does not take); query, key and value
    may be arrays or `jax.ShapeDtypeStruct`s, and so may the lengths, segment ids and mask. Raises what
    `attention` raises for the same arguments.

    Example:
      >>> q = jax.ShapeDtypeStruct((1, 4096, 16, 88), jnp.bfloat16)
      >>> print(fa4_jax.explain(q, q, q, causal=True))   # on an H200
      cute: fwd_sm90a_bf16_d96_dv96_causal (backward bwd_sm90a_bf16_d96_dv96_causal), zero-padded to head dims 96/96
    """
    call = _ATTENTION_SIGNATURE.bind(query, key, value, **options)
    call.apply_defaults()
    arguments = dict(call.arguments)
    query, key, value = (validation.shaped(arguments.pop(name)) for name in ("query", "key", "value"))
    return_lse, implementation = arguments.pop("return_lse"), arguments.pop("implementation")
    validation.check_bool("return_lse", return_lse)
    params, visibility = validation.describe_call(query, key, value, implementation=implementation,
                                                  **arguments)
    plan = planning.plan(query, key, value, params, visibility, implementation=implementation,
                         return_lse=return_lse)
    if plan.backend != "cute":
        return Explanation(plan.backend, plan.reason)
    params, kinds = kernel_view(visibility, plan.params)
    forward = dispatch.forward_plan(query, key, value, params, kinds)
    backward = None
    if params.backward_reason is None:
        backward = dispatch.backward_variant(query, key, value, params, kinds).name
    padded = forward.head_dims != (query.shape[-1], value.shape[-1])
    return Explanation("cute", None, forward.variant.name, backward, forward.head_dims, padded,
                       forward.split_kv, forward.pack_gqa)


_ATTENTION_SIGNATURE = inspect.signature(attention)


def which_backend(query, key, value, **options) -> tuple[str, str | None]:
    """(`explain(...).backend`, `explain(...).reason`): which backend `attention` with these
    arguments runs on, and why not the kernels ("reference", None when implementation=
    "reference" asked for it)."""
    explanation = explain(query, key, value, **options)
    return explanation.backend, explanation.reason


def attention_params(
    query,
    key,
    value,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(None, None),
    softcap=None,
    deterministic=False,
    implementation=None,
):
    """The validated, planned `AttentionParams` of `attention(query, key, value, ...)` on the
    kernels or the reference (never cuDNN, which returns no differentiable logsumexp).

    Same arguments (query, key, value as arrays) and the same errors as `attention`, sequence
    lengths aside (they are operands, not parameters); for entry points that run the attention
    ops themselves (`ring_attention`).
    """
    params, visibility = validation.describe_call(
        query, key, value, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, deterministic=deterministic, implementation=implementation)
    plan = planning.plan(query, key, value, params, visibility, implementation=implementation,
                         cudnn=False)
    if plan.reason is not None:
        notices.fallback(planning.BACKEND_NAMES["reference"], plan.reason,
                         notices.shape_class(query, value, plan.params))
    return plan.params
