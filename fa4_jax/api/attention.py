"""The public entry points: validate at trace time, canonicalise, choose a backend, call the op;
and `explain`, what a call would run."""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.fallbacks import cudnn
from fa4_jax.runtime import dispatch, mask_bits
from fa4_jax.core import notices
from fa4_jax.runtime import segments as segment_tables
from fa4_jax.core.params import AttentionParams
from fa4_jax.fallbacks.reference import attention_reference
from fa4_jax.ops.vjp import attention_op


_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_IMPLEMENTATIONS = (None, "cute", "reference")
_MAX_HEAD_DIM = 256
_HEAD_DIM_MULTIPLE = 8


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
    return _attention(
        query,
        key,
        value,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        return_lse=return_lse,
        implementation=implementation,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        score_arrays=_score_arrays(query, key, mask, None, query_segment_ids, kv_segment_ids),
    )


@dataclasses.dataclass(frozen=True)
class _ScoreArrays:
    """The caller's per-score operands, validated: a bool mask and an additive bias, each
    [batch | 1, heads_q | 1, seqlen_q | 1, seqlen_k | 1], and segment ids [batch, seqlen]."""

    mask: object = None
    bias: object = None
    query_segment_ids: object = None
    kv_segment_ids: object = None

    @property
    def not_read_by_kernels(self) -> str | None:
        """Why the kernels do not read these arrays, or None when they do: segment ids and a
        mask (the mask_array kernels; one that differs between heads with each (batch, head) an
        entry of its own, `_per_head_mask_attention`), not yet a bias."""
        if self.bias is not None:
            return "a bias array"
        return None

    @property
    def per_head_mask(self) -> bool:
        return self.mask is not None and self.mask.shape[1] != 1

    def kernel_call(self, params, seq_lengths, batch, seqlen_q, seqlen_k):
        """(the params and segment operands of the kernel call): segment ids' operands
        (`fa4_jax.runtime.segments.operands`), or a mask's (`fa4_jax.runtime.mask_bits.operands`: segment ids
        and the causal and window rules folded into its bits, so the params lose them)."""
        if self.mask is None:
            return params, segment_tables.operands(
                (self.query_segment_ids, self.kv_segment_ids), seq_lengths)
        mask = self.mask[:, 0]
        if self.query_segment_ids is not None:
            mask = mask & (self.query_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :])
        operands = mask_bits.operands(mask, params, seq_lengths, seqlen_q, seqlen_k, batch)
        return _folded_mask_params(params), operands


def _folded_mask_params(params):
    """A mask call's params as its kernels see them: the rules folded into the mask's bits."""
    return dataclasses.replace(params, causal=False, window_left=None, window_right=None, top_left=False)



