"""Context parallelism: ring attention over a sequence sharded along one mesh axis.

Inside a `shard_map` body, each of the n devices on `mesh_axis` holds one block of the query
rows and one block of the key/value rows. `ring_attention` passes the key/value blocks around
the ring with `lax.ppermute`, runs the single-device attention op on (local queries, visiting
keys) at each of the n hops, and merges the partial results by their logsumexp.

The backward pass is the same ring run again (a custom VJP, not autodiff through the forward):
each hop takes the visiting block's share of the gradient from the single-device backward op,
given the merged out and lse (FlashAttention's backward contract), adds dq locally and adds dk,
dv to float32 accumulators that travel with their key/value block and arrive home after the
last hop. So the residuals are only the local (q, k, v, out, lse), whatever n, and dk, dv are
summed in float32.

Causal attention uses the zig-zag layout for load balance: the sequence is cut into 2n equal
chunks and device i holds chunks i and 2n-1-i (one early, one late), so every device does the
same work at every hop. `to_zigzag_layout` / `from_zigzag_layout` permute a full sequence into
and out of that layout; with it, contiguous sharding of the permuted sequence over the mesh
axis gives each device its two chunks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fa4_jax.ops import sharding
from fa4_jax.api.attention import attention_params
from fa4_jax.runtime.lse_merge import merge_by_lse
from fa4_jax.core.params import AttentionParams
from fa4_jax.ops.vjp import backward_cotangents


def ring_attention(
    query,
    key,
    value,
    *,
    mesh_axis: str,
    causal=False,
    softmax_scale=None,
    window_size=(None, None),
    softcap=None,
    deterministic=False,
    return_lse=False,
    implementation=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
):
    """Attention of a sequence sharded over `mesh_axis`; call it inside `shard_map`.

    Each device passes its local blocks; the result is its local block of the full attention.

    Args:
      query: [batch, seqlen_q_local, heads_q, head_dim], this device's query rows.
      key, value: [batch, seqlen_k_local, heads_kv, head_dim(_v)], this device's key rows.
      mesh_axis: the mesh axis the sequence is sharded over (manual in the enclosing
        shard_map); n = its size.
      causal: causal self-attention. The global sequence must be in the zig-zag layout (see
        `to_zigzag_layout`) for queries and keys alike, and the local query and key blocks
        must have one even length. Without causal any layout works, and seqlen_q_local may
        differ from seqlen_k_local.
      softmax_scale, softcap, deterministic, implementation: as `fa4_jax.attention`, applied
        at every hop. deterministic also holds for the ring: hops and merges run in a fixed
        order.
      window_size: must be (None, None); sliding windows are not supported over a ring.
      return_lse: also return the local rows' logsumexp over the whole sequence.
      query_seq_lengths, key_value_seq_lengths: must be None; ragged batches are not
        supported over a ring (each hop would need its block's share of every length).

    Returns:
      out [batch, seqlen_q_local, heads_q, head_dim_v] in the input dtype, and with return_lse
      lse [batch, heads_q, seqlen_q_local] float32; rows in the same layout as the query.
      Both are differentiable.

    Raises:
      NotImplementedError for a sliding window or sequence lengths; ValueError for causal
      blocks of unequal or odd length; plus whatever `fa4_jax.attention` raises for its
      arguments.
    """
    if tuple(window_size) != (None, None):
        raise NotImplementedError(
            f"ring_attention does not support sliding windows (window_size={window_size}); "
            f"use causal=True or gather the sequence and call fa4_jax.attention"
        )
    for name, lengths in (("query_seq_lengths", query_seq_lengths),
                          ("key_value_seq_lengths", key_value_seq_lengths)):
        if lengths is not None:
            raise NotImplementedError(
                f"ring_attention does not support {name} (ragged batches); gather the sequence "
                f"and call fa4_jax.attention with the lengths, or shard the batch instead"
            )
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    params = functools.partial(
        attention_params,
        query,
        key,
        value,
        softmax_scale=softmax_scale,
        softcap=softcap,
        deterministic=deterministic,
        implementation=implementation,
    )
    if causal and (key.shape[1] != query.shape[1] or query.shape[1] % 2):
        raise ValueError(
            f"causal ring_attention needs query and key blocks of one even length (two zig-zag "
            f"chunks each), got seqlen_q_local={query.shape[1]}, seqlen_k_local={key.shape[1]}"
        )
    ring = _Ring(
        mesh_axis=mesh_axis,
        size=lax.axis_size(mesh_axis),
        causal=bool(causal),
        unmasked=params(causal=False),
        first_hop=params(causal=bool(causal)),
    )
    out, lse = _ring_attention(query, key, value, ring)
    return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static description of one ring: axis, size, mask, and the op options per hop."""

    mesh_axis: str
    size: int
    causal: bool
    unmasked: AttentionParams  # hops after the first: whole blocks, no mask
    first_hop: AttentionParams  # the local blocks: causal when the ring is


class _Piece(NamedTuple):
    """The local query rows and visiting key rows one hop attends (static slices)."""

    rows: slice
    keys: slice


_WHOLE = _Piece(rows=slice(None), keys=slice(None))


def _visit(ring, hop, state, key, value, step):
    """state = step(state, key, value, piece, params) for the block visiting at `hop` >= 1.

    Causal, zig-zag: local rows are chunks (i, 2n-1-i) of 2n, and the block from device j
    holds key chunks (j, 2n-1-j). For j < i both local chunks see key chunk j whole and key
    chunk 2n-1-j not at all; for j > i local chunk i sees neither and chunk 2n-1-i sees both
    whole. Either way one half-size attention per hop, the same work on every device. (At
    hop 0, j == i: causal attention of the local blocks, both in increasing order.)
    """
    if not ring.causal:
        return step(state, key, value, _WHOLE, ring.unmasked)
    half = key.shape[1] // 2
    from_earlier = _Piece(rows=slice(None), keys=slice(0, half))
    from_later = _Piece(rows=slice(half, None), keys=slice(None))
    device = lax.axis_index(ring.mesh_axis)
    source = (device - hop) % ring.size
    return lax.cond(
        source < device,
        lambda *args: step(*args, from_earlier, ring.unmasked),
        lambda *args: step(*args, from_later, ring.unmasked),
        state,
        key,
        value,
    )


def _pass_to_next(ring, *blocks):
    """Each device sends its blocks to the next on the ring: after h passes, device i holds
    device (i - h) mod n's blocks."""
    ring_order = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return lax.ppermute(blocks, ring.mesh_axis, perm=ring_order)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_attention(query, key, value, ring):
    return _ring_forward(query, key, value, ring)


def _ring_forward(query, key, value, ring):
    """(out, lse) of the local query rows over the whole ring's keys."""

    def attend(partial, key, value, piece, params):
        out, lse = sharding.attention_forward(
            query[:, piece.rows], key[:, piece.keys], value[:, piece.keys], params
        )
        return partial.merge_rows(piece.rows, out, lse)

    out, lse = sharding.attention_forward(query, key, value, ring.first_hop)
    partial = _Partial(out.astype(jnp.float32), lse)
    if ring.size > 1:
        # Each loop step passes the visiting block on while it attends to it (independent,
        # so the send can overlap the attention); the last hop is peeled off so that it sends
        # nothing.
        def one_hop(carry, hop):
            partial, key, value = carry
            next_key, next_value = _pass_to_next(ring, key, value)
            return (_visit(ring, hop, partial, key, value, attend), next_key, next_value), None

        key, value = _pass_to_next(ring, key, value)
        (partial, key, value), _ = lax.scan(
            one_hop, (partial, key, value), jnp.arange(1, ring.size - 1)
        )
        partial = _visit(ring, ring.size - 1, partial, key, value, attend)
    return partial.out.astype(query.dtype), partial.lse


def _ring_attention_fwd(query, key, value, ring):
    # Each array comes wrapped with whether it is differentiated (symbolic_zeros=True).
    query, key, value = (primal.value for primal in (query, key, value))
    out, lse = _ring_forward(query, key, value, ring)
    return (out, lse), (query, key, value, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents):
    """(dq, dk, dv): the forward's ring again, each hop adding its block's gradient share."""
    query, key, value, out, lse = residuals
    d_out, d_lse = backward_cotangents(cotangents)  # d_lse None: lse not differentiated

    def add_share(grads, key, value, piece, params):
        dq, dk, dv = grads
        rows, keys = piece.rows, piece.keys
        share = sharding.attention_backward(
            query[:, rows], key[:, keys], value[:, keys], out[:, rows], lse[..., rows],
            d_out[:, rows], None if d_lse is None else d_lse[..., rows], params,
        )
        return (
            _update_rows(dq, rows, dq[:, rows] + share[0].astype(jnp.float32), axis=1),
            _update_rows(dk, keys, dk[:, keys] + share[1].astype(jnp.float32), axis=1),
            _update_rows(dv, keys, dv[:, keys] + share[2].astype(jnp.float32), axis=1),
        )

    shares = sharding.attention_backward(
        query, key, value, out, lse, d_out, d_lse, ring.first_hop
    )
    dq, dk, dv = (share.astype(jnp.float32) for share in shares)
    if ring.size > 1:
        # dk, dv travel with their key/value block; the block itself is sent ahead, while
        # the hop computes, and its gradients follow once they include this hop's share.
        def one_hop(carry, hop):
            dq, key, value, dk, dv = carry
            next_key, next_value = _pass_to_next(ring, key, value)
            dq, dk, dv = _visit(ring, hop, (dq, dk, dv), key, value, add_share)
            dk, dv = _pass_to_next(ring, dk, dv)
            return (dq, next_key, next_value, dk, dv), None

        key, value, dk, dv = _pass_to_next(ring, key, value, dk, dv)
        (dq, key, value, dk, dv), _ = lax.scan(
            one_hop, (dq, key, value, dk, dv), jnp.arange(1, ring.size - 1)
        )
        dq, dk, dv = _visit(ring, ring.size - 1, (dq, dk, dv), key, value, add_share)
        dk, dv = _pass_to_next(ring, dk, dv)  # after n passes: home
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd, symbolic_zeros=True)


