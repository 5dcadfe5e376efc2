"""Backward postprocess (arch-independent): dQ = softmax_scale · dQaccum, fp32 -> the io dtype.

mdQaccum [b, h, sq_pad, d] (fp32, row-major, filled by the main kernel's atomic adds) ->
mdQ [b, sq, h, d]. Each thread converts `chunk` contiguous elements per step (32-byte loads,
16-byte stores); rows >= seqlen_q are padding and are not written. Rows past the batch entry's
valid query rows (mSeqUsedQ [b]: a ragged batch's padding) are written as 0.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32


class BackwardPostprocess:
    threads = 128
    rows_per_block = 64
    chunk = 8

    def __init__(self, dtype, head_dim: int):
        assert head_dim % self.chunk == 0, "whole chunks per row"
        self.dtype = dtype
        self.head_dim = head_dim
        self.chunks_per_row = head_dim // self.chunk
        assert self.rows_per_block * self.chunks_per_row % self.threads == 0, "whole steps per block"
        self.steps = self.rows_per_block * self.chunks_per_row // self.threads

    @cute.jit
    def __call__(self, mdQaccum, mdQ, mSeqUsedQ, softmax_scale: Float32, stream):
        sq_pad, heads, batch = mdQaccum.shape[2], mdQaccum.shape[1], mdQaccum.shape[0]
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
            if row < seqlen_q:
                result = cute.make_rmem_tensor(self.chunk, self.dtype)
                result.fill(0.0)
                if row < seq_used_q:
                    values = cute.local_tile(accum, (1, self.chunk), (row, col_chunk)).load()
                    result.store((values * softmax_scale).to(self.dtype))
                cute.local_tile(out, (1, self.chunk), (row, col_chunk)).store(result.load())
