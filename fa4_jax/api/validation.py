"""The entry points' checks and canonical forms: every argument checked when the call is traced,
with an error that names it, then described as one `AttentionParams` (the static options) and
one `Visibility` (which pairs the call sees).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from fa4_jax.core.params import AttentionParams
from fa4_jax.core.visibility import Visibility

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = (None, "cute", "reference")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


def describe_call(query, key, value, *, causal, softmax_scale, window_size, softcap, deterministic,
                  implementation, top_left=False, query_seq_lengths=None, key_value_seq_lengths=None,
                  query_segment_ids=None, kv_segment_ids=None, mask=None,
                  ) -> tuple[AttentionParams, Visibility]:
    """(params, visibility) of `fa4_jax.attention`'s arguments (query, key, value as arrays or
    ShapeDtypeStructs), the masks aligned top-left when `top_left` (the jax drop-in's rule).

    Canonical forms: a right window bound of 0 is `causal`; the alignment is kept only where it
    matters (a rule, and corners on different diagonals); both lengths of a ragged batch, int32
    and clamped to the sequences (the only clamp); segment ids int32."""
    check_arrays(query, key, value)
    window_left, window_right = check_window(window_size)
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    if causal and window_right is not None and window_right > 0:
        raise ValueError(
            f"window_size right must be None or 0 when causal=True (causal means a right window "
            f"of 0), got window_size={tuple(window_size)}"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    ragged = query_seq_lengths is not None or key_value_seq_lengths is not None
    # One canonical form for "right bound on the diagonal", so kernels dispatch on `causal`.
    causal = bool(causal) or window_right == 0
    banded = causal or window_left is not None or window_right is not None
    # The alignment matters only under a rule, and not when both corners share a diagonal
    # (equal lengths, one for every entry): one canonical form for the kernels.
    top_left = bool(top_left) and banded and (ragged or query.shape[1] != key.shape[1])
    params = AttentionParams(
        softmax_scale=canonical_scale(softmax_scale, query.shape[-1]),
        causal=causal,
        window_left=window_left,
        window_right=None if causal else window_right,
        softcap=None if softcap is None else static_positive("softcap", softcap),
        top_left=top_left,
        deterministic=bool(deterministic),
    )
    lengths = (None, None)
    if ragged:
        lengths = (canonical_lengths("query_seq_lengths", query_seq_lengths, query.shape[:2]),
                   canonical_lengths("key_value_seq_lengths", key_value_seq_lengths, key.shape[:2]))
    query_segment_ids, kv_segment_ids = check_segment_ids(query, key, query_segment_ids, kv_segment_ids)
    visibility = Visibility(params.causal, params.window_left, params.window_right, params.top_left,
                            *lengths, query_segment_ids, kv_segment_ids,
                            check_score_array("mask", query, key, mask))
    return params, visibility


def check_arrays(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {x.shape}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
                        f"{value.dtype}")
    if query.dtype not in DTYPES:
        raise TypeError(f"query/key/value dtype must be bfloat16, float16 or float32, got {query.dtype}")
    batch, _, heads_q, head_dim = query.shape
    _, seqlen_k, heads_kv, _ = key.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"query, key and value must have the same batch size, got {batch}, "
                         f"{key.shape[0]}, {value.shape[0]}")
    if value.shape[1] != seqlen_k:
        raise ValueError(f"key and value must have the same sequence length, got {seqlen_k} and "
                         f"{value.shape[1]}")
    if value.shape[2] != heads_kv:
        raise ValueError(f"key and value must have the same number of heads, got {heads_kv} and "
                         f"{value.shape[2]}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if key.shape[3] != head_dim:
        raise ValueError(f"query and key must have the same head_dim, got {head_dim} and {key.shape[3]}")
    for name, dim in (("query/key", head_dim), ("value", value.shape[3])):
        if dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE or dim == 0:
            raise ValueError(f"{name} head_dim must be a positive multiple of {HEAD_DIM_MULTIPLE} and "
                             f"at most {MAX_HEAD_DIM}, got {dim}")


def check_score_array(name: str, query, key, x):
    """A mask ("mask": bool) or bias ("bias": floating) broadcastable to [batch, heads_q, seqlen_q,
    seqlen_k], as an array; None stays None."""
    if x is None:
        return None
    batch, seqlen_q, heads_q, _ = query.shape
    full = (batch, heads_q, seqlen_q, key.shape[1])
    x = shaped(x)
    if x.ndim != 4 or any(n not in (1, m) for n, m in zip(x.shape, full)):
        raise ValueError(f"{name} must be broadcastable to [batch, heads_q, seqlen_q, seqlen_k] "
                         f"= {full} (each axis that size or 1), got shape {x.shape}")
    if name == "mask" and x.dtype != jnp.bool_:
        raise TypeError(f"mask must be bool, got dtype {x.dtype}")
    if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"bias must be a floating dtype, got dtype {x.dtype}")
    return x


def check_segment_ids(query, key, query_segment_ids, kv_segment_ids):
    """The ids as int32 arrays [batch, seqlen_q] and [batch, seqlen_k] (both or neither)."""
    if (query_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both query_segment_ids and kv_segment_ids, or neither")
    if query_segment_ids is None:
        return None, None
    batch, seqlen_q = query.shape[:2]
    checked = []
    for name, ids, shape in (("query_segment_ids", query_segment_ids, (batch, seqlen_q)),
                             ("kv_segment_ids", kv_segment_ids, (batch, key.shape[1]))):
        ids = shaped(ids)
        if ids.shape != shape:
            raise ValueError(f"{name} must have shape [batch, seq] = {shape}, got {ids.shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got dtype {ids.dtype}")
        checked.append(ids.astype(jnp.int32))
    return tuple(checked)


def shaped(x):
    """x as an array, unless it already has a shape and dtype (an array, a ShapeDtypeStruct)."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def canonical_lengths(name, lengths, batch_and_seqlen):
    """Valid lengths as int32 [batch], clamped to [0, seqlen]; all lengths full for None."""
    batch, seqlen = batch_and_seqlen
    if lengths is None:
        return jnp.full((batch,), seqlen, jnp.int32)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape [batch] = ({batch},), got shape {lengths.shape}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {lengths.dtype}")
    # Traced values cannot be checked; clamping keeps every backend inside the arrays.
    return jnp.clip(lengths, 0, seqlen).astype(jnp.int32)


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {value!r}")


def check_window(window_size, name="window_size"):
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) or len(window_size) != 2:
        raise TypeError(f"{name} must be a (left, right) pair, got {window_size!r}")
    for side, bound in zip(("left", "right"), window_size):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral):
            raise TypeError(f"{name} {side} must be None or an int >= 0, got {bound!r}")
        if bound < 0:
            raise ValueError(f"{name} {side} must be None or an int >= 0, got {bound}")
    return tuple(None if bound is None else int(bound) for bound in window_size)


def static_positive(name, value):
    """A Python float from a static, positive, finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be None or a static positive finite number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be None or a positive finite number, got {value}")
    return value


def canonical_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return static_positive("softmax_scale", softmax_scale)
