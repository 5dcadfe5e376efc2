"""Segment ids for the kernels: the span tables of fa4_jax/segment_layout.py, computed in JAX.

For every position the visible partners are those of equal id on the other side within its
valid length. One stable sort of the partner ids and two binary searches per position give their
count, the first and the last (equal ids sort in position order), so the tables cost
O((sq + sk) log) and never an [sq, sk] array. A position's partners are contiguous when last −
first + 1 equals the count: then the tables may call whole blocks inside that run fully visible.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.segment_layout import NO_SPAN, SPAN_CHUNK


def _partner_runs(ids, partner_ids, partner_count):
    """(first, last, count) of the partners of each position: the positions j < partner_count
    with partner_ids[j] == ids[i]. first and last are meaningless where count is 0."""
    order = jnp.argsort(partner_ids, stable=True).astype(jnp.int32)
    sorted_ids = partner_ids[order]
    valid = (order < partner_count).astype(jnp.int32)
    valid_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(valid, dtype=jnp.int32)])
    # method="sort": one sort of both arrays, where the default ("scan") is a loop of log2(n)
    # dependent gathers, each a kernel launch on a GPU.
    left = jnp.searchsorted(sorted_ids, ids, side="left", method="sort").astype(jnp.int32)
    right = jnp.searchsorted(sorted_ids, ids, side="right", method="sort").astype(jnp.int32)
    count = valid_before[right] - valid_before[left]
    # Within a run of equal ids the positions ascend, so its valid ones (below partner_count)
    # come first.
    last_index = len(order) - 1
    first = order[jnp.clip(left, 0, last_index)]
    last = order[jnp.clip(left + count - 1, 0, last_index)]
    return first, last, count


def _chunk_table(ids, partner_ids, count, partner_count):
    """[ceil(len(ids) / SPAN_CHUNK), 4] entries (LO, HI, FULL_LO, FULL_HI) of one batch entry."""
    length = ids.shape[0]
    first, last, partners = _partner_runs(ids, partner_ids, partner_count)
    counted = jnp.arange(length, dtype=jnp.int32) < count
    seen = counted & (partners > 0)
    exact = seen & (last - first + 1 == partners)
    lo = jnp.where(seen, first, NO_SPAN)
    hi = jnp.where(seen, last + 1, 0)
    full_lo = jnp.where(counted, jnp.where(exact, first, NO_SPAN), 0)
    full_hi = jnp.where(counted, jnp.where(exact, last + 1, 0), NO_SPAN)
    chunks = -(-length // SPAN_CHUNK)
    pad = chunks * SPAN_CHUNK - length

    def by_chunk(x, identity, reduce):
        x = jnp.pad(x, (0, pad), constant_values=identity).reshape(chunks, SPAN_CHUNK)
        return reduce(x, axis=1)

    return jnp.stack([by_chunk(lo, NO_SPAN, jnp.min), by_chunk(hi, 0, jnp.max),
                      by_chunk(full_lo, 0, jnp.max), by_chunk(full_hi, NO_SPAN, jnp.min)],
                     axis=1).astype(jnp.int32)


def span_tables(q_ids, kv_ids, seq_lengths=None):
    """(row_spans [b, ceil(sq / 64), 4], key_spans [b, ceil(sk / 64), 4]) int32 of segment ids
    q_ids [b, sq] and kv_ids [b, sk] (int32), with the ragged lengths (q_len, kv_len) [b] when
    given (positions past them are not counted)."""
    batch, seqlen_q = q_ids.shape
    seqlen_k = kv_ids.shape[1]
    if seq_lengths is None:
        q_len = jnp.full((batch,), seqlen_q, jnp.int32)
        kv_len = jnp.full((batch,), seqlen_k, jnp.int32)
    else:
        q_len, kv_len = (jnp.clip(x.astype(jnp.int32), 0, n) for x, n in zip(seq_lengths, (seqlen_q, seqlen_k)))
    row_spans = jax.vmap(_chunk_table)(q_ids, kv_ids, q_len, kv_len)
    key_spans = jax.vmap(_chunk_table)(kv_ids, q_ids, kv_len, q_len)
    return row_spans, key_spans


def operands(segment_ids, seq_lengths=None):
    """The segments custom calls' four operands (q_ids, kv_ids, row_spans, key_spans), int32,
    from the caller's (q_ids [b, sq], kv_ids [b, sk]), or those four themselves (computed once
    for a forward and its backward)."""
    if len(segment_ids) == 4:
        return tuple(segment_ids)
    q_ids, kv_ids = (ids.astype(np.int32) for ids in segment_ids)
    return (q_ids, kv_ids, *span_tables(q_ids, kv_ids, seq_lengths))
