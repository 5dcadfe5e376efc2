"""`dot_product_attention`: a drop-in for `jax.nn.dot_product_attention` running on fa4_jax,
with jax's argument checks, top-left masks, and its answer for rows that see no key."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.api import validation
from fa4_jax.api.attention import run


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
        scale = validation.static_positive("scale", scale)
    validation.check_bool("is_causal", is_causal)
    validation.check_bool("return_residual", return_residual)
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
    result = run(query, key, value, return_lse=keyless_rows or return_residual,
                 implementation=implementation, bias=bias, top_left=True, causal=False,
                 softmax_scale=scale, window_size=(left, right), softcap=None, deterministic=False,
                 query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                 mask=mask)
    out, lse = result if keyless_rows or return_residual else (result, None)
    if keyless_rows:
        out = keyless_rows_see_every_key(out, jnp.isneginf(lse), value, query_seq_lengths)
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


def keyless_rows_see_every_key(out, keyless, value, query_seq_lengths=None):
    """out with each valid row flagged in `keyless` ([batch | 1, heads_q | 1, seqlen_q] bool)
    replaced by the mean of its head's values: what jax's and Flax's dense attention give a row
    whose masked scores are all one large negative number, so its softmax is uniform over every
    key. Rows past query_seq_lengths stay as they are (0)."""
    batch, seqlen_q, heads_q, _ = out.shape
    rows_valid = jnp.ones((batch, seqlen_q), bool)
    if query_seq_lengths is not None:
        rows_valid = jnp.arange(seqlen_q)[None, :] < query_seq_lengths[:, None]
    keyless = jnp.swapaxes(keyless, 1, 2) & rows_valid[:, :, None]
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
