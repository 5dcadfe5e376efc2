"""Backward postprocess: dQ = softmax_scale · dQaccum, fp32 -> the io dtype.

mdQaccum [b, h, sq_pad, d] (fp32, filled by the main kernel's adds) -> mdQ [b, sq, h, d]; rows
>= seqlen_q are padding and are not written. Rows past the batch entry's valid query rows
(mSeqUsedQ [b]: a ragged batch's padding) are written as 0.

In tile order (row-major rows) each thread converts `chunk` contiguous elements per step (32-byte
loads, 16-byte stores). In fragment order (the Hopper backward's dq_fragment_order) each query
block of `fragment_tile_m` rows holds the main kernel's dQ accumulators as
layouts.fragment_order_view lays them out; one CTA per block, running the main kernel's dQ tiled
MMA, reads each thread's accumulator back with 16-byte loads, converts it, puts it back in the
tile's order through shared memory and stores rows as in tile order.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4_jax.kernels.common.layouts import FRAGMENT_GROUP_THREADS, fragment_order_view


class BackwardPostprocess:
    threads = 128
    rows_per_block = 64
    chunk = 8

    def __init__(self, dtype, head_dim: int, fragment_tile_m: int | None = None):
        assert head_dim % self.chunk == 0, "whole chunks per row"
        self.dtype = dtype
        self.head_dim = head_dim
        self.fragment_tile_m = fragment_tile_m
        self.chunks_per_row = head_dim // self.chunk
        assert self.rows_per_block * self.chunks_per_row % self.threads == 0, "whole steps per block"
        self.steps = self.rows_per_block * self.chunks_per_row // self.threads

    @cute.jit
    def __call__(self, mdQaccum, mdQ, mSeqUsedQ, softmax_scale: Float32, stream, tiled_mma_dq=None):
        """tiled_mma_dq: the main kernel's dQ MMA, which defines fragment order (else unused)."""
        sq_pad, heads, batch = mdQaccum.shape[2], mdQaccum.shape[1], mdQaccum.shape[0]
        if cutlass.const_expr(self.fragment_tile_m is not None):
            self.kernel_fragment_order(mdQaccum, mdQ, mSeqUsedQ, softmax_scale, tiled_mma_dq).launch(
                grid=(sq_pad // self.fragment_tile_m, heads, batch),
                block=[cute.size(tiled_mma_dq), 1, 1],
                smem=cute.size_in_bytes(self.dtype, self._fragment_tile_layout()) + 16,
                stream=stream,
            )
            return
        self.kernel(mdQaccum, mdQ, mSeqUsedQ, softmax_scale).launch(
            grid=(cute.ceil_div(sq_pad, self.rows_per_block), heads, batch),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mdQaccum, mdQ, mSeqUsedQ, softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, batch = cute.arch.block_idx()
        seqlen_q = mdQ.shape[1]
        seq_used_q = mSeqUsedQ[batch]
        accum = mdQaccum[batch, head, None, None]
        out = mdQ[batch, None, head, None]
        for step in cutlass.range_constexpr(self.steps):
            index = step * self.threads + tidx
            row = row_block * self.rows_per_block + index // self.chunks_per_row
            col_chunk = index % self.chunks_per_row
            self._store_chunk(out, row, col_chunk, seqlen_q, seq_used_q, lambda: (
                cute.local_tile(accum, (1, self.chunk), (row, col_chunk)).load() * softmax_scale
            ).to(self.dtype))

    @cute.kernel
    def kernel_fragment_order(self, mdQaccum, mdQ, mSeqUsedQ, softmax_scale: Float32,
                              tiled_mma_dq: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mdQ.shape[1]
        seq_used_q = mSeqUsedQ[batch]
        tile = (self.fragment_tile_m, self.head_dim)
        thr_mma = tiled_mma_dq.get_slice(tidx)
        acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C(tile))
        slab = cute.local_tile(mdQaccum[batch, head, None, None], tile, (m_block, 0)).iterator
        groups = cute.size(tiled_mma_dq) // FRAGMENT_GROUP_THREADS
        cute.autovec_copy(fragment_order_view(slab, acc.shape, tidx, groups), acc)
        values = cute.make_rmem_tensor_like(acc, self.dtype)
        values.store((acc.load() * softmax_scale).to(self.dtype))
        # Through shared memory back to the tile's order, so that rows leave in 16-byte stores
        # (a thread's registers are column pairs of rows 8 apart: stored directly, each warp
        # store would touch 8 rows with 16 bytes each).
        sTile = cutlass.utils.SmemAllocator().allocate_tensor(
            self.dtype, self._fragment_tile_layout(), byte_alignment=16)
        cute.autovec_copy(values, thr_mma.partition_C(sTile))
        cute.arch.barrier()
        out = mdQ[batch, None, head, None]
        for step in cutlass.range_constexpr(self.fragment_tile_m * self.chunks_per_row // cute.size(tiled_mma_dq)):
            index = step * cute.size(tiled_mma_dq) + tidx
            row_in_tile = index // self.chunks_per_row
            col_chunk = index % self.chunks_per_row
            self._store_chunk(out, m_block * self.fragment_tile_m + row_in_tile, col_chunk, seqlen_q,
                              seq_used_q, lambda: cute.local_tile(sTile, (1, self.chunk), (row_in_tile, col_chunk)).load())

    @cute.jit
    def _store_chunk(self, out, row, col_chunk, seqlen_q, seq_used_q, values):
        """out[row, chunk col_chunk] = values() (io dtype), 0 on a ragged entry's padding rows,
        nothing on rows past seqlen_q."""
        if row < seqlen_q:
            result = cute.make_rmem_tensor(self.chunk, self.dtype)
            result.fill(0.0)
            if row < seq_used_q:
                result.store(values())
            cute.local_tile(out, (1, self.chunk), (row, col_chunk)).store(result.load())

    def _fragment_tile_layout(self):
        """The staged tile, rows padded by 16 bytes: a warp's 2-element stores (8 rows, 4 column
        pairs each) then fall in 32 different banks."""
        return cute.make_layout((self.fragment_tile_m, self.head_dim), stride=(self.head_dim + 8, 1))
