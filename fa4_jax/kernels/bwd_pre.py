"""Backward preprocess (arch-independent): the per-row statistics the main backward kernel reads.

For every padded query row r < sq_pad of every (batch, head):
  mdPsum[b, h, r]   = rowsum(dO ∘ O)[r] − dLSE[r]  in fp32 (0 for padded rows), the `D` of dS = P∘(dP − D);
                      dLSE is 0 when mdLSE is empty ([0, h, sq]: lse not differentiated);
  mLSElog2[b, h, r] = lse[r] · log2(e), or +inf for padded rows and for rows with lse = −inf
                      (no visible key), so the main kernel's P = exp2(s·scale_log2 − LSElog2) is 0
                      there instead of NaN.
Rows past the batch entry's valid query rows (mSeqUsedQ [b], clamped to sq: a ragged batch's
padding; [0] for a dense batch) are padded rows too.
The main kernel's first add into each copy of a query block's dQ accumulator (mdQaccum
[copies, b, h, sq_pad, d]) stores instead of adding: in deterministic mode its turn 0, in the
default mode, where `default_stores_first`, the add that claims the store. So the preprocess
zeroes the semaphores (mSemaphore [copies, b, h, sq_pad / 64]) that order or claim those adds,
and zeroes its rows of every copy of mdQaccum only in the default mode without
`default_stores_first`. The FFI handler launches nothing before it. Every CTA lets the main
kernel launch once it has started (`griddepcontrol.launch_dependents`: programmatic dependent
launch).
`lanes_per_row` adjacent lanes share a row, each reducing a contiguous chunk of dv elements, so
the loads are wide and a warp covers several rows.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_jax.abi.workspace import BWD_SEMAPHORE_ROWS
from fa4_jax.kernels.common.exp2 import LOG2_E
from fa4_jax.kernels.common.ragged import entry_length


class BackwardPreprocess:
    threads = 256
    # Elements per 16-byte vector of the 2-byte io dtype: each lane's chunk is whole vectors.
    vector = 8

    def __init__(self, dtype, head_dim: int, head_dim_v: int, default_stores_first: bool):
        # Up to 8 lanes per row, as many as split the row into whole vectors (dv = 96: 4 lanes of 24).
        self.lanes_per_row = next(n for n in (8, 4, 2, 1) if head_dim_v % (self.vector * n) == 0)
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.chunk = head_dim_v // self.lanes_per_row
        self.rows_per_block = self.threads // self.lanes_per_row
        self.head_dim = head_dim
        self.default_stores_first = default_stores_first
        # The accumulator's rows of a block are contiguous: each thread zeroes 4 fp32 per step.
        assert self.rows_per_block * head_dim % (self.threads * 4) == 0, "whole zeroing steps"
        self.zero_steps = self.rows_per_block * head_dim // (self.threads * 4)

    @cute.jit
    def __call__(self, mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mSemaphore, mSeqUsedQ,
                 deterministic, stream):
        """mO/mdO [b, sq, h, dv]; mLSE [b, h, sq]; mdLSE [b, h, sq] or [0, h, sq];
        mdPsum/mLSElog2 [b, h, sq_pad]; mdQaccum [copies, b, h, sq_pad, d];
        mSemaphore [copies, b, h, sq_pad / 64]; mSeqUsedQ [b] or [0]; deterministic 0 or 1."""
        sq_pad, heads, batch = mdPsum.shape[2], mdPsum.shape[1], mdPsum.shape[0]
        self.kernel(mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mSemaphore, mSeqUsedQ,
                    deterministic).launch(
            grid=(cute.ceil_div(sq_pad, self.rows_per_block), heads, batch),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mSemaphore, mSeqUsedQ,
               deterministic):
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, batch = cute.arch.block_idx()
        # Where the main kernel's first add into a query block stores (its turn 0 when
        # deterministic, its claim otherwise) its semaphores must start at 0 and mdQaccum need not.
        if deterministic != 0:
            self._zero_turns(mSemaphore, row_block, head, batch, tidx)
        else:
            if cutlass.const_expr(self.default_stores_first):
                self._zero_turns(mSemaphore, row_block, head, batch, tidx)
            else:
                self._zero_dq_rows(mdQaccum, row_block, head, batch, tidx)
        lane_in_row = tidx % self.lanes_per_row
        row = row_block * self.rows_per_block + tidx // self.lanes_per_row
        seqlen_q = entry_length(mSeqUsedQ, batch, mO.shape[1])

        partial_sum = Float32(0.0)
        if row < seqlen_q:
            o = cute.local_tile(mO[batch, row, head, None], (self.chunk,), (lane_in_row,)).load()
            do = cute.local_tile(mdO[batch, row, head, None], (self.chunk,), (lane_in_row,)).load()
            partial_sum = (o.to(Float32) * do.to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # Every lane of the row group joins the shuffle, padded rows included (their sum is 0).
        row_sum = cute.arch.warp_reduction_sum(partial_sum, threads_in_group=self.lanes_per_row)

        if lane_in_row == 0 and row < mdPsum.shape[2]:
            d_value = Float32(0.0)
            lse_log2 = Float32.inf
            if row < seqlen_q:
                d_value = row_sum
                if mdLSE.shape[0] > 0:
                    d_value -= mdLSE[batch, head, row]
                lse = mLSE[batch, head, row]
                if lse != -Float32.inf:
                    lse_log2 = lse * LOG2_E
            mdPsum[batch, head, row] = d_value
            mLSElog2[batch, head, row] = lse_log2

    @cute.jit
    def _zero_turns(self, mSemaphore, row_block, head, batch, tidx):
        """mSemaphore[:, batch, head, counters of this block's rows] = 0: the block whose rows
        start a counter's 64 zeroes it."""
        first_row = row_block * self.rows_per_block
        if first_row % BWD_SEMAPHORE_ROWS == 0:
            counter = first_row // BWD_SEMAPHORE_ROWS + tidx
            if tidx < (self.rows_per_block + BWD_SEMAPHORE_ROWS - 1) // BWD_SEMAPHORE_ROWS:
                if counter < mSemaphore.shape[3]:
                    for copy in cutlass.range(mSemaphore.shape[0], unroll=1):
                        mSemaphore[copy, batch, head, counter] = Int32(0)

    @cute.jit
    def _zero_dq_rows(self, mdQaccum, row_block, head, batch, tidx):
        """mdQaccum[:, batch, head, this block's rows] = 0."""
        chunks_per_row = self.head_dim // 4
        zeros = cute.make_rmem_tensor(4, Float32)
        zeros.fill(0.0)
        for copy in cutlass.range(mdQaccum.shape[0], unroll=1):
            rows = mdQaccum[copy, batch, head, None, None]
            for step in cutlass.range_constexpr(self.zero_steps):
                index = step * self.threads + tidx
                row = row_block * self.rows_per_block + index // chunks_per_row
                if row < rows.shape[0]:
                    cute.local_tile(rows, (1, 4), (row, index % chunks_per_row)).store(zeros.load())
