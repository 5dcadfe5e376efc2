"""GQA packing: the query heads that share a key/value head run as the rows of one kernel tile.

With grouped-query attention (heads_q = group · heads_kv) and few query rows (decode: seqlen_q =
1), every kernel tile of tile_m ≥ 128 rows holds seqlen_q real rows and the rest is padding that
still costs its full Q·Kᵀ and P·V work, and each of the `group` query heads streams the same K/V
again. Packing reshapes q [b, sq, heads_q, d] into [b, sq · group, heads_kv, d], row
r = s · group + g holding query s of head (kv_head · group + g), so one tile serves the whole
group with one pass over its K/V: at sq = 1 the tile work drops `group`-fold.

The rows of a packed tile belong to different queries, which the kernels' masks (indexed by row)
cannot tell apart, so only calls whose mask is the same for every query row pack: no mask, or
causal with one bottom-right aligned query row (it sees every key). The reshape around the call
copies q, out and lse once each: small next to K/V at the lengths where packing applies
(`PACK_BELOW_SEQLEN_Q`). Ragged batches pack too: rows s < q_len are exactly the packed rows
r < q_len · group.
"""
from __future__ import annotations

import dataclasses

# Calls with seqlen_q at most this pack: a tile (128 or 192 rows) is then at least half padding
# unpacked. Above it a group's packed rows fill about as many tiles as its heads' rows do
# unpacked, and the reshapes would cost without saving tile work.
PACK_BELOW_SEQLEN_Q = 64


def decode_sized(seqlen_q: int, params) -> bool:
    """At most PACK_BELOW_SEQLEN_Q query rows, and a mask the same for every row: the calls
    that may be packed here and split (split_kv.py)."""
    # One query row aligned bottom-right sees every key; aligned top-left, only the first.
    row_independent_mask = (params.window_left is None and params.window_right is None
                            and (not params.causal or (seqlen_q == 1 and not params.top_left)))
    return seqlen_q <= PACK_BELOW_SEQLEN_Q and row_independent_mask


def packs(q_shape, k_shape, params) -> bool:
    """Whether a forward call with these shapes and `AttentionParams` runs packed."""
    return q_shape[2] > k_shape[2] and decode_sized(q_shape[1], params)


def pack(q, k, params, seq_lengths=None):
    """(q [b, sq · group, heads_kv, d], params without the (here vacuous) causal flag,
    seq_lengths with q_len scaled by the group) for a call that `packs`."""
    b, sq, heads_q, d = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    packed_q = (q.reshape(b, sq, heads_kv, group, d).transpose(0, 1, 3, 2, 4)
                .reshape(b, sq * group, heads_kv, d))
    if seq_lengths is not None:
        q_len, kv_len = seq_lengths
        seq_lengths = (q_len * group, kv_len)
    return packed_q, packed_params(params), seq_lengths


def packed_params(params):
    """A packed call's params: without the causal flag, vacuous for the one bottom-right row
    that `decode_sized` lets pack causal, and wrong for its packed rows."""
    return dataclasses.replace(params, causal=False)


def unpack(out, lse, heads_q):
    """The packed call's out [b, sq · group, heads_kv, dv] and lse [b, heads_kv, sq · group]
    back to out [b, sq, heads_q, dv] and lse [b, heads_q, sq]."""
    b, rows, heads_kv, dv = out.shape
    group = heads_q // heads_kv
    sq = rows // group
    out = (out.reshape(b, sq, group, heads_kv, dv).transpose(0, 1, 3, 2, 4)
           .reshape(b, sq, heads_q, dv))
    lse = lse.reshape(b, heads_kv, sq, group).transpose(0, 1, 3, 2).reshape(b, heads_q, sq)
    return out, lse
