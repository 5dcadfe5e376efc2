"""The public entry points: validate at trace time, canonicalise, choose a backend, call the op."""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import ffi
from fa4_jax.params import AttentionParams
from fa4_jax.vjp import attention_op

logger = logging.getLogger("fa4_jax")

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
        float32 (reference only). head_dim and head_dim_v are multiples of 8, at most 256.
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
      implementation: None (the kernels when they serve this call, else the reference; the
        choice and its reason are logged at debug level on the "fa4_jax" logger), "cute" (the
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
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _check_bool("return_lse", return_lse)
    ragged = query_seq_lengths is not None or key_value_seq_lengths is not None
    params = attention_params(
        query,
        key,
        value,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        implementation=implementation,
    )
    seq_lengths = None
    if ragged:
        seq_lengths = (
            _canonical_lengths("query_seq_lengths", query_seq_lengths, query.shape[:2]),
            _canonical_lengths("key_value_seq_lengths", key_value_seq_lengths, key.shape[:2]),
        )
    out, lse = attention_op(query, key, value, params, seq_lengths)
    return (out, lse) if return_lse else out


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
    """The validated, canonical `AttentionParams` of `attention(query, key, value, ...)`.

    Same arguments (query, key, value as arrays) and the same errors as `attention`, sequence
    lengths aside (they are operands, not parameters); for entry points that run the attention
    ops themselves (`ring_attention`).
    """
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
    params = AttentionParams(
        softmax_scale=_canonical_scale(softmax_scale, query.shape[-1]),
        causal=causal,
        window_left=window_left,
        window_right=None if causal else window_right,
        softcap=_canonical_softcap(softcap),
        deterministic=bool(deterministic),
        implementation=_choose_implementation(query.dtype, implementation),
    )
    return _resolve_backend(query, key, value, params, implementation)


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

    Same signature and meaning as jax's (jax 0.11): inputs [B, T, N, H] / [B, S, K, H] or,
    without the batch dimension, [T, N, H] / [S, K, H]; N a multiple of K.

    Differences:
      - bias and mask are not supported yet and raise NotImplementedError.
      - jax aligns is_causal and local_window_size to the top-left corner (query i vs key i);
        fa4_jax aligns to the bottom-right. The two agree when T == S; otherwise the call is
        translated to fa4_jax's windows, and a NotImplementedError is raised when that needs a
        negative window (e.g. is_causal with T < S).
      - With query_seq_lengths / key_value_seq_lengths, fa4_jax aligns is_causal and
        local_window_size bottom-right to each entry's valid lengths (see `attention`), jax
        still top-left: the two agree when both lengths are given and equal entry by entry
        (padded self-attention), so with a mask both are required (NotImplementedError
        otherwise) and entries of unequal lengths follow fa4_jax's rule. Without a mask,
        either length may come alone, as in jax. Lengths may be any integer dtype (jax:
        int32) and are clamped to [0, T] and [0, S]. Ragged calls run on the kernels like
        any other (their padding is zeroed first, see `fa4_jax.ffi`).
      - A query row that sees no key gives 0 here (jax: the mean of all values), padded rows
        included (jax: 0 as well).
      - implementation is None, "cute" or "reference" (see `attention`); "xla" and "cudnn"
        are jax's own backends: call `jax.nn.dot_product_attention` for them.
      - The residual of return_residual (the logsumexp, [B, T, N] or [T, N], in key's dtype,
        gradient stopped, as in jax) is -inf for rows that see no key, padded rows included
        (jax: a large negative number).
    """
    for name, argument in (("bias", bias), ("mask", mask)):
        if argument is not None:
            raise NotImplementedError(
                f"fa4_jax.dot_product_attention does not support {name} yet; pass {name}=None "
                f"or use jax.nn.dot_product_attention"
            )
    if implementation in ("xla", "cudnn"):
        raise ValueError(
            f"implementation={implementation!r} is a backend of jax.nn.dot_product_attention, "
            f"not of fa4_jax; use None, 'cute' or 'reference', or call jax's function"
        )
    if scale is not None:
        scale = _static_positive("scale", scale)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(
                f"query, key and value must all be rank 3 [T, N, H] or all rank 4 [B, T, N, H], "
                f"got ranks {query.ndim}, {key.ndim}, {value.ndim}"
            )
        query, key, value = query[None], key[None], value[None]
        query_seq_lengths, key_value_seq_lengths = (
            None if lengths is None else jnp.reshape(jnp.asarray(lengths), (-1,))
            for lengths in (query_seq_lengths, key_value_seq_lengths)
        )
    ragged = query_seq_lengths is not None or key_value_seq_lengths is not None
    # With lengths fa4_jax's masks align to the valid lengths, which matches jax's top-left
    # alignment when they are equal: no shift, as for T == S.
    seqlen_q = key.shape[1] if ragged else query.shape[1]
    window_size = _top_left_to_bottom_right(
        is_causal, local_window_size, seqlen_q=seqlen_q, seqlen_k=key.shape[1]
    )
    masked = window_size != (None, None)
    if ragged and masked and (query_seq_lengths is None or key_value_seq_lengths is None):
        raise NotImplementedError(
            "is_causal / local_window_size with only one of query_seq_lengths and "
            "key_value_seq_lengths: fa4_jax aligns masks to the valid lengths, jax to index 0; "
            "they agree when both are given and equal entry by entry (padded self-attention), "
            "so pass both"
        )
    out, lse = attention(
        query,
        key,
        value,
        softmax_scale=scale,
        window_size=window_size,
        return_lse=True,
        implementation=implementation,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
    )
    if unbatched:
        out, lse = out[0], lse[0]
    if not return_residual:
        return out
    # jax's residual is [.., T, N] in key's dtype, without gradient.
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2)).astype(key.dtype)
    return out, residual


def _top_left_to_bottom_right(is_causal, local_window_size, *, seqlen_q, seqlen_k):
    """jax's (is_causal, local_window_size) as fa4_jax's bottom-right window_size.

    jax: row i sees key j when j <= i (is_causal) and i - left <= j <= i + right (window).
    fa4_jax measures from i + offset, offset = seqlen_k - seqlen_q, so each bound shifts by
    -offset.
    """
    _check_bool("is_causal", is_causal)
    left = right = None
    if local_window_size is not None:
        if isinstance(local_window_size, numbers.Integral) and not isinstance(
            local_window_size, bool
        ):
            local_window_size = (local_window_size, local_window_size)
        left, right = _check_window(local_window_size, name="local_window_size")
    if is_causal:
        right = 0 if right is None else min(right, 0)
    offset = seqlen_k - seqlen_q
    left = None if left is None else left + offset
    right = None if right is None else right - offset
    if (left is not None and left < 0) or (right is not None and right < 0):
        raise NotImplementedError(
            f"is_causal={is_causal}, local_window_size={local_window_size} with "
            f"seqlen_q={seqlen_q} != seqlen_k={seqlen_k}: jax aligns these masks top-left and "
            f"fa4_jax bottom-right; the translation needs a negative window, which fa4_jax "
            f"does not support"
        )
    return (left, right)


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


def _choose_implementation(dtype, implementation):
    """The backend to try first: the requested one, else "cute" when the dtype allows it."""
    if implementation is not None:
        return implementation
    return "cute" if dtype in _KERNEL_DTYPES else "reference"


def _resolve_backend(query, key, value, params, requested):
    """Confirms the kernels serve the call, or falls back to the reference (when allowed)."""
    if params.implementation == "reference":
        if requested is None:
            logger.debug("fa4_jax: reference backend (%s inputs run on the reference only)",
                         query.dtype)
        return params
    reason = _kernel_unsupported_reason(query, key, value, params)
    if reason is None:
        logger.debug("fa4_jax: cute backend")
        return params
    if requested == "cute":
        raise ValueError(f"implementation='cute' cannot serve this call: {reason}")
    logger.debug("fa4_jax: reference backend (%s)", reason)
    return dataclasses.replace(params, implementation="reference")


def _kernel_unsupported_reason(query, key, value, params):
    if query.dtype not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16, got {query.dtype}"
    if not ffi.is_available():
        return ffi.unsupported_reason(query, key, value, params) or "the kernels are unavailable"
    return ffi.unsupported_reason(query, key, value, params)