def _score_arrays(query, key, mask, bias, query_segment_ids, kv_segment_ids):
    """A validated `_ScoreArrays`, or None when the call passes none of them."""
    if mask is None and bias is None and query_segment_ids is None and kv_segment_ids is None:
        return None
    if len(query.shape) != 4 or len(key.shape) != 4:
        return None  # `_check_arrays` names the rank error
    batch, seqlen_q, heads_q, _ = query.shape
    seqlen_k = key.shape[1]
    full = (batch, heads_q, seqlen_q, seqlen_k)
    for name, x, dtype_ok, kind in (
            ("mask", mask, lambda d: d == jnp.bool_, "bool"),
            ("bias", bias, lambda d: jnp.issubdtype(d, jnp.floating), "a floating dtype")):
        if x is None:
            continue
        x = _shaped(x)
        if x.ndim != 4 or any(n not in (1, m) for n, m in zip(x.shape, full)):
            raise ValueError(f"{name} must be broadcastable to [batch, heads_q, seqlen_q, seqlen_k] "
                             f"= {full} (each axis that size or 1), got shape {x.shape}")
        if not dtype_ok(x.dtype):
            raise TypeError(f"{name} must be {kind}, got dtype {x.dtype}")
    if (query_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both query_segment_ids and kv_segment_ids, or neither")
    for name, ids, shape in (("query_segment_ids", query_segment_ids, (batch, seqlen_q)),
                             ("kv_segment_ids", kv_segment_ids, (batch, seqlen_k))):
        if ids is None:
            continue
        ids = _shaped(ids)
        if ids.shape != shape:
            raise ValueError(f"{name} must have shape [batch, seq] = {shape}, got {ids.shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got dtype {ids.dtype}")
    return _ScoreArrays(*(None if x is None else _shaped(x)
                          for x in (mask, bias, query_segment_ids, kv_segment_ids)))


def _shaped(x):
    """x as an array, unless it already has a shape and dtype (an array, a ShapeDtypeStruct)."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _attention(
    query,
    key,
    value,
    *,
    causal,
    softmax_scale,
    window_size,
    softcap,
    deterministic,
    return_lse,
    implementation,
    query_seq_lengths,
    key_value_seq_lengths,
    top_left=False,
    score_arrays=None,
):
    """`attention`, with the masks aligned top-left when `top_left` (the drop-in's rule) and
    the caller's mask, bias or segment ids (`_ScoreArrays`) when given."""
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    ragged = query_seq_lengths is not None or key_value_seq_lengths is not None
    params, backend, reason = _plan(
        query, key, value, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_lse=return_lse,
        implementation=implementation, ragged=ragged, top_left=top_left, score_arrays=score_arrays)
    seq_lengths = None
    if ragged:
        seq_lengths = (
            _canonical_lengths("query_seq_lengths", query_seq_lengths, query.shape[:2]),
            _canonical_lengths("key_value_seq_lengths", key_value_seq_lengths, key.shape[:2]),
        )
    if 0 in (query.shape[0], query.shape[1], key.shape[1]):
        # An empty batch, no rows, or no keys (every row then sees none: out 0, lse -inf, no
        # gradient, as jax.nn.dot_product_attention gives zeros): no kernel or reference tiles
        # an empty axis.
        out = jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype)
        lse = jnp.full((query.shape[0], query.shape[2], query.shape[1]), -jnp.inf, jnp.float32)
        return (out, lse) if return_lse else out
    if score_arrays is not None and not (backend == "cute" and score_arrays.not_read_by_kernels is None):
        if reason is not None:
            notices.fallback(_BACKEND_NAMES["reference"], reason,
                             notices.shape_class(query, value, params))
        out, lse = _reference_with_score_arrays(query, key, value, params, score_arrays,
                                                query_seq_lengths, key_value_seq_lengths)
        return (out, lse) if return_lse else out
    if reason is not None:
        shape = notices.shape_class(query, value, params)
        notices.fallback(_BACKEND_NAMES[backend], reason, shape)
        if backend == "cudnn":
            return cudnn.attention(query, key, value, params)
    if score_arrays is not None and score_arrays.per_head_mask:
        given = (query_seq_lengths is not None, key_value_seq_lengths is not None)
        lengths = (None, None) if seq_lengths is None else tuple(x if g else None for x, g in zip(seq_lengths, given))
        out, lse = _per_head_mask_attention(
            query, key, value, score_arrays, lengths, causal=causal, softmax_scale=params.softmax_scale,
            window_size=window_size, softcap=softcap, deterministic=deterministic,
            implementation=implementation, top_left=top_left)
        return (out, lse) if return_lse else out
    segment_ids = None
    if score_arrays is not None:
        # Segment ids or a mask on the kernels (anything else returned above): the span tables
        # (and a mask's bits) once, for the forward and its backward (residuals of the op).
        params, segment_ids = score_arrays.kernel_call(params, seq_lengths, query.shape[0],
                                                       query.shape[1], key.shape[1])
    out, lse = attention_op(query, key, value, params, seq_lengths, segment_ids)
    return (out, lse) if return_lse else out


def _per_head_mask_attention(query, key, value, score_arrays, seq_lengths, **options):
    """(out, lse) of a call whose mask differs between heads, on the kernels: the kernels read one
    mask per batch entry, so each (batch, head) becomes an entry of its own, [b · h, s, 1, d]
    (kv heads repeated to the query heads', segment ids and lengths to each head), and the
    results are put back. The price is a copy of q, k, v and out (and of their gradients)
    around kernels that skip what the mask hides, where the reference computes every score in
    float32. seq_lengths: the call's (query, key) lengths [b], each None where not given.
    `options`: `_attention`'s keywords."""
    batch, seqlen_q, heads, _ = query.shape
    head_dim_v = value.shape[-1]

    def fold(x):
        if x.shape[2] != heads:
            x = jnp.repeat(x, heads // x.shape[2], axis=2)
        return x.transpose(0, 2, 1, 3).reshape(batch * heads, x.shape[1], 1, x.shape[3])

    def per_head(x):
        return None if x is None else jnp.repeat(x, heads, axis=0)

    mask = score_arrays.mask
    mask = jnp.broadcast_to(mask, (batch, heads) + mask.shape[2:]).reshape((batch * heads, 1) + mask.shape[2:])
    folded = dataclasses.replace(score_arrays, mask=mask, query_segment_ids=per_head(score_arrays.query_segment_ids),
                                 kv_segment_ids=per_head(score_arrays.kv_segment_ids))
    q_len, kv_len = (per_head(x) for x in seq_lengths)
    out, lse = _attention(fold(query), fold(key), fold(value), return_lse=True, query_seq_lengths=q_len,
                          key_value_seq_lengths=kv_len, score_arrays=folded, **options)
    out = out.reshape(batch, heads, seqlen_q, head_dim_v).transpose(0, 2, 1, 3)
    return out, lse.reshape(batch, heads, seqlen_q)


_BACKEND_NAMES = {"cudnn": "cuDNN (jax.nn.dot_product_attention)",
                  "reference": "the pure-JAX reference (float32 math)"}


def _reference_with_score_arrays(query, key, value, params, score_arrays, query_seq_lengths,
                                 key_value_seq_lengths):
    """(out, lse) of a call with a mask, bias or segment ids, on the chunked reference in
    float32, differentiated as it is (it never holds more than one score tile per chunk)."""
    lengths = {}
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        lengths = dict(
            query_seq_lengths=_canonical_lengths("query_seq_lengths", query_seq_lengths, query.shape[:2]),
            key_value_seq_lengths=_canonical_lengths("key_value_seq_lengths", key_value_seq_lengths,
                                                     key.shape[:2]))
    return attention_reference(
        query, key, value, softmax_scale=params.softmax_scale, causal=params.causal,
        window_left=params.window_left, window_right=params.window_right, softcap=params.softcap,
        top_left=params.top_left, mask=score_arrays.mask, bias=score_arrays.bias,
        query_segment_ids=score_arrays.query_segment_ids,
        kv_segment_ids=score_arrays.kv_segment_ids, compute_dtype=jnp.float32, **lengths)


def _plan(query, key, value, *, return_lse, ragged, score_arrays=None, **options):
    """(the validated, canonical params, "cute" | "cudnn" | "reference", why not the kernels or
    None) of a call: cuDNN where the kernels do not serve it and its semantics are the call's,
    else the reference (always, for a call with score arrays, `_ScoreArrays`).
    `options`: `_params_and_fallback`'s."""
    _check_bool("return_lse", return_lse)
    params, reason = _params_and_fallback(query, key, value, ragged=ragged,
                                          score_arrays=score_arrays, **options)
    if reason is None or score_arrays is not None:
        return params, params.implementation, reason
    compute_capability = dispatch.compute_capability()
    cudnn_reason = cudnn.unsupported_reason(query, key, value, params, ragged, return_lse,
                                            compute_capability)
    if cudnn_reason is None:
        return params, "cudnn", reason
    if compute_capability is not None:
        reason = f"{reason}; not cuDNN: {cudnn_reason}"
    return params, "reference", reason


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
    lengths = [arguments.pop(n) for n in ("query_seq_lengths", "key_value_seq_lengths")]
    segment_ids = [arguments.pop(n) for n in ("query_segment_ids", "kv_segment_ids")]
    mask = arguments.pop("mask")
    score_arrays = _score_arrays(query, key, mask, None, *segment_ids)
    params, backend, reason = _plan(
        ragged=any(x is not None for x in lengths), score_arrays=score_arrays, **arguments)
    if backend != "cute":
        return Explanation(backend, reason)
    ragged = any(x is not None for x in lengths)
    segmented = score_arrays is not None
    masked = segmented and score_arrays.mask is not None
    if masked:
        params = _folded_mask_params(params)
    filters = dict(segments=segmented, mask_array=masked)
    plan = dispatch.explain_forward(query, key, value, params, ragged, **filters)
    backward = None
    if dispatch.unsupported_reason(query, key, value, params, "bwd", **filters) is None:
        backward = dispatch.explain_variant(query, key, value, params, "bwd", ragged, **filters).name
    padded = plan.head_dims != (query.shape[-1], value.shape[-1])
    return Explanation("cute", None, plan.variant.name, backward, plan.head_dims, padded,
                       plan.split_kv, plan.pack_gqa)


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
    """The validated, canonical `AttentionParams` of `attention(query, key, value, ...)` on the
    kernels or the reference (never cuDNN, which returns no differentiable logsumexp).

    Same arguments (query, key, value as arrays) and the same errors as `attention`, sequence
    lengths aside (they are operands, not parameters); for entry points that run the attention
    ops themselves (`ring_attention`).
    """
    params, reason = _params_and_fallback(
        query, key, value, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, deterministic=deterministic, implementation=implementation)
    if reason is not None:
        notices.fallback("the pure-JAX reference (float32 math)", reason,
                         notices.shape_class(query, value, params))
    return params


def _params_and_fallback(
    query,
    key,
    value,
    *,
    causal,
    softmax_scale,
    window_size,
    softcap,
    deterministic,
    implementation,
    top_left=False,
    ragged=False,
    score_arrays=None,
):
    """(the validated, canonical params, why the kernels do not serve the call or None)."""
    _check_arrays(query, key, value)
    window_left, window_right = _check_window(window_size)
    _check_bool("causal", causal)
    _check_bool("deterministic", deterministic)
    if causal and window_right is not None and window_right > 0:
        raise ValueError(
            f"window_size right must be None or 0 when causal=True (causal means a right window "
            f"of 0), got window_size={tuple(window_size)}"
        )
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}"
        )
    # One canonical form for "right bound on the diagonal", so kernels dispatch on `causal`.
    causal = bool(causal) or window_right == 0
    masked = causal or window_left is not None or window_right is not None
    # The alignment matters only under a mask, and not when both corners share a diagonal
    # (equal lengths, one for every entry): one canonical form for the kernels.
    top_left = bool(top_left) and masked and (ragged or query.shape[1] != key.shape[1])
    params = AttentionParams(
        softmax_scale=_canonical_scale(softmax_scale, query.shape[-1]),
        causal=causal,
        window_left=window_left,
        window_right=None if causal else window_right,
        softcap=_canonical_softcap(softcap),
        top_left=top_left,
        deterministic=bool(deterministic),
    )
    return _resolve_backend(query, key, value, params, implementation, score_arrays)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
):
    """A drop-in for `jax.nn.dot_product_attention` running on fa4_jax.

    Same signature, semantics and input checks as jax's (jax 0.11): query [B, T, N, H], key and
    value [B, S, K, H] (or, without the batch dimension, [T, N, H] / [S, K, H]), N a multiple of
    K, one dtype, lengths int32 [B]. Masks follow jax's top-left rule: with `is_causal` query i
    sees key j when j <= i, with `local_window_size=(left, right)` when
    i - left <= j <= i + right, whatever T, S and the lengths; query_seq_lengths /
    key_value_seq_lengths keep each entry's first rows / keys (values outside [0, T] and
    [0, S] act as jax's do: clamped). A valid query row that sees no key (a window past the
    keys, an entry with no keys) gets, as in jax's default (XLA) implementation, the mean of
    all S values of its head; padded query rows get 0; the residual of either is
    `log(S) - 0.7 * float32_max` in key's dtype, as jax's. Runs on the kernels like
    `fa4_jax.attention`, gradients included.

    `mask` (bool) and `bias` (added to the scaled scores, differentiable) broadcast to
    [B, N, T, S] as jax's do, a row the mask hides entirely getting the mean of the values as
    in jax. A mask shared by every head (N axis of size 1, as Flax's make_causal_mask and
    make_attention_mask give) runs on the kernels, which read it packed to bits and skip the
    key blocks it hides (`fa4_jax.runtime.mask_bits`); so does a per-head mask, each (batch, head) an
    entry of its own (a copy of q, k, v and out around the kernels); a bias runs on the pure-JAX
    reference (chunked: no [T, S] buffer beyond what the caller passed; a FallbackWarning says
    so).

    Differences from jax:
      - negative local_window_size bounds raise NotImplementedError.
      - implementation is None, "cute" or "reference" (see `fa4_jax.attention`); "xla" and
        "cudnn" are jax's own backends: call `jax.nn.dot_product_attention` for them.
      - scale must be a static Python number (jax also takes a traced one).
      - The contents of padding (rows past the lengths) are never read. jax's XLA path
        multiplies masked keys' values by a probability of zero, so a NaN or inf in the padding
        of V reaches every output row there; its cuDNN path, like fa4_jax, ignores it.
    """
    if implementation in ("xla", "cudnn"):
        raise ValueError(
            f"implementation={implementation!r} is a backend of jax.nn.dot_product_attention, "
            f"not of fa4_jax; use None, 'cute' or 'reference', or call jax's function"
        )
    if scale is not None:
        scale = _static_positive("scale", scale)
    _check_bool("is_causal", is_causal)
    _check_bool("return_residual", return_residual)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(
                f"query, key and value must all be rank 3 [T, N, H] or all rank 4 [B, T, N, H], "
                f"got ranks {query.ndim}, {key.ndim}, {value.ndim}"
            )
        query, key, value = query[None], key[None], value[None]
    _check_like_jax(query, key, value)
    # jax prepends axes to a mask or bias of rank < 4, then broadcasts it to [B, N, T, S].
    mask, bias = (None if x is None else _ensure_rank_4(jnp.asarray(x)) for x in (mask, bias))
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask dtype should be bool (as in jax.nn.dot_product_attention), got "
                         f"{mask.dtype}; pass an additive mask as bias")
    batch = key.shape[0]
    query_seq_lengths, key_value_seq_lengths = (
        None if lengths is None else _jax_lengths(name, lengths, batch)
        for name, lengths in (("query_seq_lengths", query_seq_lengths),
                              ("key_value_seq_lengths", key_value_seq_lengths))
    )
    left, right = _jax_window(local_window_size)
    if is_causal:
        right = 0
    seqlen_q, seqlen_k = query.shape[1], key.shape[1]
    # jax gives a valid row that sees no key a uniform softmax over all S keys (masked scores
    # are a finite large negative number there), so its output is the mean of the head's
    # values. Rows see no key only when an entry has no keys, or a window ends before them.
    keyless_rows = seqlen_k > 0 and (key_value_seq_lengths is not None or mask is not None
                                     or (left is not None and seqlen_q > seqlen_k + left))
    result = _attention(
        query,
        key,
        value,
        causal=False,
        softmax_scale=scale,
        window_size=(left, right),
        softcap=None,
        deterministic=False,
        return_lse=keyless_rows or return_residual,
        implementation=implementation,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        top_left=True,
        score_arrays=_score_arrays(query, key, mask, bias, None, None),
    )
    out, lse = result if keyless_rows or return_residual else (result, None)
    if keyless_rows:
        out = _keyless_rows_see_every_key(out, lse, value, query_seq_lengths)
    if unbatched:
        out = out[0]
        lse = None if lse is None else lse[0]
    if not return_residual:
        return out
    # jax's residual is [.., T, N] in key's dtype, without gradient. Where a row sees no key
    # (padded rows too) it is the logsumexp of S large negative scores.
    large_negative = np.float32(-0.7) * np.finfo(np.float32).max
    residual = jnp.swapaxes(lse, -1, -2)
    if seqlen_k > 0:
        keyless_residual = jnp.float32(large_negative) + jnp.log(jnp.float32(seqlen_k))
        residual = jnp.where(jnp.isneginf(residual), keyless_residual, residual)
    return out, jax.lax.stop_gradient(residual.astype(key.dtype))


