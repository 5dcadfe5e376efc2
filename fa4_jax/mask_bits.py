"""Boolean masks for the kernels: the mask's bits and span tables, computed in JAX.

A call with jax's `mask=` runs the segments kernels' walk (kernels/common/segments.py) with the
mask in place of the ids' runs: span tables of the same layout (fa4_jax/segment_layout.py) say,
per 64 query rows, the hull of the keys they see and the keys every one of them sees (and, per
64 keys, the same of the rows that see them), so key blocks a tile sees none of are skipped,
blocks it sees whole run unmasked, and only the blocks between read the mask's bits. The call's
causal and window rules and its lengths are folded into the bits first, so one kernel per head
dim serves every mask (the variants with `mask_array`, problem class "none").

The bits are the mask packed 32 keys to an int32 word: [b, sq, ceil(sk / 32)], bit k % 32 of
word k // 32 of row q set when q sees k; 1/8 of the boolean mask's bytes. The tables come from
the bits (rows) and from one reduction over the boolean mask (keys): no float [sq, sk] buffer,
and no pass beyond those two over the caller's mask.

The ids the segments kernels also compare are all 0 (one segment): a call with segment ids and
a mask folds the ids into the mask instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.segments import chunk_table

WORD_BITS = 32


def visible(mask, params, seq_lengths, seqlen_q: int, seqlen_k: int):
    """Bool [b, sq, sk]: which (row, key) pairs take part in the softmax, from the caller's
    mask [b | 1, sq | 1, sk | 1] (its head axis dropped: one mask for every head), the call's
    causal and window rules (`params`, aligned as `params.top_left` says) and its lengths
    (q_len, kv_len) [b], whose padding rows and keys see nothing."""
    q_len, kv_len = seq_lengths
    batch = q_len.shape[0]
    rows = jnp.arange(seqlen_q, dtype=jnp.int32)[None, :, None]
    keys = jnp.arange(seqlen_k, dtype=jnp.int32)[None, None, :]
    q_len, kv_len = q_len[:, None, None], kv_len[:, None, None]
    diagonal = rows + (0 if params.top_left else kv_len - q_len)
    seen = jnp.broadcast_to(mask, (batch, seqlen_q, seqlen_k)) & (rows < q_len) & (keys < kv_len)
    if params.causal:
        seen &= keys <= diagonal
    if params.window_left is not None:
        seen &= keys >= diagonal - params.window_left
    if params.window_right is not None:
        seen &= keys <= diagonal + params.window_right
    return seen


def pack(seen):
    """Bool [b, sq, sk] -> int32 [b, sq, ceil(sk / 32)], bit k % 32 of word k // 32 = seen[.., k]."""
    batch, seqlen_q, seqlen_k = seen.shape
    words = -(-seqlen_k // WORD_BITS)
    padded = jnp.pad(seen, [(0, 0), (0, 0), (0, words * WORD_BITS - seqlen_k)])
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    bits = jnp.sum(padded.reshape(batch, seqlen_q, words, WORD_BITS).astype(jnp.uint32) * weights,
                   axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def unpack(bits, seqlen_k: int):
    """The inverse of `pack`: bool [b, sq, seqlen_k]."""
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    seen = (words[..., None] >> shifts) & 1
    return seen.reshape(*bits.shape[:-1], -1)[..., :seqlen_k].astype(bool)


def _row_runs(bits):
    """Per row of bits [b, sq, words]: (first seen key, last seen key, how many), each int32
    [b, sq] (first and last arbitrary where none is seen)."""
    words = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    base = jnp.arange(words.shape[-1], dtype=jnp.int32) * WORD_BITS
    nonzero = words != 0
    lowest = words & (jnp.uint32(0) - words)  # the lowest set bit alone
    first_in_word = WORD_BITS - 1 - jax.lax.clz(lowest).astype(jnp.int32)
    last_in_word = WORD_BITS - 1 - jax.lax.clz(words).astype(jnp.int32)
    first = jnp.min(jnp.where(nonzero, base + first_in_word, np.iinfo(np.int32).max), axis=-1)
    last = jnp.max(jnp.where(nonzero, base + last_in_word, -1), axis=-1)
    count = jnp.sum(jax.lax.population_count(words).astype(jnp.int32), axis=-1)
    return first, last, count


def _key_runs(seen):
    """Per key of seen [b, sq, sk]: (first row that sees it, last, how many), int32 [b, sk]."""
    rows = jnp.arange(seen.shape[1], dtype=jnp.int32)[None, :, None]
    first = jnp.min(jnp.where(seen, rows, np.iinfo(np.int32).max), axis=1)
    last = jnp.max(jnp.where(seen, rows, -1), axis=1)
    count = jnp.sum(seen, axis=1, dtype=jnp.int32)
    return first, last, count


def operands(mask, params, seq_lengths, seqlen_q: int, seqlen_k: int):
    """The masked custom calls' five operands (q_ids, kv_ids, row_spans, key_spans, bits), int32,
    from the caller's bool mask [b | 1, sq | 1, sk | 1] and the call's rules and lengths (as for
    `visible`); computed once per call, for the forward and its backward."""
    q_len, kv_len = seq_lengths
    batch = q_len.shape[0]
    seen = visible(mask, params, seq_lengths, seqlen_q, seqlen_k)
    bits = pack(seen)
    row_spans = jax.vmap(chunk_table)(*_row_runs(bits), q_len)
    key_spans = jax.vmap(chunk_table)(*_key_runs(seen), kv_len)
    q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
    kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
    return q_ids, kv_ids, row_spans, key_spans, bits
