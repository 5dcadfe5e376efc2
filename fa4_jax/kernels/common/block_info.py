"""Which key blocks a query tile visits, and which of them need a mask.

Mask geometry (docs/design.md): query row i sees key column j when
`i + offset - window_left <= j <= i + offset + window_right` and j < seqlen_k, where the
diagonal's offset is seqlen_k - seqlen_q (bottom-right alignment, FlashAttention's) or 0
(top-left, jax.nn.dot_product_attention's). seqlen_q and seqlen_k are one batch entry's valid
lengths (a ragged batch's, else the buffers'); tiles past them visit nothing. A causal mask is
window_right = 0 with no left bound.
Kernels walk key blocks from the highest to the lowest, so the first block visited carries the
sequence tail and the diagonal, and the row maximum is seeded by real scores.

Integer division here truncates toward zero, so every numerator is clamped to >= 0 first.
"""
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclasses.dataclass(frozen=True)
class MaskBounds:
    """The runtime half of a mask: the window bounds (unused without a "local" mask) and the
    alignment (`top_left` nonzero: offset 0; None or 0: bottom-right)."""

    window_left: Int32
    window_right: Int32
    top_left: Int32 | None = None

    @cute.jit
    def offset(self, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """The diagonal's column at row 0."""
        offset = seqlen_k - seqlen_q
        if cutlass.const_expr(self.top_left is not None):
            offset = offset * (1 - self.top_left)
        return offset

    @cute.jit
    def shifted(self, base: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """base + offset, summed left to right as `base + seqlen_k - seqlen_q`."""
        result = base + seqlen_k - seqlen_q
        if cutlass.const_expr(self.top_left is not None):
            result = base + self.offset(seqlen_q, seqlen_k)
        return result


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    tile_m: int
    tile_n: int
    causal: bool
    local: bool
    bounds: MaskBounds

    @property
    def has_right_bound(self) -> bool:
        return self.causal or self.local

    @cute.jit
    def _right_limit(self) -> Int32:
        """How far right of the diagonal a row sees (0 for causal)."""
        limit = Int32(0)
        if cutlass.const_expr(self.local):
            limit = self.bounds.window_right
        return limit

    @cute.jit
    def n_block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[n_block_min, n_block_max): the key blocks with at least one visible key for this tile."""
        n_block_max = cute.ceil_div(seqlen_k, self.tile_n)
        n_block_min = Int32(0)
        offset = self.bounds.offset(seqlen_q, seqlen_k)
        if cutlass.const_expr(self.has_right_bound):
            last_row = cutlass.min((m_block + 1) * self.tile_m, seqlen_q) - 1
            # Blocks up to the one holding column last_row + offset + right; none if that is < 0.
            reach = last_row + offset + self._right_limit() + self.tile_n
            n_block_max = cutlass.min(n_block_max, cutlass.max(reach, 0) // self.tile_n)
        if cutlass.const_expr(self.local):
            first_col = m_block * self.tile_m + offset - self.bounds.window_left
            n_block_min = cutlass.max(first_col, 0) // self.tile_n
        if m_block * self.tile_m >= seqlen_q:  # a tile of padding rows
            n_block_max = n_block_min
        return n_block_min, n_block_max

    @cute.jit
    def n_block_min_right_masked(self, m_block: Int32, n_block_min: Int32, seqlen_q: Int32,
                                 seqlen_k: Int32) -> Int32:
        """Blocks at or above this index cross the right (causal/window) edge for some row."""
        first_unseen = self.bounds.shifted(m_block * self.tile_m, seqlen_q, seqlen_k) + self._right_limit() + 1
        return cutlass.max(n_block_min, cutlass.max(first_unseen, 0) // self.tile_n)

    @cute.jit
    def n_block_min_unmasked(self, m_block: Int32, n_block_min: Int32, seqlen_q: Int32,
                             seqlen_k: Int32) -> Int32:
        """Blocks below this index cross the left window edge for some row."""
        result = n_block_min
        if cutlass.const_expr(self.local):
            last_row = cutlass.min((m_block + 1) * self.tile_m, seqlen_q) - 1
            left_edge = self.bounds.shifted(last_row, seqlen_q, seqlen_k) - self.bounds.window_left
            result = cutlass.max(n_block_min, (cutlass.max(left_edge, 0) + self.tile_n - 1) // self.tile_n)
        return result

    @cute.jit
    def m_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[m_block_min, m_block_max): the query tiles a backward key block visits.

        A superset of the tiles whose `n_block_range` holds n_block (the inverse relation, derived
        from the same bounds without the sequence clipping), so no query tile that counts this key
        block in its deterministic dQ order is skipped; tiles in it with no visible pair are fully
        masked and contribute zero.
        """
        m_block_max = cute.ceil_div(seqlen_q, self.tile_m)
        m_block_min = Int32(0)
        offset = self.bounds.offset(seqlen_q, seqlen_k)
        if cutlass.const_expr(self.has_right_bound):
            # Row i sees column j only if i >= j - offset - right: the first row the block's
            # first key is visible to.
            first_row = n_block * self.tile_n - offset - self._right_limit()
            m_block_min = cutlass.max(first_row, 0) // self.tile_m
        if cutlass.const_expr(self.local):
            # Row i sees column j only if i <= j - offset + left: the last row that still sees the
            # block's last key; none if that is < 0.
            last_row = (n_block + 1) * self.tile_n - 1 - offset + self.bounds.window_left
            m_block_max = cutlass.min(m_block_max, cutlass.max(last_row + self.tile_m, 0) // self.tile_m)
        if n_block * self.tile_n >= seqlen_k:  # a block of padding keys
            m_block_max = m_block_min
        return m_block_min, m_block_max

    @cute.jit
    def tile_needs_mask(self, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                        seqlen_k: Int32) -> cutlass.Boolean:
        """Whether some (row, column) pair of the tile falls outside the causal/window band.

        Sequence tails are not its concern: padded rows carry lse = +inf (so P = 0), and the
        backward masks keys past seqlen_k (the buffer's, or a ragged entry's) separately
        (AttentionMask.apply_key_tail).
        """
        needed = cutlass.Boolean(False)
        offset = self.bounds.offset(seqlen_q, seqlen_k)
        if cutlass.const_expr(self.has_right_bound):
            # The tile's first row against its last column.
            first_row_reach = m_block * self.tile_m + offset + self._right_limit()
            if first_row_reach < (n_block + 1) * self.tile_n - 1:
                needed = cutlass.Boolean(True)
        if cutlass.const_expr(self.local):
            # The tile's last row against its first column.
            last_row_start = (m_block + 1) * self.tile_m - 1 + offset - self.bounds.window_left
            if last_row_start > n_block * self.tile_n:
                needed = cutlass.Boolean(True)
        return needed