def _keyless_rows_see_every_key(out, lse, value, query_seq_lengths=None):
    """out with each valid row that saw no key (lse -inf) replaced by the mean of its head's
    values: what jax's and Flax's dense attention give such a row, whose masked scores are all
    one large negative number, so its softmax is uniform over every key. Rows past
    query_seq_lengths stay as they are (0)."""
    batch, seqlen_q, heads_q, _ = out.shape
    rows_valid = jnp.ones((batch, seqlen_q), bool)
    if query_seq_lengths is not None:
        rows_valid = jnp.arange(seqlen_q)[None, :] < query_seq_lengths[:, None]
    keyless = jnp.isneginf(jnp.swapaxes(lse, 1, 2)) & rows_valid[:, :, None]
    groups = heads_q // value.shape[2]
    value_mean = jnp.repeat(jnp.mean(value.astype(jnp.float32), axis=1), groups, axis=1)
    return jnp.where(keyless[..., None], value_mean[:, None].astype(out.dtype), out)


def _ensure_rank_4(x):
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _check_like_jax(query, key, value):
    """jax.nn.dot_product_attention's own checks: value's shape and dtype are key's, query
    shares batch and head dim, the heads group."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [B, T, N, H] (or 3 without the batch), got shape "
                f"{x.shape}"
            )
    batch, seqlen_k, heads_kv, head_dim = key.shape
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"value must have key's shape and dtype {key.shape} {key.dtype} (as in "
            f"jax.nn.dot_product_attention), got {value.shape} {value.dtype}"
        )
    if query.shape[0] != batch or query.shape[3] != head_dim or query.dtype != key.dtype:
        raise ValueError(
            f"query must be [{batch}, T, N, {head_dim}] in {key.dtype} to match key, got "
            f"{query.shape} {query.dtype}"
        )
    if query.shape[2] % heads_kv:
        raise ValueError(
            f"the number of query heads must be a multiple of key/value heads, got "
            f"{query.shape[2]} vs {heads_kv}"
        )


def _jax_lengths(name, lengths, batch):
    """Sequence lengths as jax takes them: int32 [B] (traced values are fine)."""
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"{name} must be an int32 array of shape ({batch},) (as in "
            f"jax.nn.dot_product_attention), got {lengths.dtype} {lengths.shape}"
        )
    return lengths


def _jax_window(local_window_size):
    """jax's local_window_size (an int w for (w, w), or a (left, right) pair) as (left, right)."""
    if local_window_size is None:
        return None, None
    if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    if (isinstance(local_window_size, (str, bytes)) or not isinstance(local_window_size, Sequence)
            or len(local_window_size) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool)
                       for b in local_window_size)):
        raise TypeError(
            f"local_window_size must be None, an int or a (left, right) pair of ints, got "
            f"{local_window_size!r}"
        )
    left, right = (int(bound) for bound in local_window_size)
    if left < 0 or right < 0:
        raise NotImplementedError(
            f"local_window_size={local_window_size}: negative bounds (a window that excludes "
            f"the query's own position) are not supported by fa4_jax"
        )
    return left, right


