"""Online softmax over key blocks, in the exp2 domain, for one thread's rows of a score tile.

Scores arrive already transformed (softcap applied); `scale_log2` turns them into log2 units,
so p = 2^(s·scale_log2 − m·scale_log2) with m the running row maximum. A row whose keys are all
masked keeps m = −inf; its scale is taken as 0 so no NaN forms, its sum stays 0, and finalize
reports lse = −inf and an output row of zeros (DESIGN.md's edge semantics).
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

# The four lanes of a quad hold one accumulator row between them (WGMMA C layout).
_LANES_PER_ROW = 4


def _quad_max(x: Float32) -> Float32:
    return cute.arch.warp_reduction_max(x, threads_in_group=_LANES_PER_ROW)


def _quad_sum(x: Float32) -> Float32:
    return cute.arch.warp_reduction_sum(x, threads_in_group=_LANES_PER_ROW)


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """Row statistics live in caller-owned register tensors (`row_max`, `row_sum`, one per row)."""

    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(scale_log2, row_max, row_sum)

    @cute.jit
    def step(self, scores: cute.Tensor, row_scale: cute.Tensor):
        """scores (rows, cols) -> probabilities in place; row_scale gets the factor for the old O."""
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            block_max = scores[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(scores, mode=[1])):
                block_max = cute.arch.fmax(block_max, scores[r, c])
            new_max = cute.arch.fmax(self.row_max[r], _quad_max(block_max))
            safe_max = new_max
            if new_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            row_scale[r] = cute.math.exp2(self.row_max[r] * self.scale_log2 - max_scaled, fastmath=True)
            self.row_max[r] = new_max
            block_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                p = cute.math.exp2(scores[r, c] * self.scale_log2 - max_scaled, fastmath=True)
                scores[r, c] = p
                block_sum += p
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + block_sum

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale <- 1/row_sum (0 for empty rows); lse <- natural-log sum of exp of the scores."""
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = _quad_sum(self.row_sum[r])
            row_scale[r] = Float32(0.0)
            lse[r] = -Float32.inf
            if total > 0.0:
                row_scale[r] = cute.arch.rcp_approx(total)
                lse[r] = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * math.log(2.0)
            if total != total:
                row_scale[r] = total
                lse[r] = total


@cute.jit
def scale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """acc (rows, cols) *= row_scale per row."""
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            acc[r, c] = acc[r, c] * row_scale[r]
