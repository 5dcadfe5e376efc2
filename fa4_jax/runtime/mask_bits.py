"""Boolean masks for the kernels: the mask's bits and span tables, computed in JAX.

A call with jax's `mask=` runs the segments kernels' walk (kernels/common/segments.py) with the
mask in place of the ids' runs: span tables of the same layout (fa4_jax/abi/segment_layout.py) say,
per 64 query rows, the hull of the keys they see and the keys every one of them sees (and, per
64 keys, the same of the rows that see them), so key blocks a tile sees none of are skipped,
blocks it sees whole run unmasked, and only the blocks between read the mask's bits. The call's
causal and window rules and its lengths are folded into the bits first, so one kernel per head
dim serves every mask (the variants with `mask_array`, problem class "none").

The bits are the mask packed 32 keys to an int32 word: [b, sq, ceil(sk / 32)], bit k % 32 of
word k // 32 of row q set when q sees k; 1/8 of the boolean mask's bytes. The tables come from
the bits: one pass over the caller's mask in all, and no float [sq, sk] buffer. A table's full
range is the partners every counted position sees, when they form one run (a mask need not be
one run per row, as segment ids are: its rows' intersection may still be).

The mask_array kernels test bits instead of comparing ids: a call with segment ids and a mask
folds the ids into the mask, and the id operands are all 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.abi.segment_layout import MASK_WORD_BITS as WORD_BITS
from fa4_jax.abi.segment_layout import NO_SPAN, SPAN_CHUNK


def _bit_weights():
    """uint32 [32]: bit i of a word alone (a bool's weight in a word's sum)."""
    return jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))


def visible(mask, params, seq_lengths, seqlen_q: int, seqlen_k: int):
    """Bool [b, sq, sk]: which (row, key) pairs take part in the softmax, from the caller's
    mask [b | 1, sq | 1, sk | 1] (its head axis dropped: one mask for every head), the call's
    causal and window rules (`params`, aligned as `params.top_left` says) and its lengths
    (q_len, kv_len) [b], whose padding rows and keys see nothing."""
    q_len, kv_len = (x[:, None, None] for x in seq_lengths)
    # Lengths as arrays make the rule ragged: rows past q_len see no key.
    seen = params.rules.band(jnp.arange(seqlen_q, dtype=jnp.int32), jnp.arange(seqlen_k, dtype=jnp.int32),
                             q_len, kv_len)
    return jnp.broadcast_to(mask, seen.shape) & seen


def pack(seen):
    """Bool [b, sq, sk] -> int32 [b, sq, ceil(sk / 32)], bit k % 32 of word k // 32 = seen[.., k].

    A sum of 32 weighted bools per word, which XLA fuses with the mask's fold into one pass
    (0.21 ms for 16k x 16k on the H200; four bools per multiply as uint32 words measured 2x
    slower, its byte view not fusing: docs/perf-log.md)."""
    batch, seqlen_q, seqlen_k = seen.shape
    words = -(-seqlen_k // WORD_BITS)
    padded = jnp.pad(seen, [(0, 0), (0, 0), (0, words * WORD_BITS - seqlen_k)])
    bits = jnp.sum(padded.reshape(batch, seqlen_q, words, WORD_BITS).astype(jnp.uint32) * _bit_weights(),
                   axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def unpack(bits, seqlen_k: int):
    """The inverse of `pack`: bool [b, sq, seqlen_k]."""
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    seen = (words[..., None] >> shifts) & 1
    return seen.reshape(*bits.shape[:-1], -1)[..., :seqlen_k].astype(bool)


def _bit_runs(words):
    """Over the last axis of uint32 words read as one bit string: (first set bit, last set bit,
    how many), int32 (first NO_SPAN and last -1 where none is set)."""
    base = jnp.arange(words.shape[-1], dtype=jnp.int32) * WORD_BITS
    nonzero = words != 0
    lowest = words & (jnp.uint32(0) - words)  # the lowest set bit alone
    first_in_word = WORD_BITS - 1 - jax.lax.clz(lowest).astype(jnp.int32)
    last_in_word = WORD_BITS - 1 - jax.lax.clz(words).astype(jnp.int32)
    first = jnp.min(jnp.where(nonzero, base + first_in_word, NO_SPAN), axis=-1)
    last = jnp.max(jnp.where(nonzero, base + last_in_word, -1), axis=-1)
    count = jnp.sum(jax.lax.population_count(words).astype(jnp.int32), axis=-1)
    return first, last, count


def _entries(any_first, any_last, every_first, every_last, every_count, counted):
    """Span entries (LO, HI, FULL_LO, FULL_HI) [..., 4]: the hull of the partners any counted
    position sees, and the partners every one sees when they form one run (else none); the
    reductions' identities where no position is counted (fa4_jax/abi/segment_layout.py)."""
    one_run = (every_count > 0) & (every_last - every_first + 1 == every_count)
    lo = jnp.where(counted, any_first, NO_SPAN)
    hi = jnp.where(counted, any_last + 1, 0)
    full_lo = jnp.where(counted, jnp.where(one_run, every_first, NO_SPAN), 0)
    full_hi = jnp.where(counted, jnp.where(one_run, every_last + 1, 0), NO_SPAN)
    return jnp.stack([lo, hi, full_lo, full_hi], axis=-1).astype(jnp.int32)


