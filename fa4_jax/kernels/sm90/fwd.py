"""FlashAttention forward for Hopper (sm_90a): TMA loads, WGMMA, online softmax in registers.

A CTA computes (tile_m query rows, head, batch) tiles of O and LSE: one per CTA, or, with the
persistent "lpt" scheduler (kernels/common/tile_scheduler.py), a strided share of all tiles in
longest-first order, its pipelines carrying from tile to tile. Warp-role table:

- warp group 0 (`producer_warp_group`): its first warp issues TMA for each tile's Q, and for
  K and V blocks through a `kv_stages`-deep ring of mbarrier-guarded shared-memory buffers; the
  rest of the group idles at a low register budget.
- warp groups 1..2 (`mma_warp_groups`; 1..3 with d64's 3 groups, 1 alone for decode): each owns 64 of the
  tile's rows. S = Q·Kᵀ by WGMMA from shared memory, mask and online softmax in registers, then O += P·V with P fed straight from
  registers as the WGMMA A operand, so S and P never touch shared memory. Within a warp group
  the GEMMs of block j (S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}) are issued together and the
  softmax of S_j runs while O's GEMM is still in flight (intra-warp-group overlap); between the
  warp groups, named barriers pass GEMM issue round in order so one group's softmax overlaps
  the others' GEMMs (ping-pong).
- epilogue (the MMA warp groups): O / ℓ to shared memory (reusing Q's buffer), one TMA store;
  LSE written per row by the lane that holds the row's first columns. The storing thread
  releases Q's buffer to the producer once the store has read it (the next tile's Q goes there).

Key blocks are visited from the highest to the lowest so the first block carries the sequence
tail and the causal diagonal; the tail mask, the causal/window masks and the unmasked middle run
in separate loops (block_info.py) so the common case does no per-element mask work.

Ragged batches: each tile reads its batch entry's valid lengths (mSeqUsedQ, mSeqUsedK; a dense
call passes them empty and the buffers' sizes serve, common/ragged.py) and they, not the buffers'
sizes, bound its key blocks, masks and offset, so the padding keys are masked like a sequence tail
(and their V rows zeroed in shared memory); rows past the entry's length come out 0 with LSE −inf.
The tile schedule stays on the buffers' sizes: a tile wholly past the length visits no key block
and only writes those zeros.
"""
import dataclasses
import functools
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from fa4_jax.kernels.common.block_info import BlockInfo
from fa4_jax.kernels.common.layouts import (
    acc_as_operand_a, acc_prefix, acc_rows_cols, convert_pairs, opaque_int32,
)
from fa4_jax.kernels.common.mask import AttentionMask
from fa4_jax.kernels.common.ragged import entry_length
from fa4_jax.kernels.common.softmax import OnlineSoftmax, SoftmaxConfig, scale_rows
from fa4_jax.kernels.common.tile_scheduler import L2_SECTION_BYTES, TileScheduler
from fa4_jax.kernels.sm90.operands import (
    permute_modes, smem_layout, swizzled_tensor, tma_pipeline, wgmma_gemm,
)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One head dim's static kernel shape and FA4 settings."""

    tile_m: int
    tile_n: int
    kv_stages: int
    pingpong: bool
    softmax: SoftmaxConfig
    # Tile order without a mask. Under a causal/local mask the masked_* fields replace their
    # unmasked twins (MASKED_FIELDS, `for_mask`); None: the same as without a mask.
    scheduler: str = "linear"
    masked_scheduler: str = "lpt_grid"
    masked_pingpong: bool = True
    masked_tile_n: int | None = None
    # MMA warp groups of 64 query rows each: tile_m = 64 · mma_warp_groups.
    mma_warp_groups: int = 2
    # O staged in its own shared buffer instead of Q's. Q's buffer then frees once the tile's
    # last Q·Kᵀ GEMM retires, so a persistent CTA loads the next tile's Q during the last P·V
    # and the epilogue; with O in Q's buffer that load waits for the O store (the ~6.6 µs per
    # tile fixed cost at s = 1k, docs/perf-log.md, is what this tries to shrink). Costs
    # tile_m·dv·2 bytes of shared memory (d128: 32 KB; d256 has no room).
    separate_o: bool = False
    # K/V bytes one LPT section may keep in L2 (tile_scheduler.py), in MiB.
    l2_section_mb: int = L2_SECTION_BYTES // 2**20
    # Persistent order only, with separate_o: a tile's last P·V is issued together with the next
    # tile's first Q·Kᵀ, and the tile's epilogue runs under the next tile's first softmax
    # (`mma_tile_boundary`), instead of draining before the next tile ramps up.
    overlap_tiles: bool = False
    # A tile's first S GEMM takes a ping-pong turn (`mma_first_block`); no effect without ping-pong.
    pingpong_first_block: bool = False
    # The wait for block j-1's V after block j's S GEMM is issued, inside the ping-pong turn (FA4
    # upstream's order), instead of before the turn with the wait for K_j: +0.5-2.1% at d64 and
    # d128 over three runs (docs/perf-log.md, session 14), so S_j never waits for V_{j-1}.
    v_wait_in_turn: bool = True
    # O into its shared staging buffer with stmatrix (8 instructions per thread at d128, FA4
    # upstream's epilogue) instead of element stores (33 STS and their swizzled addresses):
    # 112 fewer instructions per tile, even in time over three runs (session 14).
    o_stmatrix: bool = True
    # One CTA per tile: Q's load issued before the tile's lengths are read (two dependent global
    # loads of mSeqUsedQ/K, which the first K's block index needs), so its latency overlaps
    # theirs. A persistent CTA keeps K first (Q's buffer may still hold the previous tile's O).
    q_first: bool = True
    # An MMA warp group whose 64 rows all lie past the entry's query rows (the last m-block of a
    # sequence that tile_m does not divide: d64's 192-row tiles at s = 1k leave two of three
    # groups there) skips its GEMMs and softmax and only keeps the pipelines' and ping-pong's
    # barriers in step (`mma_tile_skipped`); its rows come out as O = 0, LSE = −inf as
    # before. Not with overlap_tiles. On at d64 (the tile table); off elsewhere, where 128-row
    # tiles leave a group all padding only at lengths of 64 mod 128 (unmeasured).
    skip_padded_groups: bool = False
    # The wait for block j-1's P·V GEMM inside both arms of O's rescale branch (`if any row's
    # maximum moved: rescale O`), not before the branch. ptxas schedules within a basic block:
    # in the branch, the wait stays below the whole softmax of block j, which then runs under
    # the GEMM. Before the branch ptxas hoists it, by an amount that code far from the loop
    # decides (0 to 65 of a d128 block's 66 exponentials under the GEMM, sessions 14-16 of
    # docs/perf-log.md). Measured in session 17 (four runs): +1-4% under d128's causal mask,
    # whose unmasked loop had none of its exponentials under the GEMM; 1-2% behind at d64
    # causal and d128 without a mask, mixed at d256 (the tile table's comment).
    pv_wait_in_branch: bool = False
    masked_pv_wait_in_branch: bool | None = None
    # Without a mask: the call's last key block holds at most this many keys (1 to tail_keys), so
    # the tile's first block, that tail, is computed that wide: its S GEMM a WGMMA of N =
    # tail_keys, its mask and softmax over those columns, its P·V over their k16 steps only; 0:
    # at the full tile_n. When tile_n does not divide the keys the full width computes padding:
    # at d128's 176-key blocks 64 of 2048 keys' worth and 128 of 4096 (3% of the GEMM work).
    # The width is static: a WGMMA under a runtime branch between widths made ptxas serialize
    # every WGMMA (C7511), so `variants.call_tuning` picks a variant by a dense call's key count.
    # A multiple of 16 (P·V's k step); masked kernels keep the full width.
    tail_keys: int = 0
    # Under a causal mask on 128 x 128 tiles of two MMA warp groups whose diagonal is
    # block-aligned (seqlen_k − seqlen_q a multiple of 128: `variants.diagonal_fits`, dense
    # calls), the first group's diagonal block, the tile's first, is computed 64 keys wide: its
    # rows see none of the block's last 64 keys. The same narrowed S GEMM, softmax and P·V
    # k-steps as `tail_keys`, in the first group's own copy of the tile loop (a WGMMA's width
    # is static); the diagonal is then the tile's only masked block. Softcap kernels keep the
    # full width: d64's fp16 one serialized every WGMMA with it (C7511).
    first_group_diagonal: bool = False

    def for_mask(self, masked: bool) -> "TileConfig":
        """The settings a kernel with (masked) or without a causal/local mask runs."""
        if not masked:
            return self
        return dataclasses.replace(self, **{
            field: getattr(self, twin) for field, twin in MASKED_FIELDS.items()
            if getattr(self, twin) is not None
        })

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        """Q and O (one buffer unless separate_o) plus the K/V ring, as laid out by SharedStorage."""
        q_o = (self.tile_m * (head_dim + head_dim_v) if self.separate_o
               else self.tile_m * max(head_dim, head_dim_v))
        return elem_bytes * (q_o + self.kv_stages * self.tile_n * (head_dim + head_dim_v))


