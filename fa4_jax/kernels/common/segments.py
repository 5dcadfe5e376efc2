"""Segment ids in the kernels: which blocks a tile visits, which need ids compared, and the
comparison itself on a score tile in registers.

Query row i sees key j only if q_ids[i] == k_ids[j] (on top of the causal/window rules and the
lengths). The span tables (fa4_jax/segment_layout.py) say, per 64 positions, the hull of the
partners they see and the partners every one of them sees; a tile reduces its chunks' entries to

- a visit range: key blocks (query tiles, in the backward) wholly outside it share no segment
  with the tile and are skipped, not masked;
- a full range: blocks wholly inside it are visible to every row of the tile, so the unmasked
  loop runs them; only the blocks between the two compare ids, element by element.

A boolean mask (a `mask_array` kernel) rides the same walk: its span tables come from the mask
(fa4_jax/mask_bits.py), and the blocks between the two ranges test the mask's bit for each score
instead of the ids (the caller folds a call's segment ids into the mask).
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_jax.segment_layout import FULL_HI, FULL_LO, HI, LO, NO_SPAN, SPAN_CHUNK


@dataclasses.dataclass(frozen=True)
class BlockSpans:
    """A tile's ranges over the other side's blocks: [lo, hi) visited, [full_lo, full_hi) with
    every pair visible. Either may be empty (lo >= hi)."""

    lo: Int32
    hi: Int32
    full_lo: Int32
    full_hi: Int32

    def partial(self, block: Int32):
        """Whether some pair of `block` and the tile is hidden (outside the full range): the
        blocks whose ids (or mask bits) must be compared."""
        return (block < self.full_lo) | (block >= self.full_hi)


@dataclasses.dataclass(frozen=True)
class SegmentIds:
    """One call's ids (q_ids [b, sq], k_ids [b, sk] int32) and span tables (row_spans
    [b, ceil(sq / 64), 4], key_spans [b, ceil(sk / 64), 4]), for tiles of tile_m rows and
    tile_n keys (both multiples of SPAN_CHUNK, except a forward's tile_n, which only divides
    positions). bits: a `mask_array` kernel's mask, [b, sq, ceil(sk / 32)] int32, bit k % 32 of
    word k // 32 of row q set when query q may see key k; None otherwise."""

    tile_m: int
    tile_n: int
    q_ids: cute.Tensor
    k_ids: cute.Tensor
    row_spans: cute.Tensor
    key_spans: cute.Tensor
    bits: cute.Tensor | None = None

    @cute.jit
    def _reduce(self, table: cute.Tensor, batch: Int32, block: Int32, tile: cutlass.Constexpr[int],
                other_tile: cutlass.Constexpr[int]) -> BlockSpans:
        """The spans of positions [block · tile, (block + 1) · tile) over blocks of other_tile."""
        chunks = tile // SPAN_CHUNK
        lo, hi, full_lo, full_hi = Int32(NO_SPAN), Int32(0), Int32(0), Int32(NO_SPAN)
        for i in cutlass.range_constexpr(chunks):
            chunk = block * chunks + i
            if chunk < table.shape[1]:
                lo = cutlass.min(lo, table[batch, chunk, LO])
                hi = cutlass.max(hi, table[batch, chunk, HI])
                full_lo = cutlass.max(full_lo, table[batch, chunk, FULL_LO])
                full_hi = cutlass.min(full_hi, table[batch, chunk, FULL_HI])
        # Visited: blocks holding a position of [lo, hi); full: blocks wholly inside
        # [full_lo, full_hi). NO_SPAN + other_tile stays far from overflow.
        return BlockSpans(lo // other_tile, (hi + other_tile - 1) // other_tile,
                          (full_lo + other_tile - 1) // other_tile, full_hi // other_tile)

    @cute.jit
    def key_blocks(self, batch: Int32, m_block: Int32) -> BlockSpans:
        """Query tile m_block's spans over key blocks of tile_n."""
        return self._reduce(self.row_spans, batch, m_block, self.tile_m, self.tile_n)

    @cute.jit
    def query_blocks(self, batch: Int32, n_block: Int32) -> BlockSpans:
        """Key block n_block's spans over query tiles of tile_m (the backward's walk)."""
        return self._reduce(self.key_spans, batch, n_block, self.tile_n, self.tile_m)

    @cute.jit
    def _id(self, ids: cute.Tensor, batch: Int32, position: Int32) -> Int32:
        """ids[batch, position], the position clamped into the buffer: a tile's overhang rows
        and keys are masked or cleared by the length rules, but must not be read out of bounds."""
        return ids[batch, cutlass.min(position, ids.shape[1] - 1)]

    @cute.jit
    def _hidden_by_mask(self, batch: Int32, query: Int32, key: Int32) -> cutlass.Boolean:
        """Whether the mask hides key `key` from query `query` (both clamped into the buffer, as
        `_id` clamps: the length rules mask a tile's overhang)."""
        query = cutlass.min(query, self.bits.shape[1] - 1)
        word = self.bits[batch, query, cutlass.min(key >> 5, self.bits.shape[2] - 1)]
        return ((word >> (key & 31)) & 1) == 0

    @cute.jit
    def _load_ids(self, scores: cute.Tensor, coords0: cute.Tensor, row_ids: cute.Tensor, row_start: Int32,
                  col_ids: cute.Tensor, col_start: Int32, batch: Int32, needed) -> cute.Tensor:
        """The ids of the thread's score rows, then of its columns: [rows + cols] int32 registers,
        loaded where `needed`."""
        rows, cols = cute.size(scores, mode=[0]), cute.size(scores, mode=[1])
        ids = cute.make_rmem_tensor((rows + cols,), Int32)
        if needed:
            for r in cutlass.range_constexpr(rows):
                ids[r] = self._id(row_ids, batch, row_start + coords0[r, 0][0])
            for c in cutlass.range_constexpr(cols):
                ids[rows + c] = self._id(col_ids, batch, col_start + coords0[0, c][1])
        return ids

    def fetch(self, scores: cute.Tensor, coords0: cute.Tensor, thread_row: Int32, thread_col: Int32,
              m_block: Int32, n_block: Int32, batch: Int32, needed):
        """The ids `apply` compares on this thread's scores of block (m_block, n_block), loaded
        into registers where `needed` (the block is partial: BlockSpans.partial); None for a
        mask's bits, which `apply` reads per score.

        A step calls it before it waits for the block's S GEMM: loaded after that wait (ptxas
        keeps loads below a WGMMA wait), each masked block paid a whole L2 round trip on its
        critical path (docs/perf-log.md, "Segment ids: fetched ahead of the S GEMM")."""
        if self.bits is not None:
            return None
        return self._load_ids(scores, coords0, self.q_ids, m_block * self.tile_m + thread_row, self.k_ids,
                              n_block * self.tile_n + thread_col, batch, needed)

    @cute.jit
    def _compare(self, scores: cute.Tensor, coords0: cute.Tensor, row_ids: cute.Tensor, row_start: Int32,
                 col_ids: cute.Tensor, col_start: Int32, batch: Int32, fill: cutlass.Constexpr[float],
                 rows_are_keys: cutlass.Constexpr[bool], fetched, needed):
        """scores[r, c] = fill where the id of row r differs from the id of column c (or, with
        mask bits, where the mask hides the pair), where `needed` (None: everywhere); the
        tile's rows and columns start at row_start and col_start of row_ids and col_ids
        (AttentionMask.apply's register scheme). `fetched`: the ids as `fetch` loaded them, or
        None to load them here."""
        if cutlass.const_expr(needed is None):
            self._compare_all(scores, coords0, row_ids, row_start, col_ids, col_start, batch, fill, rows_are_keys,
                              fetched)
        elif needed:
            self._compare_all(scores, coords0, row_ids, row_start, col_ids, col_start, batch, fill, rows_are_keys,
                              fetched)

    @cute.jit
    def _compare_all(self, scores: cute.Tensor, coords0: cute.Tensor, row_ids: cute.Tensor, row_start: Int32,
                     col_ids: cute.Tensor, col_start: Int32, batch: Int32, fill: cutlass.Constexpr[float],
                     rows_are_keys: cutlass.Constexpr[bool], fetched):
        """`_compare` on every score. Each id not fetched is loaded once per tile; each mask word
        once per score (an L1 hit for all but the first of a row's 32 keys)."""
        if cutlass.const_expr(self.bits is not None):
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                col = col_start + coords0[0, c][1]
                for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                    row = row_start + coords0[r, 0][0]
                    query, key = (col, row) if cutlass.const_expr(rows_are_keys) else (row, col)
                    if self._hidden_by_mask(batch, query, key):
                        scores[r, c] = Float32(fill)
        else:
            rows = cute.size(scores, mode=[0])
            ids_of_rows = fetched  # its first `rows` entries
            if cutlass.const_expr(fetched is None):
                ids_of_rows = cute.make_rmem_tensor((rows,), Int32)
                for r in cutlass.range_constexpr(rows):
                    ids_of_rows[r] = self._id(row_ids, batch, row_start + coords0[r, 0][0])
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                if cutlass.const_expr(fetched is None):
                    col_id = self._id(col_ids, batch, col_start + coords0[0, c][1])
                else:
                    col_id = fetched[rows + c]
                for r in cutlass.range_constexpr(rows):
                    if ids_of_rows[r] != col_id:
                        scores[r, c] = Float32(fill)

    @cute.jit
    def apply(self, scores: cute.Tensor, coords0: cute.Tensor, thread_row: Int32, thread_col: Int32,
              m_block: Int32, n_block: Int32, batch: Int32, fetched=None, needed=None):
        """scores (rows = queries, cols = keys) to −inf where the row's id differs from the key's
        (or the mask hides the pair), where `needed` (None: always); `fetched` from `fetch`, or
        None."""
        self._compare(scores, coords0, self.q_ids, m_block * self.tile_m + thread_row, self.k_ids,
                      n_block * self.tile_n + thread_col, batch, -math.inf, False, fetched, needed)

    @cute.jit
    def apply_transposed(self, scores_t: cute.Tensor, coords0: cute.Tensor, thread_row: Int32,
                         thread_col: Int32, m_block: Int32, n_block: Int32, batch: Int32,
                         fill: cutlass.Constexpr[float]):
        """The same on a transposed tile Sᵀ (rows = keys, cols = queries), to `fill`."""
        self._compare(scores_t, coords0, self.k_ids, n_block * self.tile_n + thread_row, self.q_ids,
                      m_block * self.tile_m + thread_col, batch, fill, True, None, None)
