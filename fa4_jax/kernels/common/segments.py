"""Segment ids in the kernels: which blocks a tile visits, which need ids compared, and the
comparison itself on a score tile in registers.

Query row i sees key j only if q_ids[i] == k_ids[j] (on top of the causal/window rules and the
lengths). The span tables (fa4_jax/abi/segment_layout.py) say, per 64 positions, the hull of the
partners they see and the partners every one of them sees; a tile reduces its chunks' entries to

- a visit range: key blocks (query tiles, in the backward) wholly outside it share no segment
  with the tile and are skipped, not masked;
- a full range: blocks wholly inside it are visible to every row of the tile, so the unmasked
  loop runs them; only the blocks between the two compare ids, element by element.

A boolean mask (a `mask_array` kernel) rides the same walk: its span tables come from the mask
(fa4_jax/runtime/mask_bits.py), and the blocks between the two ranges test the mask's bit for each score
instead of the ids (the caller folds a call's segment ids into the mask), from the words that
cover the thread's rows (forward: fetched ahead of the S GEMM, as the ids are) or its columns
(backward: one per query column, shared by the thread's keys).
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_jax.abi.segment_layout import FULL_HI, FULL_LO, HI, LO, MASK_WORD_BITS, NO_SPAN, SPAN_CHUNK


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

    def __post_init__(self):
        if self.bits is not None and self.tile_n % MASK_WORD_BITS:
            raise ValueError(f"tile_n={self.tile_n}: a mask's key blocks must start on a word of its bits "
                             f"(a multiple of {MASK_WORD_BITS} keys)")

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

    @cute.jit
    def _load_row_words(self, scores: cute.Tensor, coords0: cute.Tensor, row_start: Int32, n_block: Int32,
                        batch: Int32, needed) -> cute.Tensor:
        """The mask words of the thread's score rows over key block n_block, [rows · words]
        int32 registers (words = tile_n / 32, row by row), loaded where `needed`. A row past the
        buffer reads its last row and a word past it its last word: the length rules mask the
        tile's overhang."""
        rows, words = cute.size(scores, mode=[0]), self.tile_n // MASK_WORD_BITS
        fetched = cute.make_rmem_tensor((rows * words,), Int32)
        if needed:
            first = n_block * words
            for r in cutlass.range_constexpr(rows):
                query = cutlass.min(row_start + coords0[r, 0][0], self.bits.shape[1] - 1)
                for w in cutlass.range_constexpr(words):
                    fetched[r * words + w] = self.bits[batch, query, cutlass.min(first + w, self.bits.shape[2] - 1)]
        return fetched

    def fetch(self, scores: cute.Tensor, coords0: cute.Tensor, thread_row: Int32, thread_col: Int32,
              m_block: Int32, n_block: Int32, batch: Int32, needed):
        """What `apply` reads on this thread's scores of block (m_block, n_block), loaded into
        registers where `needed` (the block is partial: BlockSpans.partial): the ids it compares,
        or a mask's words over the block's keys (8 for two rows of 128 keys, where testing a bit
        per score loaded a word per score, 64).

        A step calls it before it waits for the block's S GEMM: loaded after that wait (ptxas
        keeps loads below a WGMMA wait), each masked block paid a whole L2 round trip on its
        critical path (docs/perf-log.md, "Segment ids: fetched ahead of the S GEMM")."""
        if self.bits is not None:
            return self._load_row_words(scores, coords0, m_block * self.tile_m + thread_row, n_block, batch, needed)
        return self._load_ids(scores, coords0, self.q_ids, m_block * self.tile_m + thread_row, self.k_ids,
                              n_block * self.tile_n + thread_col, batch, needed)

    @cute.jit
    def _test_row_words(self, scores: cute.Tensor, coords0: cute.Tensor, thread_col: Int32, words: cute.Tensor,
                        needed):
        """scores[r, c] = −inf where the mask word of row r (`_load_row_words`) hides column c,
        where `needed`. A column's word and bit: the block starts on a word (tile_n is a multiple
        of 32) and the thread's first column is below 8, so a column offset of o lies in word
        o // 32 at bit thread_col + o % 32 (`_check_word_layout`)."""
        if needed:
            per_row = self.tile_n // MASK_WORD_BITS
            shifted = cute.make_rmem_tensor((cute.size(words),), Int32)
            for i in cutlass.range_constexpr(cute.size(words)):
                shifted[i] = words[i] >> thread_col
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    col = coords0[r, c][1]
                    if (shifted[r * per_row + col // MASK_WORD_BITS] >> (col % MASK_WORD_BITS)) & 1 == 0:
                        scores[r, c] = -Float32.inf

    @cute.jit
    def _test_bits_transposed(self, scores_t: cute.Tensor, coords0: cute.Tensor, key_start: Int32,
                              query_start: Int32, batch: Int32, fill: cutlass.Constexpr[float]):
        """scores_t[r, c] (rows = keys, cols = queries) = fill where the mask hides key r from
        query c: one word per column and 32 rows of keys, shared by the thread's keys in it (2 of
        them, where testing a bit per score loaded a word per score). key_start = the thread's
        first key, whose offset in its word is below 24 (`_check_word_layout`), so a row offset
        o lies in word key_start // 32 + o // 32 at bit key_start % 32 + o % 32."""
        rows = cute.size(scores_t, mode=[0])
        groups = _row_word_groups(coords0)
        key_word, key_bit = key_start >> 5, key_start & (MASK_WORD_BITS - 1)
        for c in cutlass.range_constexpr(cute.size(scores_t, mode=[1])):
            query = cutlass.min(query_start + coords0[0, c][1], self.bits.shape[1] - 1)
            for g in cutlass.range_constexpr(len(groups)):
                word = self.bits[batch, query, cutlass.min(key_word + groups[g], self.bits.shape[2] - 1)]
                for r in cutlass.range_constexpr(rows):
                    row = coords0[r, 0][0]
                    if cutlass.const_expr(row // MASK_WORD_BITS == groups[g]):
                        if (word >> (key_bit + row % MASK_WORD_BITS)) & 1 == 0:
                            scores_t[r, c] = Float32(fill)

    @cute.jit
    def _compare(self, scores: cute.Tensor, coords0: cute.Tensor, row_ids: cute.Tensor, row_start: Int32,
                 col_ids: cute.Tensor, col_start: Int32, batch: Int32, fill: cutlass.Constexpr[float], fetched,
                 needed):
        """scores[r, c] = fill where the id of row r differs from the id of column c, where
        `needed` (None: everywhere); the tile's rows and columns start at row_start and col_start
        of row_ids and col_ids (AttentionMask.apply's register scheme). `fetched`: the ids as
        `fetch` loaded them, or None to load them here."""
        if cutlass.const_expr(needed is None):
            self._compare_all(scores, coords0, row_ids, row_start, col_ids, col_start, batch, fill, fetched)
        elif needed:
            self._compare_all(scores, coords0, row_ids, row_start, col_ids, col_start, batch, fill, fetched)

    @cute.jit
    def _compare_all(self, scores: cute.Tensor, coords0: cute.Tensor, row_ids: cute.Tensor, row_start: Int32,
                     col_ids: cute.Tensor, col_start: Int32, batch: Int32, fill: cutlass.Constexpr[float], fetched):
        """`_compare` on every score; each id not fetched is loaded once per tile."""
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
        None to load the ids here. A mask's words always come from `fetch`, with the block's
        `needed` (TileMask, the forward's only caller, fetches every block it applies)."""
        if cutlass.const_expr(self.bits is not None):
            _check_word_layout(coords0, 1, COLUMN_ORIGIN_MAX)
            self._test_row_words(scores, coords0, thread_col, fetched, needed)
        else:
            self._compare(scores, coords0, self.q_ids, m_block * self.tile_m + thread_row, self.k_ids,
                          n_block * self.tile_n + thread_col, batch, -math.inf, fetched, needed)

    @cute.jit
    def apply_transposed(self, scores_t: cute.Tensor, coords0: cute.Tensor, thread_row: Int32,
                         thread_col: Int32, m_block: Int32, n_block: Int32, batch: Int32,
                         fill: cutlass.Constexpr[float]):
        """The same on a transposed tile Sᵀ (rows = keys, cols = queries), to `fill`."""
        if cutlass.const_expr(self.bits is not None):
            _check_word_layout(coords0, 0, ROW_ORIGIN_MAX)
            self._test_bits_transposed(scores_t, coords0, n_block * self.tile_n + thread_row,
                                       m_block * self.tile_m + thread_col, batch, fill)
        else:
            self._compare(scores_t, coords0, self.k_ids, n_block * self.tile_n + thread_row, self.q_ids,
                          m_block * self.tile_m + thread_col, batch, fill, None, None)


# A thread's first register of a WGMMA accumulator, modulo 32: its column 2 · (lane % 4) is at
# most 6; its row 16 · (warp % 4) + lane / 4 is at most 23. With a block that starts on a mask
# word, a register at offset o from it shares the word of offset o − o % 32 while o % 32 plus
# this stays below 32.
COLUMN_ORIGIN_MAX = 6
ROW_ORIGIN_MAX = 23


def _row_word_groups(coords0: cute.Tensor) -> list[int]:
    """The words (from the thread's first key's) that a thread's rows of keys fall in."""
    return sorted({coords0[r, 0][0] // MASK_WORD_BITS for r in range(cute.size(coords0, mode=[0]))})


def _check_word_layout(coords0: cute.Tensor, mode: int, origin_max: int):
    """Raise at trace time unless every register offset of `coords0` along `mode` (1: columns,
    0: rows) stays in its word from any thread origin up to origin_max (mod 32)."""
    offsets = {coords0[r, c][mode] % MASK_WORD_BITS
               for r in range(cute.size(coords0, mode=[0])) for c in range(cute.size(coords0, mode=[1]))}
    if max(offsets) + origin_max >= MASK_WORD_BITS:
        raise ValueError(f"mask words: register offsets {sorted(offsets)} (mod {MASK_WORD_BITS}) from a thread "
                         f"origin up to {origin_max} cross a word; the bit tests assume they do not")