# TileConfig fields that a causal/local mask may set apart: field -> its masked twin. A tuning
# knob of the field's name sets both.
MASKED_FIELDS = {"scheduler": "masked_scheduler", "pingpong": "masked_pingpong", "tile_n": "masked_tile_n",
                 "pv_wait_in_branch": "masked_pv_wait_in_branch"}
# Constructor overrides of a TileConfig, for ablation variants compiled side by side: the
# softmax's settings, the MMA warp-group count (which sets tile_m), and TileConfig fields of the
# same name.
SOFTMAX_KNOBS = ("rescale_threshold", "exp2_poly_share", "max_tree")
TILE_KNOBS = ("pingpong", "scheduler", "tile_n", "kv_stages", "separate_o", "l2_section_mb",
              "overlap_tiles", "pingpong_first_block", "v_wait_in_turn",
              "o_stmatrix", "q_first", "skip_padded_groups", "pv_wait_in_branch", "tail_keys",
              "first_group_diagonal")
TUNING_KNOBS = SOFTMAX_KNOBS + ("mma_warp_groups",) + TILE_KNOBS
# setmaxnreg budget of each MMA thread by MMA warp-group count: the 64K registers of an SM less
# the producer group's 128 · 24, shared by the MMA threads, rounded down to a multiple of 8, and
# at most 240 (a thread may not hold more than 255). One group (tile_m 64) is the decode shape.
MMA_REGISTERS = {1: 240, 2: 240, 3: 160}


# 64 query rows per MMA warp group. Shared memory bounds tile_n and the ring depth: Q (tile_m·d)
# plus kv_stages·tile_n·(d + dv), 2 bytes each, under the 227 KB an sm_90 CTA may use
# (`TileConfig.smem_bytes`; asserted at construction). Keyed by (head_dim, head_dim_v). Each entry
# is what the H200 ablations chose (docs/perf-log.md, forward v3; bf16, 16k tokens, TF/s):
# - d64: three MMA warp groups (tile_m 192, FlashAttention-3's d64 shape): 456/509 vs 392/430
#   TF/s for two groups at s4k/s16k, equal under a causal mask. 128-key blocks (S 64 + P 32 + O 32
#   of 160 registers since P's conversion stopped spilling, docs/perf-log.md "P converted through
#   asm"): 471/523 vs 453/497 for 96-key blocks without a mask at s4k/s16k, 395/492 vs 372/482
#   causal. Padded warp groups skip their GEMMs (session 16, run 1, against the same kernel
#   without the skip): 385 vs 364 at 1k, 487 vs 477 at 4k, causal 421 vs 410 at 4k.
# - d128: two groups, 128 x 176 without a mask (582/647 vs 568/617 for 128 x 128 at s4k/s16k;
#   128 x 192 578/635), 128 x 128 under one (n176 501/584 vs 504/610). Ping-pong on without a
#   mask; exp2 polynomial share 0 (the conversion-free polynomial of session 12: an eighth
#   542/588 and a quarter 524/571 against 572/640 at s4k/s16k; the H200 runs power-limited, so
#   the FMA-pipe exponentials' extra instructions cost clock) and rescale threshold 8
#   (threshold 0: 606 vs 638 at s4k).
#   Under a causal mask ping-pong off: 483/589 vs 466/586 at s4k/s16k with LPT order (and
#   514/592 vs 480/583 in the linear order), since the diagonal blocks' uneven softmax phases
#   make the turn-taking wait. At d64 it stays on (331/427 vs 335/437 off).
# - d256: 128 x 64, ping-pong off (FlashAttention-3's choice too). Both ping-pong and 128 x 80
#   fit since P's conversion stopped spilling, but neither pays: 677/719 and 660/718 against
#   676/725 at s4k/s16k, causal 590/688 and 591/644 against 597/691.
# - masked calls (causal, local) visit tiles longest-first, one CTA per tile ("lpt_single"):
#   d128 causal 526/604 vs 480/583 linear at s4k/s16k, d256 665/714 vs 606/645. The persistent
#   "lpt" lost there (516/561) and without a mask (558 vs 638): a static stride balances the
#   causal tail worse than the hardware's dynamic CTA dispatch. Since session 15 the same order
#   with the grid in its shape ("lpt_grid": no decode before a tile's first load), causal TF/s
#   over two passes of one run against "lpt_single", 2k/4k/8k/16k: d128 466/459, 541/544,
#   607/595, 628/630 against 442/434, 528/526, 590/587, 603/618; d64 (4k-16k) +0.4-2.4% but
#   one row (−0.6%); d256 −1 to +3%. Without a mask it loses to "linear" (d128 2k/4k/16k
#   505/569/643 against 548/609/656).
# - the wait for the previous block's P·V GEMM in O's rescale branch (`pv_wait_in_branch`: every
#   exponential under the GEMM) only under d128's mask, where ptxas otherwise left none there.
#   Session 17, pinned against hoisted, four runs, causal 2k/4k/8k/16k: d128 +0.9/+1.4/+1.4/+4.3%
#   on average (3 of 14 comparisons behind, none by more than 0.4%); d64 −2.4/−1.6/−0.6/−2.0%
#   (13 of 14 behind, one level); d256 +1.9/−0.4/−0.7/+2.8%; without a mask, two runs at
#   2k/4k/16k, d128 −0.9/−1.8/−1.0%, d64 and d256 within ±1%. The short causal rule's d128
#   kernel ("short") inherits it; d64's ("short_wg2") sets it (aot/variants.py).
# - d128's tail block without a mask (`tail_keys`, the "tail{48,96,128}" variants that
#   `variants.call_tuning` routes dense calls to; session 21): against the full-width tail
#   ("tail_full"), TF/s at 2k/4k/8k/16k: run 1 558/623/650/668 against 559/603/646/656, run
#   2 (4k, 16k) 613/664 against 597/650, run 3 in two processes 553/609/644/661 and
#   563/612/641/654 against 547/595/645/649 and 549/589/635/641: +2.4 to +3.9% at 4k, +1.8 to
#   +2.2% at 16k, 0 to +2.6% at 2k (112 keys in a 128-wide tail), nothing at 8k. With the P·V
#   wait pinned the tail kernels read the same (630/642/667 at 4k/8k/16k, run 1).
# - d96: the d128 shape (O is 48 registers, S 64), and its 48 KB K/V stage leaves room for three
#   stages (168 KB). 1.13-1.20x cuDNN at s4k/s16k (494/525, causal 439/499); one run's
#   alternatives were within 1-5% either way (176-key blocks on two stages 492/538, causal
#   435/523; ping-pong off 504/545, causal 426/489), so it stays. Its P·V wait pinned since
#   session 22: ptxas had hoisted it above every exponential of the causal kernel's unmasked
#   loop (none under the GEMM; all 66 pinned). Two processes, TF/s at 1k/2k/4k/8k/16k, pinned
#   against hoisted: without a mask 434/491/525/550/561 and 432/487/521/542/557 against
#   412/476/514/531/545 and 406/477/513/533/544 (+2-6%); causal 316/406/486/504/533 and
#   324/400/480/489/535 against 309/399/463/487/522 and 316/406/472/486/521 (−1.5 to +5%,
#   +2% on average).
# - d192/dv128 (DeepSeek's shape): the registers of d128 (Q·Kᵀ only has more k-steps), an 80 KB
#   K/V stage, so 128-key blocks on two stages (208 KB). Its P·V wait is pinned without a mask
#   since session 18, when reading no lengths in dense calls (common/ragged.py) let ptxas hoist
#   it above all 64 exponentials of the block (41 of them under the GEMM before; 107 of 128 with
#   softcap, then 16); masked, it stayed where it was (30 of 66 under the GEMM) and is left
#   unpinned. Session 22's ablations (docs/perf-log.md, "d192's tile-table entry measured"; TF/s
#   at 1k/2k/4k/8k/16k, the default first): without a mask 500/576/649/680/691 against
#   nopingpong 508/602/640/653/694, n112 496/590/651/665/692, n96 517/574/631/658/676, 80-key
#   blocks on three stages 511/569/592/609/661; the default's own kernel under two other names
#   read 511-522/582-602/646-654/653-660/692, so ±3% is this grid's noise. Causal
#   359/456/573/607/652 against nopingpong 355/445/547/607/603, n112 342/428/537/591/614, n96
#   351/446/543/597/621, n80 on three stages 345/419/518/575/592, the wait pinned
#   338/457/564/613/659. Nothing beat it; narrower blocks and no ping-pong lose under the mask.
TILE_CONFIGS = {
    (64, 64): TileConfig(192, 128, 3, True, SoftmaxConfig(rescale_threshold=8.0), mma_warp_groups=3,
                         skip_padded_groups=True),
    (96, 96): TileConfig(128, 128, 3, True, SoftmaxConfig(rescale_threshold=8.0), pv_wait_in_branch=True),
    (128, 128): TileConfig(128, 176, 2, True, SoftmaxConfig(rescale_threshold=8.0), masked_pingpong=False,
                           masked_tile_n=128, masked_pv_wait_in_branch=True),
    (192, 128): TileConfig(128, 128, 2, True, SoftmaxConfig(rescale_threshold=8.0), pv_wait_in_branch=True,
                           masked_pv_wait_in_branch=False),
    (256, 256): TileConfig(128, 64, 2, False, SoftmaxConfig(rescale_threshold=8.0)),
}
# The most dynamic shared memory an sm_90 CTA may use (227 KB). On top of TileConfig.smem_bytes
# come the barriers (under 1 KB for any ring depth up to 31), padded to the 1 KB alignment of the
# first buffer; every buffer's size is itself a multiple of 1 KB.
SM90_SMEM_BYTES = 227 * 1024
_SMEM_MARGIN = 1024

LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class _BlockOperands:
    """What every key block of one MMA warp group touches: MMAs, fragments, softmax state, rings."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    acc_s: cute.Tensor
    p: cute.Tensor
    acc_o: cute.Tensor
    acc_o_rc: cute.Tensor
    softmax: OnlineSoftmax
    row_scale: cute.Tensor
    pipeline_k: pipeline.PipelineTmaAsync
    pipeline_v: pipeline.PipelineTmaAsync
    score_prescale: Float32


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The runtime sizes every role needs to walk the tile schedule, and each batch entry's
    valid lengths (mSeqUsedQ, mSeqUsedK [b]: a ragged batch's; empty for a dense one)."""

    seqlen_q: Int32
    seqlen_k: Int32
    num_heads: Int32
    num_heads_kv: Int32
    batch: Int32
    seq_used_q: cute.Tensor
    seq_used_k: cute.Tensor

    def seqlens(self, batch: Int32):
        """(query rows, keys) of entry `batch` that exist: its lengths, clamped to the buffers.
        The tile schedule stays on the buffers' sizes; these bound the blocks, masks and rows."""
        return (entry_length(self.seq_used_q, batch, self.seqlen_q),
                entry_length(self.seq_used_k, batch, self.seqlen_k))

    def tile_count(self, scheduler: TileScheduler) -> Int32:
        return scheduler.tile_count(self.seqlen_q, self.num_heads, self.batch)

    def tile(self, scheduler: TileScheduler, i: Int32):
        """The i-th tile's (m_block, head, batch). Inside the tile loop, the sizes go through
        opaque copies: otherwise LLVM hoists the schedule's divisions out of the loop and holds
        their results in registers across the main loop (d256 causal then spilled)."""
        sizes = (self.seqlen_q, self.seqlen_k, self.num_heads, self.num_heads_kv, self.batch)
        if cutlass.const_expr(scheduler.kind != "linear"):
            sizes = tuple(opaque_int32(x) for x in sizes)
        return scheduler.tile(i, *sizes)

    def key_blocks(self, scheduler: TileScheduler, block_info: BlockInfo, i: Int32, window_left,
                   window_right):
        """The i-th tile's (m_block, seqlen_q, seqlen_k, n_block_min, n_block_max): its entry's
        lengths and the range of key blocks it visits."""
        m_block, _, batch = self.tile(scheduler, i)
        seqlen_q, seqlen_k = self.seqlens(batch)
        n_block_min, n_block_max = block_info.n_block_range(
            m_block, seqlen_q, seqlen_k, window_left, window_right
        )
        return m_block, seqlen_q, seqlen_k, n_block_min, n_block_max