def _update_rows(x, rows, new_rows, *, axis):
    """x with the static slice `rows` of `axis` replaced by new_rows.

    A dynamic_update_slice at a static offset, not `x.at[...].set` (a scatter, which XLA:CPU
    fails to compile inside these shard_map bodies).
    """
    start = rows.start or 0
    if start == 0 and new_rows.shape[axis] == x.shape[axis]:
        return new_rows
    return lax.dynamic_update_slice_in_dim(x, new_rows, start, axis)


class _Partial(NamedTuple):
    """Attention over some of the keys: out [batch, rows, heads, head_dim_v] float32, and
    lse [batch, heads, rows] float32 (-inf for a row that has seen no key yet)."""

    out: jax.Array
    lse: jax.Array

    def merge_rows(self, rows, out, lse):
        """Merges the attention of `rows` (a static slice) over more keys into those rows."""
        merged = _Partial(self.out[:, rows], self.lse[..., rows]).merge(out, lse)
        return _Partial(
            _update_rows(self.out, rows, merged.out, axis=1),
            _update_rows(self.lse, rows, merged.lse, axis=2),
        )

    def merge(self, out, lse):
        """Attention over the union of the two key sets (disjoint), by logsumexp weights
        (`lse_merge`): a row that has seen no key on either side keeps out 0 and lse -inf."""
        parts_out = jnp.stack([self.out, out.astype(jnp.float32)], axis=1)
        return _Partial(*merge_by_lse(parts_out, jnp.stack([self.lse, lse], axis=1)))


