"""Context parallelism: ring attention over a sequence sharded along one mesh axis.

Inside a `shard_map` body, each of the n devices on `mesh_axis` holds one block of the query
rows and one block of the key/value rows. `ring_attention` passes the key/value blocks around
the ring with `lax.ppermute` (n - 1 hops, each overlappable with one block's attention), runs
the single-device attention on (local queries, visiting keys) and merges the partial results by
their logsumexp. Gradients come from autodiff through the ring: `attention`'s custom VJP takes
the cotangents of both its outputs (out and lse), and the transpose of each ppermute sends the
key/value gradients back around the ring.

Causal attention uses the zig-zag layout for load balance: the sequence is cut into 2n equal
chunks and device i holds chunks i and 2n-1-i (one early, one late), so every device does the
same work at every hop. `to_zigzag_layout` / `from_zigzag_layout` permute a full sequence into
and out of that layout; with it, contiguous sharding of the permuted sequence over the mesh
axis gives each device its two chunks.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fa4_jax.api import attention


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
        at every hop. deterministic also holds for the ring: the merge order is fixed.
      window_size: must be (None, None); sliding windows are not supported over a ring.
      return_lse: also return the local rows' logsumexp over the whole sequence.

    Returns:
      out [batch, seqlen_q_local, heads_q, head_dim_v] in the input dtype, and with return_lse
      lse [batch, heads_q, seqlen_q_local] float32; rows in the same layout as the query.

    Raises:
      NotImplementedError for a sliding window; ValueError for causal blocks of unequal or odd
      length; plus whatever `fa4_jax.attention` raises for its arguments.
    """
    if tuple(window_size) != (None, None):
        raise NotImplementedError(
            f"ring_attention does not support sliding windows (window_size={window_size}); "
            f"use causal=True or gather the sequence and call fa4_jax.attention"
        )
    options = dict(
        softmax_scale=softmax_scale,
        softcap=softcap,
        deterministic=deterministic,
        return_lse=True,
        implementation=implementation,
    )
    ring_size = lax.axis_size(mesh_axis)
    if causal:
        out, lse = _causal_zigzag_ring(query, key, value, mesh_axis, ring_size, options)
    else:
        out, lse = _full_ring(query, key, value, mesh_axis, ring_size, options)
    out = out.astype(query.dtype)
    return (out, lse) if return_lse else out


def _full_ring(query, key, value, mesh_axis, ring_size, options):
    """Non-causal: every query block sees every key block."""

    def attend(partial, key, value, hop):
        del hop
        return partial.merge(*attention(query, key, value, **options))

    out, lse = attention(query, key, value, **options)
    partial = _Partial(out.astype(jnp.float32), lse)
    partial = _around_the_ring(mesh_axis, ring_size, key, value, partial, attend)
    return partial.out, partial.lse


def _causal_zigzag_ring(query, key, value, mesh_axis, ring_size, options):
    """Causal in the zig-zag layout: local rows are chunks (i, 2n-1-i) of 2n.

    With the key/value blocks of device j visiting device i:
      j == i (hop 0): causal attention of the local block with itself (both chunk pairs are in
        increasing order, so local causality is global causality);
      j < i: both local query chunks see key chunk j whole and key chunk 2n-1-j not at all;
      j > i: local query chunk i sees neither key chunk; chunk 2n-1-i sees both whole.
    Each hop after the first is one half-size attention: the same work on every device.
    """
    seqlen = query.shape[1]
    if key.shape[1] != seqlen or seqlen % 2:
        raise ValueError(
            f"causal ring_attention needs query and key blocks of one even length (two zig-zag "
            f"chunks each), got seqlen_q_local={seqlen}, seqlen_k_local={key.shape[1]}"
        )
    half = seqlen // 2
    device = lax.axis_index(mesh_axis)

    def key_block_is_earlier(early, late, key, value):
        out, lse = attention(query, key[:, :half], value[:, :half], **options)
        return (
            early.merge(out[:, :half], lse[..., :half]),
            late.merge(out[:, half:], lse[..., half:]),
        )

    def key_block_is_later(early, late, key, value):
        return early, late.merge(*attention(query[:, half:], key, value, **options))

    def attend(halves, key, value, hop):
        source = (device - hop) % ring_size
        return lax.cond(
            source < device, key_block_is_earlier, key_block_is_later, *halves, key, value
        )

    out, lse = attention(query, key, value, causal=True, **options)
    out = out.astype(jnp.float32)
    halves = (
        _Partial(out[:, :half], lse[..., :half]),
        _Partial(out[:, half:], lse[..., half:]),
    )
    early, late = _around_the_ring(mesh_axis, ring_size, key, value, halves, attend)
    return (
        jnp.concatenate([early.out, late.out], axis=1),
        jnp.concatenate([early.lse, late.lse], axis=-1),
    )


def _around_the_ring(mesh_axis, ring_size, key, value, partials, attend):
    """Hops 1 .. n-1: partials = attend(partials, key, value, hop) with the visiting blocks.

    Hop 0 (the local blocks) is the caller's. Each loop step passes the visiting blocks on
    while it attends to them (the two are independent, so the send can overlap the
    attention); the last hop is peeled off the loop so that it sends nothing.
    """
    if ring_size == 1:
        return partials

    def one_hop(carry, hop):
        partials, key, value = carry
        next_key, next_value = _pass_to_next(mesh_axis, ring_size, key, value)
        return (attend(partials, key, value, hop), next_key, next_value), None

    key, value = _pass_to_next(mesh_axis, ring_size, key, value)
    (partials, key, value), _ = lax.scan(
        one_hop, (partials, key, value), jnp.arange(1, ring_size - 1)
    )
    return attend(partials, key, value, ring_size - 1)


def _pass_to_next(mesh_axis, ring_size, *blocks):
    """Each device sends its blocks to the next on the ring: after h hops, device i holds
    device (i - h) mod n's blocks."""
    ring = [(i, (i + 1) % ring_size) for i in range(ring_size)]
    return lax.ppermute(blocks, mesh_axis, perm=ring)


class _Partial(NamedTuple):
    """Attention over some of the keys: out [batch, rows, heads, head_dim_v] float32, and
    lse [batch, heads, rows] float32 (-inf for a row that has seen no key yet)."""

    out: jax.Array
    lse: jax.Array

    def merge(self, out, lse):
        """Attention over the union of the two key sets (disjoint), by logsumexp weights.

        out = Σ exp(lse_i - lse) out_i and lse = log Σ exp(lse_i); shifted by the larger lse
        so no exp overflows. Safe for -inf lse on either side: a row that has seen no key at
        all keeps out 0 and lse -inf, and the gradients stay finite (the double `where`
        keeps log(0) and 0/0 out of the untaken branches).
        """
        larger = jnp.maximum(self.lse, lse)
        shift = jnp.where(jnp.isfinite(larger), larger, 0.0)
        weight_self = jnp.exp(self.lse - shift)
        weight_other = jnp.exp(lse - shift)
        total = weight_self + weight_other
        empty = total == 0.0
        safe_total = jnp.where(empty, 1.0, total)
        merged_lse = jnp.where(empty, -jnp.inf, shift + jnp.log(safe_total))

        def rows_to_out_layout(weight):  # [batch, heads, rows] -> [batch, rows, heads, 1]
            return jnp.swapaxes(weight / safe_total, 1, 2)[..., None]

        merged_out = (
            rows_to_out_layout(weight_self) * self.out
            + rows_to_out_layout(weight_other) * out.astype(jnp.float32)
        )
        return _Partial(merged_out, merged_lse)


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