class FlashAttentionForwardSm90:
    producer_warp_group = 0
    threads_per_warp_group = 128
    # Query rows of one MMA warp group's WGMMA (M = 64): tile_m = rows · MMA warp groups.
    rows_per_warp_group = 64
    # setmaxnreg budgets: the producer needs few registers; the MMA groups hold S, P and O
    # (MMA_REGISTERS, by how many MMA warp groups share the register file).
    producer_registers = 24
    # Named barrier 0 is __syncthreads; 1 syncs all MMA warp groups (around the epilogue, and
    # after a ragged entry's padding V rows are zeroed: every MMA thread passes both in the same
    # order); 2, 3 (and 4) are the GEMM-issue turns of MMA warp groups 1, 2 (and 3).
    epilogue_barrier_id = 1
    pingpong_barrier_base = 2

    def __init__(self, dtype, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool, **tuning):
        """`tuning` overrides the tile table's settings: any of TUNING_KNOBS, the SoftmaxConfig and
        TileConfig fields of the same name (their comments say what each does), and
        mma_warp_groups (1 to 3, which sets tile_m)."""
        if mask not in ("none", "causal", "local"):
            raise ValueError(f"mask must be 'none', 'causal' or 'local', got {mask!r}")
        if (head_dim, head_dim_v) not in TILE_CONFIGS:
            raise ValueError(f"no tile configuration for head_dim={head_dim}, head_dim_v={head_dim_v}")
        unknown = set(tuning) - set(TUNING_KNOBS)
        if unknown:
            raise TypeError(f"unknown tuning knobs {sorted(unknown)}; known: {TUNING_KNOBS}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = mask == "causal"
        self.local = mask == "local"
        self.has_softcap = has_softcap
        config = TILE_CONFIGS[(head_dim, head_dim_v)]
        softmax_tuning = {k: type(getattr(config.softmax, k))(tuning[k])
                          for k in SOFTMAX_KNOBS if k in tuning}
        knobs = {k: tuning[k] for k in TILE_KNOBS if k in tuning}
        knobs.update({MASKED_FIELDS[k]: tuning[k] for k in MASKED_FIELDS if k in tuning})
        if "mma_warp_groups" in tuning:
            groups = int(tuning["mma_warp_groups"])
            knobs.update(mma_warp_groups=groups, tile_m=self.rows_per_warp_group * groups)
        config = dataclasses.replace(
            config, softmax=dataclasses.replace(config.softmax, **softmax_tuning), **knobs
        )
        if (config.mma_warp_groups not in MMA_REGISTERS
                or config.tile_m != self.rows_per_warp_group * config.mma_warp_groups):
            raise ValueError(f"{config}: tile_m must be 64 per MMA warp group, 1 to 3 groups")
        # Both ping-pong settings: an ablation row compiles its tuning at both masks.
        if (config.pingpong or config.masked_pingpong) and config.mma_warp_groups == 1:
            raise ValueError(f"{config}: ping-pong needs two or more MMA warp groups")
        config = config.for_mask(self.causal or self.local)
        if config.tile_n % 16 or not 16 <= config.tile_n <= 256:
            raise ValueError(f"{config}: tile_n must be a multiple of 16 (P·V's k16 blocks), at most 256")
        if not 0.0 <= config.softmax.exp2_poly_share <= 1.0 or config.softmax.rescale_threshold < 0.0:
            raise ValueError(f"bad softmax tuning {config.softmax}")
        self.config = config
        if config.smem_bytes(head_dim, head_dim_v) + _SMEM_MARGIN > SM90_SMEM_BYTES:
            raise ValueError(f"{config} needs more than {SM90_SMEM_BYTES} bytes of shared memory")
        self.tile_m, self.tile_n, self.kv_stages = config.tile_m, config.tile_n, config.kv_stages
        self.scheduler = TileScheduler(
            config.scheduler,
            self.tile_m, reverse_m=self.causal or self.local,
            kv_bytes_per_key=(head_dim + head_dim_v) * dtype.width // 8,
            l2_bytes=config.l2_section_mb * 2**20,
        )
        if config.overlap_tiles and not (self.scheduler.kind == "lpt" and config.separate_o):
            raise ValueError(f"{config}: overlap_tiles needs the persistent 'lpt' order and separate_o")
        if config.overlap_tiles and config.skip_padded_groups:
            raise ValueError(f"{config}: skip_padded_groups is not implemented with overlap_tiles")
        # The tail block's width; 0 where it is the full tile_n (always under a mask).
        self.tail_keys = 0 if self.causal or self.local else config.tail_keys
        if config.tail_keys % 16 or config.tail_keys < 0 or self.tail_keys >= config.tile_n:
            raise ValueError(f"{config}: tail_keys must be a multiple of 16 (P·V's k step) below tile_n")
        if self.tail_keys and (config.overlap_tiles or config.skip_padded_groups):
            raise ValueError(f"{config}: tail_keys is not implemented with overlap_tiles or skip_padded_groups")
        # The first MMA warp group's diagonal width; 0 where it is the full tile_n.
        narrow_diagonal = self.causal and config.first_group_diagonal and not has_softcap
        self.diagonal_keys = self.rows_per_warp_group if narrow_diagonal else 0
        if self.diagonal_keys and not (config.tile_m == config.tile_n == 128 and not config.overlap_tiles):
            raise ValueError(f"{config}: first_group_diagonal needs 128 x 128 tiles of two MMA warp groups, "
                             "without overlap_tiles")
        self.pingpong = config.pingpong
        self.mma_warp_groups = tuple(range(1, config.mma_warp_groups + 1))
        self.mma_registers = MMA_REGISTERS[config.mma_warp_groups]
        self.num_mma_threads = len(self.mma_warp_groups) * self.threads_per_warp_group
        self.num_threads = self.num_mma_threads + self.threads_per_warp_group

    def qk_tiled_mma(self, keys: int) -> cute.TiledMma:
        """S = Q·Kᵀ over `keys` keys: one 64 x keys WGMMA per MMA warp group, both operands
        K-major in shared memory."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (len(self.mma_warp_groups), 1, 1), (self.rows_per_warp_group, keys),
        )

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's shared memory: barriers, Q, the K/V ring and O. Without separate_o, O is
        staged in Q's buffer (sized for the larger of the two) and its own field is empty, which
        adds no bytes."""
        kv_stages, dtype = self.kv_stages, self.dtype
        q_elems, o_elems = cute.cosize(sQ_layout), cute.cosize(sO_layout)
        if not self.config.separate_o:
            q_elems, o_elems = max(q_elems, o_elems), 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * kv_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, o_elems], 1024]

        assert SharedStorage.size_in_bytes() <= SM90_SMEM_BYTES, (
            f"{self.config}: {SharedStorage.size_in_bytes()} bytes of shared memory")
        return SharedStorage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        """mQ [b, sq, h, d], mK [b, sk, hk, d], mV [b, sk, hk, dv], mO [b, sq, h, dv], mLSE [b, h, sq],
        mSeqUsedQ / mSeqUsedK [b] int32: each entry's valid query rows and keys; [0] for a
        dense batch (the buffers' sizes).

        Rows past an entry's valid ones get O = 0 and LSE = −inf; keys past its valid ones are
        masked like the sequence tail, and the V rows of those inside the last key block read
        are zeroed in shared memory (`zero_v_past_keys`), so K and V padding may hold anything.
        Q's padding must be finite (ffi.forward zeroes it): a padding row's NaN would reach its
        O through the rescale by 0."""
        # Kernel-side views put the sequence and feature modes first: (s, d, heads, batch).
        mQ, mK, mV, mO = [permute_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mV, mO)]
        mLSE = permute_modes(mLSE, (2, 1, 0))

        tiled_mma_qk = self.qk_tiled_mma(self.tile_n)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (len(self.mma_warp_groups), 1, 1), (64, self.head_dim_v),
            warpgroup.OperandSource.RMEM,
        )

        sQ_layout = smem_layout(self.dtype, self.tile_m, self.head_dim)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.kv_stages)
        sO_layout = smem_layout(self.dtype, self.tile_m, self.head_dim_v)

        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_layout, (self.tile_m, self.head_dim)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(sK_layout, mode=[0, 1]),
            (self.tile_n, self.head_dim),
        )
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.select(sV_layout, mode=[0, 1]),
            (self.tile_n, self.head_dim_v),
        )
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.head_dim_v)
        )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tma_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)

        # With softcap the scores become tanh(s·scale/softcap), and softcap·log2(e) carries them
        # into the exp2 domain; without it, scale·log2(e) does.
        if cutlass.const_expr(self.has_softcap):
            score_prescale = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        else:
            score_prescale = Float32(1.0)
            scale_log2 = softmax_scale * LOG2_E

        grid = self.scheduler.grid(cute.size(mQ.shape[0]), cute.size(mK.shape[0]), cute.size(mQ.shape[2]),
                                   cute.size(mK.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            mLSE, mSeqUsedQ, mSeqUsedK, sQ_layout, sK_layout, sV_layout, sO_layout,
            score_prescale, scale_log2, window_left, window_right,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        score_prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        mma_warps = self.num_mma_threads // 32
        # Q's buffer is released by the one thread that stores O from it (the buffer doubles as
        # O's staging area), once its TMA store has read it: the next tile's Q may then overwrite
        # it. With separate_o every MMA warp releases it after its last Q·Kᵀ GEMM.
        q_arrivals = mma_warps if self.config.separate_o else 1
        pipeline_q = tma_pipeline(storage.mbar_q, 1, q_arrivals, self.tma_bytes_q)
        pipeline_k = tma_pipeline(storage.mbar_k, self.kv_stages, mma_warps, self.tma_bytes_k)
        pipeline_v = tma_pipeline(storage.mbar_v, self.kv_stages, mma_warps, self.tma_bytes_v)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = swizzled_tensor(storage.sQ, sQ_layout)
        sO = swizzled_tensor(storage.sO if self.config.separate_o else storage.sQ, sO_layout)
        sK = swizzled_tensor(storage.sK, sK_layout)
        sV = swizzled_tensor(storage.sV, sV_layout)

        problem = _Problem(mQ.shape[0], mK.shape[0], mQ.shape[2], mK.shape[2], mQ.shape[3], mSeqUsedQ, mSeqUsedK)
        block_info = BlockInfo(self.tile_m, self.tile_n, self.causal, self.local)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warp_group = cute.arch.make_warp_uniform(warp_idx // 4)
        if warp_group == self.producer_warp_group:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load(
                    tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, sQ, sK, sV,
                    pipeline_q, pipeline_k, pipeline_v, problem, block_info, window_left, window_right,
                )
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            tidx, _, _ = cute.arch.thread_idx()
            self.mma(
                tiled_mma_qk, tiled_mma_pv, tidx - self.threads_per_warp_group,
                sQ, sK, sV, sO, tma_atom_o, mO, mLSE, pipeline_q, pipeline_k, pipeline_v,
                problem, score_prescale, scale_log2, window_left, window_right, block_info,
            )

    @cute.jit
    def load(
        self, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, sQ, sK, sV,
        pipeline_q, pipeline_k, pipeline_v, problem, block_info, window_left, window_right,
    ):
        """One warp: for each of the CTA's tiles, Q and the first K (Q first when the CTA has one
        tile, `q_first`; K first in a persistent CTA), then V and the other K/V blocks from the
        highest down.

        The pipeline states carry across tiles, in step with the MMA warp groups' (same tile
        sequence, same block count per tile)."""
        no_cluster = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        q_first = self.config.q_first and not self.scheduler.persistent
        for tile_i in cutlass.range(problem.tile_count(self.scheduler), unroll=1):
            m_block, head, batch = problem.tile(self.scheduler, tile_i)
            head_kv = head // (problem.num_heads // problem.num_heads_kv)
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            load_q = functools.partial(self.load_q, tma_atom_q, tQgQ, tQsQ, pipeline_q)
            if cutlass.const_expr(q_first):
                load_q(q_state)
                q_state.advance()
                # A scheduling fence for ptxas: without it the Q load was placed after the
                # lengths' arithmetic, in order behind the wait for their loads.
                cute.arch.sync_warp()
            seqlen_q, seqlen_k = problem.seqlens(batch)
            n_block_min, n_block_max = block_info.n_block_range(
                m_block, seqlen_q, seqlen_k, window_left, window_right
            )
            gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, no_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, no_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

            n_blocks = n_block_max - n_block_min
            # In a persistent CTA the first K goes out before Q: Q's buffer frees only once the
            # previous tile's O has been stored from it (or, with separate_o, its last Q·Kᵀ GEMM
            # retired), and the K load need not wait for that.
            if n_blocks > 0:
                pipeline_k.producer_acquire(kv_state)
                cute.copy(tma_atom_k, tKgK[None, n_block_max - 1], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
            if cutlass.const_expr(not q_first):
                load_q(q_state)
                q_state.advance()
            if n_blocks > 0:
                pipeline_v.producer_acquire(kv_state)
                cute.copy(tma_atom_v, tVgV[None, n_block_max - 1], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
                kv_state.advance()
            for i in cutlass.range(n_blocks - 1, unroll=1):
                n_block = n_block_max - 2 - i
                pipeline_k.producer_acquire(kv_state)
                cute.copy(tma_atom_k, tKgK[None, n_block], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
                pipeline_v.producer_acquire(kv_state)
                cute.copy(tma_atom_v, tVgV[None, n_block], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
                kv_state.advance()

    @staticmethod
    def load_q(tma_atom_q, tQgQ, tQsQ, pipeline_q, q_state):
        """One tile's Q into its buffer, once the buffer is free (the caller advances q_state)."""
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

    @cute.jit
    def mma(
        self, tiled_mma_qk, tiled_mma_pv, tidx, sQ, sK, sV, sO, tma_atom_o, mO, mLSE,
        pipeline_q, pipeline_k, pipeline_v, problem, score_prescale, scale_log2,
        window_left, window_right, block_info,
    ):
        warp_group = cute.arch.make_warp_uniform(tidx // self.threads_per_warp_group)
        # WGMMA descriptors are per warp group; register fragments are per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(warp_group * self.threads_per_warp_group)
        wg_mma_pv = tiled_mma_pv.get_slice(warp_group * self.threads_per_warp_group)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)

        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        # V viewed as (dv, tile_n): the P·V B operand, MN-major over the same swizzled tiles.
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(permute_modes(sV, (1, 0, 2))))
        acc_o = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)))
        acc_o_rc = acc_rows_cols(acc_o)
        score_identity = cute.make_identity_tensor((self.tile_m, self.tile_n))
        score_coords0 = acc_rows_cols(tiled_mma_qk.get_slice(0).partition_C(score_identity))
        thread_origin = acc_rows_cols(thr_mma_qk.partition_C(score_identity))[0, 0]

        softmax = OnlineSoftmax.create(self.config.softmax, scale_log2, cute.size(acc_o_rc, mode=[0]))
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        mask = AttentionMask(self.tile_m, self.tile_n, self.causal, self.local)
        acc_s = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)))
        p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        blocks = _BlockOperands(
            tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, acc_s, p, acc_o, acc_o_rc,
            softmax, row_scale, pipeline_k, pipeline_v, score_prescale,
        )
        step = functools.partial(self.mma_overlapped_block, blocks, warp_group)
        # The tile's first block and, in the second block's step, its P·V (TileConfig.tail_keys).
        first_blocks, first_step = blocks, None
        if cutlass.const_expr(self.tail_keys):
            first_blocks = self.narrow_operands(blocks, warp_group, tidx, sQ, sK, self.tail_keys)
            first_step = functools.partial(step, pv_k_blocks=self.tail_keys // 16)
        # The first group's narrowed diagonal and its P·V step (TileConfig.first_group_diagonal).
        diagonal_blocks, diagonal_step = None, None
        if cutlass.const_expr(self.diagonal_keys):
            diagonal_blocks = self.narrow_operands(blocks, warp_group, tidx, sQ, sK, self.diagonal_keys)
            diagonal_step = functools.partial(step, pv_k_blocks=self.diagonal_keys // 16)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        # Both warp groups run the same number of GEMM turns per tile, so the ping-pong token is
        # back with the first group at every tile boundary: one hand-over for the whole CTA.
        self.pingpong_init(warp_group)
        finish_tile = functools.partial(
            self.finish_tile, tiled_mma_pv, thr_mma_pv, tidx, acc_o, acc_o_rc, sO, tma_atom_o, mO, mLSE,
            problem, pipeline_q,
        )
        tile_mask = functools.partial(
            mask.apply, coords0=score_coords0, thread_row=thread_origin[0], thread_col=thread_origin[1],
            window_left=window_left, window_right=window_right,
        )
        if cutlass.const_expr(self.config.overlap_tiles):
            self.mma_tiles_overlapped(blocks, warp_group, step, tile_mask, finish_tile, sV, tidx, pipeline_q,
                                      q_state, kv_state, problem, block_info, window_left, window_right)
        else:
            for tile_i in cutlass.range(problem.tile_count(self.scheduler), unroll=1):
                m_block, seqlen_q, seqlen_k, n_block_min, n_block_max = problem.key_blocks(
                    self.scheduler, block_info, tile_i, window_left, window_right
                )
                apply_mask = functools.partial(tile_mask, m_block=m_block, seqlen_q=seqlen_q,
                                               seqlen_k=seqlen_k)
                masked = functools.partial(step, apply_mask=apply_mask)
                acc_o.fill(0.0)
                softmax.reset()

                pipeline_q.consumer_wait(q_state)
                if n_block_max > n_block_min:
                    padded = cutlass.Boolean(False)
                    if cutlass.const_expr(self.config.skip_padded_groups):
                        padded = m_block * self.tile_m + warp_group * self.rows_per_warp_group >= seqlen_q
                    tile_blocks = functools.partial(
                        self.mma_tile_blocks, blocks, step, masked, warp_group, kv_state, block_info, m_block,
                        n_block_min, n_block_max, seqlen_q, seqlen_k, window_left, window_right, apply_mask,
                        sV, problem, tidx, pipeline_q, q_state,
                    )
                    if padded:
                        kv_state = self.mma_tile_skipped(blocks, warp_group, kv_state, n_block_min, n_block_max,
                                                         sV, seqlen_k, problem, tidx, pipeline_q, q_state)
                    else:
                        if cutlass.const_expr(self.diagonal_keys):
                            if warp_group == 0:
                                kv_state = tile_blocks(diagonal_blocks, diagonal_step, True)
                            else:
                                kv_state = tile_blocks(blocks, None, False)
                        else:
                            kv_state = tile_blocks(first_blocks, first_step, False)
                    # kv_state held the last block's slot; the next tile starts at the one after it.
                    kv_state.advance()
                if cutlass.const_expr(self.config.separate_o):
                    if n_block_max <= n_block_min:
                        pipeline_q.consumer_release(q_state)

                lse = cute.make_rmem_tensor_like(softmax.row_max, Float32)
                softmax.finalize(row_scale, lse)
                finish_tile(row_scale, lse, tile_i, q_state)
                q_state.advance()
        if cutlass.const_expr(self.config.separate_o):
            # The last tile's O store must have read sO before the CTA's shared memory goes.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mma_tile_blocks(self, blocks, step, masked, warp_group, kv_state, block_info, m_block, n_block_min,
                        n_block_max, seqlen_q, seqlen_k, window_left, window_right, apply_mask, sV, problem,
                        tidx, pipeline_q, q_state, first_blocks, first_step,
                        narrowed_diagonal: cutlass.Constexpr[bool]):
        """A tile's key blocks, its first one through `first_blocks` (narrowed, or `blocks`) and the
        next one's step `first_step`; returns the last block's ring slot. narrowed_diagonal: the
        first block is the first group's narrowed diagonal, which may be the tile's only block
        (its P·V then runs only the narrowed k16 steps); otherwise the tile has two or more
        blocks wherever the first is narrowed (`variants.tail_fits`)."""
        later_blocks = functools.partial(
            self.mma_key_blocks, step, masked, block_info=block_info, m_block=m_block,
            n_block_min=n_block_min, n_block_max=n_block_max, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            window_left=window_left, window_right=window_right, first_step=first_step,
        )
        self.mma_first_block(first_blocks, warp_group, kv_state, n_block_max - 1, apply_mask,
                             sV, seqlen_k, problem, tidx)
        if cutlass.const_expr(narrowed_diagonal):
            if n_block_max - n_block_min > 1:
                kv_state = later_blocks(kv_state=kv_state)
                self.release_q(pipeline_q, q_state)
                self.mma_last_pv(blocks, kv_state)
            else:
                self.release_q(pipeline_q, q_state)
                self.mma_last_pv(blocks, kv_state, k_blocks=self.diagonal_keys // 16)
        else:
            kv_state = later_blocks(kv_state=kv_state)
            self.release_q(pipeline_q, q_state)
            self.mma_last_pv(blocks, kv_state)
        return kv_state

    @cute.jit
    def release_q(self, pipeline_q, q_state):
        """Every Q·Kᵀ GEMM of the tile has retired (each block waits for its own): with O apart
        from Q, Q's buffer goes back to the producer."""
        if cutlass.const_expr(self.config.separate_o):
            pipeline_q.consumer_release(q_state)

    @cute.jit
    def finish_tile(self, tiled_mma_pv, thr_mma_pv, tidx, acc_o, acc_o_rc, sO, tma_atom_o, mO, mLSE,
                    problem, pipeline_q, row_scale, lse, tile_i, q_state):
        """O · row_scale (1/ℓ, 0 for rows past the entry) and LSE of tile tile_i, stored."""
        # Decoded again rather than held in registers across the main loop.
        m_block, head, batch = problem.tile(self.scheduler, tile_i)
        seqlen_q, _ = problem.seqlens(batch)
        self.clear_rows_past(thr_mma_pv, row_scale, lse, m_block, seqlen_q)
        scale_rows(acc_o_rc, row_scale)
        self.epilogue(tiled_mma_pv, thr_mma_pv, tidx, acc_o, lse, sO, tma_atom_o, mO, mLSE,
                      m_block, head, batch, problem.seqlen_q, pipeline_q, q_state)

    @cute.jit
    def mma_tiles_overlapped(self, blocks, warp_group, step, tile_mask, finish_tile, sV, tidx,
                             pipeline_q, q_state, kv_state, problem, block_info, window_left,
                             window_right):
        """The persistent tile loop with each tile boundary as one overlapped step.

        When the next tile has key blocks, this tile's last P·V is issued with the next tile's
        first Q·Kᵀ (`mma_overlapped_block` with the next tile's mask, O left unscaled), so the
        tensor pipe works through the boundary: this tile's statistics are finalized first, its
        epilogue runs once the P·V retires, and the next iteration skips its first block. The
        producer's ring order already matches (this tile's last V, then the next tile's first K,
        then its Q into the buffer this tile released after its last Q·Kᵀ)."""
        tile_count = problem.tile_count(self.scheduler)
        started = cutlass.Boolean(False)  # this tile's first block ran in the previous boundary
        for tile_i in cutlass.range(tile_count, unroll=1):
            m_block, seqlen_q, seqlen_k, n_block_min, n_block_max = problem.key_blocks(
                self.scheduler, block_info, tile_i, window_left, window_right
            )
            apply_mask = functools.partial(tile_mask, m_block=m_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
            masked = functools.partial(step, apply_mask=apply_mask)
            if not started:
                blocks.acc_o.fill(0.0)
                blocks.softmax.reset()
                pipeline_q.consumer_wait(q_state)
                if n_block_max > n_block_min:
                    self.mma_first_block(blocks, warp_group, kv_state, n_block_max - 1, apply_mask, sV,
                                         seqlen_k, problem, tidx)
            # The next tile (index clamped: its lengths are read from memory) and its key blocks.
            next_m_block, next_seqlen_q, next_seqlen_k, next_min, next_max = problem.key_blocks(
                self.scheduler, block_info, cutlass.min(tile_i + 1, tile_count - 1), window_left,
                window_right
            )
            next_blocks = next_max - next_min
            if tile_i + 1 >= tile_count:
                next_blocks = Int32(0)
            lse = cute.make_rmem_tensor_like(blocks.softmax.row_max, Float32)
            continued = cutlass.Boolean(False)
            if n_block_max > n_block_min:
                kv_state = self.mma_key_blocks(step, masked, kv_state, block_info, m_block, n_block_min,
                                               n_block_max, seqlen_q, seqlen_k, window_left, window_right)
                pipeline_q.consumer_release(q_state)
                if next_blocks > 0:
                    final_scale = cute.make_rmem_tensor_like(blocks.softmax.row_max, Float32)
                    blocks.softmax.finalize(final_scale, lse)
                    blocks.softmax.reset()
                    next_q_state = q_state.clone()
                    next_q_state.advance()
                    pipeline_q.consumer_wait(next_q_state)
                    next_mask = functools.partial(tile_mask, m_block=next_m_block, seqlen_q=next_seqlen_q,
                                                  seqlen_k=next_seqlen_k)
                    kv_state = self.mma_overlapped_block(blocks, warp_group, kv_state, next_max - 1,
                                                         next_mask, rescale_o=False)
                    finish_tile(final_scale, lse, tile_i, q_state)
                    blocks.acc_o.fill(0.0)
                    if next_seqlen_k < problem.seqlen_k:
                        self.zero_v_past_keys(sV, blocks.pipeline_v, kv_state, next_max - 1, next_seqlen_k, tidx)
                    continued = cutlass.Boolean(True)
                else:
                    self.mma_last_pv(blocks, kv_state)
                    kv_state.advance()
            else:
                pipeline_q.consumer_release(q_state)
            if not continued:
                blocks.softmax.finalize(blocks.row_scale, lse)
                finish_tile(blocks.row_scale, lse, tile_i, q_state)
            started = continued
            q_state.advance()

    @cute.jit
    def mma_key_blocks(self, step, masked, kv_state, block_info, m_block, n_block_min, n_block_max,
                       seqlen_q, seqlen_k, window_left, window_right, first_step=None):
        """The overlapped steps of a tile's key blocks after the first, from n_block_max − 2 down:
        right-masked (local), unmasked, left-masked (local). Returns the last block's ring slot.
        `first_step`, if given, replaces `step` for the first of them, which must exist (kernels
        without a mask, on keys that fill more than one block, or with the first group's
        narrowed diagonal, whose tile has no other right-masked block)."""
        n_block = n_block_max - 2
        if cutlass.const_expr(block_info.has_right_bound and not self.diagonal_keys):
            n_masked_from = block_info.n_block_min_right_masked(
                m_block, n_block_min, seqlen_q, seqlen_k, window_right
            )
            for _ in cutlass.range(n_block + 1 - n_masked_from, unroll=1):
                kv_state = masked(kv_state, n_block)
                n_block -= 1
        n_unmasked_from = block_info.n_block_min_unmasked(
            m_block, n_block_min, seqlen_q, seqlen_k, window_left
        )
        if cutlass.const_expr(first_step is not None):
            assert not self.local and (self.diagonal_keys or not block_info.has_right_bound), \
                "first_step: kernels without a mask, or the first group's narrowed diagonal"
            # Unconditional: under a branch, P's registers past the tail would have to live on
            # through this step for `mma_last_pv` (ptxas then serialized the WGMMAs, C7511).
            kv_state = first_step(kv_state, n_block)
            n_block -= 1
        for _ in cutlass.range(n_block + 1 - n_unmasked_from, unroll=1):
            kv_state = step(kv_state, n_block)
            n_block -= 1
        if cutlass.const_expr(self.local):
            for _ in cutlass.range(n_block + 1 - n_block_min, unroll=1):
                kv_state = masked(kv_state, n_block)
                n_block -= 1
        return kv_state

    @cute.jit
    def mma_tile_skipped(self, blocks, warp_group, kv_state, n_block_min, n_block_max, sV, seqlen_k,
                         problem, tidx, pipeline_q, q_state):
        """A padded warp group's tile (`skip_padded_groups`): no GEMM or softmax, only the barriers
        `mma_first_block`, `mma_overlapped_block` and `mma_last_pv` pass, in their order, so the
        producer's ring and the other groups' ping-pong turns and V zeroing go on as if it
        computed. Returns the last block's ring slot, as `mma_key_blocks` does."""
        blocks.pipeline_k.consumer_wait(kv_state)
        if cutlass.const_expr(self.config.pingpong_first_block):
            self.pingpong_wait(warp_group)
            self.pingpong_yield(warp_group)
        blocks.pipeline_k.consumer_release(kv_state)
        if seqlen_k < problem.seqlen_k:
            self.zero_v_past_keys(sV, blocks.pipeline_v, kv_state, n_block_max - 1, seqlen_k, tidx)
        for _ in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            v_state = kv_state.clone()
            kv_state.advance()
            blocks.pipeline_k.consumer_wait(kv_state)
            self.pingpong_wait(warp_group)
            blocks.pipeline_v.consumer_wait(v_state)
            self.pingpong_yield(warp_group)
            blocks.pipeline_k.consumer_release(kv_state)
            blocks.pipeline_v.consumer_release(v_state)
        if cutlass.const_expr(self.config.separate_o):
            pipeline_q.consumer_release(q_state)
        blocks.pipeline_v.consumer_wait(kv_state)
        blocks.pipeline_v.consumer_release(kv_state)
        return kv_state

    @cute.jit
    def clear_rows_past(self, thr_mma_pv, row_scale, lse, m_block, seqlen_q):
        """Rows at or past seqlen_q (a ragged entry's padding, computed from its zeroed Q like
        any other row) come out as O = 0 and LSE = −inf: XLA does not zero results."""
        o_coords = acc_rows_cols(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        for r in cutlass.range_constexpr(cute.size(lse)):
            if m_block * self.tile_m + o_coords[r, 0][0] >= seqlen_q:
                row_scale[r] = Float32(0.0)
                lse[r] = -Float32.inf

    @cute.jit
    def mma_first_block(self, blocks, warp_group, kv_state, n_block, apply_mask, sV, seqlen_k, problem,
                        tidx):
        """S for a tile's first (highest) block and its softmax; its P·V joins the next block's
        GEMMs. The highest block holds the sequence tail (and the diagonal): always masked, and
        for an entry shorter than the buffer its V rows past the keys are zeroed.

        With `pingpong_first_block` the S GEMM takes a ping-pong turn like any later step, so the
        groups' first GEMMs run one after the other and the first group's softmax overlaps the
        next group's GEMM; without it every group issues at once, and their softmaxes then run
        together with the tensor pipe idle. Every group takes the turn, so each still takes as
        many turns per tile as the others."""
        take_turn = self.config.pingpong_first_block
        blocks.pipeline_k.consumer_wait(kv_state)
        if cutlass.const_expr(take_turn):
            self.pingpong_wait(warp_group)
        wgmma_gemm(blocks.tiled_mma_qk, blocks.acc_s, blocks.tSrQ, blocks.tSrK[None, None, None, kv_state.index],
                  zero_init=True, wait_group=-1 if take_turn else 0)
        if cutlass.const_expr(take_turn):
            self.pingpong_yield(warp_group)
            warpgroup.wait_group(0)
        blocks.pipeline_k.consumer_release(kv_state)
        self.softmax_block(blocks, n_block, apply_mask)
        if seqlen_k < problem.seqlen_k:
            self.zero_v_past_keys(sV, blocks.pipeline_v, kv_state, n_block, seqlen_k, tidx)

    def narrow_operands(self, blocks, warp_group, tidx, sQ, sK, keys: int) -> _BlockOperands:
        """`blocks` narrowed to a block's first `keys` keys: the S GEMM's MMA and K operand,
        and S and P as prefixes of the full-width fragments (`acc_prefix`)."""
        tiled_mma = self.qk_tiled_mma(keys)
        wg_mma = tiled_mma.get_slice(warp_group * self.threads_per_warp_group)
        sK_narrow = cute.local_tile(sK, (keys, self.head_dim, self.kv_stages), (0, 0, 0))
        shape = tiled_mma.get_slice(tidx).partition_shape_C((self.tile_m, keys))
        return dataclasses.replace(
            blocks, tiled_mma_qk=tiled_mma,
            tSrQ=wg_mma.make_fragment_A(wg_mma.partition_A(sQ)),
            tSrK=wg_mma.make_fragment_B(wg_mma.partition_B(sK_narrow)),
            acc_s=acc_prefix(blocks.acc_s, shape), p=acc_prefix(blocks.p, shape),
        )

    @cute.jit
    def zero_v_past_keys(self, sV, pipeline_v, kv_state, n_block, seqlen_k, tidx):
        """Zeroes the rows of block n_block's V that lie past a ragged entry's last key.

        Those keys' P is exactly 0, but their V rows are the buffer's padding, which the caller
        may have left non-finite, and 0 · NaN is NaN in the P·V GEMM (their K rows need nothing:
        the mask overwrites their scores). A dense call's tail block reads past the buffer's end,
        which the TMA fills with zeros, so only entries shorter than the buffer come here. Every
        MMA thread takes a share of the elements; the fence and barrier make the zeros visible to
        both warp groups' P·V WGMMAs (async proxy) before either is issued."""
        valid_rows = seqlen_k - n_block * self.tile_n
        if valid_rows < self.tile_n:
            pipeline_v.consumer_wait(kv_state)
            sV_block = sV[None, None, kv_state.index]
            zero_elems = (self.tile_n - valid_rows) * self.head_dim_v
            for i in cutlass.range(tidx, zero_elems, self.num_mma_threads, unroll=1):
                sV_block[valid_rows + i // self.head_dim_v, i % self.head_dim_v] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.num_mma_threads)

    @cute.jit
    def mma_overlapped_block(self, blocks, warp_group, kv_state, n_block, apply_mask=None,
                             rescale_o: cutlass.Constexpr[bool] = True,
                             pv_k_blocks: cutlass.Constexpr[int] = 0):
        """S_j = Q·K_jᵀ issued with O += P_{j-1}·V_{j-1}; softmax of S_j overlaps the P·V GEMM.

        kv_state is block j-1's ring slot on entry; returns block j's. rescale_o=False: S_j is the
        next tile's first block (`mma_tiles_overlapped`), so O is this tile's and keeps its scale.
        pv_k_blocks: P_{j-1}·V_{j-1} over only that many k16 steps (a narrowed tail block's).
        """
        v_state = kv_state.clone()
        kv_state.advance()
        blocks.pipeline_k.consumer_wait(kv_state)
        if cutlass.const_expr(not self.config.v_wait_in_turn):
            blocks.pipeline_v.consumer_wait(v_state)
        self.pingpong_wait(warp_group)
        wgmma_gemm(blocks.tiled_mma_qk, blocks.acc_s, blocks.tSrQ, blocks.tSrK[None, None, None, kv_state.index],
                  zero_init=True, wait_group=-1)
        if cutlass.const_expr(self.config.v_wait_in_turn):
            blocks.pipeline_v.consumer_wait(v_state)
        wgmma_gemm(blocks.tiled_mma_pv, blocks.acc_o, acc_as_operand_a(blocks.p),
                  blocks.tOrVt[None, None, None, v_state.index], zero_init=False, wait_group=-1,
                  k_blocks=pv_k_blocks)
        self.pingpong_yield(warp_group)
        warpgroup.wait_group(1)
        blocks.pipeline_k.consumer_release(kv_state)
        moved = self.softmax_block(blocks, n_block, apply_mask, convert_p=False)
        # P_{j-1} (registers read by the in-flight WGMMA) and O may be touched only after it
        # retires: the wait in the rescale branch (`retire_pv`, TileConfig.pv_wait_in_branch), or
        # before it, where ptxas may hoist it into the softmax.
        if cutlass.const_expr(self.config.pv_wait_in_branch and rescale_o):
            self.retire_pv(blocks, v_state, moved)
        else:
            warpgroup.wait_group(0)
            blocks.pipeline_v.consumer_release(v_state)
            if cutlass.const_expr(rescale_o):
                if cute.arch.vote_any_sync(moved):
                    scale_rows(blocks.acc_o_rc, blocks.row_scale)
        convert_pairs(blocks.acc_s, blocks.p)
        return kv_state

    @cute.jit
    def retire_pv(self, blocks, v_state, moved):
        """Wait for block j-1's P·V GEMM, rescale O if a row's maximum moved, free V_{j-1}'s
        stage. Each arm of the branch waits: ptxas schedules within a basic block, so the wait
        cannot rise above the code before the branch (TileConfig.pv_wait_in_branch)."""
        if cute.arch.vote_any_sync(moved):
            warpgroup.wait_group(0)
            scale_rows(blocks.acc_o_rc, blocks.row_scale)
        else:
            warpgroup.wait_group(0)
        blocks.pipeline_v.consumer_release(v_state)

    @cute.jit
    def mma_last_pv(self, blocks, kv_state, k_blocks: cutlass.Constexpr[int] = 0):
        blocks.pipeline_v.consumer_wait(kv_state)
        wgmma_gemm(blocks.tiled_mma_pv, blocks.acc_o, acc_as_operand_a(blocks.p),
                  blocks.tOrVt[None, None, None, kv_state.index], zero_init=False, wait_group=0,
                  k_blocks=k_blocks)
        blocks.pipeline_v.consumer_release(kv_state)

    @cute.jit
    def softmax_block(self, blocks, n_block, apply_mask, convert_p: cutlass.Constexpr[bool] = True):
        """Softcap and mask S in place, then the online-softmax step; P = S in the input dtype."""
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(blocks.acc_s)):
                blocks.acc_s[i] = cute.math.tanh(blocks.acc_s[i] * blocks.score_prescale, fastmath=True)
        scores = acc_rows_cols(blocks.acc_s)
        if cutlass.const_expr(apply_mask is not None):
            apply_mask(scores, n_block=n_block)
        moved = blocks.softmax.step(scores, blocks.row_scale)
        if cutlass.const_expr(convert_p):
            convert_pairs(blocks.acc_s, blocks.p)
        return moved

    # GEMM issue goes round the MMA warp groups in order: group g waits on barrier base + g,
    # issues, and arrives on the next group's. Each barrier joins two groups (the waiter and the
    # one handing over), so it counts 2 · 128 threads.
    @cute.jit
    def pingpong_init(self, warp_group):
        """The last MMA warp group hands the first its initial turn."""
        if cutlass.const_expr(self.pingpong):
            if warp_group == len(self.mma_warp_groups) - 1:
                cute.arch.barrier_arrive(
                    barrier_id=self.pingpong_barrier_base, number_of_threads=2 * self.threads_per_warp_group
                )

    @cute.jit
    def pingpong_wait(self, warp_group):
        """Wait for this warp group's turn to issue GEMMs."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=self.pingpong_barrier_base + warp_group,
                number_of_threads=2 * self.threads_per_warp_group,
            )

    @cute.jit
    def pingpong_yield(self, warp_group):
        """Give the next warp group its turn once this one's GEMMs are issued."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(
                barrier_id=self.pingpong_barrier_base + (warp_group + 1) % len(self.mma_warp_groups),
                number_of_threads=2 * self.threads_per_warp_group,
            )

    @cute.jit
    def epilogue(self, tiled_mma_pv, thr_mma_pv, tidx, acc_o, lse, sO, tma_atom_o, mO, mLSE,
                 m_block, head, batch, seqlen_q, pipeline_q, q_state):
        # LSE: the lane holding column 0 of a row writes it; rows past the buffer's seqlen_q
        # are the tile's overhang.
        o_coords = acc_rows_cols(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        gLSE = mLSE[None, head, batch]
        if o_coords[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + o_coords[r, 0][0]
                if row < seqlen_q:
                    gLSE[row] = lse[r]

        # O: registers -> shared memory (Q's buffer: every WGMMA reading it has completed) -> TMA.
        o_out = cute.make_rmem_tensor_like(acc_o, self.dtype)
        o_out.store(acc_o.load().to(self.dtype))
        if cutlass.const_expr(self.config.separate_o):
            # The previous tile's O store must have read sO before it is overwritten.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Both warp groups must be done reading Q (or, with separate_o, the previous store done
        # reading sO) before O overwrites it (layouts differ if dv != d).
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.num_mma_threads)
        # The thread's slice is rebuilt from an opaque index so its swizzled addresses are
        # computed here, not hoisted out of a persistent kernel's tile loop (see opaque_int32).
        if cutlass.const_expr(self.config.o_stmatrix):
            store_o = cute.make_tiled_copy_C(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
                tiled_mma_pv)
            thr_store_o = store_o.get_slice(opaque_int32(tidx))
            cute.copy(store_o, thr_store_o.retile(o_out), thr_store_o.partition_D(sO))
        else:
            cute.autovec_copy(o_out, tiled_mma_pv.get_slice(opaque_int32(tidx)).partition_C(sO))
        # Ordinary stores must be made visible to the TMA (async proxy) before the store is issued.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.num_mma_threads)
        # One thread issues the store: a bulk tensor copy is per thread (unlike the loads, the DSL
        # elects no lane for it), so a whole warp would store the tile 32 times.
        if tidx == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.head_dim_v), (m_block, 0))
            tOsO_tma, tOgO_tma = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(tma_atom_o, tOsO_tma, tOgO_tma)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.config.separate_o):
                # Once the store has read O out of Q's buffer, the producer may load the next Q.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                pipeline_q.consumer_release(q_state)