def _check_arrays(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {x.shape}"
            )
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if query.dtype not in _DTYPES:
        raise TypeError(
            f"query/key/value dtype must be bfloat16, float16 or float32, got {query.dtype}"
        )
    batch, _, heads_q, head_dim = query.shape
    _, seqlen_k, heads_kv, _ = key.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(
            f"query, key and value must have the same batch size, got {batch}, {key.shape[0]}, "
            f"{value.shape[0]}"
        )
    if value.shape[1] != seqlen_k:
        raise ValueError(
            f"key and value must have the same sequence length, got {seqlen_k} and "
            f"{value.shape[1]}"
        )
    if value.shape[2] != heads_kv:
        raise ValueError(
            f"key and value must have the same number of heads, got {heads_kv} and "
            f"{value.shape[2]}"
        )
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})"
        )
    if key.shape[3] != head_dim:
        raise ValueError(
            f"query and key must have the same head_dim, got {head_dim} and {key.shape[3]}"
        )
    for name, dim in (("query/key", head_dim), ("value", value.shape[3])):
        if dim > _MAX_HEAD_DIM or dim % _HEAD_DIM_MULTIPLE or dim == 0:
            raise ValueError(
                f"{name} head_dim must be a positive multiple of {_HEAD_DIM_MULTIPLE} and at "
                f"most {_MAX_HEAD_DIM}, got {dim}"
            )


