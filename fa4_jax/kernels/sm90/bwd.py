"""FlashAttention backward for Hopper (sm_90a): TMA loads, WGMMA, Sᵀ/dPᵀ in registers.

One `__call__` launches three kernels on the stream, in order:

1. `BackwardPreprocess` (kernels/bwd_pre.py): D = rowsum(dO ∘ O) − dLSE → mdPsum, and
   lse·log2(e) → mLSElog2 (+inf for padded rows and rows with no visible key, so their P is 0);
   mdQaccum zeroed, but for deterministic calls whose adds store first.
2. The main kernel below: dK and dV of one key block, and dS·K added into mdQaccum.
3. `BackwardPostprocess` (kernels/bwd_post.py): dQ = softmax_scale · (the sum of mdQaccum's
   copies) → mdQ.

Main kernel: one CTA per (key block of tile_n keys, kv head, batch); it walks the q heads of its
GQA group and, for each, the query blocks of tile_m rows that see its keys (BlockInfo.m_block_range),
keeping dK and dV in registers for a single store at the end (no atomics on dK/dV, and GQA sums over
the group inside the CTA). Warp-role table:

- warp group 0 (`producer_warp_group`): its first warp issues TMA for K and V once, then for each
  query block Q with its LSElog2 row slice and dO with its D slice through a `stages`-deep ring of
  mbarrier-guarded buffers (`pipeline_q`, `pipeline_do`, one slot index for both).
- warp groups 1..2 (`mma_warp_groups`), per query block:
    Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (WGMMA from shared memory; transposed so that keys are the M
    mode; with `scores_ahead` Sᵀ is issued while the previous block's dQ is handed over);
    Pᵀ = exp2(Sᵀ·scale_log2 − LSElog2) while the dPᵀ GEMM runs (causal / window mask first,
    only on tiles that cross the band: BlockInfo.tile_needs_mask);
    dV += Pᵀ·dO issued, then dSᵀ = Pᵀ∘(dPᵀ − D) while it runs (`dv_during_ds`; else dV after
    dSᵀ); dK += dSᵀ·Q;
    dSᵀ to shared memory (stmatrix), a named barrier, then dQ_partial = dS·K (WGMMA, dS read as
    an M-major view of dSᵀ); dQ_partial added into mdQaccum: with `dq_tma_reduce` (every head
    dim of the menu) through a shared fp32 tile and bulk reduce-adds issued by dQ-writer warps of
    warp group 0 (with `dq_fragment_order`, every head dim's default, the tile holds each
    thread's registers in their own order, one chunk per warp group, and so does mdQaccum until
    the postprocess), otherwise by per-thread `red.global.add.v2.f32`. In deterministic mode the
    adds into a (batch, head, query block) go in a fixed key-block order (decreasing under a
    causal/local mask: `det_descending`), each waiting on mSemaphore for its turn; in fragment
    order the turns alternate between mdQaccum's copies when the call gives it two
    (`_dq_copy`), and each copy's first turn stores rather than adds, so that nothing zeroes the
    workspace first (`_det_stores_first`).
    With softcap, Sᵀ and dPᵀ are both awaited and one pass computes t = tanh(Sᵀ·scale/softcap),
    Pᵀ and dSᵀ = Pᵀ∘(dPᵀ − D)∘(1 − t²); the mask then zeroes Pᵀ and dSᵀ (masking the scores
    to −inf first would leave no t for the derivative).
  With `dkv_from_registers` (d ≤ 128) each MMA warp group owns 64 of the tile's keys: its Pᵀ and
  dSᵀ registers are directly the WGMMA A operand of dV and dK (layouts.py), the way the forward
  feeds P, and only dSᵀ goes to shared memory. Otherwise (d = 192, 256: dK and dV of 64 keys
  would be 64·(d + dv)/128 fp32 registers per thread, too many) the warp groups split dK/dV
  (and Sᵀ, dPᵀ) along the other mode, so Pᵀ and dSᵀ both go through shared memory.
  The dQ GEMM gives each warp group 64 query rows: all of them and half of d on 64-row tiles,
  its half of the rows and all of d on 128-row tiles (d64).
- epilogue (the MMA warp groups): dK·softmax_scale and dV to shared memory (reusing K's and V's
  buffers once every GEMM has retired), then TMA stores, which drop rows past seqlen_k.

Sequence tails: query rows past seqlen_q have LSElog2 = +inf (P = 0) and zero Q and dO rows, so
they need no mask. Keys past seqlen_k are zero, score 0 and would get P = exp2(−LSElog2), which
overflows for a row with lse below about −88 (inf · 0 = NaN in dQ); the CTA of the partial key
block masks them (AttentionMask.apply_key_tail). Their dK/dV rows are never stored.

Ragged batches (mSeqUsedQ, mSeqUsedK: each entry's valid query rows and keys; empty for a dense
batch, whose lengths are the buffers', common/ragged.py): seqlen_q and seqlen_k above are the
entry's, clamped to the buffers, and the padding past them is zero (ffi.backward zeroes Q, K, V
and dO there): padded rows get LSElog2 = +inf and D = 0 from the preprocess, so P = dS = 0 and
their dQ rows stay 0 (the postprocess writes 0 there anyway); padded keys are loaded (a TMA box
cannot stop at a per-entry length) and masked like the tail above, so their dK/dV rows are exact
zeros; key blocks wholly past the length visit no query block and store zeros.
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
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_jax.kernels.bwd_post import BackwardPostprocess
from fa4_jax.kernels.bwd_pre import BackwardPreprocess
from fa4_jax.kernels.bwd_workspace import BWD_SEMAPHORE_ROWS
from fa4_jax.kernels.common.block_info import BlockInfo
from fa4_jax.kernels.common.exp2 import exp2_poly, uses_poly
from fa4_jax.kernels.common.layouts import (
    acc_as_operand_a, acc_rows_cols, fragment_order_view, opaque_int32,
)
from fa4_jax.kernels.common.mask import AttentionMask
from fa4_jax.kernels.common.ragged import entry_length
from fa4_jax.kernels.sm90.operands import (
    permute_modes, smem_layout, swizzled_tensor, tma_pipeline, wgmma_gemm,
)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One head dim's static backward kernel shape."""

    tile_m: int  # query rows per step of the inner loop
    tile_n: int  # keys per CTA
    stages: int  # depth of the Q / dO rings
    dkv_from_registers: bool  # Pᵀ, dSᵀ feed the dV/dK WGMMAs from registers (else from smem)
    pds_stages: int  # dSᵀ (and Pᵀ) shared-memory buffers; 2 saves a barrier per query block
    # Deterministic causal/local only: key blocks add into a query block's dQ in *decreasing*
    # order (turn = n_block_hi(m) − 1 − n_block), and CTA x of the grid takes key block
    # N − 1 − x so that launch order matches add order. A CTA's first query block (its diagonal)
    # then has it as the first contributor, instead of waiting for every lower key block to walk
    # down to it (a wavefront of ~n_block steps). False: increasing order (backward v1); measured
    # at d128 16k causal, deterministic: 371 TF/s descending vs 251 increasing.
    det_descending: bool = True
    # dQ_partial goes registers -> a shared fp32 tile -> one TMA reduce-add
    # (cp.reduce.async.bulk.tensor .add.f32) issued by a dQ-writer warp of the producer warp group
    # (FlashAttention-3's scheme), instead of per-thread red.global.add.v2.f32 from the MMA warp
    # groups; in deterministic mode that warp, not the MMA warps, waits for the turn. Needs
    # tile_m·d·4 bytes more shared memory (d128: 32 KB; d256: 64 KB, which fits only with
    # single-buffered Q/dO and dSᵀ/Pᵀ), and a multiple of 8 dQ columns per warp group.
    # Measured at d128 4k/16k: 521/555 TF/s fwd+bwd vs 443/468 with red.global (backward v1);
    # d96 +8-12%, d192/dv128 +32-34% (session 8).
    dq_tma_reduce: bool = False
    # dkv_from_registers: dV's WGMMA is issued as soon as Pᵀ is in registers, so that it runs
    # while dSᵀ is computed. It then holds Pᵀ's registers and dV's accumulator through that
    # pass; at 128 query rows (Sᵀ and dPᵀ 64 fp32 each, dK and dV 32 each, Pᵀ and dSᵀ 32 each)
    # that is more than 240 registers and ptxas serializes every WGMMA of the kernel (C7512),
    # so there dV is issued after dSᵀ, beside dK. At d128 issuing it after dSᵀ (FA4 upstream's
    # order) measured +0.3-1.6% (session 13; `dv_during_ds` is the ablation).
    dv_during_ds: bool = True
    # With dv_during_ds off: dV's WGMMA issued once dSᵀ is in shared memory (before the fence
    # and the warp groups' barrier), FA4 upstream's place, instead of as soon as dSᵀ is in
    # registers. With do_release_early, the ablation `upstream_tail`: even, −1.8 to +1.6% at
    # d128 1k-16k over two processes (session 17).
    dv_after_ds_store: bool = False
    # Deterministic dq_tma_reduce: the dQ writer hands sdQ back to the MMA warp groups once its
    # TMA has read it, so they fill it with the next block's dQ while the add lands; False: once
    # the add is complete and the turn passed on (backward v2), so that a CTA's step cannot be
    # shorter than the add's round trip to L2. (Without determinism sdQ is always freed on read.)
    # Measured (docs/perf-log.md, "when the writer hands sdQ back"): +4-6% at d256, even at d64,
    # 4-7% slower at d128 with one writer; with two (which need it) d128 gains 4-9% over that.
    det_free_sdq_on_read: bool = True
    # Ablation only: False keeps the deterministic mode's per-add costs (the add waited on to
    # completion, the semaphore released) but not the wait for the turn, so adds land in any
    # order and results are not reproducible. Against the default mode and the ordered one it
    # splits the deterministic cost into those per-add costs and the waits for the order.
    det_ordered: bool = True
    # Deterministic dq_tma_reduce: warps of the producer group that take the dQ adds in turn,
    # each waiting for its own adds to complete before passing their turns on, so that one
    # add's round trip to L2 overlaps the next add instead of holding up the only writer
    # (det_unordered measured that wait as most of the deterministic cost at d192 and half of
    # it at d256 under a mask). Each walks every block; token barriers in a ring keep one
    # writer at a time on the hand-over barriers. Needs sdQ freed on read. Three (warp 3 too)
    # is the ablation `dq_writers3`. Measured
    # (docs/perf-log.md, "two dQ writers"), deterministic, 1k/4k/16k: d192 +10/13/18%, d256
    # +6/8/18% (causal +9/12/21%), d96 +10/8/9%; the default mode unchanged. d64 and d128 took
    # it with fragment order (d64 deterministic +0-4% over one writer: docs/perf-log.md "dQ in
    # fragment order", run 1).
    dq_writers: int = 1
    # The next query block's Sᵀ GEMM is issued as soon as this block's GEMMs have retired, so
    # that it runs while this block's dQ goes to sdQ (or to global memory) and the threads meet
    # at its barriers; False: after that hand-over, where the exponentials wait for it. Needs a
    # second Q/dO stage (the next block's Q is loaded while this block's is still read). dPᵀ
    # stays at the top of the block: issued ahead too, it would be one more tile_m / 2 fp32
    # registers held beside dQ's, dK's and dV's. Measured (docs/perf-log.md, "Sᵀ issued
    # ahead"): +3-6% at d96 and d192 without a mask, whose dQ goes out by per-thread atomics
    # from the MMA warps; even at d128 (a short hand-over to the writer warp) and 4-7% slower
    # there deterministically; at d64's 128 rows ptxas serializes the WGMMAs (C7512). d96 took
    # dq_during_dk instead in session 13 (3-6% faster than this, `d96_v11_order`).
    scores_ahead: bool = False
    # Columns of a thread's Sᵀ/dPᵀ fragment whose LSE and D values are read from shared memory
    # before the GEMM waits instead of at their use (ptxas leaves a load that follows a wait
    # after it, and at d128 the exponentials' first FFMAs waited on it: ~10% of the kernel's
    # stall samples, short scoreboard). 16 is all of a 64-row tile; all 32 of d64's 128 rows
    # spill. Measured (docs/perf-log.md, "where a d128 step stalls"): d256 +1-2.5%; d64 even by
    # default and 1-4% slower deterministically, so it reads them at their use (0). At d128 it
    # was +0-4% by default and 7-11% slower deterministically in session 8's GEMM order, −1 to
    # +1% in session 11's, and +0.3-2% in both modes in session 13's (the default since).
    row_stats_ahead: int = 16
    # The LSE values read ahead are read right after Q's slot is ready, before the Sᵀ GEMM is
    # issued (FA4 upstream's place), instead of after the dPᵀ GEMM's issue. There ptxas left
    # the loads under the other warp group's GEMMs' shared-memory reads, and the
    # exponentials' first FFMAs still waited on them: Nsight Compute, d128 causal s4k (session
    # 16), 10% of the stall samples on four of those FFMAs against 1% on upstream's, whose
    # kernel took 1.90 M cycles against our 2.07 M. With the loads moved those stalls went,
    # but the warps then waited for the dPᵀ GEMM instead: 2.04 M cycles, forward+backward
    # +0.5% over two runs (−0.6 to +1.3% per row; docs/perf-log.md "LSE read before the Sᵀ
    # GEMM"). Not with scores_ahead (the values would be held through the previous block's dQ
    # hand-over) or softcap (which reads them one column at a time).
    lse_before_scores: bool = False
    # The dK GEMM is issued after dQ's, and the dQ hand-over (its stores to sdQ, or its atomics)
    # runs while dK's GEMM does; False: dK is issued first (from registers, before dSᵀ goes to
    # shared memory) and the hand-over waits for every GEMM of the block, the tensor pipe idle
    # through it. Holds dSᵀ's 16-bit registers (dK's operand) through the hand-over. Not with
    # scores_ahead, which overlaps the hand-over with the next block's Sᵀ instead. Measured
    # (docs/perf-log.md, "the dQ hand-over during the dK GEMM"): d64 +1-2%; d256 11-14% slower.
    # d128: even without a mask and 1-3% slower under one with dV issued during dSᵀ (session 9),
    # +0.3-1% with dV issued after it (session 13). The other warp group's GEMMs already fill
    # most of a hand-over.
    dq_during_dk: bool = False
    # With dq_during_dk: dO's slot released as soon as the dV and dQ GEMMs retire, before the
    # dQ hand-over (FA4 upstream releases it there), instead of with Q's at the end of the
    # step, so the producer may load the dO two blocks ahead sooner. Measured even with
    # dv_after_ds_store (the ablation `upstream_tail`, session 17).
    do_release_early: bool = False
    # dq_tma_reduce: sdQ holds the MMA threads' dQ registers in fragment order
    # (layouts.fragment_order_view: 128-bit stores free of bank conflicts, one address per
    # thread) instead of the tile's; each warp group hands its chunk over on its own pair of
    # barriers, and the writer adds each chunk into mdQaccum with one plain bulk reduce
    # (cp.reduce.async.bulk .add.f32, no tensor map). mdQaccum's query blocks then hold fragment
    # order too, and the postprocess reads them back through the same view (FlashAttention-3's
    # dQ path). Measured (docs/perf-log.md, "dQ in fragment order") against the tile order:
    # +2-7% forward+backward at every head dim without a mask, +0-6% under one; deterministic
    # +3-9% (d128 with the second writer its tile order could not take).
    dq_fragment_order: bool = False
    # Default mode, fragment order: the first key block to reach a query block stores its dQ
    # instead of adding it (a compare-and-swap on the block's semaphore claims the store; the
    # others wait until the claimer's store is complete, then add), so the preprocess need not
    # zero mdQaccum: b·h·sq·d·4 bytes, 128 MB on the ANCHORS grid, half the preprocess's
    # traffic (Nsight Compute, d128: 66 µs at 79% of the DRAM bandwidth, 6% of forward+backward
    # at 1k tokens). Without a mask the walk is then rotated as a deterministic call's is, so
    # that a head's key blocks reach each query block a step apart rather than all at once.
    # Measured (docs/perf-log.md, "the default mode's first add stores", one run): +2-3% at 1k
    # at d64 and under d128's and d64's causal mask, even at d64/d128 from 4k, 1-5% slower at
    # d256 (the claim's L2 round trip sits on the dQ writer's path between the hand-over and
    # the add) and at d128 16k without a mask. d64's default since session 20, after two more
    # runs ("first add stores at d64"): 1k +1.7%, causal +2.2% on average over three, 4k and
    # 16k within ±1.5%; elsewhere the ablation `stores_first` (d64's old kernel: `dq_zeroed`).
    default_stores_first: bool = False
    # Deterministic without a mask: each key block's walk over the query blocks starts n_block
    # steps before the end, so that a chain's key blocks never queue at one query block
    # (`_query_walk`, where it applies); False: every walk starts at the first query block.
    # Measured (docs/perf-log.md, "the rotated walk"), deterministic at 1k/4k: d64 +10/11%,
    # d96 +7/6%, d128 +6/5%, d192 +5/1%, d256 +11/3%; at 16k even (d64 −3%).
    det_rotated_walk: bool = True
    # The main kernel and the postprocess are launched as programmatic dependents of the kernel
    # before them (PDL): their CTAs take SMs as the previous grid's last CTAs leave, and run
    # their prologue (barriers, descriptors, K and V's loads) before griddepcontrol.wait, so
    # the launch gaps between the three kernels close. Measured against `no_pdl` at d64/d128
    # (docs/perf-log.md, "PDL"): −0.5% to +2%, within the noise; kept as FA4 upstream does.
    pdl: bool = True
    # Share of Pᵀ's exponentials computed by exp2.py's polynomial on the FMA pipes instead of
    # MUFU.EX2 (register columns assigned by exp2.uses_poly, as in the forward; softcap keeps
    # MUFU). The two MMA warp groups meet at the dSᵀ barrier every step, so their
    # exponentials run at the same time on the same SMSPs' MUFU units (d64: 2 warps × 64 MUFU
    # × 8 clocks, ~1000 of a ~4800-clock step). Measured (docs/perf-log.md, "exponentials on
    # the FMA pipes in the backward", session 23): d128 an eighth +1.0% on average, all 12
    # cells ahead over two processes (deterministic +0.7%), a quarter or more no better; d64
    # an eighth 1-2% slower under the mask (a quarter spills there); d96 and d256 even or
    # behind.
    exp2_poly_share: float = 0.0


