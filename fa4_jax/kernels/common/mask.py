"""Element masks on a score tile held in registers (-inf where a key is not visible)."""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_jax.kernels.common.block_info import MaskBounds
from fa4_jax.kernels.common.segments import BlockSpans, SegmentIds


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Applies the sequence-tail, causal and sliding-window rules of block_info.py to one tile,
    and with `segments` the segment ids' (kernels/common/segments.py; `batch` then names the
    entry whose ids apply).

    Register (r, c) of a thread sits at (thread_row, thread_col) + coords0[r, c] inside the tile,
    where `coords0` is thread 0's partition of the tile's identity tensor (compile-time constants)
    and the thread offsets are two runtime integers. Comparing a constant column against a
    per-row limit keeps the mask at one compare per element and no per-element registers;
    per-thread coordinates would be loop-invariant values the compiler hoists into ~64 live
    registers, which on the causal path pushed the MMA warps past 240 registers and made ptxas
    serialize every WGMMA (C7512).
    """

    tile_m: int
    tile_n: int
    causal: bool
    local: bool
    bounds: MaskBounds
    segments: SegmentIds | None = None

    @cute.jit
    def apply(
        self,
        scores: cute.Tensor,
        coords0: cute.Tensor,
        thread_row: Int32,
        thread_col: Int32,
        m_block: Int32,
        n_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        batch: Int32 | None = None,
        fetched=None,
        segments_needed=None,
    ):
        """`fetched`: what TileMask.fetch loaded for this block, or None (loaded here);
        `segments_needed`: whether the segment rules apply to the block (None: they do)."""
        window_left, window_right = self.bounds.window_left, self.bounds.window_right
        offset = self.bounds.offset(seqlen_q, seqlen_k)
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            row = m_block * self.tile_m + thread_row + coords0[r, 0][0]
            # Visible columns of this row as [col_lo, col_hi), relative to the thread's first column.
            col_base = n_block * self.tile_n + thread_col
            col_hi = seqlen_k - col_base
            col_lo = Int32(0)
            if cutlass.const_expr(self.causal):
                col_hi = cutlass.min(col_hi, row + offset + 1 - col_base)
            if cutlass.const_expr(self.local):
                col_hi = cutlass.min(col_hi, row + offset + window_right + 1 - col_base)
                col_lo = row + offset - window_left - col_base
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                col = coords0[r, c][1]
                if col >= col_hi:
                    scores[r, c] = -Float32.inf
                if cutlass.const_expr(self.local):
                    if col < col_lo:
                        scores[r, c] = -Float32.inf
        if cutlass.const_expr(self.segments is not None):
            self.segments.apply(scores, coords0, thread_row, thread_col, m_block, n_block, batch, fetched,
                                segments_needed)

    @cute.jit
    def apply_key_tail(
        self,
        scores_t: cute.Tensor,
        coords0: cute.Tensor,
        thread_row: Int32,
        n_block: Int32,
        seqlen_k: Int32,
        fill: cutlass.Constexpr[float] = -math.inf,
    ):
        """Rows of a transposed tile Sᵀ past seqlen_k (keys TMA zero-filled) become `fill`.

        A zero-filled key scores exactly 0, so its P = exp2(−LSElog2) overflows to +inf for a row
        whose lse is below about −88; inf · 0 in the dQ GEMM would then be NaN.
        """
        for r in cutlass.range_constexpr(cute.size(scores_t, mode=[0])):
            key = n_block * self.tile_n + thread_row + coords0[r, 0][0]
            if key >= seqlen_k:
                for c in cutlass.range_constexpr(cute.size(scores_t, mode=[1])):
                    scores_t[r, c] = Float32(fill)

    @cute.jit
    def apply_transposed(
        self,
        scores_t: cute.Tensor,
        coords0: cute.Tensor,
        thread_row: Int32,
        thread_col: Int32,
        m_block: Int32,
        n_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        fill: cutlass.Constexpr[float] = -math.inf,
        batch: Int32 | None = None,
    ):
        """The causal/window rules on a transposed tile Sᵀ: rows are keys, columns are queries,
        and with `segments` the ids' (`batch` names the entry).

        Invisible entries become `fill` (−inf for scores; 0 for a tile that already holds P or dS).
        Same register-coordinate scheme as `apply`. The sequence tails are not masked here: padded
        query rows have lse = +inf (P = 0), and keys past seqlen_k go through `apply_key_tail`.
        """
        if cutlass.const_expr(self.causal or self.local):
            window_left, window_right = self.bounds.window_left, self.bounds.window_right
            offset = self.bounds.offset(seqlen_q, seqlen_k)
            for r in cutlass.range_constexpr(cute.size(scores_t, mode=[0])):
                key = n_block * self.tile_n + thread_row + coords0[r, 0][0]
                # Queries that see this key, as [col_lo, col_hi) relative to the thread's first column.
                col_base = m_block * self.tile_m + thread_col
                right = Int32(0)
                if cutlass.const_expr(self.local):
                    right = window_right
                col_lo = key - offset - right - col_base
                col_hi = Int32(0)
                if cutlass.const_expr(self.local):
                    col_hi = key - offset + window_left + 1 - col_base
                for c in cutlass.range_constexpr(cute.size(scores_t, mode=[1])):
                    col = coords0[r, c][1]
                    if col < col_lo:
                        scores_t[r, c] = Float32(fill)
                    if cutlass.const_expr(self.local):
                        if col >= col_hi:
                            scores_t[r, c] = Float32(fill)
        if cutlass.const_expr(self.segments is not None):
            self.segments.apply_transposed(scores_t, coords0, thread_row, thread_col, m_block, n_block, batch,
                                           fill)


@dataclasses.dataclass(frozen=True)
class TileMask:
    """An AttentionMask bound to one thread's registers of one query tile: its coordinate
    scheme, the tile's m_block, its entry's lengths and, with segments, the entry and the
    tile's spans over key blocks (SegmentIds.key_blocks): the segment rules are fetched and
    applied only on blocks outside the full span. What a key block's step fetches ahead of its
    scores and then applies to them."""

    mask: AttentionMask
    coords0: cute.Tensor
    thread_row: Int32
    thread_col: Int32
    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    batch: Int32 | None = None
    spans: BlockSpans | None = None

    def __post_init__(self):
        if self.mask.segments is not None and self.spans is None:
            raise ValueError("a TileMask with segment ids needs the tile's spans (SegmentIds.key_blocks)")

    def _segments_needed(self, n_block: Int32):
        return None if self.spans is None else self.spans.partial(n_block)

    def fetch(self, scores: cute.Tensor, n_block: Int32):
        """What `apply` reads from memory for key block n_block, the segment ids or the mask's
        words, loaded into registers now, so that a step can issue the loads before it waits for
        the block's scores (SegmentIds.fetch); None when the rules read nothing."""
        if self.mask.segments is None:
            return None
        return self.mask.segments.fetch(scores, self.coords0, self.thread_row, self.thread_col, self.m_block,
                                        n_block, self.batch, self._segments_needed(n_block))

    def apply(self, scores: cute.Tensor, n_block: Int32, fetched=None):
        self.mask.apply(scores, self.coords0, self.thread_row, self.thread_col, self.m_block, n_block,
                        self.seqlen_q, self.seqlen_k, self.batch, fetched, self._segments_needed(n_block))
