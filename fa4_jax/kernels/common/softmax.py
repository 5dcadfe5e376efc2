"""Online softmax over key blocks, in the exp2 domain, for one thread's rows of a score tile.

Scores arrive already transformed (softcap applied); `scale_log2` turns them into log2 units,
so p = 2^(s·scale_log2 − m·scale_log2) with m the running row maximum.

FA4's two tricks live here, both static settings of the kernel configuration:

- Conditional rescaling: the running maximum is only moved when a block's maximum exceeds it by
  more than `rescale_threshold` (log2 units; 8 = a factor of 256). Otherwise the stale maximum
  stays, p may reach 2^threshold (harmless in fp32 and in a bf16/fp16 P), and the accumulated O
  needs no rescale. Row sums are kept against the same stale maximum, so O / ℓ and the LSE stay
  exact. 0 means "move the maximum whenever it grows" (classic online softmax).
- Exponentials split between MUFU and the FMA pipes: a static share `exp2_poly_share` of each
  row's columns uses the polynomial of exp2.py.

A row whose keys are all masked keeps m = −inf; its scale is taken as 0 so no NaN forms, its
sum stays 0, and finalize reports lse = −inf and an output row of zeros (DESIGN.md).
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32

from fa4_jax.kernels.common.exp2 import exp2_poly

# The four lanes of a quad hold one accumulator row between them (WGMMA C layout).
_LANES_PER_ROW = 4
# Columns of a row are assigned to the polynomial in groups of this many.
_EXP2_SPLIT_PERIOD = 8


def _quad_max(x: Float32) -> Float32:
    return cute.arch.warp_reduction_max(x, threads_in_group=_LANES_PER_ROW)


def _quad_sum(x: Float32) -> Float32:
    return cute.arch.warp_reduction_sum(x, threads_in_group=_LANES_PER_ROW)


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig:
    """Static FA4 softmax settings (see the module docstring)."""

    rescale_threshold: float = 8.0
    exp2_poly_share: float = 0.0

    def uses_poly(self, col: int) -> bool:
        poly_cols = round(self.exp2_poly_share * _EXP2_SPLIT_PERIOD)
        return col % _EXP2_SPLIT_PERIOD < poly_cols


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """Row statistics live in caller-owned register tensors (`row_max`, `row_sum`, one per row)."""

    config: SoftmaxConfig
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(config: SoftmaxConfig, scale_log2: Float32, num_rows: int) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        softmax = OnlineSoftmax(config, scale_log2, row_max, row_sum)
        softmax.reset()
        return softmax

    def reset(self):
        """Start a new tile's rows: no maximum yet, nothing summed."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, scores: cute.Tensor, row_scale: cute.Tensor) -> Boolean:
        """scores (rows, cols) -> probabilities in place; row_scale gets the factor for the old O.

        Returns whether any of this thread's rows moved its maximum (row_scale != 1).
        """
        moved = Boolean(False)
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            block_max = scores[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(scores, mode=[1])):
                block_max = cute.arch.fmax(block_max, scores[r, c])
            old_max = self.row_max[r]
            new_max = cute.arch.fmax(old_max, _quad_max(block_max))
            if cutlass.const_expr(self.config.rescale_threshold > 0.0):
                # Keep the stale maximum unless the block outgrows it by the threshold. From
                # −inf any finite maximum qualifies; −inf to −inf is NaN here and keeps −inf.
                if (new_max - old_max) * self.scale_log2 <= self.config.rescale_threshold:
                    new_max = old_max
            safe_max = new_max
            if new_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            row_scale[r] = cute.math.exp2(old_max * self.scale_log2 - max_scaled, fastmath=True)
            if new_max != old_max:
                moved = Boolean(True)
            self.row_max[r] = new_max
            block_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                x = scores[r, c] * self.scale_log2 - max_scaled
                if cutlass.const_expr(self.config.uses_poly(c)):
                    p = exp2_poly(x)
                else:
                    p = cute.math.exp2(x, fastmath=True)
                scores[r, c] = p
                block_sum += p
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + block_sum
        return moved

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
