"""Split-KV: calls with too few tiles to fill the GPU (decode) split their keys over several CTAs.

A decode call has one query tile per (batch entry, KV head) once GQA-packed (pack_gqa.py): at
batch 8 with 8 KV heads that is 64 CTAs on a GPU of 132 SMs, each streaming a whole long KV
cache. Splitting the keys into n contiguous chunks turns k, v [b, sk, hkv, d] into
[b·n, sk/n, hkv, d], a free reshape, and the kernel runs b·n entries, each giving its chunk's
(out_i, lse_i). They combine exactly as softmax blocks do:
lse = log Σ exp(lse_i), out = Σ exp(lse_i − lse) · out_i.

Only the calls packing may take split (`pack_gqa.decode_sized`: few query rows, and no mask or
causal with one query row, which sees every key). The partial outputs come back
in the input dtype, so the combined output carries one more rounding of that dtype than a single
pass: well inside docs/design.md's numerics rule, which allows twice the low-precision reference's
error (tests/gpu/test_split_kv_gpu.py).
"""
from __future__ import annotations

import dataclasses
import math

from fa4_jax.runtime.lse_merge import merge_by_lse
from fa4_jax.runtime.pack_gqa import decode_sized

# A split should leave each chunk enough key blocks that the tile's fixed cost (~6.6 µs at d128,
# docs/perf-log.md) stays small against its streaming time: 1024 keys at d128 are 512 KB of K/V,
# ~4 µs of one SM's share of the HBM bandwidth at 36 GB/s.
MIN_KEYS_PER_SPLIT = 1024
# Enough CTAs for two waves: the kernels run one CTA per SM.
WAVES = 2
# Query rows per tile, for counting a call's tiles. Calls of at most 64 (packed) rows run 64-row
# tiles ("decode"), where any row count up to 64 is one tile either way; longer ones run 128 rows
# (192 at d64, whose tiles this overcounts, erring towards fewer splits).
TILE_ROWS = 128


def num_splits(q_shape, k_shape, params, sm_count: int) -> int:
    """How many key chunks a forward call runs as (1: no split)."""
    batch, seqlen_q, heads_q, _ = q_shape
    seqlen_k, heads_kv = k_shape[1], k_shape[2]
    if not decode_sized(seqlen_q, params):
        return 1
    # Tiles of the call as the kernel will run it: GQA-packed when there is a group to pack.
    rows = seqlen_q * heads_q // heads_kv
    tiles = batch * heads_kv * math.ceil(rows / TILE_ROWS)
    wanted = min(math.ceil(WAVES * sm_count / tiles), seqlen_k // MIN_KEYS_PER_SPLIT)
    # The chunks must tile the keys exactly for the reshape to be free: the largest divisor.
    return max((n for n in range(1, wanted + 1) if seqlen_k % n == 0), default=1)


def split(q, k, v, params, seq_lengths, n: int):
    """The call as b·n entries: (q, k, v, params, seq_lengths) with each entry's chunk of keys.

    Entry (i, j) is batch entry i's keys [j·sk/n, (j+1)·sk/n); its kv length is what remains of
    entry i's within that chunk (0 when the chunk is past it)."""
    b, sk = k.shape[:2]
    if n < 1 or sk % n:
        raise ValueError(f"split_kv={n} must be a positive divisor of seqlen_k={sk}")
    chunk = sk // n
    q = q[:, None].repeat(n, axis=1).reshape((b * n,) + q.shape[1:])
    k = k.reshape((b * n, chunk) + k.shape[2:])
    v = v.reshape((b * n, chunk) + v.shape[2:])
    if seq_lengths is not None:
        import jax.numpy as jnp

        q_len, kv_len = seq_lengths
        starts = jnp.arange(n, dtype=kv_len.dtype) * chunk
        kv_len = jnp.clip(kv_len[:, None] - starts[None, :], 0, chunk).reshape(b * n)
        seq_lengths = (q_len.repeat(n), kv_len)
    return q, k, v, chunk_params(params), seq_lengths


def chunk_params(params):
    """A split call's params: without the causal flag. A causal call splits only with one query
    row, which sees every key of its entry; against a chunk, "causal" would align to the
    chunk's last key instead."""
    return dataclasses.replace(params, causal=False)


def combine(out, lse, n: int):
    """The chunks' out [b·n, sq, h, dv] and lse [b·n, h, sq] merged into the call's out
    [b, sq, h, dv] (input dtype) and lse [b, h, sq] (float32); rows no chunk saw get 0, −inf."""
    merged_out, merged_lse = merge_by_lse(out.reshape((-1, n) + out.shape[1:]),
                                          lse.reshape((-1, n) + lse.shape[1:]))
    return merged_out.astype(out.dtype), merged_lse
