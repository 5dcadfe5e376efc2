"""Pure-JAX attention: the backend for platforms without kernels, and the test oracle.

It computes exactly what the kernels compute (same masks, softcap, GQA mapping, lse) with a
chunked online softmax, so memory stays linear in the sequence length: the forward never holds
more than one [q_chunk, kv_chunk] score tile per (batch, head), and the backward (plain reverse
mode through `lax.scan`, with `jax.checkpoint` so the scan saves only its carries) never holds
more than one query chunk's running statistics per key chunk.

Which pairs are visible is `fa4_jax.core.visibility.Visibility`'s rule, evaluated per tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fa4_jax.core.visibility import Visibility

DEFAULT_CHUNK_SIZE = 512


def attention_reference(
    query,
    key,
    value,
    *,
    softmax_scale=None,
    causal=False,
    window_left=None,
    window_right=None,
    softcap=None,
    top_left=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    mask=None,
    bias=None,
    query_segment_ids=None,
    kv_segment_ids=None,
    compute_dtype=jnp.float32,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """Attention with the package's mask semantics, as `(out, lse)`.

    Args:
      query: [batch, seqlen_q, heads_q, head_dim].
      key: [batch, seqlen_k, heads_kv, head_dim]; heads_q must be a multiple of heads_kv
        (query head i reads kv head i // (heads_q // heads_kv)).
      value: [batch, seqlen_k, heads_kv, head_dim_v]; head_dim_v may differ from head_dim.
      softmax_scale: multiplies q·k; None means 1 / sqrt(head_dim).
      causal, window_left, window_right: the masks of `fa4_jax.core.params.AttentionParams`,
        bottom-right aligned (offset = seqlen_k - seqlen_q) unless top_left (offset = 0).
      softcap: if not None, scores become softcap * tanh(scores / softcap) after the scale.
      top_left: align the masks to the top-left corner, as jax.nn.dot_product_attention does.
      query_seq_lengths, key_value_seq_lengths: None, or integer arrays [batch] with values in
        [0, seqlen_q] and [0, seqlen_k] (traced values are fine; both or neither): batch entry b
        holds only its first query_seq_lengths[b] rows and key_value_seq_lengths[b] keys, and
        the masks align bottom-right to those (offset = kv length - q length, per entry), or
        top-left (offset 0). Rows
        past the length have out 0, lse -inf; keys past it get zero gradient. What the padding
        holds (even inf or NaN) does not matter.
      mask: None, or a bool array broadcastable to [batch, heads_q, seqlen_q, seqlen_k] (each
        axis its full size or 1; rank 4): False hides the key from the row, on top of the
        masks above.
      bias: None, or a float array broadcastable like mask, added to the scores after the
        scale and softcap (differentiable).
      query_segment_ids, kv_segment_ids: None, or integer arrays [batch, seqlen_q] and
        [batch, seqlen_k] (both or neither): a row sees only the keys of its own segment id.
        Segments need not be contiguous.
      compute_dtype: dtype of the matmul inputs and outputs, the scale/softcap arithmetic and
        the probabilities fed to the second matmul. float32 gives the oracle `ref`; the input
        dtype gives FlashAttention's `ref_lowp`. The running max, row sum and output
        accumulator are float32 either way (as in the kernels), so `ref_lowp`'s error
        measures rounding, not an accumulation drift that would depend on the chunk size.
      chunk_size: query and key rows per tile (clipped to the sequence lengths); it needs
        not divide them.

    Returns:
      out: [batch, seqlen_q, heads_q, head_dim_v], query's dtype.
      lse: [batch, heads_q, seqlen_q] float32, natural-log logsumexp of the (scaled, capped)
        visible scores. A row with no visible key has out 0, lse -inf and zero gradient.
    """
    batch, seqlen_q, heads_q, head_dim = query.shape
    _, seqlen_k, heads_kv, _ = key.shape
    head_dim_v = value.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    q_chunk = max(1, min(chunk_size, seqlen_q))
    kv_chunk = max(1, min(chunk_size, seqlen_k))
    if (query_seq_lengths is None) != (key_value_seq_lengths is None):
        raise ValueError("give both query_seq_lengths and key_value_seq_lengths, or neither")
    valid_q, valid_k = seqlen_q, seqlen_k
    if query_seq_lengths is not None:
        valid_q, valid_k = map(_as_tile_batch, (query_seq_lengths, key_value_seq_lengths))
        query = _zero_padding(query, query_seq_lengths)
        key = _zero_padding(key, key_value_seq_lengths)
        value = _zero_padding(value, key_value_seq_lengths)
    if (query_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both query_segment_ids and kv_segment_ids, or neither")
    score_tiles = _ScoreTiles.of(mask, bias, query_segment_ids, kv_segment_ids, heads_kv,
                                 q_chunk, kv_chunk)
    rules = Visibility(causal, window_left, window_right, top_left)

    q_tiles = _tile_queries(query.astype(compute_dtype), q_chunk, heads_kv)
    k_tiles = _tile_keys(key.astype(compute_dtype), kv_chunk)
    v_tiles = _tile_keys(value.astype(compute_dtype), kv_chunk)

    one_query_tile = functools.partial(
        _attend_query_tile,
        k_tiles=k_tiles,
        v_tiles=v_tiles,
        rules=rules,
        lengths=(valid_q, valid_k),
        score_tiles=score_tiles,
        softmax_scale=softmax_scale,
        softcap=softcap,
        compute_dtype=compute_dtype,
    )
    # Checkpointed so the outer scan saves only its query tile; the backward re-runs one
    # query tile's forward at a time.
    out_tiles, lse_tiles = lax.map(
        jax.checkpoint(one_query_tile),
        (jnp.arange(q_tiles.shape[0]) * q_chunk, q_tiles),
    )
    # out_tiles: [nq, batch, heads_kv, groups, q_chunk, head_dim_v]; lse_tiles without head_dim_v.
    out = jnp.transpose(out_tiles, (1, 0, 4, 2, 3, 5))
    out = out.reshape(batch, -1, heads_q, head_dim_v)[:, :seqlen_q]
    lse = jnp.transpose(lse_tiles, (1, 2, 3, 0, 4))
    lse = lse.reshape(batch, heads_q, -1)[:, :, :seqlen_q]
    return out.astype(query.dtype), lse


def dense_attention(q, k, v, *, compute_dtype, softmax_scale=None, softcap=None, causal=False,
                    window_left=None, window_right=None, query_segment_ids=None, kv_segment_ids=None,
                    mask=None):
    """`attention_reference`'s (out, lse) with the same compute_dtype semantics, unchunked
    (segment ids and a bool mask [b | 1, h | 1, sq, sk], when given, as there: a row sees only
    keys of its own id that the mask shows).

    The score matrix is materialised ([batch, heads, seqlen_q, seqlen_k] float32), so it is for
    small shapes only (the GPU tier's oracle, `python -m fa4_jax selftest`'s); in exchange XLA
    compiles it and its VJP in a fraction of the chunked scan's time. Matmul inputs and outputs,
    the scale and the softcap are in compute_dtype, the softmax statistics in float32, and the
    probabilities are rounded to compute_dtype before the second matmul, as in the reference.
    out comes back in compute_dtype.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    softmax_scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest",
                        preferred_element_type=compute_dtype)
    scores = scores * jnp.asarray(softmax_scale, compute_dtype)
    if softcap is not None:
        cap = jnp.asarray(softcap, compute_dtype)
        scores = cap * jnp.tanh(scores / cap)
    visible = Visibility(causal, window_left, window_right).band(
        jnp.arange(seqlen_q), jnp.arange(seqlen_k), seqlen_q, seqlen_k)
    if query_segment_ids is not None:
        visible = visible & (query_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    if mask is not None:
        visible = visible & mask
    scores = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    empty = ~visible.any(axis=-1, keepdims=True)
    safe_scores = jnp.where(empty, 0.0, scores)
    lse = jax.nn.logsumexp(safe_scores, axis=-1, keepdims=True)
    probs = jnp.where(empty, 0.0, jnp.exp(safe_scores - lse)).astype(compute_dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest",
                     preferred_element_type=compute_dtype)
    return out, jnp.where(empty[..., 0], -jnp.inf, lse[..., 0])


class _ScoreTiles:
    """The caller's per-score arrays (a bool mask, an additive bias, segment ids), cut into the
    [batch, heads_kv, groups, q_chunk, kv_chunk] score tiles one at a time, so no buffer of the
    full [seqlen_q, seqlen_k] is made beyond what the caller passed. An axis of size 1 stays 1
    and broadcasts."""

    def __init__(self, mask, bias, query_segment_ids, kv_segment_ids):
        self.mask, self.bias = mask, bias
        self.query_segment_ids, self.kv_segment_ids = query_segment_ids, kv_segment_ids

    @classmethod
    def of(cls, mask, bias, query_segment_ids, kv_segment_ids, heads_kv, q_chunk, kv_chunk):
        def grouped(x, fill):
            # [b, heads, sq, sk] -> [b, heads_kv | 1, groups | 1, sq padded, sk padded].
            b, heads, sq, sk = x.shape
            x = x.reshape(b, 1, 1, sq, sk) if heads == 1 else x.reshape(b, heads_kv, heads // heads_kv, sq, sk)
            widths = [(0, 0)] * 3 + [(0, 0 if n == 1 else -n % chunk) for n, chunk in ((sq, q_chunk), (sk, kv_chunk))]
            return jnp.pad(x, widths, constant_values=fill)

        def padded_ids(ids, chunk, fill):
            ids = jnp.asarray(ids, jnp.int32)
            return jnp.pad(ids, [(0, 0), (0, -ids.shape[1] % chunk)], constant_values=fill)

        return cls(
            None if mask is None else grouped(jnp.asarray(mask, bool), False),
            None if bias is None else grouped(jnp.asarray(bias), 0),
            None if query_segment_ids is None else padded_ids(query_segment_ids, q_chunk, -1),
            None if kv_segment_ids is None else padded_ids(kv_segment_ids, kv_chunk, -1),
        )

    @staticmethod
    def _tile(x, q_start, k_start, q_chunk, kv_chunk):
        starts = (0, 0, 0, q_start if x.shape[3] > 1 else 0, k_start if x.shape[4] > 1 else 0)
        sizes = x.shape[:3] + (q_chunk if x.shape[3] > 1 else 1, kv_chunk if x.shape[4] > 1 else 1)
        return lax.dynamic_slice(x, starts, sizes)

    def visible(self, q_start, k_start, q_chunk, kv_chunk):
        """Bool, broadcastable to the score tile at (q_start, k_start), or True."""
        visible = True
        if self.mask is not None:
            visible = self._tile(self.mask, q_start, k_start, q_chunk, kv_chunk)
        if self.query_segment_ids is not None:
            rows = lax.dynamic_slice_in_dim(self.query_segment_ids, q_start, q_chunk, axis=1)
            keys = lax.dynamic_slice_in_dim(self.kv_segment_ids, k_start, kv_chunk, axis=1)
            visible = visible & (rows[:, None, None, :, None] == keys[:, None, None, None, :])
        return visible

    def biased(self, scores, q_start, k_start):
        if self.bias is None:
            return scores
        q_chunk, kv_chunk = scores.shape[-2:]
        return scores + self._tile(self.bias, q_start, k_start, q_chunk, kv_chunk).astype(scores.dtype)


def _zero_padding(x, lengths):
    """x [batch, seq, ...] with the rows past each entry's length zeroed.

    Masking the scores is not enough: padding holding inf or NaN would still reach the
    output or the gradients through 0 * NaN in a matmul, and a truncated call never reads it.
    """
    row = jnp.arange(x.shape[1])[None, :, None, None]
    valid = row < jnp.asarray(lengths).reshape(-1, 1, 1, 1)
    return jnp.where(valid, x, jnp.zeros((), x.dtype))


def _as_tile_batch(lengths):
    """Valid lengths [batch] as int32 [batch, 1, 1, 1, 1], the score tile's batch axis."""
    return jnp.asarray(lengths, jnp.int32).reshape(-1, 1, 1, 1, 1)


def _pad_rows(x, chunk):
    """Pads axis 1 of [batch, seq, ...] up to a multiple of chunk."""
    pad = -x.shape[1] % chunk
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)


def _tile_queries(query, chunk, heads_kv):
    """[batch, seq, heads_q, d] -> [n_tiles, batch, heads_kv, groups, chunk, d]."""
    query = _pad_rows(query, chunk)
    batch, seq, heads_q, head_dim = query.shape
    query = query.reshape(batch, seq // chunk, chunk, heads_kv, heads_q // heads_kv, head_dim)
    return jnp.transpose(query, (1, 0, 3, 4, 2, 5))


def _tile_keys(x, chunk):
    """[batch, seq, heads_kv, d] -> [n_tiles, batch, heads_kv, chunk, d]."""
    x = _pad_rows(x, chunk)
    batch, seq, heads_kv, head_dim = x.shape
    x = x.reshape(batch, seq // chunk, chunk, heads_kv, head_dim)
    return jnp.transpose(x, (1, 0, 3, 2, 4))


def _matmul(spec, a, b, compute_dtype):
    # HIGHEST: the fp32 oracle must not silently drop to TF32/bf16 passes on GPU/TPU.
    return jnp.einsum(
        spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=compute_dtype
    )


def _attend_query_tile(
    q_start_and_tile, *, k_tiles, v_tiles, rules, lengths, score_tiles, softmax_scale, softcap,
    compute_dtype,
):
    """Online softmax of one query tile over all key tiles.

    q_tile: [batch, heads_kv, groups, q_chunk, d]. Returns out [..., q_chunk, head_dim_v]
    (float32) and lse [..., q_chunk] (float32).
    """
    q_start, q_tile = q_start_and_tile
    q_chunk = q_tile.shape[-2]
    kv_chunk = k_tiles.shape[-2]
    q_index = q_start + jnp.arange(q_chunk)
    # Zeros built from q, k and v (not jnp.zeros) so that inside a shard_map body the scan
    # carries vary over the same mesh axes as the values the scan writes into them.
    zero_stats = (
        jnp.zeros_like(q_tile[..., 0], jnp.float32)
        + jnp.zeros_like(k_tiles[0, :, :, None, :1, 0], jnp.float32)
        + jnp.zeros_like(v_tiles[0, :, :, None, :1, 0], jnp.float32)
    )
    carry = (
        zero_stats - jnp.inf,  # running max
        zero_stats,  # running sum of exp
        zero_stats[..., None] + jnp.zeros_like(v_tiles[0, :, :, None, :1], jnp.float32),  # out
    )

    def one_key_tile(carry, k_start_and_tiles):
        running_max, running_sum, acc = carry
        k_start, k_tile, v_tile = k_start_and_tiles
        scores = _matmul("bhgqd,bhkd->bhgqk", q_tile, k_tile, compute_dtype)
        scores = scores * jnp.asarray(softmax_scale, compute_dtype)
        if softcap is not None:
            cap = jnp.asarray(softcap, compute_dtype)
            scores = cap * jnp.tanh(scores / cap)
        scores = score_tiles.biased(scores, q_start, k_start)
        visible = (rules.band(q_index, k_start + jnp.arange(kv_chunk), *lengths)
                   & score_tiles.visible(q_start, k_start, q_chunk, kv_chunk))
        scores = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)

        # The result does not depend on the max (it cancels), so no gradient flows through it.
        new_max = lax.stop_gradient(jnp.maximum(running_max, scores.max(axis=-1)))
        # A row with nothing visible yet has max -inf; subtracting 0 instead keeps exp(-inf)=0
        # rather than exp(nan).
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        probs = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)
        running_sum = running_sum * rescale + probs.sum(axis=-1)
        tile_out = _matmul("bhgqk,bhkd->bhgqd", probs.astype(compute_dtype), v_tile, compute_dtype)
        acc = acc * rescale[..., None] + tile_out.astype(jnp.float32)
        return (new_max, running_sum, acc), None

    k_starts = jnp.arange(k_tiles.shape[0]) * kv_chunk
    # Checkpointed so the scan saves only its carries, never a score tile per step.
    (running_max, running_sum, acc), _ = lax.scan(
        jax.checkpoint(one_key_tile), carry, (k_starts, k_tiles, v_tiles)
    )
    empty = running_sum == 0.0
    # Double where: the untaken branch must be finite too, or its gradient is nan.
    safe_sum = jnp.where(empty, 1.0, running_sum)
    out = jnp.where(empty[..., None], 0.0, acc / safe_sum[..., None])
    lse = jnp.where(empty, -jnp.inf, running_max + jnp.log(safe_sum))
    return out, lse
