"""FlashAttention backward for Hopper (sm_90a): TMA loads, WGMMA, Sᵀ/dPᵀ in registers.

One `__call__` launches three kernels on the stream, in order, each the programmatic dependent
(PDL) of the one before: its CTAs take SMs as the previous grid's last CTAs leave and run their
prologue before `griddepcontrol.wait`, so the launch gaps close.

1. `BackwardPreprocess` (kernels/bwd_pre.py): D = rowsum(dO ∘ O) − dLSE → mdPsum, and
   lse·log2(e) → mLSElog2 (+inf for padded rows and rows with no visible key, so their P is 0);
   the semaphores zeroed, and mdQaccum zeroed unless the first add into it stores.
2. The main kernel below: dK and dV of one key block, and dS·K added into mdQaccum.
3. `BackwardPostprocess` (kernels/bwd_post.py): dQ = softmax_scale · (the sum of mdQaccum's
   copies) → mdQ.

Main kernel: one CTA per (key block of tile_n keys, kv head, batch); it walks the q heads of its
GQA group and, for each, the query blocks of tile_m rows that see its keys (BlockInfo.m_block_range),
keeping dK and dV in registers for a single store at the end (no atomics on dK/dV, and GQA sums over
the group inside the CTA). The warp roles are `ROLES`:

- the producer warp group's first warp issues TMA for K and V once, then for each query block
  Q with its LSElog2 row slice and dO with its D slice through a `stages`-deep ring of
  mbarrier-guarded buffers (`pipeline_q`, `pipeline_do`, one slot index for both). Its next
  `dq_writers` warps take the dQ adds in turn: each reduces a query block's sdQ into mdQaccum
  with one plain bulk reduce per MMA warp group's chunk (cp.reduce.async.bulk .add.f32).
- the MMA warp groups, per query block:
    Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (WGMMA from shared memory; transposed so that keys are the M
    mode; with `scores_ahead` Sᵀ is issued while the previous block's dQ is handed over);
    Pᵀ = exp2(Sᵀ·scale_log2 − LSElog2) while the dPᵀ GEMM runs (causal / window mask first,
    only on tiles that cross the band: BlockInfo.tile_needs_mask);
    dV += Pᵀ·dO issued, then dSᵀ = Pᵀ∘(dPᵀ − D) while it runs (`dv_during_ds`; else dV after
    dSᵀ); dK += dSᵀ·Q;
    dSᵀ to shared memory (stmatrix), a named barrier, then dQ_partial = dS·K (WGMMA, dS read as
    an M-major view of dSᵀ); dQ_partial goes to the shared fp32 tile sdQ in the threads' own
    register order (layouts.fragment_order_view: 128-bit stores free of bank conflicts), one
    chunk per warp group, and mdQaccum keeps that order until the postprocess. In
    deterministic mode the adds into a (batch, head, query block) go in a fixed key-block order
    (decreasing under a causal/local mask, the grid launching the highest key block first), each
    waiting on mSemaphore for its turn; the turns alternate between mdQaccum's copies when the
    call gives it two (`_dq_copy`), and each copy's first turn stores rather than adds, so that
    nothing zeroes the workspace first.
    With softcap, Sᵀ and dPᵀ are both awaited and one pass computes t = tanh(Sᵀ·scale/softcap),
    Pᵀ and dSᵀ = Pᵀ∘(dPᵀ − D)∘(1 − t²); the mask then zeroes Pᵀ and dSᵀ (masking the scores
    to −inf first would leave no t for the derivative).
  With `release_early` (d256) dO's slot is released once the dV GEMM retires and Q's once dK's
  has, so that the next query block's loads overlap the dQ GEMM and its hand-over.
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
entry's, clamped to the buffers, and the padding past them, which the caller may leave
non-finite, is zeroed in shared memory by the MMA warp groups as it lands (`zero_rows_past`: K
and V once in an entry's last key block, Q and dO at each visit of its last query block):
padded rows get LSElog2 = +inf and D = 0 from the preprocess, so P = dS = 0 and
their dQ rows stay 0 (the postprocess writes 0 there anyway); padded keys are loaded (a TMA box
cannot stop at a per-entry length) and masked like the tail above, so their dK/dV rows are exact
zeros; key blocks wholly past the length visit no query block and store zeros.

Segment ids (a `segments` kernel; kernels/common/segments.py): a key block walks only the query
blocks in its span (in deterministic mode a span transposed from the row spans: see `kernel`), a query
block takes the adds of the key blocks in its own span as the forward visits them (`_dq_turn`,
so turns count those), no rotated walk, and ids are compared on the pairs outside the key
block's full span (`dkv_step`). A `mask_array` kernel is the same walk over a boolean mask's
span tables, testing its bits instead of ids.
"""
import dataclasses
import enum
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
from fa4_jax.abi.workspace import BWD_SEMAPHORE_ROWS
from fa4_jax.kernels.common.block_info import BlockInfo, MaskBounds
from fa4_jax.kernels.common.exp2 import exp2_poly, uses_poly
from fa4_jax.kernels.common.layouts import acc_as_operand_a, acc_rows_cols, fragment_order_view, permute_modes
from fa4_jax.kernels.common.mask import AttentionMask
from fa4_jax.kernels.common.ragged import entry_length
from fa4_jax.kernels.common.segments import SegmentIds
from fa4_jax.kernels.common.softmax import score_scales
from fa4_jax.kernels.sm90 import hardware
from fa4_jax.kernels.sm90.operands import smem_layout, swizzled_tensor, tma_pipeline, wgmma_gemm
from fa4_jax.abi.segment_layout import WIDEST_BACKWARD_TILE_M


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One head dim's static backward kernel shape. The defaults are the shipped values that
    most head dims share; TILE_CONFIGS says where and why an entry differs."""

    tile_m: int = 64  # query rows per step of the inner loop
    tile_n: int = 128  # keys per CTA
    stages: int = 2  # depth of the Q / dO rings
    # Pᵀ, dSᵀ feed the dV/dK WGMMAs from registers (else from shared memory).
    dkv_from_registers: bool = True
    pds_stages: int = 2  # dSᵀ (and Pᵀ) shared-memory buffers; 2 saves a barrier per query block
    # dkv_from_registers: dV's WGMMA is issued as soon as Pᵀ is in registers, so that it runs
    # while dSᵀ is computed; False: after dSᵀ, beside dK (FA4 upstream's order). Issued early,
    # it holds Pᵀ's registers and dV's accumulator through that pass, which at 128 query rows
    # is more than 240 registers: ptxas then serializes every WGMMA of the kernel (C7512).
    dv_during_ds: bool = False
    # Warps of the producer group that take the dQ adds in turn, each waiting for its own adds
    # to complete before passing their turns on, so that one add's round trip to L2 overlaps the
    # next add instead of holding up the only writer (docs/perf-log.md, "Two dQ writers"). Token
    # barriers in a ring keep one writer at a time on the hand-over barriers.
    dq_writers: int = 2
    # The next query block's Sᵀ GEMM is issued as soon as this block's GEMMs have retired, so
    # that it runs while this block's dQ goes to sdQ and the threads meet at its barriers;
    # False: after that hand-over. Needs a second Q/dO stage. dPᵀ stays at the top of the block:
    # issued ahead too, it would be one more tile_m / 2 fp32 registers held beside dQ's, dK's
    # and dV's.
    scores_ahead: bool = False
    # Columns of a thread's Sᵀ/dPᵀ fragment whose LSE and D values are read from shared memory
    # before the GEMM waits instead of at their use (ptxas leaves a load that follows a wait
    # after it, and the exponentials' first FFMAs then wait on it). 16 is all of a 64-row tile;
    # all 32 of d64's 128 rows spill.
    row_stats_ahead: int = 16
    # The LSE values read ahead are read right after Q's slot is ready, before the Sᵀ GEMM is
    # issued (FA4 upstream's place), instead of after the dPᵀ GEMM's issue. Not with
    # scores_ahead (the values would be held through the previous block's dQ hand-over) or
    # softcap (which reads them one column at a time).
    lse_before_scores: bool = False
    # The dK GEMM is issued after dQ's, and the dQ hand-over runs while dK's GEMM does; False:
    # dK is issued first and the hand-over waits for every GEMM of the block, the tensor pipe
    # idle through it. Holds dSᵀ's 16-bit registers (dK's operand) through the hand-over. Not
    # with scores_ahead, which overlaps the hand-over with the next block's Sᵀ instead.
    dq_during_dk: bool = True
    # Default mode: the first key block to reach a query block stores its dQ instead of adding
    # it (a compare-and-swap on the block's semaphore claims the store; the others wait until the
    # claimer's store is complete, then add), so the preprocess need not zero mdQaccum (half its
    # traffic). Without a mask the walk is then rotated as a deterministic call's is, so that a
    # head's key blocks reach each query block a step apart rather than all at once.
    default_stores_first: bool = False
    # P and dSᵀ from shared memory, dK before dQ (d192, d256): dO's slot is released as soon as
    # dV's GEMM retires and Q's once dK's has, not after the dQ GEMM, so that the next block's
    # loads overlap the dQ GEMM and its hand-over (with one stage, they otherwise wait for both).
    release_early: bool = False
    # Share of Pᵀ's exponentials computed by exp2.py's polynomial on the FMA pipes instead of
    # MUFU.EX2 (register columns assigned by exp2.uses_poly; softcap keeps MUFU). The two MMA
    # warp groups meet at the dSᵀ barrier every step, so their exponentials run at the same
    # time on the same SMSPs' MUFU units.
    exp2_poly_share: float = 0.0


# A WGMMA has 64 rows: the Sᵀ/dPᵀ GEMMs put keys on them (64 per warp group with
# dkv_from_registers), the dQ GEMM query rows (one 64-row tile per warp group: tile_m 64 splits d
# between the warp groups, tile_m 128 splits the rows). Shared memory, 2-byte elements, under the
# 227 KB of an sm_90 CTA, plus tile_m·d·4 bytes of fp32 sdQ:
#   2 · (stages·tile_m·(d + dv) + tile_n·(d + dv) + pds_stages·tile_n·tile_m·(1, or 2 with P))
#   d64, 128 rows: 2·(2·128·128 + 128·128 + 2·128·128) = 160 KB, + 32 KB of sdQ = 192 KB
#   d96:  2·(2·64·192 + 128·192 + 2·128·64)   = 128 KB, + 24 KB
#   d128: 2·(2·64·256 + 128·256 + 2·128·64)   = 160 KB, + 32 KB
#   d192/dv128: 2·(2·64·320 + 64·320 + 2·2·64·64) = 152 KB, + 48 KB
#   d256: one stage and one dSᵀ/Pᵀ buffer: 144 KB, + 64 KB = 208 KB.
# Registers per MMA thread (240 budget): with dkv_from_registers a warp group holds dK and dV of
# 64 keys (d128: 64 + 64 fp32), Sᵀ and dPᵀ (tile_m / 2 each) and their 16-bit copies. d192 and
# d256 with 64 keys per warp group would need 160 and 256 for dK + dV alone, hence tile_n = 64
# with dK/dV split along d and P/dS through shared memory. Each entry's reason, and the
# measurements behind it, are in docs/perf-log.md under the section named.
TILE_CONFIGS = {
    # 128 × 128 tiles, FlashAttention-3's d64 shape ("Backward d64 on 128 × 128 tiles"), LSE and
    # D at their use ("The same backward order at d64 and d96"), the first add stores ("The
    # first add stores at d64: adopted").
    64: TileConfig(tile_m=128, row_stats_ahead=0, default_stores_first=True),
    # d64's tiles for small models ("Every head dim: served zero-padded").
    32: TileConfig(tile_m=128, row_stats_ahead=0, default_stores_first=True),
    # FA4 upstream's GEMM order ("The same backward order at d64 and d96").
    96: TileConfig(),
    # Upstream's order ("d128 backward in FA4 upstream's GEMM order"), LSE read before the Sᵀ
    # GEMM ("The d128 backward against upstream's under Nsight Compute"), an eighth of the
    # exponentials on the FMA pipes ("Exponentials on the FMA pipes in the backward").
    128: TileConfig(lse_before_scores=True, exp2_poly_share=0.125),
    # dK/dV split along d, P through shared memory, Sᵀ issued ahead ("Backward: Sᵀ issued
    # ahead, during the previous block's dQ hand-over").
    192: TileConfig(tile_n=64, dkv_from_registers=False, dv_during_ds=True, dq_during_dk=False,
                    scores_ahead=True),
    # d192's shape: 64 keys per warp group would hold 160 fp32 registers of dK and dV alone.
    160: TileConfig(tile_n=64, dkv_from_registers=False, dv_during_ds=True, dq_during_dk=False,
                    scores_ahead=True),
    # Single-buffered rings so that sdQ fits ("Backward d256: `dq_tma_1stage` compiled, not yet
    # measured" and its measurement in "Backward v3 measured whole"); Q and dO released as their
    # last GEMMs retire ("The d256 backward: a CTA pair sharing dSᵀ, and Q/dO released early").
    256: TileConfig(tile_n=64, stages=1, dkv_from_registers=False, pds_stages=1, dv_during_ds=True,
                    dq_during_dk=False, release_early=True),
}
# With softcap the one pass over Sᵀ and dPᵀ keeps both in fp32 until the end; on d64's 128 rows
# that spills (168 bytes of stack), so softcap keeps 64-row tiles there.
SOFTCAP_TILE_CONFIGS = {
    d: dataclasses.replace(TILE_CONFIGS[d], tile_m=64, dv_during_ds=True) for d in (32, 64)
}


class Barrier(enum.IntEnum):
    """Named barriers (0 is __syncthreads). The dQ hand-over's come in pairs, one per MMA warp
    group's chunk of sdQ: FULL (the group has written its chunk: it arrives, the writer syncs)
    and EMPTY (the writer's bulk reduce has read it: the writer arrives, the group syncs)."""

    PDS = 1  # dSᵀ (Pᵀ) fully in shared memory before the GEMMs that read it across warp groups
    EPILOGUE = 2  # the dK/dV epilogue
    PADDING = 3  # a ragged entry's padding rows zeroed in shared memory before any GEMM reads them
    DQ_FULL_0 = 4
    DQ_EMPTY_0 = 5
    # dq_writers > 1: writer w waits on DQ_TOKEN[w] for the previous writer's (w - 1 mod
    # writers) bulk reduce to have read sdQ; the writers take the adds round-robin.
    DQ_TOKEN_0 = 6
    DQ_TOKEN_1 = 7
    DQ_FULL_1 = 8
    DQ_EMPTY_1 = 9
    DQ_TOKEN_2 = 10


DQ_FULL = (Barrier.DQ_FULL_0, Barrier.DQ_FULL_1)
DQ_EMPTY = (Barrier.DQ_EMPTY_0, Barrier.DQ_EMPTY_1)
DQ_TOKEN = (Barrier.DQ_TOKEN_0, Barrier.DQ_TOKEN_1, Barrier.DQ_TOKEN_2)


@dataclasses.dataclass(frozen=True)
class Roles:
    """The warp-role table: warp group 0 produces (warp 0 loads, the next `dq_writers` warps
    write dQ), the ones after it compute."""

    producer_warp_group: int = 0
    load_warp: int = 0
    dq_writer_warps: tuple = (1, 2, 3)
    mma_warp_groups: tuple = (1, 2)
    producer_registers: int = 24  # setmaxnreg budgets: the producer needs few registers,
    mma_registers: int = 240  # the MMA groups hold dK, dV, Sᵀ, dPᵀ


ROLES = Roles()
THREADS_PER_WARP_GROUP = 128
# Elements of one 16-byte shared-memory store (16-bit types): a ragged entry's padding rows of
# Q, dO, K and V are zeroed in these (`zero_rows_past`).
ZERO_CHUNK = 8
THREADS_PER_WARP = 32


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
class _KeyBlock:
    """The CTA's key block and its batch entry: which keys, whose lengths, which q heads."""

    n_block: Int32
    head_kv: Int32
    batch: Int32
    group: Int32  # q heads per kv head
    seqlen_q: Int32  # the entry's valid query rows and keys
    seqlen_k: Int32
    segments: SegmentIds | None = None  # a segments kernel's ids and span tables


@dataclasses.dataclass(frozen=True)
class _Tma:
    """The TMA atoms with the global tensors (in the kernel's (s, d, heads, batch) views) they
    load or store."""

    atom_q: cute.CopyAtom
    q: cute.Tensor
    atom_do: cute.CopyAtom
    do: cute.Tensor
    atom_k: cute.CopyAtom
    k: cute.Tensor
    atom_v: cute.CopyAtom
    v: cute.Tensor
    atom_lse: cute.CopyAtom
    lse_log2: cute.Tensor
    atom_dpsum: cute.CopyAtom
    dpsum: cute.Tensor
    atom_dk: cute.CopyAtom
    dk: cute.Tensor
    atom_dv: cute.CopyAtom
    dv: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _Smem:
    q: cute.Tensor
    do: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    ds: cute.Tensor
    p: cute.Tensor  # None with dkv_from_registers
    lse: cute.Tensor
    dpsum: cute.Tensor
    dq: cute.Tensor  # the fp32 dQ_partial tile the writer warps reduce, in fragment order


@dataclasses.dataclass(frozen=True)
class _Pipelines:
    kv: pipeline.PipelineTmaAsync
    q: pipeline.PipelineTmaAsync
    do: pipeline.PipelineTmaAsync


@dataclasses.dataclass(frozen=True)
class _Mmas:
    sdp: cute.TiledMma  # Sᵀ and dPᵀ
    dk: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma


@dataclasses.dataclass(frozen=True)
class _Scale:
    softmax_scale: Float32
    score_prescale: Float32  # multiplies the scores inside softcap's tanh (1 without softcap)
    scale_log2: Float32  # carries the (capped) scores into the exp2 domain


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
    sdQ: cute.Tensor


class FlashAttentionBackwardSm90:
    def __init__(self, dtype, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool,
                 segments: bool = False, mask_array: bool = False, **tuning):
        """`tuning` overrides the tile table's settings (TileConfig fields of the same name).
        `segments`: the kernel reads segment ids and their span tables
        (kernels/common/segments.py); `mask_array`, a segments kernel that also reads a boolean
        mask's bits."""
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
        if mask_array and not segments:
            raise ValueError("a mask_array kernel is a segments kernel (it walks the mask's span tables)")
        self.segments = segments
        self.mask_array = mask_array
        config = SOFTCAP_TILE_CONFIGS.get(head_dim) if has_softcap else None
        self.config = dataclasses.replace(config or TILE_CONFIGS[head_dim], **tuning)
        self.tile_m, self.tile_n, self.stages = self.config.tile_m, self.config.tile_n, self.config.stages
        self.mma_warp_groups = ROLES.mma_warp_groups
        self.num_mma_threads = len(self.mma_warp_groups) * THREADS_PER_WARP_GROUP
        self.num_threads = self.num_mma_threads + THREADS_PER_WARP_GROUP
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
        # K is the dQ GEMM's MN-major B operand, each warp group reading dq_cols of it: 40 (d80 on
        # 64-row tiles) compiled, and gave wrong dQ on the H200; the shipped splits are
        # multiples of 16.
        if self.dq_cols % 16:
            raise ValueError(f"{self.config}: {self.dq_cols} columns of dQ per warp group must be a "
                             "multiple of 16")
        self.preprocess = BackwardPreprocess(dtype, head_dim, head_dim_v, self._default_stores_first())
        self.postprocess = BackwardPostprocess(dtype, head_dim, self.tile_m,
                                               default_stores_first=self._default_stores_first())

    def _check_config(self):
        """Refuses settings the kernel cannot run correctly, naming the setting."""
        config = self.config
        if (config.tile_m not in (64, 128) or config.tile_m % BWD_SEMAPHORE_ROWS
                or WIDEST_BACKWARD_TILE_M % config.tile_m):
            raise ValueError(f"{config}: tile_m must be 64 or 128 (one or two 64-row WGMMA tiles "
                             f"per warp group, whole {BWD_SEMAPHORE_ROWS}-row semaphores, dividing "
                             f"the deterministic walk's {WIDEST_BACKWARD_TILE_M})")
        if config.stages % config.pds_stages:
            raise ValueError(f"{config}: stages must be a multiple of pds_stages (consecutive "
                             "query blocks alternate dSᵀ buffers by stage)")
        if config.row_stats_ahead < 0:
            raise ValueError(f"{config}: row_stats_ahead counts columns read ahead (0: none)")
        if not 1 <= config.dq_writers <= len(ROLES.dq_writer_warps):
            raise ValueError(f"{config}: dq_writers is 1 to {len(ROLES.dq_writer_warps)}")
        if config.lse_before_scores and config.scores_ahead:
            raise ValueError(f"{config}: lse_before_scores is not implemented with scores_ahead")
        if config.scores_ahead and config.dq_during_dk:
            raise ValueError(f"{config}: scores_ahead and dq_during_dk both overlap the dQ hand-over; "
                             "choose one")
        if config.release_early and (config.dkv_from_registers or config.dq_during_dk):
            raise ValueError(f"{config}: release_early orders dV, dK, then dQ (dkv_from_registers and "
                             "dq_during_dk off)")
        if config.scores_ahead and config.stages < 2:
            raise ValueError(f"{config}: scores_ahead needs two Q/dO stages (the next block's Q "
                             "loads while this block's is still read; released early, at d256 it "
                             "measured 7-11% slower: docs/perf-log.md)")

    def _tiled_mmas(self) -> _Mmas:
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
        return _Mmas(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq)

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
        mQSegmentIds: cute.Tensor,
        mKSegmentIds: cute.Tensor,
        mRowSpans: cute.Tensor,
        mKeySpans: cute.Tensor,
        mMaskBits: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        top_left: Int32,
        deterministic: Int32,
        num_sms: Int32,
        stream: cuda.CUstream,
    ):
        """Tensors as fa4_jax.aot.compile.TENSORS["bwd"] (JAX row-major layouts); the segment
        ids and span tables are read by a segments kernel only, the mask bits by a mask_array
        kernel only (FlashAttentionForwardSm90)."""
        self.preprocess(mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mSemaphore, mSeqUsedQ,
                        deterministic, stream)

        # Kernel-side views put the sequence and feature modes first: (s, d, heads, batch), and
        # (s_pad, heads, batch) for the per-row workspaces.
        mQ_k, mK_k, mV_k, mdO_k, mdK_k, mdV_k = [permute_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSElog2_k, mdPsum_k = [permute_modes(t, (2, 1, 0)) for t in (mLSElog2, mdPsum)]

        mmas = self._tiled_mmas()

        # Q, dO and K are also the MN-major B operands of dK, dV and dQ; V's buffer stages dV's
        # epilogue, each warp group writing its dv_cols.
        sQ_layout = smem_layout(self.dtype, self.tile_m, self.head_dim, self.stages, split=self.dk_cols)
        sdO_layout = smem_layout(self.dtype, self.tile_m, self.head_dim_v, self.stages, split=self.dv_cols)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.head_dim, split=self.dq_cols)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.head_dim_v, split=self.dv_cols)
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
        # Flat: the MMA threads and the bulk reduces address it through fragment_order_view.
        sdQ_layout = cute.make_layout(self.tile_m * self.head_dim)
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
        assert SharedStorage.size_in_bytes() <= hardware.SMEM_BYTES, (
            f"{self.config} needs {SharedStorage.size_in_bytes()} bytes of shared memory")
        self.shared_storage = SharedStorage

        score_prescale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)

        # Key blocks are the fastest grid mode, so in deterministic mode a CTA is never resident
        # while one of lower key block (whose dQ adds it waits for) has not been launched yet.
        # The CTAs of a wave are then mostly one head's, and share its Q and dO in L2: dispatching
        # the heads' chains interleaved instead cost the deterministic mode 10-28%
        # (docs/perf-log.md, "interleaving the chains").
        grid = (cute.ceil_div(cute.size(mK_k.shape[0]), self.tile_n), cute.size(mK_k.shape[2]),
                cute.size(mK_k.shape[3]))
        # Only a segments kernel takes the ids and tables (None: no kernel parameter at all).
        segment_tensors = (mQSegmentIds, mKSegmentIds, mRowSpans, mKeySpans) if self.segments \
            else (None, None, None, None)
        mask_bits = mMaskBits if self.mask_array else None
        self.kernel(
            mmas.sdp, mmas.dk, mmas.dv, mmas.dq,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_lse, tma_lse, tma_atom_dpsum, tma_dpsum, tma_atom_dk, tma_dk, tma_atom_dv, tma_dv,
            mdQaccum, mSemaphore, mSeqUsedQ, mSeqUsedK, mQ_k.shape[0], mQ_k.shape[2],
            sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sRow_layout, sdQ_layout,
            softmax_scale, score_prescale, scale_log2, window_left, window_right, top_left,
            deterministic, num_sms, *segment_tensors, mask_bits,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,
        )

        self.postprocess(mdQaccum, mdQ, mSeqUsedQ, mSemaphore, softmax_scale, deterministic, stream,
                         mmas.dq)

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
        sdQ_layout: cute.Layout,
        softmax_scale: Float32,
        score_prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        top_left: Int32,
        deterministic: Int32,
        num_sms: Int32,
        mQSegmentIds: cute.Tensor | None,
        mKSegmentIds: cute.Tensor | None,
        mRowSpans: cute.Tensor | None,
        mKeySpans: cute.Tensor | None,
        mMaskBits: cute.Tensor | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_lse, tma_atom_dpsum,
                         tma_atom_dk, tma_atom_dv):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        mma_warps = self.num_mma_threads // 32
        pipes = _Pipelines(
            kv=tma_pipeline(storage.mbar_kv, 1, mma_warps, self.tma_bytes_kv),
            q=tma_pipeline(storage.mbar_q, self.stages, mma_warps, self.tma_bytes_q),
            do=tma_pipeline(storage.mbar_do, self.stages, mma_warps, self.tma_bytes_do),
        )
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
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sdPsum = storage.sdPsum.get_tensor(sRow_layout)
        smem = _Smem(q=sQ, do=sdO, k=sK, v=sV, ds=sdS, p=sP, lse=sLSE, dpsum=sdPsum, dq=sdQ)
        tma = _Tma(tma_atom_q, mQ, tma_atom_do, mdO, tma_atom_k, mK, tma_atom_v, mV, tma_atom_lse, mLSElog2,
                   tma_atom_dpsum, mdPsum, tma_atom_dk, mdK, tma_atom_dv, mdV)

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
        segments = None
        if cutlass.const_expr(self.segments):
            segments = SegmentIds(self.tile_m, self.tile_n, mQSegmentIds, mKSegmentIds, mRowSpans, mKeySpans,
                                  mMaskBits)
        key_block = _KeyBlock(n_block, head_kv, batch, num_heads // mK.shape[2], seqlen_q, seqlen_k, segments)
        bounds = MaskBounds(window_left, window_right, top_left if self.causal or self.local else None)
        block_info = BlockInfo(self.tile_m, self.tile_n, self.causal, self.local, bounds)
        m_block_min, m_block_max = block_info.m_block_range(n_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(self.segments):
            # The query blocks that share no segment with this key block are skipped. In
            # deterministic mode a query block's turns count the key blocks of its own span
            # (`_dq_turn`), so the dispatch passes key spans transposed from the row spans
            # (fa4_jax.runtime.segments.deterministic_walk): every query block that counts this key
            # block is on its walk, or a later turn would wait forever.
            spans = segments.query_blocks(batch, n_block)
            m_block_min = cutlass.max(m_block_min, spans.lo)
            m_block_max = cutlass.max(cutlass.min(m_block_max, spans.hi), m_block_min)
        walk = self._query_walk(m_block_min, m_block_max, n_block, seqlen_k, deterministic, num_sms)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        # The preprocess's writes (D, LSE, the zeroed dQ workspace and turn counters) are visible
        # after this; the load warp waits only after issuing K and V.
        if warp_idx != ROLES.load_warp:
            cute.arch.griddepcontrol_wait()

        warp_group = cute.arch.make_warp_uniform(warp_idx // 4)
        if warp_group == ROLES.producer_warp_group:
            cute.arch.setmaxregister_decrease(ROLES.producer_registers)
            if warp_idx == ROLES.load_warp:
                self.load(tma, smem, pipes, key_block, walk)
            for writer in cutlass.range_constexpr(self.config.dq_writers):
                if warp_idx == ROLES.dq_writer_warps[writer]:
                    self.dq_writer(mdQaccum, smem.dq, mSemaphore, key_block, walk, deterministic,
                                   block_info, num_heads, writer)
        else:
            cute.arch.setmaxregister_increase(ROLES.mma_registers)
            tidx, _, _ = cute.arch.thread_idx()
            self.mma(
                _Mmas(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq),
                tidx - THREADS_PER_WARP_GROUP, smem, pipes, tma, mdQaccum, mSemaphore, mSeqUsedK,
                key_block, walk, _Scale(softmax_scale, score_prescale, scale_log2), deterministic,
                block_info,
            )

    @cute.jit
    def load(self, tma, smem, pipes, key_block, walk):
        no_cluster = cute.make_layout(1)
        n_block, head_kv, batch = key_block.n_block, key_block.head_kv, key_block.batch
        gK = cute.local_tile(tma.k[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        gV = cute.local_tile(tma.v[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma.atom_k, 0, no_cluster, cute.group_modes(smem.k, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma.atom_v, 0, no_cluster, cute.group_modes(smem.v, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipes.kv.producer_acquire(kv_state)
        cute.copy(tma.atom_k, tKgK, tKsK, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
        cute.copy(tma.atom_v, tVgV, tVsV, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
        cute.arch.griddepcontrol_wait()

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for head_in_group in cutlass.range(key_block.group, unroll=1):
            head = head_kv * key_block.group + head_in_group
            gQ = cute.local_tile(tma.q[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(tma.do[None, None, head, batch], (self.tile_m, self.head_dim_v), (None, 0))
            gLSE = cute.local_tile(tma.lse_log2[None, head, batch], (self.tile_m,), (None,))
            gdPsum = cute.local_tile(tma.dpsum[None, head, batch], (self.tile_m,), (None,))
            tQsQ, tQgQ = cpasync.tma_partition(tma.atom_q, 0, no_cluster, cute.group_modes(smem.q, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma.atom_do, 0, no_cluster, cute.group_modes(smem.do, 0, 2), cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma.atom_lse, 0, no_cluster, cute.group_modes(smem.lse, 0, 1), cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma.atom_dpsum, 0, no_cluster, cute.group_modes(smem.dpsum, 0, 1), cute.group_modes(gdPsum, 0, 1))
            for step in cutlass.range(walk.m_block_max - walk.m_block_min, unroll=1):
                m_block = self._m_block_at(walk, step)
                pipes.q.producer_acquire(state)
                q_bar = pipes.q.producer_get_barrier(state)
                cute.copy(tma.atom_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=q_bar)
                cute.copy(tma.atom_lse, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=q_bar)
                pipes.do.producer_acquire(state)
                do_bar = pipes.do.producer_get_barrier(state)
                cute.copy(tma.atom_do, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=do_bar)
                cute.copy(tma.atom_dpsum, tDgD[None, m_block], tDsD[None, state.index], tma_bar_ptr=do_bar)
                state.advance()

    @cute.jit
    def mma(self, mmas, tidx, smem, pipes, tma, mdQaccum, mSemaphore, mSeqUsedK, key_block, walk, scale,
            deterministic, block_info):
        warp_group = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARP_GROUP)
        # WGMMA descriptors are per warp group; register fragments are per thread.
        wg_first_thread = warp_group * THREADS_PER_WARP_GROUP
        wg_mma_sdp = mmas.sdp.get_slice(wg_first_thread)
        wg_mma_dk = mmas.dk.get_slice(wg_first_thread)
        wg_mma_dv = mmas.dv.get_slice(wg_first_thread)
        wg_mma_dq = mmas.dq.get_slice(wg_first_thread)
        thr_mma_sdp = mmas.sdp.get_slice(tidx)
        thr_mma_dk = mmas.dk.get_slice(tidx)
        thr_mma_dv = mmas.dv.get_slice(tidx)
        thr_mma_dq = mmas.dq.get_slice(tidx)

        # Transposed views: (d, queries, stage) of Q and dO, (queries, keys, stage) of dSᵀ, (d, keys) of K.
        sQt = permute_modes(smem.q, (1, 0, 2))
        sdOt = permute_modes(smem.do, (1, 0, 2))
        sdSt = permute_modes(smem.ds, (1, 0, 2))
        sKt = permute_modes(smem.k, (1, 0))
        # Pᵀ/dSᵀ registers -> shared memory with stmatrix: one address per 4 8x8 matrices, where
        # element-wise stores would keep ~20 more swizzled addresses live through the loop.
        store_pds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            mmas.sdp,
        ).get_slice(tidx)
        tdVrP, tdKrdS = None, None
        tPsP = None
        if cutlass.const_expr(not self.config.dkv_from_registers):
            tdVrP = wg_mma_dv.make_fragment_A(wg_mma_dv.partition_A(smem.p))
            tdKrdS = wg_mma_dk.make_fragment_A(wg_mma_dk.partition_A(smem.ds))
            tPsP = store_pds.partition_D(smem.p)

        acc_s = thr_mma_sdp.make_fragment_C(thr_mma_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dk = thr_mma_dk.make_fragment_C(thr_mma_dk.partition_shape_C((self.tile_n, self.head_dim)))
        acc_dv = thr_mma_dv.make_fragment_C(thr_mma_dv.partition_shape_C((self.tile_n, self.head_dim_v)))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        score_identity = cute.make_identity_tensor((self.tile_n, self.tile_m))
        blocks = _BlockOperands(
            mmas.sdp, mmas.dk, mmas.dv, mmas.dq, thr_mma_sdp, thr_mma_dq,
            wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(smem.k)),
            wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(smem.q)),
            wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(smem.v)),
            wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(smem.do)),
            tdVrP,
            wg_mma_dv.make_fragment_B(wg_mma_dv.partition_B(sdOt)),
            tdKrdS,
            wg_mma_dk.make_fragment_B(wg_mma_dk.partition_B(sQt)),
            wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(sdSt)),
            wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(sKt)),
            store_pds,
            tPsP,
            store_pds.partition_D(smem.ds),
            smem.lse,
            smem.dpsum,
            acc_s,
            cute.make_rmem_tensor_like(acc_s, Float32),
            cute.make_rmem_tensor_like(acc_s, self.dtype),
            cute.make_rmem_tensor_like(acc_s, self.dtype),
            acc_dk,
            acc_dv,
            thr_mma_dq.make_fragment_C(thr_mma_dq.partition_shape_C((self.tile_m, self.head_dim))),
            acc_rows_cols(mmas.sdp.get_slice(0).partition_C(score_identity)),
            acc_rows_cols(thr_mma_sdp.partition_C(score_identity))[0, 0],
            scale.score_prescale,
            scale.scale_log2,
            pipes.q,
            pipes.do,
            sdQ=smem.dq,
        )
        n_block, seqlen_q, seqlen_k = key_block.n_block, key_block.seqlen_q, key_block.seqlen_k
        mask = AttentionMask(self.tile_m, self.tile_n, self.causal, self.local, block_info.bounds,
                             key_block.segments)
        apply_mask = functools.partial(
            mask.apply_transposed, coords0=blocks.score_coords0, thread_row=blocks.thread_origin[0],
            thread_col=blocks.thread_origin[1], n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        )
        if cutlass.const_expr(self.segments):
            apply_mask = functools.partial(apply_mask, batch=key_block.batch)
        key_tail = (n_block + 1) * self.tile_n > seqlen_k
        mask_key_tail = functools.partial(
            self.mask_key_tail, mask=mask, blocks=blocks, n_block=n_block, mSeqUsedK=mSeqUsedK,
            batch=key_block.batch, key_buffer=tma.dk.shape[0],
        )

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipes.kv.consumer_wait(kv_state)
        self.zero_rows_past((smem.k, smem.v), self.valid_rows(n_block, self.tile_n, seqlen_k, tma.k.shape[0]),
                            tidx)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # The CTA's (q head of the group, query block) pairs, flattened: `index` runs over them.
        coords = functools.partial(self.block_coords, walk=walk, head_kv=key_block.head_kv,
                                   group=key_block.group)
        # Query rows of a block inside the entry (tile_m but in a ragged entry's last block).
        valid_queries = functools.partial(self.valid_rows, tile=self.tile_m, seqlen=seqlen_q,
                                          buffer_rows=tma.q.shape[0])
        issue_scores = functools.partial(self.issue_scores, blocks=blocks, smem=smem, tidx=tidx)
        dkv_step = functools.partial(
            self.dkv_step, blocks=blocks, coords=coords, key_block=key_block, block_info=block_info,
            apply_mask=apply_mask, key_tail=key_tail, mask_key_tail=mask_key_tail, smem=smem, tidx=tidx,
            valid_queries=valid_queries,
        )
        dq_step = functools.partial(
            self.dq_step, blocks=blocks, coords=coords, key_block=key_block, block_info=block_info,
            walk=walk,
        )
        blocks_total = key_block.group * (walk.m_block_max - walk.m_block_min)
        if cutlass.const_expr(self.config.scores_ahead):
            # Rotated by half a block, so that each iteration issues block `index`'s Sᵀ, hands
            # over block index − 1's dQ while it runs, then awaits it: an in-flight WGMMA carried
            # across the loop's back edge made ptxas serialize every WGMMA (C7514).
            if blocks_total > 0:
                issue_scores(state=state, valid_rows=valid_queries(coords(0)[1]))
                dkv_step(state=state, index=0)
                for index in cutlass.range(1, blocks_total, unroll=1):
                    state.advance()
                    issue_scores(state=state, valid_rows=valid_queries(coords(index)[1]))
                    dq_step(index=index - 1)
                    dkv_step(state=state, index=index)
                dq_step(index=blocks_total - 1)
        else:
            for index in cutlass.range(blocks_total, unroll=1):
                lse_ahead = issue_scores(state=state, valid_rows=valid_queries(coords(index)[1]))
                if cutlass.const_expr(self.config.dq_during_dk):
                    dkv_step(state=state, index=index, hand_over_dq=functools.partial(dq_step, index=index),
                             lse_ahead=lse_ahead)
                else:
                    dkv_step(state=state, index=index, lse_ahead=lse_ahead)
                    dq_step(index=index)
                state.advance()

        self.epilogue(blocks, thr_mma_dk, thr_mma_dv, smem, tma, key_block, scale.softmax_scale)

    @cute.jit
    def valid_rows(self, block, tile: cutlass.Constexpr[int], seqlen, buffer_rows):
        """The rows of `block` (of `tile` rows) inside its entry: `tile`, but in the last block of
        an entry shorter than the buffer, whose rows past it are the caller's padding (a dense
        call's last block reads past the buffer's end, which the TMA fills with zeros)."""
        rows = Int32(tile)
        if seqlen < buffer_rows:
            rows = cutlass.min(rows, cutlass.max(seqlen - block * tile, 0))
        return rows

    @cute.jit
    def zero_rows_past(self, tiles, valid_rows, tidx):
        """Zeroes rows [valid_rows, rows) of shared-memory operand tiles (rows, cols; one row
        count), if the block has any: a ragged entry's padding rows, which the caller may leave
        non-finite. Their P and dS are exactly 0, but 0 · NaN is NaN in the GEMMs that read them
        (dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K, dPᵀ = V·dOᵀ); zeroed here, one block per CTA, they
        cost no pass over the operands before the call. Every MMA thread takes a share of the
        rows' 16-byte chunks (the swizzle moves whole chunks); `publish_zeros` then orders them
        before the WGMMAs."""
        rows = cute.size(tiles[0], mode=[0])
        if valid_rows < rows:
            zeros = cute.make_rmem_tensor((ZERO_CHUNK,), self.dtype)
            zeros.fill(0.0)
            for t in cutlass.range_constexpr(len(tiles)):
                chunks_per_row = cute.size(tiles[t], mode=[1]) // ZERO_CHUNK
                padding_chunks = (rows - valid_rows) * chunks_per_row
                for i in cutlass.range(tidx, padding_chunks, self.num_mma_threads, unroll=1):
                    cute.autovec_copy(zeros, cute.local_tile(tiles[t][valid_rows + i // chunks_per_row, None],
                                                             (ZERO_CHUNK,), (i % chunks_per_row,)))
            self.publish_zeros()

    def publish_zeros(self):
        """The MMA threads' zeros made visible to the WGMMAs (the async proxy) and joined, so that
        neither warp group issues a GEMM before every padding row is 0."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Barrier.PADDING, number_of_threads=self.num_mma_threads)

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
    def dkv_step(self, blocks, state, index, coords, key_block, block_info, apply_mask, key_tail,
                 mask_key_tail, smem, tidx, valid_queries, hand_over_dq=None, lse_ahead=()):
        """Block `index`'s dK/dV updates and its dQ share in blocks.acc_dq (handed over by
        `hand_over_dq` during the dK GEMM when dq_during_dk); `lse_ahead` from `issue_scores`."""
        _, m_block = coords(index)
        valid_rows = valid_queries(m_block)
        needs_mask = cutlass.Boolean(False)
        if cutlass.const_expr(block_info.has_right_bound):
            needs_mask = block_info.tile_needs_mask(m_block, key_block.n_block, key_block.seqlen_q,
                                                    key_block.seqlen_k)
        if cutlass.const_expr(self.segments):
            # Ids are compared unless every key of the block sees every row of the tile.
            spans = key_block.segments.query_blocks(key_block.batch, key_block.n_block)
            if m_block < spans.full_lo or m_block >= spans.full_hi:
                needs_mask = cutlass.Boolean(True)
        zero_padding = functools.partial(self.zero_do_padding, smem=smem, tidx=tidx, valid_rows=valid_rows)
        self.query_block(blocks, state, m_block, needs_mask, apply_mask, key_tail, mask_key_tail, zero_padding,
                         hand_over_dq, lse_ahead)

    @cute.jit
    def dq_step(self, blocks, index, coords, key_block, block_info, walk):
        """Block `index`'s dQ share (blocks.acc_dq) handed over to the dQ writers."""
        _, m_block = coords(index)
        self.accumulate_dq(blocks, m_block, key_block, block_info, walk)

    @cute.jit
    def issue_scores(self, blocks, state, smem, tidx, valid_rows):
        """Sᵀ = K·Qᵀ of the query block in `state`, issued, not awaited (Q's padding rows past
        `valid_rows` zeroed first). Returns the LSE values of the columns read ahead when they
        are read here (`lse_before_scores`), else []."""
        blocks.pipeline_q.consumer_wait(state)
        self.zero_rows_past((smem.q[None, None, state.index],), valid_rows, tidx)
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
    def zero_do_padding(self, smem, stage, tidx, valid_rows):
        """dO's padding rows past `valid_rows` in slot `stage` zeroed (`zero_rows_past`)."""
        self.zero_rows_past((smem.do[None, None, stage],), valid_rows, tidx)

    @cute.jit
    def query_block(self, blocks, state, m_block, needs_mask, apply_mask, key_tail, mask_key_tail, zero_padding,
                    hand_over_dq=None, lse_ahead=()):
        """dV and dK updates, and this query block's dQ share in blocks.acc_dq (its Sᵀ GEMM
        already issued: `issue_scores`), handed over by `hand_over_dq` when dq_during_dk;
        `zero_padding(stage=)` zeroes dO's padding rows once it has landed."""
        stage = state.index
        # Consecutive query blocks alternate dSᵀ buffers (stages is a multiple of pds_stages).
        pds_index = stage % self.config.pds_stages
        # dPᵀ = V·dOᵀ, issued behind Sᵀ.
        blocks.pipeline_do.consumer_wait(state)
        zero_padding(stage=stage)
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
            if cutlass.const_expr(self.causal or self.local or self.segments):
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
            if cutlass.const_expr(self.causal or self.local or self.segments):
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
        if cutlass.const_expr(self.config.dkv_from_registers and not self.config.dv_during_ds):
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
            cute.arch.barrier(barrier_id=Barrier.PDS, number_of_threads=self.num_mma_threads)
        cute.copy(blocks.store_pds, blocks.store_pds.retile(blocks.ds), blocks.tdSsdS[None, None, None, pds_index])
        if cutlass.const_expr(not self.config.dkv_from_registers):
            cute.copy(blocks.store_pds, blocks.store_pds.retile(blocks.p), blocks.tPsP[None, None, None, pds_index])
        # Ordinary stores must be made visible to WGMMA (async proxy) before it reads them.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Barrier.PDS, number_of_threads=self.num_mma_threads)
        release_early = self.config.release_early
        if cutlass.const_expr(not self.config.dkv_from_registers):
            wgmma_gemm(blocks.tiled_mma_dv, blocks.acc_dv, blocks.tdVrP[None, None, None, pds_index],
                      blocks.tdVrdO[None, None, None, stage], zero_init=False, wait_group=-1)
            if cutlass.const_expr(not dq_during_dk):
                issue_dk()
            if cutlass.const_expr(release_early):
                # dV has retired (dK may still run).
                warpgroup.wait_group(1)
                blocks.pipeline_do.consumer_release(state)
        wgmma_gemm(blocks.tiled_mma_dq, blocks.acc_dq, blocks.tdQrdS[None, None, None, pds_index],
                  blocks.tdQrK, zero_init=True,
                  wait_group=-1 if cutlass.const_expr(dq_during_dk or release_early) else 0)
        if cutlass.const_expr(release_early):
            # dK has retired (dQ may still run).
            warpgroup.wait_group(1)
            blocks.pipeline_q.consumer_release(state)
            warpgroup.wait_group(0)
        if cutlass.const_expr(dq_during_dk):
            issue_dk()
            # dQ (and dV) retired; dK runs through the hand-over.
            warpgroup.wait_group(1)
            hand_over_dq()
            warpgroup.wait_group(0)
        if cutlass.const_expr(not release_early):
            # Every GEMM reading this slot's Q and dO (and P, dS registers) has retired.
            blocks.pipeline_q.consumer_release(state)
            blocks.pipeline_do.consumer_release(state)

    @cute.jit
    def _query_of(self, blocks, c: cutlass.Constexpr[int]) -> Int32:
        """Row of the query tile that register column c of this thread's Sᵀ fragment holds."""
        return blocks.thread_origin[1] + blocks.score_coords0[0, c][1]

    @cute.jit
    def accumulate_dq(self, blocks, m_block, key_block, block_info, walk):
        """This block's dS·K (blocks.acc_dq) into its warp group's chunk of sdQ for the dQ
        writers, unless the tile is fully masked (no add: `_dq_turn`).

        The writers add the chunks into mdQaccum, in deterministic mode in each query block's
        fixed key-block order (`_dq_turn`): key blocks wait only for ones the grid launched
        earlier (lower key blocks, or under a mask the higher ones, launched first), so the
        chain cannot deadlock.
        """
        adds, _ = self._dq_turn(block_info, m_block, key_block, walk)
        if adds:
            # This warp group's chunk: wait until the writer has read it, fill it, hand it over.
            mma_thread, chunk = self._mma_thread_chunk()
            cute.arch.barrier(barrier_id=self._dq_barrier_id(DQ_EMPTY, chunk),
                              number_of_threads=self._dq_sync_threads())
            cute.autovec_copy(blocks.acc_dq, fragment_order_view(
                blocks.sdQ.iterator, blocks.acc_dq.shape, mma_thread, len(self.mma_warp_groups)))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=self._dq_barrier_id(DQ_FULL, chunk),
                                     number_of_threads=self._dq_sync_threads())

    @cute.jit
    def _mma_thread_chunk(self):
        """(this thread's index among the MMA threads, its warp group's sdQ chunk), read afresh
        rather than kept live through the main loop."""
        tidx, _, _ = cute.arch.thread_idx()
        mma_thread = tidx - THREADS_PER_WARP_GROUP
        return mma_thread, cute.arch.make_warp_uniform(mma_thread // THREADS_PER_WARP_GROUP)

    def _dq_sync_threads(self) -> int:
        """Threads on one hand-over barrier: the MMA threads filling its chunk and a writer warp."""
        return self.num_mma_threads // len(self.mma_warp_groups) + THREADS_PER_WARP

    @staticmethod
    def _dq_barrier_id(ids, chunk):
        """ids[chunk] for a chunk known only at run time (an MMA thread's warp group)."""
        return ids[0] + (ids[1] - ids[0]) * chunk

    @cute.jit
    def _dq_turn(self, block_info, m_block, key_block, walk):
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
        n_block = key_block.n_block
        adds = cutlass.Boolean(True)
        turn = n_block
        if cutlass.const_expr(block_info.has_right_bound or self.segments):
            n_block_lo, n_block_hi = block_info.n_block_range(m_block, key_block.seqlen_q, key_block.seqlen_k)
            if cutlass.const_expr(self.segments):
                # The key blocks the forward visits for this query block: the adding ones.
                spans = key_block.segments.key_blocks(key_block.batch, m_block)
                n_block_lo = cutlass.max(n_block_lo, spans.lo)
                n_block_hi = cutlass.min(n_block_hi, spans.hi)
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
        # Segments kernels count turns over a query block's span of key blocks (`_dq_turn`).
        if cutlass.const_expr(not (self.causal or self.local or self.segments)):
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
    def dq_writer(self, mdQaccum, sdQ, mSemaphore, key_block, walk, deterministic, block_info, num_heads,
                  writer: cutlass.Constexpr[int]):
        """One warp walks the MMA warp groups' query blocks and, for each that this key block adds
        into, reduce-adds each warp group's chunk of sdQ into mdQaccum with one bulk reduce, in
        turn when deterministic, the turn then passed on once the add is complete. sdQ is free
        again once read. With dq_writers = n > 1 this is writer `writer` of n, taking every n-th
        add. Deterministic, the turns alternate between mdQaccum's copies (`_dq_copy`) and each
        copy's first turn stores instead of adding (the preprocess left the copies unzeroed)."""
        lane = cute.arch.lane_idx()
        writers = self.config.dq_writers
        chunks = len(self.mma_warp_groups)
        batch = key_block.batch
        # A token barrier joins a writer (syncing) and its predecessor (arriving).
        token_threads = 2 * THREADS_PER_WARP
        adds_seen = Int32(0)
        # sdQ starts empty; the MMA warp groups consume this arrival at their first hand-over
        # (every later one follows a read; the last is consumed in their epilogue).
        if cutlass.const_expr(writer == 0):
            for chunk in cutlass.range_constexpr(chunks):
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY[chunk], number_of_threads=self._dq_sync_threads())
        for head_in_group in cutlass.range(key_block.group, unroll=1):
            head = key_block.head_kv * key_block.group + head_in_group
            for step in cutlass.range(walk.m_block_max - walk.m_block_min, unroll=1):
                m_block = self._m_block_at(walk, step)
                adds, turn = self._dq_turn(block_info, m_block, key_block, walk)
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
                                cute.arch.barrier(barrier_id=DQ_TOKEN[writer], number_of_threads=token_threads)
                        for chunk in cutlass.range_constexpr(chunks):
                            cute.arch.barrier(barrier_id=DQ_FULL[chunk], number_of_threads=self._dq_sync_threads())
                            if cutlass.const_expr(chunk == 0):
                                if deterministic != 0:
                                    if lane == 0:
                                        self._wait_for_turn(self._semaphore(mSemaphore, copy, batch, head, m_block), copy_turn)
                                    cute.arch.sync_warp()
                                    # The previous key block's adds (acquired above) precede this one.
                                    cute.arch.fence_proxy("async.global")
                                elif cutlass.const_expr(self._default_stores_first()):
                                    claimed = self._claim_store(self._semaphore(mSemaphore, 0, batch, head, m_block), lane)
                            chunk_elems = cute.cosize(sdQ.layout) // chunks
                            if lane == 0:
                                dst = _elem_ptr(mdQaccum, (copy, batch, head, m_block * self.tile_m, 0)) + chunk * chunk_elems
                                src = sdQ.iterator + chunk * chunk_elems
                                stores = cutlass.Boolean(False)
                                if deterministic != 0:
                                    stores = copy_turn == 0
                                if cutlass.const_expr(self._default_stores_first()):
                                    if deterministic == 0:
                                        stores = claimed
                                if stores:
                                    _bulk_f32(dst, src, chunk_elems * Float32.width // 8, add=False)
                                else:
                                    _bulk_f32(dst, src, chunk_elems * Float32.width // 8, add=True)
                            cute.arch.cp_async_bulk_commit_group()
                        for chunk in cutlass.range_constexpr(chunks):
                            # Chunk `chunk` has been read once at most chunks − 1 − chunk
                            # younger groups are pending.
                            cute.arch.cp_async_bulk_wait_group(chunks - 1 - chunk, read=True)
                            cute.arch.barrier_arrive(barrier_id=DQ_EMPTY[chunk], number_of_threads=self._dq_sync_threads())
                        if cutlass.const_expr(writers > 1):
                            cute.arch.barrier_arrive(barrier_id=DQ_TOKEN[(writer + 1) % writers], number_of_threads=token_threads)
                        if deterministic != 0:
                            self._pass_turn(mSemaphore, copy, batch, head, m_block, lane)
                        elif cutlass.const_expr(self._default_stores_first()):
                            if claimed:
                                self._publish_store(self._semaphore(mSemaphore, 0, batch, head, m_block), lane)
                    if cutlass.const_expr(writers > 1):
                        adds_seen += 1
        if cutlass.const_expr(writers > 1):
            # The last add's token, taken by the writer whose turn the next add would be: every
            # arrival on the token barriers is matched before the CTA exits.
            if adds_seen > 0:
                if adds_seen % writers == writer:
                    cute.arch.barrier(barrier_id=DQ_TOKEN[writer], number_of_threads=token_threads)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _dq_copy(self, mdQaccum, turn, deterministic):
        """(the copy of mdQaccum an add of turn `turn` goes to, its turn among that copy's adds).

        Deterministic with two copies (the router's dq_copies rule), consecutive turns
        alternate, so an add waits for the add two turns back, not the one just before it: a
        chain then moves at the slower of a step and half an add's round trip
        (docs/perf-log.md, "two accumulators at d192/d256")."""
        copy, copy_turn = Int32(0), turn
        if deterministic != 0:
            # Exact for 1 and 2 copies (BWD_MAX_DQ_COPIES).
            shift = mdQaccum.shape[0] - 1
            copy, copy_turn = turn & shift, turn >> shift
        return copy, copy_turn

    def _default_stores_first(self) -> bool:
        """Default mode: the first add into a query block stores (TileConfig.default_stores_first),
        so the preprocess need not zero mdQaccum (the postprocess skips blocks no add reached)."""
        return self.config.default_stores_first

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
        (head, m_block) on to the next key block (every lane fences, then one releases). Passing
        it only after the next add is issued, so that the round trip overlaps a step, was 2-26%
        slower: docs/perf-log.md, "the deterministic cost split"."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.atomic_add(self._semaphore(mSemaphore, copy, batch, head, m_block), Int32(1), sem="release", scope="gpu")

    def _descending_turns(self) -> bool:
        """Deterministic dQ adds go from the highest key block down under a causal/local mask:
        a CTA's first query block (its diagonal) then has it as the first contributor, instead of
        waiting for every lower key block to walk down to it (docs/perf-log.md, "Backward v1")."""
        return self.causal or self.local

    @cute.jit
    def _is_first_mma_warp(self) -> cutlass.Boolean:
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.mma_warp_groups[0] * 4

    @cute.jit
    def epilogue(self, blocks, thr_mma_dk, thr_mma_dv, smem, tma, key_block, softmax_scale):
        """dK·softmax_scale and dV: registers -> K's and V's shared buffers -> TMA stores."""
        dk_out = cute.make_rmem_tensor_like(blocks.acc_dk, self.dtype)
        dk_out.store((blocks.acc_dk.load() * softmax_scale).to(self.dtype))
        dv_out = cute.make_rmem_tensor_like(blocks.acc_dv, self.dtype)
        dv_out.store(blocks.acc_dv.load().to(self.dtype))
        # The dQ writer's last arrival (after its last read of sdQ): every arrival on the
        # barrier is matched before the CTA exits.
        _, chunk = self._mma_thread_chunk()
        cute.arch.barrier(barrier_id=self._dq_barrier_id(DQ_EMPTY, chunk),
                          number_of_threads=self._dq_sync_threads())
        # Both warp groups' GEMMs reading K and V have retired (each waits for its own).
        cute.arch.barrier(barrier_id=Barrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        cute.autovec_copy(dk_out, thr_mma_dk.partition_C(smem.k))
        cute.autovec_copy(dv_out, thr_mma_dv.partition_C(smem.v))
        # Ordinary stores must be made visible to the TMA (async proxy) before the store is issued.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Barrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        if self._is_first_mma_warp():
            no_cluster = cute.make_layout(1)
            n_block, head_kv, batch = key_block.n_block, key_block.head_kv, key_block.batch
            gdK = cute.local_tile(tma.dk[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
            gdV = cute.local_tile(tma.dv[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
            tdKsdK_tma, tdKgdK = cpasync.tma_partition(
                tma.atom_dk, 0, no_cluster, cute.group_modes(smem.k, 0, 2), cute.group_modes(gdK, 0, 2)
            )
            tdVsdV_tma, tdVgdV = cpasync.tma_partition(
                tma.atom_dv, 0, no_cluster, cute.group_modes(smem.v, 0, 2), cute.group_modes(gdV, 0, 2)
            )
            cute.copy(tma.atom_dk, tdKsdK_tma, tdKgdK)
            cute.copy(tma.atom_dv, tdVsdV_tma, tdVgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
