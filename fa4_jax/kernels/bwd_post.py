"""Backward postprocess: dQ = softmax_scale · dQaccum, fp32 -> the io dtype.

mdQaccum [copies, b, h, sq_pad, d] (fp32, filled by the main kernel's adds; the copies summed in
order) -> mdQ [b, sq, h, d]; rows >= seqlen_q are padding and are not written. Rows past the
batch entry's valid query rows (mSeqUsedQ [b]: a ragged batch's padding; [0] for a dense batch)
are written as 0.
A deterministic call's copies were not zeroed, nor with `default_stores_first` a default call's:
a copy of a query block that no key block wrote (its semaphore, mSemaphore
[copies, b, h, sq_pad / 64], still 0) holds stale memory and counts as 0. Launched as the main
kernel's programmatic dependent: its CTAs take the SMs the main kernel's last CTAs leave and wait
there (griddepcontrol.wait) for the whole grid's writes.

Each query block of `tile_m` rows holds the main kernel's dQ accumulators in fragment order
(layouts.fragment_order_view); one CTA per block, running the main kernel's dQ tiled MMA, reads
each thread's accumulator back with 16-byte loads, converts it, puts it back in the tile's order
through shared memory and stores rows of `chunk` elements (16-byte stores).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4_jax.abi.workspace import BWD_SEMAPHORE_ROWS
from fa4_jax.kernels.common.layouts import FRAGMENT_GROUP_THREADS, fragment_order_view
from fa4_jax.kernels.common.ragged import entry_length


class BackwardPostprocess:
    chunk = 8

    def __init__(self, dtype, head_dim: int, tile_m: int, default_stores_first: bool = False):
        assert head_dim % self.chunk == 0, "whole chunks per row"
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.default_stores_first = default_stores_first
        self.chunks_per_row = head_dim // self.chunk

    @cute.jit
    def __call__(self, mdQaccum, mdQ, mSeqUsedQ, mSemaphore, softmax_scale: Float32, deterministic,
                 stream, tiled_mma_dq):
        """tiled_mma_dq: the main kernel's dQ MMA, which defines fragment order."""
        sq_pad, heads, batch = mdQaccum.shape[3], mdQaccum.shape[2], mdQaccum.shape[1]
        self.kernel_fragment_order(mdQaccum, mdQ, mSeqUsedQ, mSemaphore, softmax_scale, deterministic,
                                   tiled_mma_dq).launch(
            grid=(sq_pad // self.tile_m, heads, batch),
            block=[cute.size(tiled_mma_dq), 1, 1],
            smem=cute.size_in_bytes(self.dtype, self._tile_layout()) + 16,
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel_fragment_order(self, mdQaccum, mdQ, mSeqUsedQ, mSemaphore, softmax_scale: Float32,
                              deterministic, tiled_mma_dq: cute.TiledMma):
        # Once the main kernel's adds are visible.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mdQ.shape[1]
        seq_used_q = entry_length(mSeqUsedQ, batch, seqlen_q)
        tile = (self.tile_m, self.head_dim)
        thr_mma = tiled_mma_dq.get_slice(tidx)
        acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C(tile))
        acc.fill(0.0)
        part = cute.make_rmem_tensor_like(acc, Float32)
        groups = cute.size(tiled_mma_dq) // FRAGMENT_GROUP_THREADS
        for copy in cutlass.range(mdQaccum.shape[0], unroll=1):
            written = cutlass.Boolean(True)
            turns = mSemaphore[copy, batch, head, m_block * (self.tile_m // BWD_SEMAPHORE_ROWS)]
            if deterministic != 0:
                written = turns > 0
            if cutlass.const_expr(self.default_stores_first):
                if deterministic == 0:
                    written = turns > 0
            if written:
                slab = cute.local_tile(mdQaccum[copy, batch, head, None, None], tile, (m_block, 0)).iterator
                cute.autovec_copy(fragment_order_view(slab, acc.shape, tidx, groups), part)
                acc.store(acc.load() + part.load())
        values = cute.make_rmem_tensor_like(acc, self.dtype)
        values.store((acc.load() * softmax_scale).to(self.dtype))
        # Through shared memory back to the tile's order, so that rows leave in 16-byte stores
        # (a thread's registers are column pairs of rows 8 apart: stored directly, each warp
        # store would touch 8 rows with 16 bytes each).
        sTile = cutlass.utils.SmemAllocator().allocate_tensor(
            self.dtype, self._tile_layout(), byte_alignment=16)
        cute.autovec_copy(values, thr_mma.partition_C(sTile))
        cute.arch.barrier()
        out = mdQ[batch, None, head, None]
        for step in cutlass.range_constexpr(self.tile_m * self.chunks_per_row // cute.size(tiled_mma_dq)):
            index = step * cute.size(tiled_mma_dq) + tidx
            row_in_tile = index // self.chunks_per_row
            col_chunk = index % self.chunks_per_row
            self._store_chunk(out, m_block * self.tile_m + row_in_tile, col_chunk, seqlen_q,
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

    def _tile_layout(self):
        """The staged tile, rows padded by 16 bytes: a warp's 2-element stores (8 rows, 4 column
        pairs each) then fall in 32 different banks."""
        return cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + 8, 1))
