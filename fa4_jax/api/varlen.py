"""Packed variable-length attention (FlashAttention's varlen form).

Sequences of different lengths are concatenated along the token axis, with cumulative offsets
`cu_seqlens` saying where each starts. Every call runs as one row with segment ids (each token's
sequence), which the kernels read with the key blocks of other sequences skipped; both ways are
differentiable and take memory O(total tokens):

- in place, the packed arrays themselves as the row, when the masks cannot tell the packing's
  diagonal from each sequence's: without a causal or window mask, or with one packing for
  queries and keys (the same cu_seqlens array for both, as in self-attention, where each
  sequence's bottom-right diagonal is the row's);
- otherwise (a causal or window mask on queries and keys packed apart) gathered into rows of
  total_q + total_k positions in which every sequence's queries and keys end at the same
  position (`_aligned_rows`): the row's bottom-right diagonal is then each sequence's, and the
  gaps hold padding ids that match nothing.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.api.attention import attention


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k=None,
    *,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    softmax_scale=None,
    window_size=(None, None),
    softcap=None,
    deterministic=False,
    return_lse=False,
    implementation=None,
):
    """Attention of n packed sequences, each attending only within itself.

    Sequence s holds query tokens cu_seqlens_q[s] : cu_seqlens_q[s + 1] and key/value tokens
    cu_seqlens_k[s] : cu_seqlens_k[s + 1]; masks (causal, window) are bottom-right aligned per
    sequence, as in `fa4_jax.attention` with each sequence its own call. Empty sequences are
    allowed. Runs as one row with segment ids (kernels or reference, as `fa4_jax.attention`
    chooses): in place without a mask or when queries and keys share one packing, else on rows
    of total_q + total_k positions that align each sequence's diagonal with the row's (module
    docstring). One packing is known when cu_seqlens_k is None or the same array as
    cu_seqlens_q, or both are concrete and equal; two traced arrays of one length are compared
    on the device, and the call takes the in-place path when they are equal (both paths are
    compiled: pass cu_seqlens_k=None for self-attention to compile one).

    Args:
      q: [total_q, heads_q, head_dim].
      k: [total_k, heads_kv, head_dim]; v: [total_k, heads_kv, head_dim_v]. Dtypes, head dims
        and the GQA rule as `fa4_jax.attention`.
      cu_seqlens_q, cu_seqlens_k: integer arrays [n + 1] (traced values are fine), the start
        of each sequence and then the total: cu[0] = 0, nondecreasing, cu[n] = total_q
        (total_k). Traced values cannot be checked: other values give unspecified
        results, never reads out of bounds. cu_seqlens_k None: the keys are packed as the
        queries (total_k must be total_q).
      max_seqlen_q, max_seqlen_k: static Python ints >= 1, FlashAttention's bounds on the
        sequences' lengths. Checked, not needed: no path sizes anything by them.
      causal, softmax_scale, window_size, softcap, deterministic, return_lse, implementation:
        as `fa4_jax.attention`.

    Returns:
      out: [total_q, heads_q, head_dim_v] in q's dtype; and, when return_lse, lse
      [heads_q, total_q] float32 (FlashAttention's varlen layout). A row that sees no key has
      out 0 and lse -inf. Both are differentiable.

    Raises:
      TypeError / ValueError naming the offending argument, as `fa4_jax.attention`.
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must have rank 3 [total_tokens, heads, head_dim], got shape {x.shape}"
            )
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}"
        )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    one_packing = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    if cu_seqlens_k is None and k.shape[0] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k=None packs the keys as the queries, so k must have q's {q.shape[0]} "
            f"tokens, got {k.shape[0]}; pass cu_seqlens_k"
        )
    cu_seqlens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"shapes {cu_seqlens_q.shape} and {cu_seqlens_k.shape}"
        )
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   deterministic=deterministic, implementation=implementation)
    banded = causal or any(bound is not None for bound in tuple(window_size))
    # (Without queries or keys there is no diagonal to align.)
    if one_packing or not banded or k.shape[0] == 0 or q.shape[0] == 0:
        return _as_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, options, return_lse)
    equal = _known_equal(cu_seqlens_q, cu_seqlens_k)
    if equal is True:
        return _as_segments(q, k, v, cu_seqlens_q, cu_seqlens_q, options, return_lse)
    if equal is False or k.shape[0] != q.shape[0]:
        return _aligned_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, options, return_lse)
    # Two traced packings of one length: which path is only known on the device.
    return jax.lax.cond(jnp.array_equal(cu_seqlens_q, cu_seqlens_k),
                        lambda *args: _as_segments(*args, options, return_lse),
                        lambda *args: _aligned_rows(*args, options, return_lse),
                        q, k, v, cu_seqlens_q, cu_seqlens_k)


def _known_equal(a, b) -> bool | None:
    """Whether two cu_seqlens arrays are equal, or None when either is traced."""
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except jax.errors.TracerArrayConversionError:
        return None


def _as_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, options, return_lse):
    """The packed call as one row whose segment ids are the tokens' sequences (tokens past the
    last sequence: ids that match nothing)."""
    q_ids, kv_ids = (_sequence_ids(cu, x.shape[0], no_match)
                     for cu, x, no_match in ((cu_seqlens_q, q, -1), (cu_seqlens_k, k, -2)))
    out, lse = attention(q[None], k[None], v[None], return_lse=True, query_segment_ids=q_ids[None],
                         kv_segment_ids=kv_ids[None], **options)
    return (out[0], lse[0]) if return_lse else out[0]