def _chunk_words(words, q_len):
    """Per 64 rows of bits words [b, sq, W] (uint32): (OR of their words: keys any of them
    sees; AND over the rows below q_len: keys all counted ones see, all ones where none is
    counted; AND over every row: keys all 64 see, rows past q_len seeing none), [b, chunks, W]
    each, and whether each chunk holds a counted row [b, chunks]: one pass over 1/8 of the
    mask's bytes, which both tables read instead of the words."""
    batch, seqlen_q, width = words.shape
    chunks = -(-seqlen_q // SPAN_CHUNK)
    counted = jnp.arange(chunks * SPAN_CHUNK, dtype=jnp.int32)[None, :] < q_len[:, None]
    words = jnp.pad(words, [(0, 0), (0, chunks * SPAN_CHUNK - seqlen_q), (0, 0)])
    by_chunk = (batch, chunks, SPAN_CHUNK, width)
    ones = ~np.uint32(0)
    any_words = jax.lax.reduce(words.reshape(by_chunk), np.uint32(0), jax.lax.bitwise_or, (2,))
    counted_words = jnp.where(counted[..., None], words, ones).reshape(by_chunk)
    every_counted = jax.lax.reduce(counted_words, ones, jax.lax.bitwise_and, (2,))
    every_row = jax.lax.reduce(words.reshape(by_chunk), ones, jax.lax.bitwise_and, (2,))
    return any_words, every_counted, every_row, counted.reshape(batch, chunks, SPAN_CHUNK).any(axis=-1)


def _row_spans(any_words, every_counted, has_counted_rows):
    """Row spans [b, ceil(sq / 64), 4]: the runs of each 64 rows' OR (LO, HI) and AND (the full
    range) of words (`_chunk_words`)."""
    any_first, any_last, _ = _bit_runs(any_words)
    return _entries(any_first, any_last, *_bit_runs(every_counted), has_counted_rows)


def _key_spans(any_words, every_row, kv_len, seqlen_k: int):
    """Key spans [b, ceil(sk / 64), 4], in whole 64-row chunks: per chunk of rows and 64 keys
    (two words of `_chunk_words`' OR and AND), whether a row of the chunk sees one of the counted
    keys (below kv_len) and whether every row sees every one, then the runs of those chunks down
    each column. The hull and the full range come out rounded outward and inward to 64 rows,
    which changes no tile's blocks: the backward's query tiles are multiples of 64 rows."""
    batch, row_chunks, width = any_words.shape
    chunks = -(-seqlen_k // SPAN_CHUNK)
    words_per_chunk = SPAN_CHUNK // WORD_BITS
    keys = jnp.arange(chunks * SPAN_CHUNK, dtype=jnp.int32).reshape(chunks * words_per_chunk, WORD_BITS)
    counted_bits = jnp.sum(jnp.where(keys[None] < kv_len[:, None, None], _bit_weights(), 0), axis=-1,
                           dtype=jnp.uint32).reshape(batch, 1, chunks, words_per_chunk)

    def by_key_chunk(x):
        x = jnp.pad(x, [(0, 0), (0, 0), (0, chunks * words_per_chunk - width)])
        return x.reshape(batch, row_chunks, chunks, words_per_chunk)

    sees_any = jnp.any(by_key_chunk(any_words) != 0, axis=-1)
    sees_every = jnp.all(by_key_chunk(every_row) & counted_bits == counted_bits, axis=-1)
    starts = jnp.arange(row_chunks, dtype=jnp.int32)[None, :, None] * SPAN_CHUNK

    def runs(seen):
        first = jnp.min(jnp.where(seen, starts, NO_SPAN), axis=1)
        last = jnp.max(jnp.where(seen, starts + SPAN_CHUNK - 1, -1), axis=1)
        return first, last, jnp.sum(seen, axis=1, dtype=jnp.int32) * SPAN_CHUNK

    any_first, any_last, _ = runs(sees_any)
    counted = jnp.arange(chunks, dtype=jnp.int32)[None, :] * SPAN_CHUNK < kv_len[:, None]
    return _entries(any_first, any_last, *runs(sees_every), counted)


def operands(mask, params, seq_lengths, seqlen_q: int, seqlen_k: int, batch: int | None = None):
    """The masked custom calls' five operands (q_ids, kv_ids, row_spans, key_spans, bits), int32,
    from the caller's bool mask [b | 1, sq | 1, sk | 1] and the call's rules and lengths (as for
    `visible`); computed once per call, for the forward and its backward.

    seq_lengths None: every one of the call's `batch` entries runs at full length. A mask shared
    by the batch (axis 0 of size 1) is then folded, packed and reduced once, and its operands
    broadcast to the batch: at 4 entries a quarter of the passes over the mask."""
    if seq_lengths is None:
        shared = mask.shape[0]
        full = tuple(jnp.full((shared,), n, jnp.int32) for n in (seqlen_q, seqlen_k))
        return tuple(jnp.broadcast_to(x, (batch,) + x.shape[1:])
                     for x in operands(mask, params, full, seqlen_q, seqlen_k))
    q_len, kv_len = seq_lengths
    batch = q_len.shape[0]
    bits = pack(visible(mask, params, seq_lengths, seqlen_q, seqlen_k))
    any_words, every_counted, every_row, has_counted_rows = _chunk_words(
        jax.lax.bitcast_convert_type(bits, jnp.uint32), q_len)
    q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
    kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
    return (q_ids, kv_ids, _row_spans(any_words, every_counted, has_counted_rows),
            _key_spans(any_words, every_row, kv_len, seqlen_k), bits)
