"""Segment ids for the kernels: the span tables of fa4_jax/abi/segment_layout.py, computed in JAX.

For every position the visible partners are those of equal id on the other side within its
valid length. One stable sort of both sides' ids together gives every id a dense rank; scatters
by rank then give each id's first and last position and count on each side, and a gather gives
every position its partners' (first, last, count). So the tables cost one sort and a few O(n)
passes, never an [sq, sk] array (one sort, not a binary search per position: on a GPU each
search or sort is kernels of its own, and the first version's six sorts cost 0.4-0.7 ms per call
at 64k tokens). A position's partners are contiguous when last − first + 1 equals the count:
then the tables may call whole blocks inside that run fully visible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.abi.segment_layout import HI, LO, NO_SPAN, SPAN_CHUNK, WIDEST_BACKWARD_TILE_M


def _dense_ranks(q_ids, kv_ids):
    """(rank of each query id, rank of each key id): equal ids share a rank, ranks < sq + sk."""
    ids = jnp.concatenate([q_ids, kv_ids])
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    new_id = jnp.concatenate([jnp.ones((1,), jnp.int32), (sorted_ids[1:] != sorted_ids[:-1]).astype(jnp.int32)])
    rank = jnp.zeros_like(order, dtype=jnp.int32).at[order].set(jnp.cumsum(new_id, dtype=jnp.int32) - 1)
    return rank[:q_ids.shape[0]], rank[q_ids.shape[0]:]


def _runs(ranks, count, num_ranks):
    """Per rank, (first, last, how many) of the positions p < count holding it."""
    position = jnp.arange(ranks.shape[0], dtype=jnp.int32)
    valid = position < count
    first = jnp.full((num_ranks,), NO_SPAN, jnp.int32).at[ranks].min(jnp.where(valid, position, NO_SPAN))
    last = jnp.full((num_ranks,), -1, jnp.int32).at[ranks].max(jnp.where(valid, position, -1))
    how_many = jnp.zeros((num_ranks,), jnp.int32).at[ranks].add(valid.astype(jnp.int32))
    return first, last, how_many


def _reduce_groups(x, size: int, identity, reduce):
    """x's last axis reduced in consecutive groups of `size`, the last group padded with
    `identity`."""
    groups = -(-x.shape[-1] // size)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, groups * size - x.shape[-1])], constant_values=identity)
    return reduce(x.reshape(*x.shape[:-1], groups, size), axis=-1)


def chunk_table(first, last, partners, count):
    """[ceil(n / SPAN_CHUNK), 4] entries (LO, HI, FULL_LO, FULL_HI) of one side of one batch
    entry, from each position's partners (first, last, how many) and the side's valid count."""
    length = first.shape[0]
    counted = jnp.arange(length, dtype=jnp.int32) < count
    seen = counted & (partners > 0)
    exact = seen & (last - first + 1 == partners)
    lo = jnp.where(seen, first, NO_SPAN)
    hi = jnp.where(seen, last + 1, 0)
    full_lo = jnp.where(counted, jnp.where(exact, first, NO_SPAN), 0)
    full_hi = jnp.where(counted, jnp.where(exact, last + 1, 0), NO_SPAN)
    by_chunk = functools.partial(_reduce_groups, size=SPAN_CHUNK)
    return jnp.stack([by_chunk(lo, identity=NO_SPAN, reduce=jnp.min), by_chunk(hi, identity=0, reduce=jnp.max),
                      by_chunk(full_lo, identity=0, reduce=jnp.max),
                      by_chunk(full_hi, identity=NO_SPAN, reduce=jnp.min)],
                     axis=1).astype(jnp.int32)


def _entry_tables(q_ids, kv_ids, q_len, kv_len):
    q_rank, k_rank = _dense_ranks(q_ids, kv_ids)
    num_ranks = q_ids.shape[0] + kv_ids.shape[0]
    key_runs = _runs(k_rank, kv_len, num_ranks)
    query_runs = _runs(q_rank, q_len, num_ranks)
    row_spans = chunk_table(*(x[q_rank] for x in key_runs), q_len)
    key_spans = chunk_table(*(x[k_rank] for x in query_runs), kv_len)
    return row_spans, key_spans


def span_tables(q_ids, kv_ids, seq_lengths=None):
    """(row_spans [b, ceil(sq / 64), 4], key_spans [b, ceil(sk / 64), 4]) int32 of int32
    segment ids q_ids [b, sq] and kv_ids [b, sk], with the ragged lengths (q_len, kv_len) [b]
    when given (positions past them are not counted)."""
    batch, seqlen_q = q_ids.shape
    seqlen_k = kv_ids.shape[1]
    if seq_lengths is None:
        q_len = jnp.full((batch,), seqlen_q, jnp.int32)
        kv_len = jnp.full((batch,), seqlen_k, jnp.int32)
    else:
        q_len, kv_len = (jnp.clip(x.astype(jnp.int32), 0, n) for x, n in zip(seq_lengths, (seqlen_q, seqlen_k)))
    return jax.vmap(_entry_tables)(q_ids, kv_ids, q_len, kv_len)


def operands(segment_ids, seq_lengths=None):
    """The segments custom calls' four operands (q_ids, kv_ids, row_spans, key_spans), int32,
    from the caller's integer (q_ids [b, sq], kv_ids [b, sk]); computed once per call, for the
    forward and its backward."""
    q_ids, kv_ids = (ids.astype(np.int32) for ids in segment_ids)
    return (q_ids, kv_ids, *span_tables(q_ids, kv_ids, seq_lengths))


def deterministic_walk(row_spans, key_spans, tile_m: int = WIDEST_BACKWARD_TILE_M):
    """key_spans [b, ceil(sk / 64), 4] with each chunk's visit range (LO, HI) replaced by the rows
    of the query tiles (tile_m rows each) whose key hull reaches the chunk: the backward's walk in
    deterministic mode.

    In deterministic mode query tile m's dQ takes the adds of the key blocks in its key hull
    (row_spans reduced over the tile, `SegmentIds.key_blocks`) in a fixed order, each waiting for
    its turn; a key block of that hull that did not visit m would leave every later turn waiting
    forever. The key spans' own hull (the rows that see the chunk's keys) need not hold m: a
    tile of ids 1 and 3 has the keys of id 2 in its hull and no row that sees them. This table
    is the hull relation transposed, so a key block walks every tile that counts it (and the
    rows that see its keys are among them). FULL_LO and FULL_HI are kept.

    tile_m: the backward kernel's query tile. A tile of WIDEST_BACKWARD_TILE_M rows holds whole
    narrower ones and its hull theirs, so that width walks a superset for any kernel (at most one
    extra narrow tile at each end of a key block's walk)."""
    if tile_m % SPAN_CHUNK:
        raise ValueError(f"tile_m={tile_m}: a query tile is whole {SPAN_CHUNK}-row chunks")
    per_tile = tile_m // SPAN_CHUNK
    hull_lo = _reduce_groups(row_spans[..., LO], per_tile, NO_SPAN, jnp.min)
    hull_hi = _reduce_groups(row_spans[..., HI], per_tile, 0, jnp.max)
    tiles = hull_lo.shape[-1]
    first_key = jnp.arange(key_spans.shape[1], dtype=jnp.int32) * SPAN_CHUNK
    reaches = (hull_lo[:, :, None] < first_key + SPAN_CHUNK) & (hull_hi[:, :, None] > first_key)
    tile = jnp.arange(tiles, dtype=jnp.int32)[None, :, None]
    first = jnp.min(jnp.where(reaches, tile, tiles), axis=1)
    last = jnp.max(jnp.where(reaches, tile, -1), axis=1)
    walked = last >= 0
    return jnp.asarray(key_spans).at[..., LO].set(jnp.where(walked, first * tile_m, NO_SPAN)).at[..., HI].set(
        jnp.where(walked, (last + 1) * tile_m, 0))