def to_zigzag_layout(x, num_shards, *, seq_axis=1):
    """Reorders a full sequence so that contiguous sharding gives device i chunks i, 2n-1-i.

    Args:
      x: an array whose `seq_axis` (1 for [batch, seq, heads, dim]; 2 for lse
        [batch, heads, seq]) has length divisible by 2 * num_shards.
      num_shards: n, the size of the mesh axis the sequence will be sharded over.

    Returns:
      x with the sequence's 2n chunks in the order 0, 2n-1, 1, 2n-2, ..., n-1, n.
    """
    return _permute_chunks(x, _zigzag_order(num_shards), seq_axis)


def from_zigzag_layout(x, num_shards, *, seq_axis=1):
    """The inverse of `to_zigzag_layout`: chunks back in sequence order."""
    return _permute_chunks(x, np.argsort(_zigzag_order(num_shards)), seq_axis)


def _zigzag_order(num_shards):
    """Chunk indices in zig-zag order: [0, 2n-1, 1, 2n-2, ...]."""
    first = np.arange(num_shards)
    return np.stack([first, 2 * num_shards - 1 - first], axis=1).reshape(-1)


def _permute_chunks(x, order, seq_axis):
    seq_axis = seq_axis % x.ndim
    length = x.shape[seq_axis]
    if length % len(order):
        raise ValueError(
            f"the sequence axis ({seq_axis}, length {length}) must be divisible into "
            f"{len(order)} chunks (2 per shard) for the zig-zag layout"
        )
    chunked = x.reshape(*x.shape[:seq_axis], len(order), -1, *x.shape[seq_axis + 1:])
    return jnp.take(chunked, order, axis=seq_axis).reshape(x.shape)
