"""Which (query row, key) pairs of an attention call take part in its softmax: one value for
every way a call restricts them, composed by conjunction.

Row i of batch entry b sees key j when every given restriction holds:

- lengths: i < query_lengths[b] and j < key_lengths[b] (the whole sequence when not given);
- causal: j <= i + offset;
- window_left: j >= i + offset - window_left; window_right: j <= i + offset + window_right;
- segment ids: query_segment_ids[b, i] == kv_segment_ids[b, j];
- mask: mask[b, h, i, j] (each axis of the mask its full size or 1);

with offset = key length - query length (the diagonal through the bottom-right corner,
FlashAttention's rule), or 0 when top_left (the top-left corner, jax.nn.dot_product_attention's).
A row that sees no key has out 0 and lse -inf.

The rules (causal, the window, the alignment) are static Python values; lengths, ids and the
mask are arrays (traced values are fine). `Visibility` is a pytree whose leaves are its arrays,
so it passes through `jax.jit` and the op's VJP as one argument. Nothing here imports the rest
of the package.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Visibility:
    """The restrictions of one call (see the module docstring); every field optional.

    causal: bool; window_left, window_right: ints >= 0 or None (unbounded); top_left: bool.
    query_lengths, key_lengths: int32 [batch], values in [0, seqlen_q] and [0, seqlen_k].
    query_segment_ids, kv_segment_ids: int32 [batch, seqlen_q] and [batch, seqlen_k].
    mask: bool [batch | 1, heads_q | 1, seqlen_q, seqlen_k].
    """

    causal: bool = dataclasses.field(default=False, metadata=_STATIC)
    window_left: int | None = dataclasses.field(default=None, metadata=_STATIC)
    window_right: int | None = dataclasses.field(default=None, metadata=_STATIC)
    top_left: bool = dataclasses.field(default=False, metadata=_STATIC)
    query_lengths: jax.Array | None = None
    key_lengths: jax.Array | None = None
    query_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    mask: jax.Array | None = None

    @property
    def banded(self) -> bool:
        """A rule hides pairs: causal or a window bound."""
        return self.causal or self.window_left is not None or self.window_right is not None

    @property
    def ragged(self) -> bool:
        """Each entry has lengths of its own."""
        return self.query_lengths is not None or self.key_lengths is not None

    @property
    def segmented(self) -> bool:
        return self.query_segment_ids is not None

    @property
    def masked(self) -> bool:
        """A boolean mask array is given (the one meaning of "masked" in fa4_jax)."""
        return self.mask is not None

    @property
    def per_head_mask(self) -> bool:
        return self.mask is not None and self.mask.shape[1] != 1

    @property
    def restricted(self) -> bool:
        """Some restriction is given (a call without one sees every pair)."""
        return self.banded or self.ragged or self.segmented or self.masked

    def rules(self) -> Visibility:
        """The static rules alone."""
        return Visibility(self.causal, self.window_left, self.window_right, self.top_left)

    def band(self, rows, keys, query_length, key_length):
        """Bool, `rows[:, None]` against `keys[None, :]` broadcast with the lengths: the pairs the
        lengths and the rules show. rows, keys: int positions; query_length, key_length: the
        sequence lengths, static ints (every entry whole) or int32 arrays shaped to broadcast
        against the [rows, keys] grid (a ragged batch: rows past an entry's length see nothing)."""
        rows, keys = rows[:, None], keys[None, :]
        diagonal = rows + (0 if self.top_left else key_length - query_length)
        seen = keys < key_length
        if not isinstance(query_length, int):
            seen = seen & (rows < query_length)
        if self.causal:
            seen = seen & (keys <= diagonal)
        if self.window_left is not None:
            seen = seen & (keys >= diagonal - self.window_left)
        if self.window_right is not None:
            seen = seen & (keys <= diagonal + self.window_right)
        return seen

    def pairs(self, seqlen_q: int, seqlen_k: int):
        """Bool [batch | 1, heads | 1, seqlen_q, seqlen_k]: every restriction evaluated densely
        (the definition; for small shapes and tests)."""
        rows = jnp.arange(seqlen_q, dtype=jnp.int32)
        keys = jnp.arange(seqlen_k, dtype=jnp.int32)
        if self.ragged:
            batch = (self.query_lengths if self.query_lengths is not None else self.key_lengths).shape[0]
            q_len, kv_len = (jnp.broadcast_to(jnp.asarray(n if x is None else x, jnp.int32), (batch,))
                             [:, None, None, None]
                             for x, n in ((self.query_lengths, seqlen_q), (self.key_lengths, seqlen_k)))
            seen = self.band(rows, keys, q_len, kv_len)
        else:
            seen = self.band(rows, keys, seqlen_q, seqlen_k)[None, None]
        if self.segmented:
            seen = seen & (self.query_segment_ids[:, None, :, None] == self.kv_segment_ids[:, None, None, :])
        if self.masked:
            seen = seen & self.mask
        return seen