# A WGMMA has 64 rows: the Sᵀ/dPᵀ GEMMs put keys on them (64 per warp group with
# dkv_from_registers), the dQ GEMM query rows (one 64-row tile per warp group: tile_m 64 splits d
# between the warp groups, tile_m 128 splits the rows). Shared memory, 2-byte elements, under the
# 227 KB of an sm_90 CTA:
#   2 · (stages·tile_m·(d + dv) + tile_n·(d + dv) + pds_stages·tile_n·tile_m·(1, or 2 with P))
#   d64, 128 rows: 2·(2·128·128 + 128·128 + 2·128·128) = 160 KB, + 32 KB of fp32 sdQ = 192 KB
#   d96:  2·(2·64·192 + 128·192 + 2·128·64)   = 128 KB
#   d128: 2·(2·64·256 + 128·256 + 2·128·64)   = 160 KB
#   d192/dv128: 2·(2·64·320 + 64·320 + 2·2·64·64) = 152 KB
#   d256: 2·(2·64·512 + 64·512 + 2·2·64·64)   = 224 KB (+1.5 KB of LSE/D slices and barriers);
#         one stage and one dSᵀ/Pᵀ buffer: 144 KB, + 64 KB of fp32 sdQ = 208 KB. The TMA dQ
#         reduce is worth more than the second stage: fwd+bwd 456/475 TF/s at s4k/16k against
#         342/358 with two stages and per-thread atomics (+33%; causal 411/481 vs 316/359;
#         deterministic +24-33%), docs/perf-log.md "Backward d256".
# Registers per MMA thread (240 budget): with dkv_from_registers a warp group holds dK and dV of
# 64 keys (d128: 64 + 64 fp32), Sᵀ and dPᵀ (tile_m / 2 each) and their 16-bit copies:
# unconstrained, ptxas would take 236-240 at d128 (250-255 with softcap) and fits all of them in
# 240 without spills. d64 on 128 rows (FlashAttention-3's shape there) fits with dv_during_ds
# off (237 registers) and runs forward+backward 8-13% faster than on 64 rows, deterministic
# 19-28% (docs/perf-log.md, "Backward d64 on 128 × 128 tiles"). d192 and d256 with 64 keys
# per warp group would need 160 and 256 for dK + dV alone, hence tile_n = 64 with dK/dV split
# along d (d256: 64 + 64) and P/dS through shared memory: d256 takes ~220, d192 ~155.
# d96 and d128 run their GEMMs in FA4 upstream's order (session 13): dV issued once dSᵀ is
# computed, dQ before dK with the dQ hand-over under the dK GEMM, LSE and D read ahead
# (docs/perf-log.md, "d128 backward in upstream's order"). Forward+backward over session 11's
# orders, which are the ablations `bwd_v11_order` (d128: dV during dSᵀ, dK first, the hand-over
# after every GEMM, LSE and D at their use) and `d96_v11_order` (dV during dSᵀ, the next Sᵀ
# issued ahead): d128 +2.4/+3.2/+4.3% at 1k/4k/16k, causal +1.6/+2.8/+3.0% (two runs agreeing
# within 1%); d96 +2.6/+6.3/+6.2%, causal +3.3/+5.6/+5.3%. At d64, whose order it already is
# but for the statistics, reading those ahead loses 1-2% (`stats_ahead` there).
TILE_CONFIGS = {
    64: TileConfig(128, 128, 2, True, 2, dq_tma_reduce=True, dv_during_ds=False,
                   row_stats_ahead=0, dq_during_dk=True, dq_writers=2, dq_fragment_order=True,
                   default_stores_first=True),
    96: TileConfig(64, 128, 2, True, 2, dq_tma_reduce=True, dv_during_ds=False, dq_during_dk=True,
                   dq_writers=2, dq_fragment_order=True),
    128: TileConfig(64, 128, 2, True, 2, dq_tma_reduce=True, dv_during_ds=False, dq_during_dk=True,
                    dq_writers=2, dq_fragment_order=True, lse_before_scores=True,
                    exp2_poly_share=0.125),
    192: TileConfig(64, 64, 2, False, 2, dq_tma_reduce=True, scores_ahead=True, dq_writers=2,
                    dq_fragment_order=True),
    256: TileConfig(64, 64, 1, False, 1, dq_tma_reduce=True, dq_writers=2, dq_fragment_order=True),
}
# With softcap the one pass over Sᵀ and dPᵀ keeps both in fp32 until the end; on d64's 128 rows
# that spills (168 bytes of stack), so softcap keeps 64-row tiles there.
SOFTCAP_TILE_CONFIGS = {
    64: dataclasses.replace(TILE_CONFIGS[64], tile_m=64, dv_during_ds=True),
}

