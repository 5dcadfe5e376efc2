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

A row's block maximum is one dependent chain of max instructions, or with `max_tree` a balanced
tree (FA4 upstream's form). The instruction count is the same; what changes is what ptxas does
with the wait for the previous block's P·V GEMM, which the source places after the softmax. On
d128's 128-key blocks, with the chain, ptxas put that wait after the first row's chain and one
shuffle, before any exponential, and the warp group sat idle for the rest of the GEMM (Nsight
Compute: 10% of the loop's stall samples on that wait, 0.1% for upstream); with the tree, 41 of
the block's exponentials run before it, +2-3%. Where ptxas already placed the wait late (d128's
176-key blocks) or the GEMM is short (d64), the chain measured even or 1-2% ahead, so only the
128-key d128 kernel takes the tree (docs/perf-log.md, "The wait for P·V").

A row whose keys are all masked keeps m = −inf; its scale is taken as 0 so no NaN forms, its
sum stays 0, and finalize reports lse = −inf and an output row of zeros (docs/design.md).
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32

from fa4_jax.kernels.common.exp2 import LOG2_E, exp2_poly, exp2_poly_pair, uses_poly

# The four lanes of a quad hold one accumulator row between them (Hopper's WGMMA C layout);
# on Blackwell one thread holds a whole row (one TMEM lane).
WGMMA_LANES_PER_ROW = 4


def score_scales(softmax_scale: Float32, softcap: Float32, has_softcap: bool):
    """(score_prescale, scale_log2) of the kernels' host side: with softcap the scores become
    tanh(s · scale / softcap), and softcap · log2(e) carries them into the exp2 domain; without
    it, scale · log2(e) does (and the scores are not prescaled)."""
    if has_softcap:
        return softmax_scale / softcap, softcap * LOG2_E
    return Float32(1.0), softmax_scale * LOG2_E


def _row_max(x: Float32, lanes: int) -> Float32:
    return x if lanes == 1 else cute.arch.warp_reduction_max(x, threads_in_group=lanes)


def _row_sum(x: Float32, lanes: int) -> Float32:
    return x if lanes == 1 else cute.arch.warp_reduction_sum(x, threads_in_group=lanes)


def tree_reduce(values: list, combine):
    """combine over values in ceil(log2(n)) dependent steps, pairing neighbours at each level
    (plain Python: unrolled at trace time; tests/test_kernel_config.py runs it on floats)."""
    while len(values) > 1:
        paired = [combine(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = paired + values[2 * len(paired):]
    return values[0]


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig:
    """Static FA4 softmax settings (see the module docstring)."""

    rescale_threshold: float = 8.0
    exp2_poly_share: float = 0.0
    max_tree: bool = False
    # Blackwell: the scaling, the polynomial exponentials and the row sum on packed f32x2
    # instructions, two columns each (sm_100+; FA4's FFMA2 form). Pairs of adjacent columns then
    # take the polynomial together: pair j when `uses_poly` picks j, so the share holds.
    packed_pairs: bool = False

    def uses_poly(self, col: int) -> bool:
        return uses_poly(self.exp2_poly_share, col)


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """Row statistics live in caller-owned register tensors (`row_max`, `row_sum`, one per row);
    `lanes_per_row` lanes of a warp share each row (their partial maxima and sums are combined
    by shuffles)."""

    config: SoftmaxConfig
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor
    lanes_per_row: int = WGMMA_LANES_PER_ROW

    @staticmethod
    def create(config: SoftmaxConfig, scale_log2: Float32, num_rows: int,
               lanes_per_row: int = WGMMA_LANES_PER_ROW) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        softmax = OnlineSoftmax(config, scale_log2, row_max, row_sum, lanes_per_row)
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
            if cutlass.const_expr(self.config.max_tree):
                block_max = tree_reduce([scores[r, c] for c in range(cute.size(scores, mode=[1]))],
                                        cute.arch.fmax)
            else:
                block_max = scores[r, 0]
                for c in cutlass.range_constexpr(1, cute.size(scores, mode=[1])):
                    block_max = cute.arch.fmax(block_max, scores[r, c])
            old_max = self.row_max[r]
            new_max = cute.arch.fmax(old_max, _row_max(block_max, self.lanes_per_row))
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
            if cutlass.const_expr(self.config.packed_pairs):
                block_sum = self._exp2_pairs(scores, r, max_scaled)
            else:
                block_sum = self._exp2_columns(scores, r, max_scaled)
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + block_sum
        return moved

    @cute.jit
    def _exp2_columns(self, scores: cute.Tensor, r: int, max_scaled: Float32) -> Float32:
        """Row r's probabilities in place, one column at a time; returns their sum."""
        block_sum = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            x = scores[r, c] * self.scale_log2 - max_scaled
            if cutlass.const_expr(self.config.uses_poly(c)):
                p = exp2_poly(x)
            else:
                p = cute.math.exp2(x, fastmath=True)
            scores[r, c] = p
            block_sum += p
        return block_sum

    @cute.jit
    def _exp2_pairs(self, scores: cute.Tensor, r: int, max_scaled: Float32) -> Float32:
        """Row r's probabilities in place, two columns per packed instruction; returns their sum
        (two running partial sums, one per lane, added at the end)."""
        scale = (self.scale_log2, self.scale_log2)
        bias = (-max_scaled, -max_scaled)
        sums = (Float32(0.0), Float32(0.0))
        for c in cutlass.range_constexpr(0, cute.size(scores, mode=[1]), 2):
            x0, x1 = cute.arch.fma_packed_f32x2((scores[r, c], scores[r, c + 1]), scale, bias)
            if cutlass.const_expr(self.config.uses_poly(c // 2)):
                p0, p1 = exp2_poly_pair(x0, x1)
            else:
                p0, p1 = cute.math.exp2(x0, fastmath=True), cute.math.exp2(x1, fastmath=True)
            scores[r, c], scores[r, c + 1] = p0, p1
            sums = cute.arch.add_packed_f32x2(sums, (p0, p1))
        return sums[0] + sums[1]

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale <- 1/row_sum (0 for empty rows); lse <- natural-log sum of exp of the scores."""
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = _row_sum(self.row_sum[r], self.lanes_per_row)
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