def _canonical_lengths(name, lengths, batch_and_seqlen):
    """Valid lengths as int32 [batch], clamped to [0, seqlen]; all lengths full for None."""
    batch, seqlen = batch_and_seqlen
    if lengths is None:
        return jnp.full((batch,), seqlen, jnp.int32)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,):
        raise ValueError(
            f"{name} must have shape [batch] = ({batch},), got shape {lengths.shape}"
        )
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {lengths.dtype}")
    # Traced values cannot be checked; clamping keeps every backend inside the arrays.
    return jnp.clip(lengths, 0, seqlen).astype(jnp.int32)


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {value!r}")


def _check_window(window_size, name="window_size"):
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) or len(
        window_size
    ) != 2:
        raise TypeError(f"{name} must be a (left, right) pair, got {window_size!r}")
    for side, bound in zip(("left", "right"), window_size):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral):
            raise TypeError(f"{name} {side} must be None or an int >= 0, got {bound!r}")
        if bound < 0:
            raise ValueError(f"{name} {side} must be None or an int >= 0, got {bound}")
    return tuple(None if bound is None else int(bound) for bound in window_size)


def _static_positive(name, value):
    """A Python float from a static, positive, finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be None or a static positive finite number, got {value!r}"
        )
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be None or a positive finite number, got {value}")
    return value


def _canonical_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _static_positive("softmax_scale", softmax_scale)


def _canonical_softcap(softcap):
    return None if softcap is None else _static_positive("softcap", softcap)


def _resolve_backend(query, key, value, params, requested, score_arrays=None):
    """(params on the backend that runs the call, why not the kernels or None).

    "reference" when asked for; the kernels when they serve the call; else ValueError for
    implementation="cute", and the reference for None (the caller may prefer cuDNN)."""
    if requested == "reference":
        return params, None
    if score_arrays is not None and score_arrays.not_read_by_kernels is not None:
        reason = f"the kernels do not read {score_arrays.not_read_by_kernels} yet"
    elif score_arrays is not None and score_arrays.mask is not None:
        reason = _kernel_unsupported_reason(query, key, value, _folded_mask_params(params),
                                            segments=True, mask_array=True)
    else:
        reason = _kernel_unsupported_reason(query, key, value, params, segments=score_arrays is not None)
    if reason is None:
        return dataclasses.replace(params, implementation="cute",
                                   require_kernels=requested == "cute"), None
    if requested == "cute":
        raise ValueError(f"implementation='cute' cannot serve this call: {reason}")
    return dataclasses.replace(params, implementation="reference"), reason


def _kernel_unsupported_reason(query, key, value, params, segments=False, mask_array=False):
    if query.dtype not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16, got {query.dtype}"
    return dispatch.unsupported_reason(query, key, value, params, segments=segments, mask_array=mask_array)