LOG2_E = math.log2(math.e)
SM90_SMEM_BYTES = 227 * 1024  # the most dynamic shared memory an sm_90 CTA may use


def _elem_ptr(tensor: cute.Tensor, index):
    return tensor.iterator + cute.crd2idx(index, tensor.layout)


def _bulk_f32(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, add: bool):
    """dst[: num_bytes] += src[: num_bytes] (add) or = (not add), fp32, global from shared: one
    plain bulk reduce or copy (no tensor map), completed through the issuing thread's bulk
    async-groups like a TMA store."""
    op = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" if add else \
        "cp.async.bulk.global.shared::cta.bulk_group"
    llvm.inline_asm(
        None, [dst.toint().ir_value(), src.toint().ir_value(), Int32(num_bytes).ir_value()],
        f"{op} [$0], [$1], $2;", "l,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dataclasses.dataclass(frozen=True)
class _QueryWalk:
    """The query blocks a CTA visits, [m_block_min, m_block_max), and in what order: from
    m_block_min, or, when `rotated`, from the one that is `shift` steps before the end
    (FlashAttentionBackwardSm90._query_walk). key_blocks: the entry's key blocks (the chain)."""

    m_block_min: Int32
    m_block_max: Int32
    rotated: cutlass.Boolean
    key_blocks: Int32
    shift: Int32


@dataclasses.dataclass(frozen=True)
class _BlockOperands:
    """What every query block of one MMA warp group touches: MMAs, fragments, accumulators."""

    tiled_mma_sdp: cute.TiledMma
    tiled_mma_dk: cute.TiledMma
    tiled_mma_dv: cute.TiledMma
    tiled_mma_dq: cute.TiledMma
    thr_mma_sdp: cute.ThrMma
    thr_mma_dq: cute.ThrMma
    tSrK: cute.Tensor  # Sᵀ = K·Qᵀ operands
    tSrQ: cute.Tensor
    tdPrV: cute.Tensor  # dPᵀ = V·dOᵀ operands
    tdPrdO: cute.Tensor
    tdVrP: cute.Tensor  # dV += Pᵀ·dO operands (A is None when Pᵀ comes from registers)
    tdVrdO: cute.Tensor
    tdKrdS: cute.Tensor  # dK += dSᵀ·Q operands (A is None when dSᵀ comes from registers)
    tdKrQ: cute.Tensor
    tdQrdS: cute.Tensor  # dQ = dS·K operands
    tdQrK: cute.Tensor
    store_pds: cute.ThrCopy  # Pᵀ / dSᵀ registers -> shared memory
    tPsP: cute.Tensor
    tdSsdS: cute.Tensor
    sLSE: cute.Tensor
    sdPsum: cute.Tensor
    acc_s: cute.Tensor
    acc_dp: cute.Tensor
    p: cute.Tensor
    ds: cute.Tensor
    acc_dk: cute.Tensor
    acc_dv: cute.Tensor
    acc_dq: cute.Tensor
    score_coords0: cute.Tensor
    thread_origin: tuple
    score_prescale: Float32
    scale_log2: Float32
    pipeline_q: pipeline.PipelineTmaAsync
    pipeline_do: pipeline.PipelineTmaAsync
    sdQ: cute.Tensor = None  # dq_tma_reduce: the fp32 dQ_partial tile the writer warp reduces


class FlashAttentionBackwardSm90:
    producer_warp_group = 0
    mma_warp_groups = (1, 2)
    threads_per_warp_group = 128
    threads_per_warp = 32
    # setmaxnreg budgets: the producer needs few registers; the MMA groups hold dK, dV, Sᵀ, dPᵀ.
    producer_registers = 24
    mma_registers = 240
    # Named barrier 0 is __syncthreads. 1: dSᵀ (Pᵀ) fully in shared memory before the GEMMs that
    # read it across warp groups; 2: the dK/dV epilogue; 3: the deterministic dQ turn.
    pds_barrier_id = 1
    epilogue_barrier_id = 2
    dq_turn_barrier_id = 3
    # dq_tma_reduce: the MMA warp groups have written sdQ (they arrive, the dQ writer syncs), and
    # the writer's TMA has read it (the writer arrives, they sync). In tile order both warp
    # groups use the first of each pair; in fragment order warp group g uses entry g.
    dq_full_barrier_ids = (4, 8)
    dq_empty_barrier_ids = (5, 9)
    # dq_writers > 1: writer w waits on token barrier w for the previous writer's (w - 1 mod
    # writers) TMA to have read sdQ; the writers take the adds round-robin.
    dq_token_barrier_ids = (6, 7, 10)
    dq_writer_warps = (1, 2, 3)  # of the producer warp group (warp 0 loads)

    def __init__(self, dtype, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool, **tuning):
        if mask not in ("none", "causal", "local"):
            raise ValueError(f"mask must be 'none', 'causal' or 'local', got {mask!r}")
        if head_dim not in TILE_CONFIGS:
            raise ValueError(f"no tile configuration for head_dim={head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = mask == "causal"
        self.local = mask == "local"
        self.has_softcap = has_softcap
        config = SOFTCAP_TILE_CONFIGS.get(head_dim) if has_softcap else None
        self.config = dataclasses.replace(config or TILE_CONFIGS[head_dim], **tuning)
        self.tile_m, self.tile_n, self.stages = self.config.tile_m, self.config.tile_n, self.config.stages
        self.num_mma_threads = len(self.mma_warp_groups) * self.threads_per_warp_group
        self.num_threads = self.num_mma_threads + self.threads_per_warp_group
        self._check_config()
        # Columns of dK, dV and dQ one MMA warp group computes.
        wgs = len(self.mma_warp_groups)
        split_dkv = 1 if self.config.dkv_from_registers else wgs
        self.dk_cols, self.dv_cols = head_dim // split_dkv, head_dim_v // split_dkv
        # The dQ GEMM (tile_m x d) gives each warp group one 64-row WGMMA tile: 128-row tiles split
        # by rows (each warp group 64 rows x all of d), 64-row tiles by columns (all rows x d / 2).
        # Split by rows, each warp group reads its dS rows and all of K once; two 64-row atoms
        # per warp group would read K twice.
        self.dq_row_groups = self.tile_m // 64
        self.dq_cols = head_dim * self.dq_row_groups // wgs
        # sdQ's swizzle atoms must not cross the warp groups' parts (32-byte atoms at least).
        if self.config.dq_tma_reduce and self.dq_cols % 8:
            raise ValueError(f"{self.config}: dq_tma_reduce needs {self.dq_cols} columns of dQ per "
                             "warp group to be a multiple of 8")
        self.preprocess = BackwardPreprocess(dtype, head_dim, head_dim_v, self._det_stores_first(),
                                             self._default_stores_first())
        self.postprocess = BackwardPostprocess(
            dtype, head_dim, fragment_tile_m=self.tile_m if self._dq_fragment_order() else None,
            det_stores_first=self._det_stores_first(),
            default_stores_first=self._default_stores_first(), pdl=self.config.pdl)

    def _check_config(self):
        """Refuses settings the kernel cannot run correctly, naming the setting."""
        config = self.config
        if config.tile_m not in (64, 128) or config.tile_m % BWD_SEMAPHORE_ROWS:
            raise ValueError(f"{config}: tile_m must be 64 or 128 (one or two 64-row WGMMA tiles "
                             f"per warp group, whole {BWD_SEMAPHORE_ROWS}-row semaphores)")
        if config.stages % config.pds_stages:
            raise ValueError(f"{config}: stages must be a multiple of pds_stages (consecutive "
                             "query blocks alternate dSᵀ buffers by stage)")
        if config.row_stats_ahead < 0:
            raise ValueError(f"{config}: row_stats_ahead counts columns read ahead (0: none)")
        # (Without dq_tma_reduce there are no writer warps or sdQ: dq_writers and
        # dq_fragment_order are not read.)
        if config.dq_writers not in (1, 2, 3) or (
                config.dq_writers > 1 and config.dq_tma_reduce and not config.det_free_sdq_on_read):
            raise ValueError(f"{config}: dq_writers is 1, or 2-3 with det_free_sdq_on_read (a writer "
                             "holding sdQ to its add's completion would hold the other too)")
        if config.dv_after_ds_store and (config.dv_during_ds or not config.dkv_from_registers):
            raise ValueError(f"{config}: dv_after_ds_store moves dV's GEMM from registers, issued "
                             "after dSᵀ (dkv_from_registers, not dv_during_ds)")
        if config.do_release_early and not config.dq_during_dk:
            raise ValueError(f"{config}: do_release_early releases dO before the dQ hand-over "
                             "that dq_during_dk runs under the dK GEMM")
        if config.lse_before_scores and config.scores_ahead:
            raise ValueError(f"{config}: lse_before_scores is not implemented with scores_ahead")
        if config.scores_ahead and config.dq_during_dk:
            raise ValueError(f"{config}: scores_ahead and dq_during_dk both overlap the dQ hand-over; "
                             "choose one")
        if config.scores_ahead and config.stages < 2:
            raise ValueError(f"{config}: scores_ahead needs two Q/dO stages (the next block's Q "
                             "loads while this block's is still read)")

    def _tiled_mmas(self):
        """Sᵀ/dPᵀ, dK, dV and dQ WGMMAs for the two MMA warp groups."""
        wgs = len(self.mma_warp_groups)
        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        if cutlass.const_expr(self.config.dkv_from_registers):
            # Each warp group: tile_n / 2 keys x all of tile_m (Sᵀ, dPᵀ) and x all of d (dK, dV).
            sdp = ((wgs, 1, 1), (self.tile_n // wgs, self.tile_m))
            dkv_atoms = (wgs, 1, 1)
            dkv_a = warpgroup.OperandSource.RMEM
        else:
            # Each warp group: all tile_n keys x half of tile_m (Sᵀ, dPᵀ) and x half of d (dK, dV).
            sdp = ((1, wgs, 1), (self.tile_n, self.tile_m // wgs))
            dkv_atoms = (1, wgs, 1)
            dkv_a = warpgroup.OperandSource.SMEM
        dkv_rows = self.tile_n // dkv_atoms[0]
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K, K, Float32, *sdp)
        # A = Pᵀ / dSᵀ (keys x queries, queries contiguous: K-major), B = dO / Q viewed as
        # (d, queries), d contiguous: MN-major.
        tiled_mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, dkv_atoms, (dkv_rows, self.dk_cols), dkv_a
        )
        tiled_mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, dkv_atoms, (dkv_rows, self.dv_cols), dkv_a
        )
        # A = dS viewed from the dSᵀ buffer (queries contiguous: MN-major), B = K viewed as
        # (d, keys), d contiguous: MN-major. Each warp group: 64 rows x dq_cols.
        dq_atoms = (self.dq_row_groups, wgs // self.dq_row_groups, 1)
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, dq_atoms, (64, self.dq_cols)
        )
        return tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdPsum: cute.Tensor,
        mLSElog2: cute.Tensor,
        mSemaphore: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        deterministic: Int32,
        num_sms: Int32,
        stream: cuda.CUstream,
    ):
        """Tensors as fa4_jax.aot.compile.TENSORS["bwd"] (JAX row-major layouts)."""
        self.preprocess(mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mSemaphore, mSeqUsedQ,
                        deterministic, stream)

        # Kernel-side views put the sequence and feature modes first: (s, d, heads, batch), and
        # (s_pad, heads, batch) for the per-row workspaces.
        mQ_k, mK_k, mV_k, mdO_k, mdK_k, mdV_k = [permute_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSElog2_k, mdPsum_k = [permute_modes(t, (2, 1, 0)) for t in (mLSElog2, mdPsum)]

        tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq = self._tiled_mmas()

        # Q, dO and K are also the MN-major B operands of dK, dV and dQ.
        sQ_layout = smem_layout(self.dtype, self.tile_m, self.head_dim, self.stages, split=self.dk_cols)
        sdO_layout = smem_layout(self.dtype, self.tile_m, self.head_dim_v, self.stages, split=self.dv_cols)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.head_dim, split=self.dq_cols)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.head_dim_v)
        # Pᵀ and dSᵀ: keys x queries, queries contiguous.
        sPdS_layout = smem_layout(self.dtype, self.tile_n, self.tile_m, self.config.pds_stages)
        sRow_layout = cute.make_layout((self.tile_m, self.stages))

        def tma_load(tensor, layout, tile):
            return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), tensor, layout, tile)

        tma_atom_q, tma_q = tma_load(mQ_k, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.head_dim))
        tma_atom_do, tma_do = tma_load(mdO_k, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, self.head_dim_v))
        tma_atom_k, tma_k = tma_load(mK_k, sK_layout, (self.tile_n, self.head_dim))
        tma_atom_v, tma_v = tma_load(mV_k, sV_layout, (self.tile_n, self.head_dim_v))
        tma_atom_lse, tma_lse = tma_load(mLSElog2_k, cute.select(sRow_layout, mode=[0]), (self.tile_m,))
        tma_atom_dpsum, tma_dpsum = tma_load(mdPsum_k, cute.select(sRow_layout, mode=[0]), (self.tile_m,))
        tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdK_k, sK_layout, (self.tile_n, self.head_dim)
        )
        tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdV_k, sV_layout, (self.tile_n, self.head_dim_v)
        )
        tma_atom_dq, tma_dq, sdQ_layout, dq_elems = None, None, None, 0
        if cutlass.const_expr(self._dq_fragment_order()):
            # Flat: the MMA threads and the bulk reduces address it through fragment_order_view.
            sdQ_layout = cute.make_layout(self.tile_m * self.head_dim)
            dq_elems = cute.cosize(sdQ_layout)
        elif cutlass.const_expr(self.config.dq_tma_reduce):
            # sdQ takes the widest swizzle atom that tiles a warp group's part (128 bytes; 64 at
            # d96), and the TMA reads it in boxes one atom wide. Narrow boxes are slow: with
            # 32-byte atoms everywhere d256 ran 11-15% slower and d128 gained nothing.
            # Rows paired: sdQ line p holds tile row (p // 2) + (tile_m / 2)·(p % 2), so a half
            # warp's STS.64 (rows r, r ^ 1 at the same columns) land in different banks: +1-3%
            # at d64/d128, neutral at d256 (docs/perf-log.md, "sdQ rows paired"). The TMA reads
            # the accumulator through a (((2, tile_m/2), query blocks), d, heads·batch) view
            # whose row mode is split the same way; heads and batch are merged to keep the
            # tensor map within 5 dimensions.
            rows = self.tile_m
            # Copy 0 only: this path adds every turn there (`_dq_copy`).
            _, batch_count, head_count, seq_pad, _ = mdQaccum.shape
            mdQaccum_k = cute.make_tensor(mdQaccum.iterator, cute.make_layout(
                (((2, rows // 2), seq_pad // rows), self.head_dim, head_count * batch_count),
                stride=((((rows // 2) * self.head_dim, self.head_dim), rows * self.head_dim), 1,
                        seq_pad * self.head_dim)))
            sdQ_layout = smem_layout(Float32, self.tile_m, self.head_dim, split=self.dq_cols)
            tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum_k, sdQ_layout, (self.tile_m, self.head_dim)
            )
            dq_elems = cute.cosize(sdQ_layout)
        row_bytes = self.tile_m * Float32.width // 8
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + row_bytes
        self.tma_bytes_do = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])) + row_bytes
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)

        # Pᵀ goes through shared memory only when it cannot feed dV from registers.
        p_elems = 0 if cutlass.const_expr(self.config.dkv_from_registers) else cute.cosize(sPdS_layout)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, dq_elems], 1024]

        # sdQ fits beside two-stage Q/dO rings only at d <= 128 (dkv_from_registers shapes).
        assert SharedStorage.size_in_bytes() <= SM90_SMEM_BYTES, (
            f"{self.config} needs {SharedStorage.size_in_bytes()} bytes of shared memory")
        self.shared_storage = SharedStorage

        # With softcap the scores become tanh(s·scale/softcap), and softcap·log2(e) carries them
        # into the exp2 domain; without it, scale·log2(e) does (as in the forward).
        if cutlass.const_expr(self.has_softcap):
            score_prescale = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        else:
            score_prescale = Float32(1.0)
            scale_log2 = softmax_scale * LOG2_E

        # Key blocks are the fastest grid mode, so in deterministic mode a CTA is never resident
        # while one of lower key block (whose dQ adds it waits for) has not been launched yet.
        # The CTAs of a wave are then mostly one head's, and share its Q and dO in L2: dispatching
        # the heads' chains interleaved instead cost the deterministic mode 10-28%
        # (docs/perf-log.md, "interleaving the chains").
        grid = (cute.ceil_div(cute.size(mK_k.shape[0]), self.tile_n), cute.size(mK_k.shape[2]),
                cute.size(mK_k.shape[3]))
        self.kernel(
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_lse, tma_lse, tma_atom_dpsum, tma_dpsum, tma_atom_dk, tma_dk, tma_atom_dv, tma_dv,
            mdQaccum, mSemaphore, mSeqUsedQ, mSeqUsedK, mQ_k.shape[0], mQ_k.shape[2],
            sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sRow_layout,
            tma_atom_dq, tma_dq, sdQ_layout,
            softmax_scale, score_prescale, scale_log2, window_left, window_right, deterministic,
            num_sms,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.config.pdl,
        )

        self.postprocess(mdQaccum, mdQ, mSeqUsedQ, mSemaphore, softmax_scale, deterministic, stream,
                         tiled_mma_dq)

    @cute.kernel
    def kernel(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_lse: cute.CopyAtom,
        mLSElog2: cute.Tensor,
        tma_atom_dpsum: cute.CopyAtom,
        mdPsum: cute.Tensor,
        tma_atom_dk: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dv: cute.CopyAtom,
        mdV: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSemaphore: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        seqlen_q: Int32,
        num_heads: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        tma_atom_dq,
        mdQaccum_tma,
        sdQ_layout,
        softmax_scale: Float32,
        score_prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        deterministic: Int32,
        num_sms: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_lse, tma_atom_dpsum,
                         tma_atom_dk, tma_atom_dv):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        mma_warps = self.num_mma_threads // 32
        pipeline_kv = tma_pipeline(storage.mbar_kv, 1, mma_warps, self.tma_bytes_kv)
        pipeline_q = tma_pipeline(storage.mbar_q, self.stages, mma_warps, self.tma_bytes_q)
        pipeline_do = tma_pipeline(storage.mbar_do, self.stages, mma_warps, self.tma_bytes_do)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = swizzled_tensor(storage.sQ, sQ_layout)
        sdO = swizzled_tensor(storage.sdO, sdO_layout)
        sK = swizzled_tensor(storage.sK, sK_layout)
        sV = swizzled_tensor(storage.sV, sV_layout)
        sdS = swizzled_tensor(storage.sdS, sPdS_layout)
        sP = None
        if cutlass.const_expr(not self.config.dkv_from_registers):
            sP = swizzled_tensor(storage.sP, sPdS_layout)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sdQ, sdQ_lines = None, None
        if cutlass.const_expr(self._dq_fragment_order()):
            sdQ = storage.sdQ.get_tensor(sdQ_layout)
            sdQ_lines = sdQ
        elif cutlass.const_expr(self.config.dq_tma_reduce):
            sdQ_lines = swizzled_tensor(storage.sdQ, sdQ_layout)
            # The MMA threads' view: tile row r at line 2·(r mod tile_m/2) + r div (tile_m/2).
            rows = self.tile_m
            sdQ = cute.make_tensor(sdQ_lines.iterator, cute.composition(
                sdQ_lines.layout,
                cute.make_layout(((rows // 2, 2), self.head_dim), stride=((2, 1), rows))))
        sdPsum = storage.sdPsum.get_tensor(sRow_layout)

        block_x, head_kv, batch = cute.arch.block_idx()
        seqlen_k = mK.shape[0]
        n_block = block_x
        if cutlass.const_expr(self._descending_turns()):
            if deterministic != 0:
                # Launch order = add order: the highest key block is dispatched first.
                n_block = cute.ceil_div(seqlen_k, self.tile_n) - 1 - block_x
        # From here on the entry's own lengths (a ragged batch's; else the buffers'): the grid
        # above stays on the buffers' sizes.
        seqlen_q = entry_length(mSeqUsedQ, batch, seqlen_q)
        seqlen_k = entry_length(mSeqUsedK, batch, seqlen_k)
        group = num_heads // mK.shape[2]
        block_info = BlockInfo(self.tile_m, self.tile_n, self.causal, self.local)
        m_block_min, m_block_max = block_info.m_block_range(
            n_block, seqlen_q, seqlen_k, window_left, window_right
        )
        walk = self._query_walk(m_block_min, m_block_max, n_block, seqlen_k, deterministic, num_sms)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        if cutlass.const_expr(self.config.pdl):
            # The preprocess's writes (D, LSE, the zeroed dQ workspace and turn counters) are
            # visible after this; the load warp waits only after issuing K and V.
            if warp_idx != 0:
                cute.arch.griddepcontrol_wait()

        warp_group = cute.arch.make_warp_uniform(warp_idx // 4)
        if warp_group == self.producer_warp_group:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load(
                    tma_atom_q, mQ, tma_atom_do, mdO, tma_atom_k, mK, tma_atom_v, mV,
                    tma_atom_lse, mLSElog2, tma_atom_dpsum, mdPsum, sQ, sdO, sK, sV, sLSE, sdPsum,
                    pipeline_kv, pipeline_q, pipeline_do, n_block, head_kv, batch, group, walk,
                )
            if cutlass.const_expr(self.config.dq_tma_reduce):
                # The writer adds through the TMA's view in tile order, plain bulk copies otherwise.
                mdQaccum_writer = mdQaccum if cutlass.const_expr(self._dq_fragment_order()) else mdQaccum_tma
                for writer in cutlass.range_constexpr(self.config.dq_writers):
                    if warp_idx == self.dq_writer_warps[writer]:
                        self.dq_writer(
                            tma_atom_dq, mdQaccum_writer, sdQ_lines, mSemaphore, n_block, head_kv, batch,
                            group, seqlen_q, seqlen_k, walk, window_left,
                            window_right, deterministic, block_info, num_heads, writer,
                        )
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            tidx, _, _ = cute.arch.thread_idx()
            self.mma(
                tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tidx - self.threads_per_warp_group,
                sQ, sdO, sK, sV, sdS, sP, sLSE, sdPsum, pipeline_kv, pipeline_q, pipeline_do,
                tma_atom_dk, mdK, tma_atom_dv, mdV, mdQaccum, mSemaphore, mSeqUsedK, sdQ,
                n_block, head_kv, batch, group, seqlen_q, seqlen_k, walk,
                softmax_scale, score_prescale, scale_log2, window_left, window_right, deterministic,
                block_info,
            )

    @cute.jit
    def load(
        self, tma_atom_q, mQ, tma_atom_do, mdO, tma_atom_k, mK, tma_atom_v, mV,
        tma_atom_lse, mLSElog2, tma_atom_dpsum, mdPsum, sQ, sdO, sK, sV, sLSE, sdPsum,
        pipeline_kv, pipeline_q, pipeline_do, n_block, head_kv, batch, group, walk,
    ):
        no_cluster = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, no_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, no_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_v, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for head_in_group in cutlass.range(group, unroll=1):
            head = head_kv * group + head_in_group
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim_v), (None, 0))
            gLSE = cute.local_tile(mLSElog2[None, head, batch], (self.tile_m,), (None,))
            gdPsum = cute.local_tile(mdPsum[None, head, batch], (self.tile_m,), (None,))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_do, 0, no_cluster, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma_atom_lse, 0, no_cluster, cute.group_modes(sLSE, 0, 1), cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_atom_dpsum, 0, no_cluster, cute.group_modes(sdPsum, 0, 1), cute.group_modes(gdPsum, 0, 1))
            for step in cutlass.range(walk.m_block_max - walk.m_block_min, unroll=1):
                m_block = self._m_block_at(walk, step)
                pipeline_q.producer_acquire(state)
                q_bar = pipeline_q.producer_get_barrier(state)
                cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=q_bar)
                cute.copy(tma_atom_lse, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=q_bar)
                pipeline_do.producer_acquire(state)
                do_bar = pipeline_do.producer_get_barrier(state)
                cute.copy(tma_atom_do, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=do_bar)
                cute.copy(tma_atom_dpsum, tDgD[None, m_block], tDsD[None, state.index], tma_bar_ptr=do_bar)
                state.advance()

    @cute.jit
    def mma(
        self, tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tidx,
        sQ, sdO, sK, sV, sdS, sP, sLSE, sdPsum, pipeline_kv, pipeline_q, pipeline_do,
        tma_atom_dk, mdK, tma_atom_dv, mdV, mdQaccum, mSemaphore, mSeqUsedK, sdQ,
        n_block, head_kv, batch, group, seqlen_q, seqlen_k, walk,
        softmax_scale, score_prescale, scale_log2, window_left, window_right, deterministic, block_info,
    ):
        warp_group = cute.arch.make_warp_uniform(tidx // self.threads_per_warp_group)
        # WGMMA descriptors are per warp group; register fragments are per thread.
        wg_first_thread = warp_group * self.threads_per_warp_group
        wg_mma_sdp = tiled_mma_sdp.get_slice(wg_first_thread)
        wg_mma_dk = tiled_mma_dk.get_slice(wg_first_thread)
        wg_mma_dv = tiled_mma_dv.get_slice(wg_first_thread)
        wg_mma_dq = tiled_mma_dq.get_slice(wg_first_thread)
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_mma_dk = tiled_mma_dk.get_slice(tidx)
        thr_mma_dv = tiled_mma_dv.get_slice(tidx)
        thr_mma_dq = tiled_mma_dq.get_slice(tidx)

        # Transposed views: (d, queries, stage) of Q and dO, (queries, keys, stage) of dSᵀ, (d, keys) of K.
        sQt = permute_modes(sQ, (1, 0, 2))
        sdOt = permute_modes(sdO, (1, 0, 2))
        sdSt = permute_modes(sdS, (1, 0, 2))
        sKt = permute_modes(sK, (1, 0))
        # Pᵀ/dSᵀ registers -> shared memory with stmatrix: one address per 4 8x8 matrices, where
        # element-wise stores would keep ~20 more swizzled addresses live through the loop.
        store_pds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tdVrP, tdKrdS = None, None
        tPsP = None
        if cutlass.const_expr(not self.config.dkv_from_registers):
            tdVrP = wg_mma_dv.make_fragment_A(wg_mma_dv.partition_A(sP))
            tdKrdS = wg_mma_dk.make_fragment_A(wg_mma_dk.partition_A(sdS))
            tPsP = store_pds.partition_D(sP)

        acc_s = thr_mma_sdp.make_fragment_C(thr_mma_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dk = thr_mma_dk.make_fragment_C(thr_mma_dk.partition_shape_C((self.tile_n, self.head_dim)))
        acc_dv = thr_mma_dv.make_fragment_C(thr_mma_dv.partition_shape_C((self.tile_n, self.head_dim_v)))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        score_identity = cute.make_identity_tensor((self.tile_n, self.tile_m))
        blocks = _BlockOperands(
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, thr_mma_sdp, thr_mma_dq,
            wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sK)),
            wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sQ)),
            wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sV)),
            wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sdO)),
            tdVrP,
            wg_mma_dv.make_fragment_B(wg_mma_dv.partition_B(sdOt)),
            tdKrdS,
            wg_mma_dk.make_fragment_B(wg_mma_dk.partition_B(sQt)),
            wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(sdSt)),
            wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(sKt)),
            store_pds,
            tPsP,
            store_pds.partition_D(sdS),
            sLSE,
            sdPsum,
            acc_s,
            cute.make_rmem_tensor_like(acc_s, Float32),
            cute.make_rmem_tensor_like(acc_s, self.dtype),
            cute.make_rmem_tensor_like(acc_s, self.dtype),
            acc_dk,
            acc_dv,
            thr_mma_dq.make_fragment_C(thr_mma_dq.partition_shape_C((self.tile_m, self.head_dim))),
            acc_rows_cols(tiled_mma_sdp.get_slice(0).partition_C(score_identity)),
            acc_rows_cols(thr_mma_sdp.partition_C(score_identity))[0, 0],
            score_prescale,
            scale_log2,
            pipeline_q,
            pipeline_do,
            sdQ=sdQ,
        )
        mask = AttentionMask(self.tile_m, self.tile_n, self.causal, self.local)
        apply_mask = functools.partial(
            mask.apply_transposed, coords0=blocks.score_coords0, thread_row=blocks.thread_origin[0],
            thread_col=blocks.thread_origin[1], n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            window_left=window_left, window_right=window_right,
        )
        key_tail = (n_block + 1) * self.tile_n > seqlen_k
        mask_key_tail = functools.partial(
            self.mask_key_tail, mask=mask, blocks=blocks, n_block=n_block, mSeqUsedK=mSeqUsedK,
            batch=batch, key_buffer=mdK.shape[0],
        )

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # The CTA's (q head of the group, query block) pairs, flattened: `index` runs over them.
        coords = functools.partial(self.block_coords, walk=walk, head_kv=head_kv, group=group)
        dkv_step = functools.partial(
            self.dkv_step, blocks=blocks, coords=coords, n_block=n_block, seqlen_q=seqlen_q,
            seqlen_k=seqlen_k, window_left=window_left, window_right=window_right,
            block_info=block_info, apply_mask=apply_mask, key_tail=key_tail, mask_key_tail=mask_key_tail,
        )
        dq_step = functools.partial(
            self.dq_step, blocks=blocks, coords=coords, mdQaccum=mdQaccum, mSemaphore=mSemaphore,
            n_block=n_block, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            window_left=window_left, window_right=window_right, deterministic=deterministic,
            block_info=block_info, walk=walk,
        )
        blocks_total = group * (walk.m_block_max - walk.m_block_min)
        if cutlass.const_expr(self.config.scores_ahead):
            # Rotated by half a block, so that each iteration issues block `index`'s Sᵀ, hands
            # over block index − 1's dQ while it runs, then awaits it: an in-flight WGMMA carried
            # across the loop's back edge made ptxas serialize every WGMMA (C7514).
            if blocks_total > 0:
                self.issue_scores(blocks, state)
                dkv_step(state=state, index=0)
                for index in cutlass.range(1, blocks_total, unroll=1):
                    state.advance()
                    self.issue_scores(blocks, state)
                    dq_step(index=index - 1)
                    dkv_step(state=state, index=index)
                dq_step(index=blocks_total - 1)
        else:
            for index in cutlass.range(blocks_total, unroll=1):
                lse_ahead = self.issue_scores(blocks, state)
                if cutlass.const_expr(self.config.dq_during_dk):
                    dkv_step(state=state, index=index, hand_over_dq=functools.partial(dq_step, index=index),
                             lse_ahead=lse_ahead)
                else:
                    dkv_step(state=state, index=index, lse_ahead=lse_ahead)
                    dq_step(index=index)
                state.advance()

        self.epilogue(
            blocks, thr_mma_dk, thr_mma_dv, sK, sV, tma_atom_dk, mdK, tma_atom_dv, mdV,
            n_block, head_kv, batch, softmax_scale,
        )

    @cute.jit
    def mask_key_tail(self, tile, mask, blocks, n_block, mSeqUsedK, batch, key_buffer,
                      fill: cutlass.Constexpr[float] = -math.inf):
        """Rows of keys past the entry's length in a transposed tile (keys × queries) to `fill`.

        The length is loaded again on each use rather than held through the main loop: held,
        it made d128 with softcap spill.
        """
        seqlen_k = entry_length(mSeqUsedK, batch, key_buffer)
        mask.apply_key_tail(tile, blocks.score_coords0, blocks.thread_origin[0], n_block, seqlen_k, fill=fill)

    @cute.jit
    def block_coords(self, index, walk, head_kv, group):
        """(q head, query block) of the CTA's `index`-th block: its group's q heads in turn, each
        over the query blocks that see this key block, in the walk's order."""
        blocks_per_head = walk.m_block_max - walk.m_block_min
        head_in_group = index // blocks_per_head
        return head_kv * group + head_in_group, self._m_block_at(walk, index - head_in_group * blocks_per_head)

    @cute.jit
    def dkv_step(self, blocks, state, index, coords, n_block, seqlen_q, seqlen_k, window_left,
                 window_right, block_info, apply_mask, key_tail, mask_key_tail, hand_over_dq=None,
                 lse_ahead=()):
        """Block `index`'s dK/dV updates and its dQ share in blocks.acc_dq (handed over by
        `hand_over_dq` during the dK GEMM when dq_during_dk); `lse_ahead` from `issue_scores`."""
        _, m_block = coords(index)
        needs_mask = cutlass.Boolean(False)
        if cutlass.const_expr(block_info.has_right_bound):
            needs_mask = block_info.tile_needs_mask(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
        self.query_block(blocks, state, m_block, needs_mask, apply_mask, key_tail, mask_key_tail, hand_over_dq,
                         lse_ahead)

    @cute.jit
    def dq_step(self, blocks, index, coords, mdQaccum, mSemaphore, n_block, batch, seqlen_q,
                seqlen_k, window_left, window_right, deterministic, block_info, walk):
        """Block `index`'s dQ share (blocks.acc_dq) handed over to global memory."""
        head, m_block = coords(index)
        self.accumulate_dq(
            blocks, mdQaccum[0, batch, head, None, None], mSemaphore, m_block, n_block, head, batch,
            seqlen_q, seqlen_k, window_left, window_right, deterministic, block_info, walk,
        )

    @cute.jit
    def issue_scores(self, blocks, state):
        """Sᵀ = K·Qᵀ of the query block in `state`, issued, not awaited. Returns the LSE values
        of the columns read ahead when they are read here (`lse_before_scores`), else []."""
        blocks.pipeline_q.consumer_wait(state)
        lse_ahead = []
        if cutlass.const_expr(self._lse_before_scores()):
            lse_ahead = [self._row_stat(blocks, blocks.sLSE, c, state.index)
                         for c in range(self._stats_ahead(blocks))]
        wgmma_gemm(blocks.tiled_mma_sdp, blocks.acc_s, blocks.tSrK, blocks.tSrQ[None, None, None, state.index],
                  zero_init=True, wait_group=-1)
        return lse_ahead

    def _lse_before_scores(self) -> bool:
        return self.config.lse_before_scores and not self.has_softcap

    def _stats_ahead(self, blocks) -> int:
        """Columns of a thread's Sᵀ fragment whose LSE and D values are read ahead."""
        return min(cute.size(acc_rows_cols(blocks.acc_s), mode=[1]), self.config.row_stats_ahead)

    def _row_stat(self, blocks, table, c: int, stage):
        """sLSE or sdPsum of the query row that register column c holds, in Q's slot `stage`."""
        return table[self._query_of(blocks, c), stage]

    @cute.jit
    def query_block(self, blocks, state, m_block, needs_mask, apply_mask, key_tail, mask_key_tail,
                    hand_over_dq=None, lse_ahead=()):
        """dV and dK updates, and this query block's dQ share in blocks.acc_dq (its Sᵀ GEMM
        already issued: `issue_scores`), handed over by `hand_over_dq` when dq_during_dk."""
        stage = state.index
        # Consecutive query blocks alternate dSᵀ buffers (stages is a multiple of pds_stages).
        pds_index = stage % self.config.pds_stages
        # dPᵀ = V·dOᵀ, issued behind Sᵀ.
        blocks.pipeline_do.consumer_wait(state)
        wgmma_gemm(blocks.tiled_mma_sdp, blocks.acc_dp, blocks.tdPrV, blocks.tdPrdO[None, None, None, stage],
                  zero_init=True, wait_group=-1)
        scores = acc_rows_cols(blocks.acc_s)
        dp = acc_rows_cols(blocks.acc_dp)

        row_stat = functools.partial(self._row_stat, blocks, stage=stage)
        stats_ahead = self._stats_ahead(blocks)
        if cutlass.const_expr(self.has_softcap):
            # One pass over Sᵀ and dPᵀ: t = tanh, P, dSᵀ = P ∘ (dPᵀ − D) ∘ (1 − t²), so only one
            # LSE and one D value are live at a time; the mask then zeroes P and dSᵀ (masking the
            # scores first would leave t = −inf for the derivative).
            # The tanh overlaps the dPᵀ GEMM.
            warpgroup.wait_group(1)
            for i in cutlass.range_constexpr(cute.size(blocks.acc_s)):
                blocks.acc_s[i] = cute.math.tanh(blocks.acc_s[i] * blocks.score_prescale, fastmath=True)
            warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                lse_log2, d_value = row_stat(blocks.sLSE, c), row_stat(blocks.sdPsum, c)
                for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                    capped = scores[r, c]
                    prob = cute.math.exp2(capped * blocks.scale_log2 - lse_log2, fastmath=True)
                    scores[r, c] = prob
                    dp[r, c] = prob * (dp[r, c] - d_value) * (1.0 - capped * capped)
            if cutlass.const_expr(self.causal or self.local):
                if needs_mask:
                    apply_mask(scores, m_block=m_block, fill=0.0)
                    apply_mask(dp, m_block=m_block, fill=0.0)
            if key_tail:
                mask_key_tail(scores, fill=0.0)
                mask_key_tail(dp, fill=0.0)
        else:
            if cutlass.const_expr(not self._lse_before_scores()):
                lse_ahead = [row_stat(blocks.sLSE, c) for c in range(stats_ahead)]
            # Sᵀ is done; the exponentials overlap the dPᵀ GEMM.
            warpgroup.wait_group(1)
            if cutlass.const_expr(self.causal or self.local):
                if needs_mask:
                    apply_mask(scores, m_block=m_block)
            if key_tail:
                mask_key_tail(scores)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                lse_log2 = lse_ahead[c] if c < stats_ahead else row_stat(blocks.sLSE, c)
                for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                    exponent = scores[r, c] * blocks.scale_log2 - lse_log2
                    if cutlass.const_expr(uses_poly(self.config.exp2_poly_share, c)):
                        scores[r, c] = exp2_poly(exponent)
                    else:
                        scores[r, c] = cute.math.exp2(exponent, fastmath=True)
        blocks.p.store(blocks.acc_s.load().to(self.dtype))
        if cutlass.const_expr(self.has_softcap):
            blocks.ds.store(blocks.acc_dp.load().to(self.dtype))

        def issue_dv_from_registers():
            wgmma_gemm(blocks.tiled_mma_dv, blocks.acc_dv, acc_as_operand_a(blocks.p),
                      blocks.tdVrdO[None, None, None, stage], zero_init=False, wait_group=-1)

        dv_from_registers_early = self.config.dkv_from_registers and self.config.dv_during_ds
        if cutlass.const_expr(dv_from_registers_early):
            issue_dv_from_registers()
        if cutlass.const_expr(not self.has_softcap):
            d_ahead = [row_stat(blocks.sdPsum, c) for c in range(stats_ahead)]
            # dPᵀ is done (the dV GEMM, if issued, may still run).
            warpgroup.wait_group(1 if cutlass.const_expr(dv_from_registers_early) else 0)
            for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
                d_value = d_ahead[c] if c < stats_ahead else row_stat(blocks.sdPsum, c)
                for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                    dp[r, c] = scores[r, c] * (dp[r, c] - d_value)
            blocks.ds.store(blocks.acc_dp.load().to(self.dtype))
        if cutlass.const_expr(self.config.dkv_from_registers and not self.config.dv_during_ds
                              and not self.config.dv_after_ds_store):
            issue_dv_from_registers()

        def issue_dk():
            if cutlass.const_expr(self.config.dkv_from_registers):
                wgmma_gemm(blocks.tiled_mma_dk, blocks.acc_dk, acc_as_operand_a(blocks.ds),
                          blocks.tdKrQ[None, None, None, stage], zero_init=False, wait_group=-1)
            else:
                wgmma_gemm(blocks.tiled_mma_dk, blocks.acc_dk, blocks.tdKrdS[None, None, None, pds_index],
                          blocks.tdKrQ[None, None, None, stage], zero_init=False, wait_group=-1)

        dq_during_dk = self.config.dq_during_dk
        if cutlass.const_expr(self.config.dkv_from_registers and not dq_during_dk):
            issue_dk()

        # dSᵀ (and Pᵀ) to shared memory for the GEMMs that read all of it from both warp groups.
        if cutlass.const_expr(self.config.pds_stages == 1):
            # The other warp group may still be reading the previous block's buffer.
            cute.arch.barrier(barrier_id=self.pds_barrier_id, number_of_threads=self.num_mma_threads)
        cute.copy(blocks.store_pds, blocks.store_pds.retile(blocks.ds), blocks.tdSsdS[None, None, None, pds_index])
        if cutlass.const_expr(not self.config.dkv_from_registers):
            cute.copy(blocks.store_pds, blocks.store_pds.retile(blocks.p), blocks.tPsP[None, None, None, pds_index])
        if cutlass.const_expr(self.config.dv_after_ds_store):
            issue_dv_from_registers()
        # Ordinary stores must be made visible to WGMMA (async proxy) before it reads them.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.pds_barrier_id, number_of_threads=self.num_mma_threads)
        if cutlass.const_expr(not self.config.dkv_from_registers):
            wgmma_gemm(blocks.tiled_mma_dv, blocks.acc_dv, blocks.tdVrP[None, None, None, pds_index],
                      blocks.tdVrdO[None, None, None, stage], zero_init=False, wait_group=-1)
            if cutlass.const_expr(not dq_during_dk):
                issue_dk()
        wgmma_gemm(blocks.tiled_mma_dq, blocks.acc_dq, blocks.tdQrdS[None, None, None, pds_index],
                  blocks.tdQrK, zero_init=True, wait_group=-1 if cutlass.const_expr(dq_during_dk) else 0)
        if cutlass.const_expr(dq_during_dk):
            issue_dk()
            # dQ (and dV) retired; dK runs through the hand-over.
            warpgroup.wait_group(1)
            if cutlass.const_expr(self.config.do_release_early):
                # dK, still running, reads Q and dSᵀ only.
                blocks.pipeline_do.consumer_release(state)
            hand_over_dq()
            warpgroup.wait_group(0)
        # Every GEMM reading this slot's Q and dO (and P, dS registers) has retired.
        blocks.pipeline_q.consumer_release(state)
        if cutlass.const_expr(not self.config.do_release_early):
            blocks.pipeline_do.consumer_release(state)

    @cute.jit
    def _query_of(self, blocks, c: cutlass.Constexpr[int]) -> Int32:
        """Row of the query tile that register column c of this thread's Sᵀ fragment holds."""
        return blocks.thread_origin[1] + blocks.score_coords0[0, c][1]

    @cute.jit
    def accumulate_dq(
        self, blocks, gdQaccum, mSemaphore, m_block, n_block, head, batch,
        seqlen_q, seqlen_k, window_left, window_right, deterministic, block_info, walk,
    ):
        """mdQaccum[batch, head, m_block rows] += this block's dS·K, unless the tile is fully masked.

        Deterministic mode: the key blocks that visit a query block (n_block_range) add in
        increasing order; the semaphore counts those done. Key blocks wait only for lower ones,
        which the grid launches first, so the chain cannot deadlock. With det_descending
        (causal/local) they add in decreasing order and the grid launches the highest key block
        first (see `kernel`): again every wait is on a CTA dispatched earlier.
        """
        adds, turn = self._dq_turn(block_info, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right, walk)
        if adds:
            if cutlass.const_expr(self._dq_fragment_order()):
                # This warp group's chunk: wait until the writer has read it, fill it, hand it over.
                mma_thread, chunk = self._mma_thread_chunk()
                cute.arch.barrier(barrier_id=self._dq_barrier_id(self.dq_empty_barrier_ids, chunk),
                                  number_of_threads=self._dq_sync_threads())
                cute.autovec_copy(blocks.acc_dq, fragment_order_view(
                    blocks.sdQ.iterator, blocks.acc_dq.shape, mma_thread, len(self.mma_warp_groups)))
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=self._dq_barrier_id(self.dq_full_barrier_ids, chunk),
                                         number_of_threads=self._dq_sync_threads())
            elif cutlass.const_expr(self.config.dq_tma_reduce):
                # Wait until the writer's previous TMA has read sdQ, fill it, hand it over.
                cute.arch.barrier(barrier_id=self.dq_empty_barrier_ids[0], number_of_threads=self._dq_sync_threads())
                # The stores' 16 swizzled addresses are computed here from an opaque thread
                # index: hoisted out of the loop they made d128 spill (see opaque_int32).
                tidx, _, _ = cute.arch.thread_idx()
                thr_mma_dq = blocks.tiled_mma_dq.get_slice(opaque_int32(tidx - self.threads_per_warp_group))
                cute.autovec_copy(blocks.acc_dq, thr_mma_dq.partition_C(blocks.sdQ))
                # Ordinary stores must be made visible to the TMA (async proxy).
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=self.dq_full_barrier_ids[0], number_of_threads=self._dq_sync_threads())
            else:
                self._accumulate_dq_red(blocks, gdQaccum, mSemaphore, m_block, turn, head, batch,
                                        deterministic)

    @cute.jit
    def _accumulate_dq_red(self, blocks, gdQaccum, mSemaphore, m_block, turn, head, batch, deterministic):
        """Per-thread red.global.add of the dQ_partial registers (in turn when deterministic)."""
        gdQ = cute.local_tile(gdQaccum, (self.tile_m, self.head_dim), (m_block, 0))
        tdQgdQ = blocks.thr_mma_dq.partition_C(gdQ)
        if deterministic != 0:
            semaphore = self._semaphore(mSemaphore, 0, batch, head, m_block)
            if self._is_first_mma_thread():
                self._wait_for_turn(semaphore, turn)
            cute.arch.barrier(barrier_id=self.dq_turn_barrier_id, number_of_threads=self.num_mma_threads)
            self.red_add(blocks.acc_dq, tdQgdQ)
            # Every thread's adds are visible GPU-wide before the next key block's turn.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=self.dq_turn_barrier_id, number_of_threads=self.num_mma_threads)
            if self._is_first_mma_thread():
                cute.arch.atomic_add(semaphore, Int32(1), sem="release", scope="gpu")
        else:
            self.red_add(blocks.acc_dq, tdQgdQ)

    @cute.jit
    def _mma_thread_chunk(self):
        """(this thread's index among the MMA threads, its warp group's sdQ chunk in fragment
        order), read afresh rather than kept live through the main loop."""
        tidx, _, _ = cute.arch.thread_idx()
        mma_thread = tidx - self.threads_per_warp_group
        return mma_thread, cute.arch.make_warp_uniform(mma_thread // self.threads_per_warp_group)

    def _dq_fragment_order(self) -> bool:
        return self.config.dq_tma_reduce and self.config.dq_fragment_order

    def _dq_chunks(self) -> int:
        """sdQ's hand-over units: one per MMA warp group in fragment order, else the whole tile."""
        return len(self.mma_warp_groups) if self._dq_fragment_order() else 1

    def _dq_sync_threads(self) -> int:
        """Threads on one hand-over barrier: the MMA threads filling its chunk and a writer warp."""
        return self.num_mma_threads // self._dq_chunks() + self.threads_per_warp

    @staticmethod
    def _dq_barrier_id(ids, chunk):
        """ids[chunk] for a chunk known only at run time (an MMA thread's warp group)."""
        return ids[0] + (ids[1] - ids[0]) * chunk

    @cute.jit
    def _dq_turn(self, block_info, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right, walk):
        """(whether key block n_block adds into query block m_block's dQ, how many key blocks
        add into it before n_block: its turn in deterministic mode).

        The adding key blocks are the query block's n_block_range. Without a mask that is every
        block of the entry's keys, each query block this CTA visits takes its add, and the turns
        count from 0 (a block of padding keys visits no query block: BlockInfo.m_block_range), so
        the entry's lengths are not read in the main loop: held through it, they made d128 with
        softcap spill. On a rotated walk the turns follow the visits instead: key block n visits
        query block m at step (m + n) mod M of M, and its turn is the number of the chain's
        key blocks that visit m at an earlier step.
        """
        adds = cutlass.Boolean(True)
        turn = n_block
        if cutlass.const_expr(block_info.has_right_bound):
            n_block_lo, n_block_hi = block_info.n_block_range(m_block, seqlen_q, seqlen_k, window_left, window_right)
            adds = cutlass.Boolean(False)
            if n_block >= n_block_lo:
                if n_block < n_block_hi:
                    adds = cutlass.Boolean(True)
            turn = n_block - n_block_lo
            if cutlass.const_expr(self._descending_turns()):
                turn = n_block_hi - 1 - n_block
        else:
            if walk.rotated:
                count = walk.m_block_max - walk.m_block_min
                m = m_block - walk.m_block_min
                if m + n_block < count:
                    # Before it: the lower key blocks, and those whose visit wrapped around
                    # (key blocks count − m .. key_blocks − 1, at steps below m).
                    turn = n_block + cutlass.max(walk.key_blocks - count + m, 0)
                else:
                    # Wrapped: only the wrapped key blocks below it went first.
                    turn = n_block - (count - m)
        return adds, turn

    @cute.jit
    def _query_walk(self, m_block_min, m_block_max, n_block, seqlen_k, deterministic, num_sms):
        """The CTA's walk over its query blocks: in order, or, without a mask, deterministic or
        with default_stores_first, rotated so that key block n starts n steps before the end
        (query block M − n of M; with default_stores_first n mod M steps, any n).

        In order, every key block of a chain (a head's) starts at query block 0, where key block
        n waits for the n below it to add: a wavefront whose fill repeats at every query block,
        most of the deterministic cost at 1k-4k tokens. Rotated, at every step the chain's key
        blocks add into different query blocks, each turn the one the previous step's add made.
        Only where that is safe, exact and cheap:
        - key block 0 now waits for key block N − 1 (at the query blocks where N − 1 wrapped
          around first), so all N of the chain must run at once: N ≤ num_sms (one CTA per SM;
          CTAs dispatch in grid order, so a chain is never held up behind a later one), and
          N ≤ num_sms / 2 so that at least two chains run at once: with one (d64/d128 at 16k
          tokens: 128 key blocks on 132 SMs) the chain's fill, paid once in order, cost less
          than the SMs the rotation leaves idle (d64 16k: 3% slower rotated);
        - with no more key blocks than query blocks each step's visits land on distinct query
          blocks;
        - the chains must nearly tile the SMs: the CTAs of a chain that is only partly resident
          soon wait for the rest of it, idling num_sms mod N SMs; at most num_sms / 16 of them
          (132 SMs: any power-of-two chain).
        """
        key_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        rotated = cutlass.Boolean(False)
        shift = n_block
        if cutlass.const_expr(self.config.det_rotated_walk and not (self.causal or self.local)):
            if deterministic != 0:
                if 2 * key_blocks <= num_sms:
                    if key_blocks <= m_block_max - m_block_min:
                        # (An entry with no keys walks nothing; it must not reach num_sms % 0.)
                        if key_blocks > 0:
                            if num_sms % key_blocks <= num_sms // 16:
                                rotated = cutlass.Boolean(True)
        if cutlass.const_expr(self._default_stores_first() and not (self.causal or self.local)):
            # Not an order here, only a spread: a claim waits for nothing but a running
            # claimer's store, so any chain length is safe. With more key blocks than query
            # blocks, two key blocks a multiple of m-blocks apart share each step's block.
            if deterministic == 0:
                if m_block_max > m_block_min:
                    rotated = cutlass.Boolean(True)
                    shift = n_block % (m_block_max - m_block_min)
        return _QueryWalk(m_block_min, m_block_max, rotated, key_blocks, shift)

    @cute.jit
    def _m_block_at(self, walk, step):
        """The query block of the walk's step `step`."""
        offset = step
        if walk.rotated:
            offset = step - walk.shift
            if offset < 0:
                offset += walk.m_block_max - walk.m_block_min
        return walk.m_block_min + offset

    @cute.jit
    def dq_writer(
        self, tma_atom_dq, mdQaccum, sdQ, mSemaphore, n_block, head_kv, batch, group, seqlen_q,
        seqlen_k, walk, window_left, window_right, deterministic, block_info,
        num_heads, writer: cutlass.Constexpr[int],
    ):
        """dq_tma_reduce: one warp walks the MMA warp groups' query blocks and, for each that this
        key block adds into, reduce-adds sdQ into mdQaccum (one TMA in tile order, one bulk reduce
        per warp group's chunk in fragment order), in turn when deterministic, the turn then
        passed on once the add is complete. sdQ is free again once read, or, deterministic
        without det_free_sdq_on_read, once the turn is passed on. With dq_writers = n > 1 this
        is writer `writer` of n, taking every n-th add. Deterministic in fragment order, the
        turns alternate between mdQaccum's copies (`_dq_copy`) and each copy's first turn stores
        instead of adding (`_det_stores_first`: the preprocess left the copies unzeroed)."""
        no_cluster = cute.make_layout(1)
        lane = cute.arch.lane_idx()
        writers = self.config.dq_writers
        chunks = self._dq_chunks()
        # A token barrier joins a writer (syncing) and its predecessor (arriving).
        token_threads = 2 * self.threads_per_warp
        adds_seen = Int32(0)
        # sdQ starts empty; the MMA warp groups consume this arrival at their first hand-over
        # (every later one follows a read; the last is consumed in their epilogue).
        if cutlass.const_expr(writer == 0):
            for chunk in cutlass.range_constexpr(chunks):
                cute.arch.barrier_arrive(barrier_id=self.dq_empty_barrier_ids[chunk], number_of_threads=self._dq_sync_threads())
        for head_in_group in cutlass.range(group, unroll=1):
            head = head_kv * group + head_in_group
            tdQsdQ, tdQgdQ = None, None
            if cutlass.const_expr(not self._dq_fragment_order()):
                gdQ = cute.local_tile(mdQaccum[None, None, head + num_heads * batch], (self.tile_m, self.head_dim), (None, 0))
                tdQsdQ, tdQgdQ = cpasync.tma_partition(
                    tma_atom_dq, 0, no_cluster, cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
                )
            for step in cutlass.range(walk.m_block_max - walk.m_block_min, unroll=1):
                m_block = self._m_block_at(walk, step)
                adds, turn = self._dq_turn(block_info, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right, walk)
                if adds:
                    copy, copy_turn = self._dq_copy(mdQaccum, turn, deterministic)
                    claimed = cutlass.Boolean(False)
                    writes_this_add = cutlass.Boolean(True)
                    if cutlass.const_expr(writers > 1):
                        writes_this_add = adds_seen % writers == writer
                    if writes_this_add:
                        if cutlass.const_expr(writers > 1):
                            # The other writer has read sdQ (and left the hand-over barriers).
                            if adds_seen > 0:
                                cute.arch.barrier(barrier_id=self.dq_token_barrier_ids[writer], number_of_threads=token_threads)
                        for chunk in cutlass.range_constexpr(chunks):
                            cute.arch.barrier(barrier_id=self.dq_full_barrier_ids[chunk], number_of_threads=self._dq_sync_threads())
                            if cutlass.const_expr(chunk == 0):
                                if deterministic != 0:
                                    if cutlass.const_expr(self.config.det_ordered):
                                        if lane == 0:
                                            self._wait_for_turn(self._semaphore(mSemaphore, copy, batch, head, m_block), copy_turn)
                                    cute.arch.sync_warp()
                                    # The previous key block's adds (acquired above) precede this one.
                                    cute.arch.fence_proxy("async.global")
                                elif cutlass.const_expr(self._default_stores_first()):
                                    claimed = self._claim_store(self._semaphore(mSemaphore, 0, batch, head, m_block), lane)
                            if cutlass.const_expr(self._dq_fragment_order()):
                                chunk_elems = cute.cosize(sdQ.layout) // chunks
                                if lane == 0:
                                    dst = _elem_ptr(mdQaccum, (copy, batch, head, m_block * self.tile_m, 0)) + chunk * chunk_elems
                                    src = sdQ.iterator + chunk * chunk_elems
                                    stores = cutlass.Boolean(False)
                                    if cutlass.const_expr(self._det_stores_first()):
                                        if deterministic != 0:
                                            stores = copy_turn == 0
                                    if cutlass.const_expr(self._default_stores_first()):
                                        if deterministic == 0:
                                            stores = claimed
                                    if stores:
                                        _bulk_f32(dst, src, chunk_elems * Float32.width // 8, add=False)
                                    else:
                                        _bulk_f32(dst, src, chunk_elems * Float32.width // 8, add=True)
                            else:
                                # The whole warp: the TMA copy elects its issuing lane itself (elect.sync).
                                cute.copy(tma_atom_dq, tdQsdQ, tdQgdQ[None, m_block])
                            cute.arch.cp_async_bulk_commit_group()
                        free_early = cutlass.Boolean(self.config.det_free_sdq_on_read)
                        if deterministic == 0:
                            free_early = cutlass.Boolean(True)
                        if free_early:
                            for chunk in cutlass.range_constexpr(chunks):
                                # Chunk `chunk` has been read once at most chunks − 1 − chunk
                                # younger groups are pending.
                                cute.arch.cp_async_bulk_wait_group(chunks - 1 - chunk, read=True)
                                cute.arch.barrier_arrive(barrier_id=self.dq_empty_barrier_ids[chunk], number_of_threads=self._dq_sync_threads())
                            if cutlass.const_expr(writers > 1):
                                cute.arch.barrier_arrive(barrier_id=self.dq_token_barrier_ids[(writer + 1) % writers], number_of_threads=token_threads)
                        if deterministic != 0:
                            self._pass_turn(mSemaphore, copy, batch, head, m_block, lane)
                        elif cutlass.const_expr(self._default_stores_first()):
                            if claimed:
                                self._publish_store(self._semaphore(mSemaphore, 0, batch, head, m_block), lane)
                        if not free_early:
                            for chunk in cutlass.range_constexpr(chunks):
                                cute.arch.barrier_arrive(barrier_id=self.dq_empty_barrier_ids[chunk], number_of_threads=self._dq_sync_threads())
                    if cutlass.const_expr(writers > 1):
                        adds_seen += 1
        if cutlass.const_expr(writers > 1):
            # The last add's token, taken by the writer whose turn the next add would be: every
            # arrival on the token barriers is matched before the CTA exits.
            if adds_seen > 0:
                if adds_seen % writers == writer:
                    cute.arch.barrier(barrier_id=self.dq_token_barrier_ids[writer], number_of_threads=token_threads)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _dq_copy(self, mdQaccum, turn, deterministic):
        """(the copy of mdQaccum an add of turn `turn` goes to, its turn among that copy's adds).

        Deterministic in fragment order with two copies (variants.dq_copies), consecutive turns
        alternate, so an add waits for the add two turns back, not the one just before it: a
        chain then moves at the slower of a step and half an add's round trip
        (docs/perf-log.md, "two dQ accumulators"). The tile order's TMA view and the atomics
        add every turn into copy 0, whose zeroed partner the postprocess adds as zeros."""
        copy, copy_turn = Int32(0), turn
        if cutlass.const_expr(self._dq_fragment_order()):
            if deterministic != 0:
                # Exact for 1 and 2 copies (BWD_MAX_DQ_COPIES).
                shift = mdQaccum.shape[0] - 1
                copy, copy_turn = turn & shift, turn >> shift
        return copy, copy_turn

    def _default_stores_first(self) -> bool:
        """Default mode, fragment order: the first add into a query block stores
        (TileConfig.default_stores_first), so the preprocess need not zero mdQaccum (the
        postprocess skips blocks no add reached)."""
        return self._dq_fragment_order() and self.config.default_stores_first

    @cute.jit
    def _claim_store(self, semaphore, lane) -> cutlass.Boolean:
        """Default mode: True for the first dQ writer to reach the semaphore's query block, which
        then stores (semaphore 0 -> 1, a compare-and-swap); the others wait until that store is
        complete (2, `_publish_store`), to add onto it. A writer claims only once its sdQ is
        full, so a claimer's store waits on nothing and every wait ends. Warp-uniform result."""
        old = Int32(0)
        if lane == 0:
            old = cute.arch.atomic_cas(semaphore, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
            if old != 0:
                self._wait_for_turn(semaphore, Int32(2))
        old = cute.arch.shuffle_sync(old, 0)
        # The claimer's store (acquired above) precedes this add.
        cute.arch.fence_proxy("async.global")
        return old == 0

    @cute.jit
    def _publish_store(self, semaphore, lane):
        """Once the claimer's store is complete in global memory, lets the waiting adds go
        (semaphore 1 -> 2; the fences as in `_pass_turn`)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.store(semaphore, Int32(2), sem="release", scope="gpu")

    def _det_stores_first(self) -> bool:
        """Deterministic in fragment order, a copy's first add into a query block stores, so the
        preprocess need not zero mdQaccum (the postprocess skips copies no add reached). Not
        without the order (det_unordered), where the first add need not land first."""
        return self._dq_fragment_order() and self.config.det_ordered

    @cute.jit
    def _semaphore(self, mSemaphore, copy, batch, head, m_block):
        """The deterministic turn counter of copy `copy` of query block m_block's dQ rows."""
        return _elem_ptr(mSemaphore, (copy, batch, head, m_block * (self.tile_m // BWD_SEMAPHORE_ROWS)))

    @cute.jit
    def _wait_for_turn(self, semaphore, turn):
        """Spins until `turn` key blocks have added into the semaphore's query block (one thread;
        the acquire orders their adds before what the caller issues next)."""
        done = cute.arch.load(semaphore, Int32, sem="acquire", scope="gpu")
        while done != turn:
            done = cute.arch.load(semaphore, Int32, sem="acquire", scope="gpu")

    @cute.jit
    def _pass_turn(self, mSemaphore, copy, batch, head, m_block, lane):
        """Once the dQ writer's adds are complete in global memory, passes the turn of
        (head, m_block) on to the next key block (as in the red.global path: every lane fences,
        then one releases). Passing it only after the next add is issued, so that the round trip
        overlaps a step, was 2-26% slower: docs/perf-log.md, "the deterministic cost split"."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.atomic_add(self._semaphore(mSemaphore, copy, batch, head, m_block), Int32(1), sem="release", scope="gpu")

    def _descending_turns(self) -> bool:
        """Deterministic dQ adds go from the highest key block down (det_descending, masked)."""
        return self.config.det_descending and (self.causal or self.local)

    @cute.jit
    def _is_first_mma_thread(self) -> cutlass.Boolean:
        # Read afresh rather than keeping the thread index live through the main loop.
        tidx, _, _ = cute.arch.thread_idx()
        return tidx == self.threads_per_warp_group

    @cute.jit
    def _is_first_mma_warp(self) -> cutlass.Boolean:
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.mma_warp_groups[0] * 4

    @cute.jit
    def red_add(self, acc, gmem):
        """gmem += acc, where both are partitions of one accumulator tile.

        Registers 2i and 2i+1 of a WGMMA accumulator hold adjacent columns, so each pair is one
        8-byte `red.global.add.v2.f32`: half the L2 atomic operations of scalar adds.
        """
        for i in cutlass.range_constexpr(0, cute.size(acc), 2):
            pair = cute.make_tensor(acc.iterator + i, cute.make_layout(2)).load()
            cute.arch.red(_elem_ptr(gmem, i), pair, op="add", dtype="f32", sem="relaxed", scope="gpu")

    @cute.jit
    def epilogue(self, blocks, thr_mma_dk, thr_mma_dv, sK, sV, tma_atom_dk, mdK, tma_atom_dv, mdV,
                 n_block, head_kv, batch, softmax_scale):
        """dK·softmax_scale and dV: registers -> K's and V's shared buffers -> TMA stores."""
        dk_out = cute.make_rmem_tensor_like(blocks.acc_dk, self.dtype)
        dk_out.store((blocks.acc_dk.load() * softmax_scale).to(self.dtype))
        dv_out = cute.make_rmem_tensor_like(blocks.acc_dv, self.dtype)
        dv_out.store(blocks.acc_dv.load().to(self.dtype))
        if cutlass.const_expr(self.config.dq_tma_reduce):
            # The dQ writer's last arrival (after its last read of sdQ): every arrival on the
            # barrier is matched before the CTA exits.
            chunk = 0
            if cutlass.const_expr(self._dq_fragment_order()):
                _, chunk = self._mma_thread_chunk()
            cute.arch.barrier(barrier_id=self._dq_barrier_id(self.dq_empty_barrier_ids, chunk),
                              number_of_threads=self._dq_sync_threads())
        # Both warp groups' GEMMs reading K and V have retired (each waits for its own).
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.num_mma_threads)
        cute.autovec_copy(dk_out, thr_mma_dk.partition_C(sK))
        cute.autovec_copy(dv_out, thr_mma_dv.partition_C(sV))
        # Ordinary stores must be made visible to the TMA (async proxy) before the store is issued.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.num_mma_threads)
        if self._is_first_mma_warp():
            no_cluster = cute.make_layout(1)
            gdK = cute.local_tile(mdK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
            gdV = cute.local_tile(mdV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
            tdKsdK_tma, tdKgdK = cpasync.tma_partition(
                tma_atom_dk, 0, no_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gdK, 0, 2)
            )
            tdVsdV_tma, tdVgdV = cpasync.tma_partition(
                tma_atom_dv, 0, no_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gdV, 0, 2)
            )
            cute.copy(tma_atom_dk, tdKsdK_tma, tdKgdK)
            cute.copy(tma_atom_dv, tdVsdV_tma, tdVgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