def _aligned_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, options, return_lse):
    """The packed call on one row of total_q + total_k positions per side, in which sequence s
    takes the positions up to end_s = sum over r <= s of max(len_q_r, len_k_r), its queries the
    last len_q_s of them and its keys the last len_k_s. Query position p then sees key position t
    under the row's bottom-right mask (both rows equally long: t <= p + window_right, and
    t >= p - window_left) exactly when query i of s sees key j of s under s's own bottom-right
    mask (p - t = len_k_s - len_q_s + i - j); segment ids keep the sequences apart, and the
    gaps hold ids that match nothing (their rows give out 0, and are not read back)."""
    lengths_q, lengths_k = jnp.diff(cu_seqlens_q), jnp.diff(cu_seqlens_k)
    ends = jnp.cumsum(jnp.maximum(lengths_q, lengths_k))
    position = jnp.arange(q.shape[0] + k.shape[0], dtype=jnp.int32)
    sequence = jnp.minimum(jnp.searchsorted(ends, position, side="right"), ends.shape[0] - 1)

    def side(cu_seqlens, lengths, total, no_match):
        """(the packed token at each row position, 0 in the gaps; whether one is there; the
        row's segment ids; each packed token's row position, 0 past the last sequence; whether
        it has one) of one side."""
        index = position - (ends[sequence] - lengths[sequence])  # within the sequence's tokens
        valid = (index >= 0) & (index < lengths[sequence]) & (position < ends[-1])
        token = jnp.where(valid, cu_seqlens[sequence] + index, 0)
        token_sequence, token_index = _token_positions(cu_seqlens, total)
        placed = jnp.arange(total, dtype=jnp.int32) < cu_seqlens[-1]
        row_position = jnp.where(placed, ends[token_sequence] - lengths[token_sequence] + token_index, 0)
        return token, valid, jnp.where(valid, sequence, no_match).astype(jnp.int32), row_position, placed

    q_token, q_valid, q_ids, q_position, q_placed = side(cu_seqlens_q, lengths_q, q.shape[0], -1)
    k_token, k_valid, kv_ids, k_position, k_placed = side(cu_seqlens_k, lengths_k, k.shape[0], -2)
    to_row_q, to_row_k = (q_token, q_valid, q_position, q_placed), (k_token, k_valid, k_position, k_placed)
    q_row, k_row, v_row = _moved(q, *to_row_q), _moved(k, *to_row_k), _moved(v, *to_row_k)
    out, lse = attention(q_row[None], k_row[None], v_row[None], return_lse=True,
                         query_segment_ids=q_ids[None], kv_segment_ids=kv_ids[None], **options)
    # Back to the packed tokens (tokens past cu_seqlens_q[-1] belong to no sequence and give
    # what a row that sees no key gives), the inverse move.
    from_row = (q_position, q_placed, q_token, q_valid)
    out = _moved(out[0], *from_row)
    lse = jnp.swapaxes(_moved(jnp.swapaxes(lse[0], 0, 1), *from_row, fill=-jnp.inf), 0, 1)
    return (out, lse) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moved(x, index, valid, inverse, inverse_valid, fill=0.0):
    """x's rows moved: row i of the result is x[index[i]] where valid[i], else `fill`. The move
    is one-to-one where valid (`inverse` [len(x)] maps back, inverse_valid where it does), so
    its gradient is the inverse move, a gather too: the transpose of a gather that XLA must take
    for a scatter-add, whose repeated index 0 (every gap position) serialises on one row."""
    return jnp.where(_rows(valid, x), jnp.take(x, index, axis=0, mode="clip"), jnp.asarray(fill, x.dtype))


def _rows(flags, x):
    return flags.reshape(flags.shape + (1,) * (x.ndim - 1))


def _moved_fwd(x, index, valid, inverse, inverse_valid, fill):
    return _moved(x, index, valid, inverse, inverse_valid, fill), (index, valid, inverse, inverse_valid)


def _moved_bwd(fill, residuals, cotangent):
    index, valid, inverse, inverse_valid = residuals
    d_x = jnp.where(_rows(inverse_valid, cotangent), jnp.take(cotangent, inverse, axis=0, mode="clip"),
                    jnp.zeros((), cotangent.dtype))
    return d_x, None, None, None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


def _sequence_ids(cu_seqlens, total, no_match):
    """int32 [total]: each packed token's sequence index, `no_match` past cu_seqlens[-1]."""
    sequence, _ = _token_positions(cu_seqlens, total)
    return jnp.where(jnp.arange(total, dtype=jnp.int32) < cu_seqlens[-1], sequence, no_match)


def _check_max_seqlen(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a static Python int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a static Python int >= 1, got {value}")
    return int(value)


def _check_cu_seqlens(name, cu_seqlens):
    cu_seqlens = jnp.asarray(cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"{name} must have shape [num_sequences + 1] with at least one sequence, got shape "
            f"{cu_seqlens.shape}"
        )
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {cu_seqlens.dtype}")
    return cu_seqlens.astype(jnp.int32)


def _token_positions(cu_seqlens, total):
    """(sequence, position within it) of each of the `total` packed tokens, int32 [total] each.

    A token belongs to the sequence whose start is the last one <= the token (side="right"
    skips empty sequences, which share their start with the next one).
    """
    token = jnp.arange(total, dtype=jnp.int32)
    sequence = jnp.searchsorted(cu_seqlens[1:-1], token, side="right").astype(jnp.int32)
    return sequence, token - cu_seqlens[sequence]
