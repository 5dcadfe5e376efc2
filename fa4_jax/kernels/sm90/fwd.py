"""FlashAttention forward for Hopper (sm_90a): TMA loads, WGMMA, online softmax in registers.

A CTA computes (tile_m query rows, head, batch) tiles of O and LSE: one per CTA, or, with the
persistent "lpt" scheduler (kernels/common/tile_scheduler.py), a strided share of all tiles in
longest-first order, its pipelines carrying from tile to tile. The warp roles are `ROLES`:

- the producer warp group's first warp issues TMA for each tile's Q, and for K and V blocks
  through a `kv_stages`-deep ring of mbarrier-guarded shared-memory buffers; the rest of the
  group idles at a low register budget.
- each MMA warp group owns 64 of the tile's rows. S = Q·Kᵀ by WGMMA from shared memory, mask and
  online softmax in registers, then O += P·V with P fed straight from registers as the WGMMA A
  operand, so S and P never touch shared memory. Within a warp group the GEMMs of block j
  (S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}) are issued together and the softmax of S_j runs while
  O's GEMM is still in flight (intra-warp-group overlap); between the warp groups, named
  barriers pass GEMM issue round in order so one group's softmax overlaps the others' GEMMs
  (ping-pong).
- epilogue (the MMA warp groups): O / ℓ to shared memory (Q's buffer, or O's own with
  `separate_o`), one TMA store; LSE written per row by the lane that holds the row's first
  columns. Q's buffer goes back to the producer once nothing reads it any more.

Key blocks are visited from the highest to the lowest so the first block carries the sequence
tail and the causal diagonal; the tail mask, the causal/window masks and the unmasked middle run
in separate loops (block_info.py) so the common case does no per-element mask work.

Ragged batches: each tile reads its batch entry's valid lengths (mSeqUsedQ, mSeqUsedK; a dense
call passes them empty and the buffers' sizes serve, common/ragged.py) and they, not the buffers'
sizes, bound its key blocks, masks and offset, so the padding keys are masked like a sequence tail
(and their V rows zeroed in shared memory); rows past the entry's length come out 0 with LSE −inf.
The tile schedule stays on the buffers' sizes: a tile wholly past the length visits no key block
and only writes those zeros.

Segment ids (a `segments` kernel; kernels/common/segments.py): a tile's key blocks are also
narrowed to the hull of the keys its rows share a segment with (the load warp and the MMA warp
groups walk the same range, `_Problem.visited_blocks`), the unmasked loop to the blocks all of
its rows see whole, and the mask on the other blocks compares ids (`mma_segment_blocks`), loaded
before the block's S GEMM is awaited and skipped on blocks inside the full span (`TileMask`). The
narrowed first blocks of the routed tunings assume the mask's own range: segments kernels run
the default tuning. A `mask_array` kernel walks a boolean mask's span tables the same way and
tests the mask's bits where a segments kernel compares ids; it runs the masked tile settings.
"""
import dataclasses
import enum
import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from fa4_jax.kernels.common.block_info import BlockInfo, MaskBounds
from fa4_jax.kernels.common.layouts import (
    acc_as_operand_a, acc_prefix, acc_rows_cols, convert_pairs, opaque_int32, permute_modes,
)
from fa4_jax.kernels.common.mask import AttentionMask, TileMask
from fa4_jax.kernels.common.ragged import entry_length
from fa4_jax.kernels.common.segments import SegmentIds
from fa4_jax.kernels.common.softmax import OnlineSoftmax, SoftmaxConfig, scale_rows, score_scales
from fa4_jax.kernels.common.tile_scheduler import TileScheduler
from fa4_jax.kernels.sm90 import hardware
from fa4_jax.kernels.sm90.operands import smem_layout, swizzled_tensor, tma_pipeline, wgmma_gemm


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One head dim's static kernel shape and FA4 settings. The defaults are the shipped values
    that most head dims share; TILE_CONFIGS says where and why an entry differs."""

    # MMA warp groups of 64 query rows each (tile_m = 64 · mma_warp_groups).
    mma_warp_groups: int = 2
    # Keys per block, and the depth of the K/V ring.
    tile_n: int = 128
    kv_stages: int = 2
    # GEMM issue passed round the MMA warp groups (ping-pong).
    pingpong: bool = True
    softmax: SoftmaxConfig = SoftmaxConfig()
    # Tile order without a mask (kernels/common/tile_scheduler.py). Under a causal/local mask
    # the masked_* fields replace their unmasked twins (MASKED_FIELDS, `for_mask`); None: the
    # same as without a mask.
    scheduler: str = "linear"
    masked_scheduler: str = "lpt_grid"
    masked_pingpong: bool = True
    masked_tile_n: int | None = None
    # O staged in its own shared buffer instead of Q's. Q's buffer then frees once the tile's
    # last Q·Kᵀ GEMM retires, so a persistent CTA loads the next tile's Q during the last P·V
    # and the epilogue. Costs tile_m·dv·2 bytes of shared memory (d128: 32 KB).
    separate_o: bool = False
    # An MMA warp group whose 64 rows all lie past the entry's query rows (the last m-block of a
    # sequence that tile_m does not divide) skips its GEMMs and softmax and only keeps the
    # pipelines' and ping-pong's barriers in step (`mma_tile_skipped`).
    skip_padded_groups: bool = False
    # The wait for block j-1's P·V GEMM inside both arms of O's rescale branch, not before the
    # branch: ptxas schedules within a basic block, so there the wait stays below the whole
    # softmax of block j, which then runs under the GEMM; before the branch ptxas hoists it by
    # an amount that code far from the loop decides (docs/perf-log.md, "The P·V wait pinned in
    # O's rescale branch").
    pv_wait_in_branch: bool = False
    masked_pv_wait_in_branch: bool | None = None
    # Without a mask: the call's last key block holds at most this many keys, so the tile's
    # first block, that tail, is computed that wide (its S GEMM, mask, softmax and P·V k16
    # steps); 0: at the full tile_n. Static, because a WGMMA under a runtime branch between
    # widths made ptxas serialize every WGMMA (C7511): the router picks the variant by a dense
    # call's key count. A multiple of 16; masked kernels keep the full width.
    tail_keys: int = 0
    # Causal, 128 x 128 tiles of two MMA warp groups, a block-aligned diagonal: the first
    # group's diagonal block is computed 64 keys wide (its rows see none of the block's last
    # 64 keys), in the first group's own copy of the tile loop. Softcap kernels keep the full
    # width: d64's fp16 one serialized every WGMMA with it (C7511).
    first_group_diagonal: bool = False

    @property
    def tile_m(self) -> int:
        return ROWS_PER_WARP_GROUP * self.mma_warp_groups

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


# Query rows of one MMA warp group's WGMMA (M = 64).
ROWS_PER_WARP_GROUP = 64
# Elements of one 16-byte shared-memory store (16-bit types): a ragged entry's V rows are zeroed in
# these (`zero_v_past_keys`).
V_ZERO_CHUNK = 8
# TileConfig fields that a causal/local mask may set apart: field -> its masked twin. A tuning
# of the field's name sets both.
MASKED_FIELDS = {"scheduler": "masked_scheduler", "pingpong": "masked_pingpong", "tile_n": "masked_tile_n",
                 "pv_wait_in_branch": "masked_pv_wait_in_branch"}
SOFTMAX_FIELDS = tuple(f.name for f in dataclasses.fields(SoftmaxConfig))
# What a tuning (kernels/sm90/menu.py, benchmarks/ablations.py) may override: the softmax's
# settings and the TileConfig fields of the same name.
TUNING_KNOBS = SOFTMAX_FIELDS + tuple(f.name for f in dataclasses.fields(TileConfig) if f.name != "softmax")
# setmaxnreg budget of each MMA thread by MMA warp-group count: the register file less the
# producer group's 128 · 24, shared by the MMA threads, rounded down to a multiple of 8, and at
# most 240 (a thread may not hold more than 255).
MMA_REGISTERS = {1: 240, 2: 240, 3: 160}

# Keyed by (head_dim, head_dim_v); shared memory bounds tile_n and the ring depth
# (`TileConfig.smem_bytes`, checked at construction). Each entry's reason, and the measurements
# behind it, are in docs/perf-log.md under the section named.
TILE_CONFIGS = {
    # Three MMA warp groups, FlashAttention-3's d64 shape ("Forward v3 defaults and backward
    # tunings, measured together"); padded groups skip their GEMMs ("Padded warp groups skip
    # their GEMMs: d64's default now").
    (64, 64): TileConfig(mma_warp_groups=3, kv_stages=3, skip_padded_groups=True),
    # d64's shape at half the width, for small models ("Every head dim: served zero-padded").
    (32, 32): TileConfig(mma_warp_groups=3, kv_stages=3, skip_padded_groups=True),
    # d96's shape for DiTs' and Phi-2's d80 ("Every head dim: served zero-padded").
    (80, 80): TileConfig(kv_stages=3, pv_wait_in_branch=True),
    # d128's shape with the three-stage ring its 48 KB stage leaves room for ("d96 forward: the
    # table entry measured"); P·V wait pinned ("d96's P·V wait pinned: adopted").
    (96, 96): TileConfig(kv_stages=3, pv_wait_in_branch=True),
    # 176-key blocks without a mask ("Forward: wider key blocks"); under a mask 128 keys, no
    # ping-pong ("Forward: ping-pong off under a causal mask, with the LPT order") and the P·V
    # wait pinned ("The P·V wait pinned in O's rescale branch").
    (128, 128): TileConfig(tile_n=176, masked_tile_n=128, masked_pingpong=False,
                           masked_pv_wait_in_branch=True),
    # d128's registers on an 80 KB K/V stage; P·V wait pinned without a mask only ("d192's
    # tile-table entry measured: the default holds").
    (192, 128): TileConfig(pv_wait_in_branch=True, masked_pv_wait_in_branch=False),
    # d192/dv128's shape on a 80 KB stage for U-Nets' and DiTs' d160, which d256's kernel
    # serves only at 0.73-0.90x cuDNN's forward ("Every head dim: served zero-padded").
    (160, 160): TileConfig(pv_wait_in_branch=True, masked_pv_wait_in_branch=False),
    # 64-key blocks, ping-pong off without a mask (on under one, the masked default),
    # FlashAttention-3's choice ("d256 forward: ping-pong and 80-key blocks, now that both fit").
    (256, 256): TileConfig(tile_n=64, pingpong=False),
}
# On top of TileConfig.smem_bytes come the barriers (under 1 KB for any ring depth up to 31),
# padded to the 1 KB alignment of the first buffer; every buffer's size is itself a multiple of
# 1 KB.
_SMEM_MARGIN = 1024


class Barrier(enum.IntEnum):
    """Named barriers (0 is __syncthreads)."""

    # Every MMA thread: around the epilogue, and after a ragged entry's padding V rows are
    # zeroed (every MMA thread passes both in the same order).
    MMA_SYNC = 1
    # GEMM-issue turns: MMA warp group g waits on PINGPONG + g (2, 3 and 4 for three groups).
    PINGPONG = 2


@dataclasses.dataclass(frozen=True)
class Roles:
    """The warp-role table: warp group 0 produces, the ones after it compute."""

    producer_warp_group: int = 0
    load_warp: int = 0  # of the producer warp group; its other warps idle
    producer_registers: int = 24  # setmaxnreg budget of the producer group's threads


ROLES = Roles()
THREADS_PER_WARP_GROUP = 128


@dataclasses.dataclass(frozen=True)
class _Tma:
    """Each TMA atom with the global tensor (in the kernel's (s, d, heads, batch) view) it moves."""

    atom_q: cute.CopyAtom
    q: cute.Tensor
    atom_k: cute.CopyAtom
    k: cute.Tensor
    atom_v: cute.CopyAtom
    v: cute.Tensor
    atom_o: cute.CopyAtom
    o: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _Smem:
    """The CTA's shared buffers: Q, the K/V ring, and O (Q's buffer unless separate_o)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _Pipelines:
    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


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
    # Segment ids and their span tables (a segments kernel's), else None.
    segments: SegmentIds | None = None

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

    def key_blocks(self, scheduler: TileScheduler, block_info: BlockInfo, i: Int32):
        """The i-th tile's (m_block, seqlen_q, seqlen_k, n_block_min, n_block_max): its entry's
        lengths and the range of key blocks it visits."""
        m_block, _, batch = self.tile(scheduler, i)
        seqlen_q, seqlen_k = self.seqlens(batch)
        n_block_min, n_block_max = self.visited_blocks(block_info, m_block, batch, seqlen_q, seqlen_k)
        return m_block, seqlen_q, seqlen_k, n_block_min, n_block_max

    @cute.jit
    def visited_blocks(self, block_info: BlockInfo, m_block: Int32, batch: Int32, seqlen_q: Int32,
                       seqlen_k: Int32):
        """[n_block_min, n_block_max): the mask's key blocks of query tile m_block, narrowed with
        segment ids to those that share a segment with it (the load warp and the MMA warp
        groups walk the same blocks)."""
        n_block_min, n_block_max = block_info.n_block_range(m_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(self.segments is not None):
            spans = self.segments.key_blocks(batch, m_block)
            n_block_min = cutlass.max(n_block_min, spans.lo)
            n_block_max = cutlass.max(cutlass.min(n_block_max, spans.hi), n_block_min)
        return n_block_min, n_block_max


class FlashAttentionForwardSm90:
    def __init__(self, dtype, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool,
                 segments: bool = False, mask_array: bool = False, **tuning):
        """`tuning` overrides the tile table's settings: any of TUNING_KNOBS (the SoftmaxConfig
        and TileConfig fields of the same name). `segments`: the kernel reads segment ids and
        their span tables (kernels/common/segments.py); `mask_array`, a segments kernel that
        also reads a boolean mask's bits."""
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
        if mask_array and not segments:
            raise ValueError("a mask_array kernel is a segments kernel (it walks the mask's span tables)")
        self.segments = segments
        self.mask_array = mask_array
        config = TILE_CONFIGS[(head_dim, head_dim_v)]
        softmax_tuning = {k: type(getattr(config.softmax, k))(tuning[k])
                          for k in SOFTMAX_FIELDS if k in tuning}
        knobs = {k: tuning[k] for k in TUNING_KNOBS if k in tuning and k not in SOFTMAX_FIELDS}
        knobs.update({MASKED_FIELDS[k]: tuning[k] for k in MASKED_FIELDS if k in tuning})
        config = dataclasses.replace(
            config, softmax=dataclasses.replace(config.softmax, **softmax_tuning), **knobs
        )
        if config.mma_warp_groups not in MMA_REGISTERS:
            raise ValueError(f"{config}: 1 to 3 MMA warp groups")
        # Both ping-pong settings: an ablation row compiles its tuning at both masks.
        if (config.pingpong or config.masked_pingpong) and config.mma_warp_groups == 1:
            raise ValueError(f"{config}: ping-pong needs two or more MMA warp groups")
        # A mask array is a mask: its kernels take the masked settings (128-key blocks at d128,
        # heavy tiles first), which causal-shaped masks, the common kind, want.
        config = config.for_mask(self.causal or self.local or mask_array)
        if config.tile_n % 16 or not 16 <= config.tile_n <= 256:
            raise ValueError(f"{config}: tile_n must be a multiple of 16 (P·V's k16 blocks), at most 256")
        if not 0.0 <= config.softmax.exp2_poly_share <= 1.0 or config.softmax.rescale_threshold < 0.0:
            raise ValueError(f"bad softmax tuning {config.softmax}")
        self.config = config
        if config.smem_bytes(head_dim, head_dim_v) + _SMEM_MARGIN > hardware.SMEM_BYTES:
            raise ValueError(f"{config} needs more than {hardware.SMEM_BYTES} bytes of shared memory")
        self.tile_m, self.tile_n, self.kv_stages = config.tile_m, config.tile_n, config.kv_stages
        self.scheduler = TileScheduler(
            config.scheduler,
            self.tile_m, reverse_m=self.causal or self.local or mask_array,
            kv_bytes_per_key=(head_dim + head_dim_v) * dtype.width // 8,
            num_sms=hardware.NUM_SMS,
        )
        # The tail block's width; 0 where it is the full tile_n (always under a mask).
        self.tail_keys = 0 if self.causal or self.local else config.tail_keys
        if config.tail_keys % 16 or config.tail_keys < 0 or self.tail_keys >= config.tile_n:
            raise ValueError(f"{config}: tail_keys must be a multiple of 16 (P·V's k step) below tile_n")
        if self.tail_keys and config.skip_padded_groups:
            raise ValueError(f"{config}: tail_keys is not implemented with skip_padded_groups")
        # The first MMA warp group's diagonal width; 0 where it is the full tile_n.
        narrow_diagonal = self.causal and config.first_group_diagonal and not has_softcap
        self.diagonal_keys = ROWS_PER_WARP_GROUP if narrow_diagonal else 0
        if self.diagonal_keys and not config.tile_m == config.tile_n == 128:
            raise ValueError(f"{config}: first_group_diagonal needs 128 x 128 tiles of two MMA warp groups")
        # The narrowed first blocks assume that the key blocks a tile visits are the mask's.
        if segments and (self.tail_keys or self.diagonal_keys):
            raise ValueError(f"{config}: tail_keys and first_group_diagonal are not implemented "
                             "with segment ids")
        self.pingpong = config.pingpong
        self.mma_warp_groups = tuple(range(1, config.mma_warp_groups + 1))
        self.mma_registers = MMA_REGISTERS[config.mma_warp_groups]
        self.num_mma_threads = len(self.mma_warp_groups) * THREADS_PER_WARP_GROUP
        self.num_threads = self.num_mma_threads + THREADS_PER_WARP_GROUP

    def qk_tiled_mma(self, keys: int) -> cute.TiledMma:
        """S = Q·Kᵀ over `keys` keys: one 64 x keys WGMMA per MMA warp group, both operands
        K-major in shared memory."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (len(self.mma_warp_groups), 1, 1), (ROWS_PER_WARP_GROUP, keys),
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

        assert SharedStorage.size_in_bytes() <= hardware.SMEM_BYTES, (
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
        stream: cuda.CUstream,
    ):
        """mQ [b, sq, h, d], mK [b, sk, hk, d], mV [b, sk, hk, dv], mO [b, sq, h, dv], mLSE [b, h, sq],
        mSeqUsedQ / mSeqUsedK [b] int32: each entry's valid query rows and keys; [0] for a
        dense batch (the buffers' sizes).

        Rows past an entry's valid ones get O = 0 and LSE = −inf; keys past its valid ones are
        masked like the sequence tail, and the V rows of those inside the last key block read
        are zeroed in shared memory (`zero_v_past_keys`), so K and V padding may hold anything.
        Q's padding must be finite (the caller zeroes it): a padding row's NaN would reach its
        O through the rescale by 0. top_left: 1 aligns the mask to the top-left corner.

        mQSegmentIds [b, sq], mKSegmentIds [b, sk] int32 and the span tables mRowSpans
        [b, ceil(sq / 64), 4], mKeySpans [b, ceil(sk / 64), 4] (fa4_jax/abi/segment_layout.py): read
        by a segments kernel (a row sees only keys of its own id; key blocks that share no
        segment with a tile are skipped), empty and unread otherwise. mMaskBits [b, sq,
        ceil(sk / 32)] int32: a boolean mask's bits (kernels/common/segments.py), read by a
        mask_array kernel, whose span tables are the mask's."""
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

        score_prescale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)

        grid = self.scheduler.grid(cute.size(mQ.shape[0]), cute.size(mK.shape[0]), cute.size(mQ.shape[2]),
                                   cute.size(mK.shape[2]), cute.size(mQ.shape[3]))
        # Only a segments kernel takes the ids and tables (None: no kernel parameter at all).
        segment_tensors = (mQSegmentIds, mKSegmentIds, mRowSpans) if self.segments else (None, None, None)
        mask_bits = mMaskBits if self.mask_array else None
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            mLSE, mSeqUsedQ, mSeqUsedK, sQ_layout, sK_layout, sV_layout, sO_layout,
            score_prescale, scale_log2, window_left, window_right, top_left, *segment_tensors, mask_bits,
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
        top_left: Int32,
        mQSegmentIds: cute.Tensor | None,
        mKSegmentIds: cute.Tensor | None,
        mRowSpans: cute.Tensor | None,
        mMaskBits: cute.Tensor | None,
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
        pipes = _Pipelines(
            q=tma_pipeline(storage.mbar_q, 1, q_arrivals, self.tma_bytes_q),
            k=tma_pipeline(storage.mbar_k, self.kv_stages, mma_warps, self.tma_bytes_k),
            v=tma_pipeline(storage.mbar_v, self.kv_stages, mma_warps, self.tma_bytes_v),
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        smem = _Smem(
            q=swizzled_tensor(storage.sQ, sQ_layout),
            k=swizzled_tensor(storage.sK, sK_layout),
            v=swizzled_tensor(storage.sV, sV_layout),
            o=swizzled_tensor(storage.sO if self.config.separate_o else storage.sQ, sO_layout),
        )
        tma = _Tma(tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, tma_atom_o, mO)
        segments = None
        if cutlass.const_expr(self.segments):
            # The forward reads no key spans: its walk is over key blocks of a query tile.
            segments = SegmentIds(self.tile_m, self.tile_n, mQSegmentIds, mKSegmentIds, mRowSpans, None,
                                  mMaskBits)
        problem = _Problem(mQ.shape[0], mK.shape[0], mQ.shape[2], mK.shape[2], mQ.shape[3], mSeqUsedQ, mSeqUsedK,
                           segments)
        bounds = MaskBounds(window_left, window_right, top_left if self.causal or self.local else None)
        block_info = BlockInfo(self.tile_m, self.tile_n, self.causal, self.local, bounds)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warp_group = cute.arch.make_warp_uniform(warp_idx // 4)
        if warp_group == ROLES.producer_warp_group:
            cute.arch.setmaxregister_decrease(ROLES.producer_registers)
            if warp_idx == ROLES.load_warp:
                self.load(tma, smem, pipes, problem, block_info)
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            tidx, _, _ = cute.arch.thread_idx()
            self.mma(tiled_mma_qk, tiled_mma_pv, tidx - THREADS_PER_WARP_GROUP, smem, tma, mLSE, pipes,
                     problem, block_info, score_prescale, scale_log2)

    @cute.jit
    def load(self, tma, smem, pipes, problem, block_info):
        """One warp: for each of the CTA's tiles, Q and the first K (Q first when the CTA has one
        tile: its latency then overlaps the two dependent loads of the entry's lengths that the
        first K's block index needs; K first in a persistent CTA, where Q's buffer may still hold
        the previous tile's O), then V and the other K/V blocks from the highest down.

        The pipeline states carry across tiles, in step with the MMA warp groups' (same tile
        sequence, same block count per tile)."""
        no_cluster = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        q_first = not self.scheduler.persistent
        for tile_i in cutlass.range(problem.tile_count(self.scheduler), unroll=1):
            m_block, head, batch = problem.tile(self.scheduler, tile_i)
            head_kv = head // (problem.num_heads // problem.num_heads_kv)
            gQ = cute.local_tile(tma.q[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma.atom_q, 0, no_cluster, cute.group_modes(smem.q, 0, 2), cute.group_modes(gQ, 0, 2))
            load_q = functools.partial(self.load_q, tma.atom_q, tQgQ, tQsQ, pipes.q)
            if cutlass.const_expr(q_first):
                load_q(q_state)
                q_state.advance()
                # A scheduling fence for ptxas: without it the Q load was placed after the
                # lengths' arithmetic, in order behind the wait for their loads.
                cute.arch.sync_warp()
            seqlen_q, seqlen_k = problem.seqlens(batch)
            n_block_min, n_block_max = problem.visited_blocks(block_info, m_block, batch, seqlen_q, seqlen_k)
            gK = cute.local_tile(tma.k[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(tma.v[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(tma.atom_k, 0, no_cluster, cute.group_modes(smem.k, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma.atom_v, 0, no_cluster, cute.group_modes(smem.v, 0, 2), cute.group_modes(gV, 0, 2))

            n_blocks = n_block_max - n_block_min
            # In a persistent CTA the first K goes out before Q: Q's buffer frees only once the
            # previous tile's O has been stored from it (or, with separate_o, its last Q·Kᵀ GEMM
            # retired), and the K load need not wait for that.
            if n_blocks > 0:
                pipes.k.producer_acquire(kv_state)
                cute.copy(tma.atom_k, tKgK[None, n_block_max - 1], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipes.k.producer_get_barrier(kv_state))
            if cutlass.const_expr(not q_first):
                load_q(q_state)
                q_state.advance()
            if n_blocks > 0:
                pipes.v.producer_acquire(kv_state)
                cute.copy(tma.atom_v, tVgV[None, n_block_max - 1], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipes.v.producer_get_barrier(kv_state))
                kv_state.advance()
            for i in cutlass.range(n_blocks - 1, unroll=1):
                n_block = n_block_max - 2 - i
                pipes.k.producer_acquire(kv_state)
                cute.copy(tma.atom_k, tKgK[None, n_block], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipes.k.producer_get_barrier(kv_state))
                pipes.v.producer_acquire(kv_state)
                cute.copy(tma.atom_v, tVgV[None, n_block], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipes.v.producer_get_barrier(kv_state))
                kv_state.advance()

    @staticmethod
    def load_q(tma_atom_q, tQgQ, tQsQ, pipeline_q, q_state):
        """One tile's Q into its buffer, once the buffer is free (the caller advances q_state)."""
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, tidx, smem, tma, mLSE, pipes, problem, block_info,
            score_prescale, scale_log2):
        warp_group = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARP_GROUP)
        # WGMMA descriptors are per warp group; register fragments are per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(warp_group * THREADS_PER_WARP_GROUP)
        wg_mma_pv = tiled_mma_pv.get_slice(warp_group * THREADS_PER_WARP_GROUP)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)

        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(smem.q))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(smem.k))
        # V viewed as (dv, tile_n): the P·V B operand, MN-major over the same swizzled tiles.
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(permute_modes(smem.v, (1, 0, 2))))
        acc_o = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)))
        acc_o_rc = acc_rows_cols(acc_o)
        score_identity = cute.make_identity_tensor((self.tile_m, self.tile_n))
        score_coords0 = acc_rows_cols(tiled_mma_qk.get_slice(0).partition_C(score_identity))
        thread_origin = acc_rows_cols(thr_mma_qk.partition_C(score_identity))[0, 0]

        softmax = OnlineSoftmax.create(self.config.softmax, scale_log2, cute.size(acc_o_rc, mode=[0]))
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        mask = AttentionMask(self.tile_m, self.tile_n, self.causal, self.local, block_info.bounds,
                             problem.segments)
        acc_s = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)))
        p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        blocks = _BlockOperands(
            tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, acc_s, p, acc_o, acc_o_rc,
            softmax, row_scale, pipes.k, pipes.v, score_prescale,
        )
        step = functools.partial(self.mma_overlapped_block, blocks, warp_group)
        # The tile's first block and, in the second block's step, its P·V (TileConfig.tail_keys).
        first_blocks, first_step = blocks, None
        if cutlass.const_expr(self.tail_keys):
            first_blocks = self.narrow_operands(blocks, warp_group, tidx, smem, self.tail_keys)
            first_step = functools.partial(step, pv_k_blocks=self.tail_keys // 16)
        # The first group's narrowed diagonal and its P·V step (TileConfig.first_group_diagonal).
        diagonal_blocks, diagonal_step = None, None
        if cutlass.const_expr(self.diagonal_keys):
            diagonal_blocks = self.narrow_operands(blocks, warp_group, tidx, smem, self.diagonal_keys)
            diagonal_step = functools.partial(step, pv_k_blocks=self.diagonal_keys // 16)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        # Both warp groups run the same number of GEMM turns per tile, so the ping-pong token is
        # back with the first group at every tile boundary: one hand-over for the whole CTA.
        self.pingpong_init(warp_group)
        for tile_i in cutlass.range(problem.tile_count(self.scheduler), unroll=1):
            m_block, seqlen_q, seqlen_k, n_block_min, n_block_max = problem.key_blocks(
                self.scheduler, block_info, tile_i
            )
            segment_spans, batch = None, None
            if cutlass.const_expr(problem.segments is not None):
                _, _, batch = problem.tile(self.scheduler, tile_i)
                segment_spans = problem.segments.key_blocks(batch, m_block)
            apply_mask = TileMask(mask, score_coords0, thread_origin[0], thread_origin[1], m_block, seqlen_q,
                                  seqlen_k, batch, segment_spans)
            masked = functools.partial(step, apply_mask=apply_mask)
            acc_o.fill(0.0)
            softmax.reset()

            pipes.q.consumer_wait(q_state)
            if n_block_max > n_block_min:
                padded = cutlass.Boolean(False)
                if cutlass.const_expr(self.config.skip_padded_groups):
                    padded = m_block * self.tile_m + warp_group * ROWS_PER_WARP_GROUP >= seqlen_q
                tile_blocks = functools.partial(
                    self.mma_tile_blocks, blocks, step, masked, warp_group, kv_state, block_info, m_block,
                    n_block_min, n_block_max, seqlen_q, seqlen_k, apply_mask, smem.v, problem, tidx,
                    pipes.q, q_state, segment_spans=segment_spans,
                )
                if padded:
                    kv_state = self.mma_tile_skipped(blocks, warp_group, kv_state, n_block_min, n_block_max,
                                                     smem.v, seqlen_k, problem, tidx, pipes.q, q_state)
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
                    pipes.q.consumer_release(q_state)

            lse = cute.make_rmem_tensor_like(softmax.row_max, Float32)
            softmax.finalize(row_scale, lse)
            self.finish_tile(tiled_mma_pv, thr_mma_pv, tidx, acc_o, acc_o_rc, smem.o, tma, mLSE,
                             problem, pipes.q, row_scale, lse, tile_i, q_state)
            q_state.advance()
        if cutlass.const_expr(self.config.separate_o):
            # The last tile's O store must have read sO before the CTA's shared memory goes.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mma_tile_blocks(self, blocks, step, masked, warp_group, kv_state, block_info, m_block, n_block_min,
                        n_block_max, seqlen_q, seqlen_k, apply_mask, sV, problem, tidx, pipeline_q, q_state,
                        first_blocks, first_step, narrowed_diagonal: cutlass.Constexpr[bool],
                        segment_spans=None):
        """A tile's key blocks, its first one through `first_blocks` (narrowed, or `blocks`) and the
        next one's step `first_step`; returns the last block's ring slot. narrowed_diagonal: the
        first block is the first group's narrowed diagonal, which may be the tile's only block
        (its P·V then runs only the narrowed k16 steps); otherwise the tile has two or more
        blocks wherever the first is narrowed (the router's tail rule). segment_spans: the
        tile's `BlockSpans` over key blocks, with segment ids."""
        later_blocks = functools.partial(
            self.mma_key_blocks, step, masked, block_info=block_info, m_block=m_block,
            n_block_min=n_block_min, n_block_max=n_block_max, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            first_step=first_step, segment_spans=segment_spans,
        )
        self.mma_first_block(first_blocks, kv_state, n_block_max - 1, apply_mask, sV, seqlen_k, problem,
                             tidx)
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
    def finish_tile(self, tiled_mma_pv, thr_mma_pv, tidx, acc_o, acc_o_rc, sO, tma, mLSE, problem,
                    pipeline_q, row_scale, lse, tile_i, q_state):
        """O · row_scale (1/ℓ, 0 for rows past the entry) and LSE of tile tile_i, stored."""
        # Decoded again rather than held in registers across the main loop.
        m_block, head, batch = problem.tile(self.scheduler, tile_i)
        seqlen_q, _ = problem.seqlens(batch)
        self.clear_rows_past(thr_mma_pv, acc_o_rc, row_scale, lse, m_block, seqlen_q)
        scale_rows(acc_o_rc, row_scale)
        self.epilogue(tiled_mma_pv, thr_mma_pv, tidx, acc_o, lse, sO, tma, mLSE,
                      m_block, head, batch, problem.seqlen_q, pipeline_q, q_state)

    @cute.jit
    def mma_key_blocks(self, step, masked, kv_state, block_info, m_block, n_block_min, n_block_max,
                       seqlen_q, seqlen_k, first_step=None, segment_spans=None):
        """The overlapped steps of a tile's key blocks after the first, from n_block_max − 2 down:
        right-masked (local), unmasked, left-masked (local). Returns the last block's ring slot.
        `first_step`, if given, replaces `step` for the first of them, which must exist (kernels
        without a mask, on keys that fill more than one block, or with the first group's
        narrowed diagonal, whose tile has no other right-masked block). With segment ids
        (`segment_spans`) the unmasked run also lies inside the tile's full span, and the
        blocks above and below it compare ids (`mma_segment_blocks`)."""
        if cutlass.const_expr(segment_spans is not None):
            kv_state = self.mma_segment_blocks(step, masked, kv_state, block_info, m_block, n_block_min,
                                               n_block_max, seqlen_q, seqlen_k, segment_spans)
        else:
            n_block = n_block_max - 2
            if cutlass.const_expr(block_info.has_right_bound and not self.diagonal_keys):
                n_masked_from = block_info.n_block_min_right_masked(m_block, n_block_min, seqlen_q, seqlen_k)
                for _ in cutlass.range(n_block + 1 - n_masked_from, unroll=1):
                    kv_state = masked(kv_state, n_block)
                    n_block -= 1
            n_unmasked_from = block_info.n_block_min_unmasked(m_block, n_block_min, seqlen_q, seqlen_k)
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
    def mma_segment_blocks(self, step, masked, kv_state, block_info, m_block, n_block_min, n_block_max,
                           seqlen_q, seqlen_k, segment_spans):
        """`mma_key_blocks` with segment ids: masked down to `upper`, unmasked down to `lower`,
        masked down to n_block_min, where [lower, upper) is the mask's unmasked run clipped to
        the blocks every row of the tile sees whole (segment_spans.full_lo .. full_hi)."""
        n_block = n_block_max - 2
        upper = n_block + 1
        if cutlass.const_expr(block_info.has_right_bound):
            upper = cutlass.min(upper, block_info.n_block_min_right_masked(m_block, n_block_min, seqlen_q,
                                                                           seqlen_k))
        upper = cutlass.max(cutlass.min(upper, segment_spans.full_hi), n_block_min)
        lower = block_info.n_block_min_unmasked(m_block, n_block_min, seqlen_q, seqlen_k)
        lower = cutlass.min(cutlass.max(lower, segment_spans.full_lo), upper)
        for _ in cutlass.range(n_block + 1 - upper, unroll=1):
            kv_state = masked(kv_state, n_block)
            n_block -= 1
        for _ in cutlass.range(n_block + 1 - lower, unroll=1):
            kv_state = step(kv_state, n_block)
            n_block -= 1
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
    def clear_rows_past(self, thr_mma_pv, acc_o_rc, row_scale, lse, m_block, seqlen_q):
        """Rows at or past seqlen_q (a ragged entry's padding, computed like any other row from
        whatever the caller left in Q there) come out as O = 0 and LSE = −inf: XLA does not zero
        results. Their O is replaced, not scaled by 0, so that NaN in the padding of Q stays out
        (rows are independent, so it reaches no other row) and the dispatch need not zero it."""
        o_coords = acc_rows_cols(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        for r in cutlass.range_constexpr(cute.size(lse)):
            if m_block * self.tile_m + o_coords[r, 0][0] >= seqlen_q:
                row_scale[r] = Float32(0.0)
                lse[r] = -Float32.inf
                for c in cutlass.range_constexpr(cute.size(acc_o_rc, mode=[1])):
                    acc_o_rc[r, c] = Float32(0.0)

    @cute.jit
    def mma_first_block(self, blocks, kv_state, n_block, apply_mask, sV, seqlen_k, problem, tidx):
        """S for a tile's first (highest) block and its softmax; its P·V joins the next block's
        GEMMs. The highest block holds the sequence tail (and the diagonal): always masked, and
        for an entry shorter than the buffer its V rows past the keys are zeroed. Every group
        issues it at once, outside the ping-pong turns."""
        fetched = apply_mask.fetch(acc_rows_cols(blocks.acc_s), n_block)
        blocks.pipeline_k.consumer_wait(kv_state)
        wgmma_gemm(blocks.tiled_mma_qk, blocks.acc_s, blocks.tSrQ, blocks.tSrK[None, None, None, kv_state.index],
                  zero_init=True, wait_group=0)
        blocks.pipeline_k.consumer_release(kv_state)
        self.softmax_block(blocks, n_block, apply_mask, fetched)
        if seqlen_k < problem.seqlen_k:
            self.zero_v_past_keys(sV, blocks.pipeline_v, kv_state, n_block, seqlen_k, tidx)

    def narrow_operands(self, blocks, warp_group, tidx, smem, keys: int) -> _BlockOperands:
        """`blocks` narrowed to a block's first `keys` keys: the S GEMM's MMA and K operand,
        and S and P as prefixes of the full-width fragments (`acc_prefix`)."""
        tiled_mma = self.qk_tiled_mma(keys)
        wg_mma = tiled_mma.get_slice(warp_group * THREADS_PER_WARP_GROUP)
        sK_narrow = cute.local_tile(smem.k, (keys, self.head_dim, self.kv_stages), (0, 0, 0))
        shape = tiled_mma.get_slice(tidx).partition_shape_C((self.tile_m, keys))
        return dataclasses.replace(
            blocks, tiled_mma_qk=tiled_mma,
            tSrQ=wg_mma.make_fragment_A(wg_mma.partition_A(smem.q)),
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
        MMA thread takes a share of the rows' 16-byte chunks (the swizzle moves whole chunks, so
        each is one vector store); the fence and barrier make the zeros visible to both warp
        groups' P·V WGMMAs (async proxy) before either is issued. The zeroing sits between the
        tile's first softmax and its next S GEMM: element by element it was a loop of up to 64
        scalar stores per thread there."""
        valid_rows = seqlen_k - n_block * self.tile_n
        if valid_rows < self.tile_n:
            pipeline_v.consumer_wait(kv_state)
            sV_block = sV[None, None, kv_state.index]
            zeros = cute.make_rmem_tensor((V_ZERO_CHUNK,), self.dtype)
            zeros.fill(0.0)
            chunks_per_row = self.head_dim_v // V_ZERO_CHUNK
            zero_chunks = (self.tile_n - valid_rows) * chunks_per_row
            for i in cutlass.range(tidx, zero_chunks, self.num_mma_threads, unroll=1):
                row = valid_rows + i // chunks_per_row
                cute.autovec_copy(zeros, cute.local_tile(sV_block[row, None], (V_ZERO_CHUNK,),
                                                         (i % chunks_per_row,)))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=Barrier.MMA_SYNC, number_of_threads=self.num_mma_threads)

    @cute.jit
    def mma_overlapped_block(self, blocks, warp_group, kv_state, n_block, apply_mask=None,
                             pv_k_blocks: cutlass.Constexpr[int] = 0):
        """S_j = Q·K_jᵀ issued with O += P_{j-1}·V_{j-1}; softmax of S_j overlaps the P·V GEMM.

        kv_state is block j-1's ring slot on entry; returns block j's. V_{j-1} is waited for
        after S_j's GEMM is issued, inside the ping-pong turn (FA4 upstream's order), so S_j
        never waits for V_{j-1}. pv_k_blocks: P_{j-1}·V_{j-1} over only that many k16 steps (a
        narrowed tail block's).
        """
        v_state = kv_state.clone()
        kv_state.advance()
        fetched = None
        if cutlass.const_expr(apply_mask is not None):
            fetched = apply_mask.fetch(acc_rows_cols(blocks.acc_s), n_block)
        blocks.pipeline_k.consumer_wait(kv_state)
        self.pingpong_wait(warp_group)
        wgmma_gemm(blocks.tiled_mma_qk, blocks.acc_s, blocks.tSrQ, blocks.tSrK[None, None, None, kv_state.index],
                  zero_init=True, wait_group=-1)
        blocks.pipeline_v.consumer_wait(v_state)
        wgmma_gemm(blocks.tiled_mma_pv, blocks.acc_o, acc_as_operand_a(blocks.p),
                  blocks.tOrVt[None, None, None, v_state.index], zero_init=False, wait_group=-1,
                  k_blocks=pv_k_blocks)
        self.pingpong_yield(warp_group)
        warpgroup.wait_group(1)
        blocks.pipeline_k.consumer_release(kv_state)
        moved = self.softmax_block(blocks, n_block, apply_mask, fetched, convert_p=False)
        # P_{j-1} (registers read by the in-flight WGMMA) and O may be touched only after it
        # retires: the wait in the rescale branch (`retire_pv`, TileConfig.pv_wait_in_branch), or
        # before it, where ptxas may hoist it into the softmax.
        if cutlass.const_expr(self.config.pv_wait_in_branch):
            self.retire_pv(blocks, v_state, moved)
        else:
            warpgroup.wait_group(0)
            blocks.pipeline_v.consumer_release(v_state)
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
    def softmax_block(self, blocks, n_block, apply_mask, fetched=None, convert_p: cutlass.Constexpr[bool] = True):
        """Softcap and mask S in place (`apply_mask`: the tile's TileMask, or None; `fetched`,
        what its `fetch` loaded for this block), then the online-softmax step; P = S in the
        input dtype."""
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(blocks.acc_s)):
                blocks.acc_s[i] = cute.math.tanh(blocks.acc_s[i] * blocks.score_prescale, fastmath=True)
        scores = acc_rows_cols(blocks.acc_s)
        if cutlass.const_expr(apply_mask is not None):
            apply_mask.apply(scores, n_block, fetched)
        moved = blocks.softmax.step(scores, blocks.row_scale)
        if cutlass.const_expr(convert_p):
            convert_pairs(blocks.acc_s, blocks.p)
        return moved

    # GEMM issue goes round the MMA warp groups in order: group g waits on Barrier.PINGPONG + g,
    # issues, and arrives on the next group's. Each barrier joins two groups (the waiter and the
    # one handing over), so it counts 2 · 128 threads.
    @cute.jit
    def pingpong_init(self, warp_group):
        """The last MMA warp group hands the first its initial turn."""
        if cutlass.const_expr(self.pingpong):
            if warp_group == len(self.mma_warp_groups) - 1:
                cute.arch.barrier_arrive(
                    barrier_id=Barrier.PINGPONG, number_of_threads=2 * THREADS_PER_WARP_GROUP
                )

    @cute.jit
    def pingpong_wait(self, warp_group):
        """Wait for this warp group's turn to issue GEMMs."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=Barrier.PINGPONG + warp_group,
                number_of_threads=2 * THREADS_PER_WARP_GROUP,
            )

    @cute.jit
    def pingpong_yield(self, warp_group):
        """Give the next warp group its turn once this one's GEMMs are issued."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(
                barrier_id=Barrier.PINGPONG + (warp_group + 1) % len(self.mma_warp_groups),
                number_of_threads=2 * THREADS_PER_WARP_GROUP,
            )

    @cute.jit
    def epilogue(self, tiled_mma_pv, thr_mma_pv, tidx, acc_o, lse, sO, tma, mLSE, m_block, head, batch,
                 seqlen_q, pipeline_q, q_state):
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
        cute.arch.barrier(barrier_id=Barrier.MMA_SYNC, number_of_threads=self.num_mma_threads)
        # stmatrix (8 instructions per thread at d128, FA4 upstream's epilogue). The thread's
        # slice is rebuilt from an opaque index so its swizzled addresses are computed here, not
        # hoisted out of a persistent kernel's tile loop (see opaque_int32).
        store_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_pv)
        thr_store_o = store_o.get_slice(opaque_int32(tidx))
        cute.copy(store_o, thr_store_o.retile(o_out), thr_store_o.partition_D(sO))
        # Ordinary stores must be made visible to the TMA (async proxy) before the store is issued.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Barrier.MMA_SYNC, number_of_threads=self.num_mma_threads)
        # One thread issues the store: a bulk tensor copy is per thread (unlike the loads, the DSL
        # elects no lane for it), so a whole warp would store the tile 32 times.
        if tidx == 0:
            gO = cute.local_tile(tma.o[None, None, head, batch], (self.tile_m, self.head_dim_v), (m_block, 0))
            tOsO_tma, tOgO_tma = cpasync.tma_partition(
                tma.atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(tma.atom_o, tOsO_tma, tOgO_tma)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.config.separate_o):
                # Once the store has read O out of Q's buffer, the producer may load the next Q.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                pipeline_q.consumer_release(q_state)
