"""FlashAttention forward for Blackwell (the sm_100f family: B200, B300): tcgen05 MMAs into tensor memory, S and P kept
in TMEM, softmax and correction warp groups (FA4's structure).

NOT YET RUN ON BLACKWELL HARDWARE. This kernel is compiled, exported and statically checked
(tests/test_sm100_*.py; docs/blackwell.md), and its protocol, as these role methods issue it, is
model-checked, but no B200 has executed it: on a Blackwell GPU each of its variants is first
checked against the reference in a child process (fa4_jax.runtime.gate), and one that
disagrees, hangs or faults is not used.

Without a mask a CTA is persistent: it computes tile after tile of the scheduler's "lpt" order
(kernels/common/tile_scheduler.py), every role walking the same tiles with its pipelines running
on from one tile into the next, so the next tile's K and V load during this one's last blocks.
Under a causal or window mask each CTA takes one tile of the same order, heaviest first
(plan.scheduler_kind says why). A tile is two 128-row query tiles ("stages") of one (head,
batch), 256 rows, against the same key blocks (one at d256, whose S is double-buffered instead:
see below); kernels/sm100/plan.py holds the warp-role table, the TMEM map, the barriers and
the pipelines. Every wait, arrival, commit and TMA issue of a role goes through
kernels/common/sync.py's `Sync`, and the work between them through methods marked `action`, so
the tests record the protocol from these role methods themselves and search it
(tests/test_sm100_protocol.py). Every tile visits at least one key block (`tile_problem`: one
whose rows see no key runs a fully masked one), so every role does the same for every tile.
Per key block, visited from the highest to the lowest (the first carries the sequence tail and
the diagonal):

- the load warp TMA-loads K_j and V_j into consecutive stages of one ring (after the tile's
  first K, Q's two tiles);
- the MMA warp issues S_i = Q_i·K_jᵀ (both operands in shared memory) into TMEM, then, when
  softmax i has written P_i and the correction has rescaled O_i, O_i += P_i·V_{j} with P_i read
  from TMEM (the TS form), followed at once by the next block's S_i into the same columns: one
  thread's tcgen05 MMAs run in order, so P_i is read before it is overwritten;
- softmax warp group i holds one query row per thread (one TMEM lane): it reads S_i, masks,
  runs the online softmax (kernels/common/softmax.py, one lane per row), hands the row scale to
  the correction through shared memory and writes P_i into the second half of S_i's columns;
- the correction warp group rescales O_i in TMEM when a warp's rows moved their maximum (FA4's
  conditional rescaling makes that rare: a vote skips the rest), and at the end divides O_i by
  the row sums into Q_i's shared memory, free by then, for one TMA store per stage, writes
  LSE from registers, and gives Q_i's buffer back to the load warp once the store has read it.

With one stage (d256: a 256-column O leaves TMEM room for no second one) one softmax warp group
alternates between two S buffers, and the MMA warp issues the S GEMM two blocks ahead
(mma_tile_one_stage): per block j, P·V_j, then S_{j+2} into the buffer P_j leaves, so that the
tensor core computes while softmax reads S_{j+1}; the correction learns that P·V_{j-1} is done
from a pipeline of its own (PV0) before it rescales O for P·V_j.

A CTA pair ("cta_pair" tuning, plan.PAIR_TILE_CONFIGS; no mask, dense calls) runs the same
roles in a cluster of two CTAs: the leader's MMA warp issues 2-CTA MMAs over both CTAs' 128 rows
per stage, each CTA holding its own Q, S, P and O and half of each K and V block; both CTAs'
loads complete on the leader's barriers and its commits reach both (plan.Pipeline.full_at).

Ragged batches (mSeqUsedQ, mSeqUsedK) follow the Hopper kernel's contract: keys past an entry's
length are masked and the V rows of its last block past it are zeroed in shared memory by the
MMA warp before P·V reads them; rows past it come out 0 with LSE −inf. (Single CTAs only: the
routes keep ragged calls off the pairs.)
"""
import dataclasses
import functools
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05

from fa4_jax.kernels.common.block_info import BlockInfo, MaskBounds
from fa4_jax.kernels.common.layouts import permute_modes
from fa4_jax.kernels.common.mask import AttentionMask
from fa4_jax.kernels.common.ragged import entry_length
from fa4_jax.kernels.common.softmax import OnlineSoftmax, SoftmaxConfig, score_scales
from fa4_jax.kernels.common.sync import Sync, action, protocol
from fa4_jax.kernels.common.tile_scheduler import TileScheduler
from fa4_jax.kernels.sm100 import hardware, plan
from fa4_jax.kernels.sm100.plan import ROWS_PER_STAGE, Barrier, Role

TUNING_KNOBS = tuple(field.name for field in dataclasses.fields(plan.TileConfig))
# TMEM columns per tcgen05.ld/st of the correction: 16 fp32 values of a row per thread.
O_CHUNK = 16
# Keys of P per tcgen05.st of the softmax (16 columns of packed 16-bit pairs).
P_CHUNK = 32
# Row statistics softmax hands the correction through shared memory, per stage and row.
STAT_SCALE, STAT_SUM, STAT_MAX = 0, 1, 2
NUM_STATS = 3


@dataclasses.dataclass(frozen=True)
class _Tile:
    """One tile of a CTA's work: two stages' query rows of (head, batch) against key blocks
    [n_block_min, n_block_min + n_blocks), visited from the highest. n_blocks >= 1: a tile
    whose rows see no key (a window or causal band that leaves them none, rows past an entry's,
    an entry without keys) runs one block, every key of which its mask hides."""

    m_block: Int32
    # The CTA's place in its pair (0 without one): its rows of each stage come after the leader's.
    cta_in_pair: Int32
    head: Int32
    head_kv: Int32
    batch: Int32
    # The entry's valid lengths (a ragged batch's, else the buffers'), and the buffer's rows.
    seqlen_q: Int32
    seqlen_k: Int32
    seqlen_q_buf: Int32
    n_block_min: Int32
    n_blocks: Int32
    # The element mask of one stage's 128 rows, and its block bounds.
    mask: AttentionMask
    stage_blocks: BlockInfo
    # Keys past an entry's length lie inside the buffer (their V rows need zeroing).
    ragged_k: cutlass.Boolean


@dataclasses.dataclass(frozen=True)
class _SoftmaxBlock:
    """What every key block of one softmax warp group touches: its row of S in TMEM and in
    registers, P's chunk registers and TMEM columns, and the softmax state."""

    thr_load: cute.TiledCopy
    scores_tmem: cute.Tensor
    scores: cute.Tensor
    scores_row: cute.Tensor
    coords_row: cute.Tensor
    thr_store: cute.TiledCopy
    probs_tmem: cute.Tensor
    probs_chunk_f32: cute.Tensor
    probs_chunk: cute.Tensor
    softmax: OnlineSoftmax
    row_scale: cute.Tensor
    row: Int32
    row_stats: cute.Tensor
    score_prescale: Float32


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """A role's tiles: `problem(i)` is its i-th (`_Tile`), of `count`."""

    problem: object
    count: Int32


@dataclasses.dataclass(frozen=True)
class _LoadResources:
    """What the load warp reads and writes: the TMA atoms and tensors, the shared-memory
    buffers, the MMAs whose partitions they follow, and the bytes of a V block."""

    tma_atom_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_atom_k: cute.CopyAtom
    mK: cute.Tensor
    tma_atom_v: cute.CopyAtom
    mV: cute.Tensor
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    v_bytes: int


@dataclasses.dataclass(frozen=True)
class _LoadSources:
    """One tile's TMA partitions: Q's, K's and V's global tiles and their shared stages."""

    q: cute.Tensor
    sq: cute.Tensor
    k: cute.Tensor
    sk: cute.Tensor
    v: cute.Tensor
    sv: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _MmaResources:
    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tP_layout: cute.ComposedLayout
    tmem_ptr: cute.Pointer
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _SoftmaxResources:
    tiled_mma_qk: cute.TiledMma
    tmem_ptr: cute.Pointer
    row_stats: cute.Tensor
    score_prescale: Float32
    scale_log2: Float32


@dataclasses.dataclass(frozen=True)
class _SBuffer:
    """A thread's row of one S buffer in TMEM: S (fp32) and P (16-bit) in its second half."""

    scores_tmem: cute.Tensor
    probs_tmem: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _Epilogue:
    """Where the correction warp group puts a tile's results: O through each stage's shared
    memory (sO[i], in Q_i's bytes) and a TMA store, LSE from registers."""

    tma_atom_o: cute.CopyAtom
    mO: cute.Tensor
    sO: tuple
    mLSE: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _CorrectionResources:
    tiled_mma_pv: cute.TiledMma
    tmem_ptr: cute.Pointer
    row_stats: cute.Tensor
    epilogue: _Epilogue
    scale_log2: Float32


@dataclasses.dataclass(frozen=True)
class _CorrectionRegisters:
    """The correction's views of its row: O's 16-column TMEM chunks per stage (`loads`,
    `stores`) with their copies and registers, the statistics softmax hands over, and where
    the epilogue writes."""

    row: Int32
    thr_load: cute.TiledCopy
    thr_store: cute.TiledCopy
    chunk_regs: cute.Tensor
    loads: tuple
    stores: tuple
    row_stats: cute.Tensor
    epilogue: _Epilogue
    scale_log2: Float32


@dataclasses.dataclass(frozen=True)
class _MmaOperands:
    """What the MMA warp's GEMMs read and write: the two MMAs, the shared-memory operand
    fragments (Q and K for S, V for P·V) and TMEM (S and P per buffer, O per stage)."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    thr_pv: cute.TiledMma
    sV: cute.Tensor
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV: cute.Tensor
    tmem_ptr: cute.Pointer
    scores_layout: cute.Layout
    outs: tuple
    probs_type: type
    probs_layout: cute.Layout


@action
def _tcgen05_after_sync():
    """Orders this thread's later tcgen05 ops after a barrier wait it just passed."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


@action
def _tcgen05_before_sync():
    """Orders this thread's earlier tcgen05 ops before a barrier arrival that follows."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


class FlashAttentionForwardSm100:
    def __init__(self, dtype, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool,
                 segments: bool = False, mask_array: bool = False, **tuning):
        """`tuning` overrides the tile table's settings (plan.TileConfig's fields)."""
        if mask not in ("none", "causal", "local"):
            raise ValueError(f"mask must be 'none', 'causal' or 'local', got {mask!r}")
        cta_pair = tuning.get("cta_pair", False)
        if (head_dim, head_dim_v) not in (plan.PAIR_TILE_CONFIGS if cta_pair else plan.TILE_CONFIGS):
            raise ValueError(f"no sm100 tile configuration for head_dim={head_dim}, head_dim_v={head_dim_v}"
                             + (" on a CTA pair" if cta_pair else ""))
        if cta_pair and mask != "none":
            raise ValueError(f"a CTA pair serves calls without a mask, got mask={mask!r}")
        if segments or mask_array:
            raise ValueError("the sm100 forward has no segment-ids or mask-array variant yet")
        unknown = set(tuning) - set(TUNING_KNOBS)
        if unknown:
            raise TypeError(f"unknown tuning knobs {sorted(unknown)}; known: {TUNING_KNOBS}")
        config = plan.tile_config(head_dim, head_dim_v, tuning)
        self.roles = plan.warp_roles(config)
        self.roles.check()
        if head_dim_v > head_dim:
            raise ValueError("V's stages sit at K's stage offsets in one ring: head_dim_v must not exceed head_dim")
        if config.tile_n != 128:
            raise ValueError(f"{config}: the softmax's row loads and P's TMEM columns assume 128-key blocks")
        self.tmem = plan.TmemMap(config.tile_n, head_dim_v, config.q_stages)
        if self.tmem.alloc_columns > hardware.TMEM_COLUMNS:
            raise ValueError(f"{config}: TMEM map needs {self.tmem.used_columns} columns")
        if config.smem_bytes(head_dim, head_dim_v) + plan.SMEM_MARGIN > hardware.SMEM_BYTES:
            raise ValueError(f"{config} needs more than {hardware.SMEM_BYTES} bytes of shared memory")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = mask == "causal"
        self.local = mask == "local"
        self.has_softcap = has_softcap
        self.config = config
        self.tile_n = config.tile_n
        self.kv_stages = config.kv_stages
        self.q_stages = config.q_stages
        self.softmax_config = SoftmaxConfig(rescale_threshold=config.rescale_threshold,
                                            exp2_poly_share=config.exp2_poly_share, packed_pairs=True)
        # CTAs per MMA, and the query rows one MMA covers (one stage of each CTA of a pair).
        self.ctas = config.ctas
        self.cta_group = tcgen05.CtaGroup.TWO if config.cta_pair else tcgen05.CtaGroup.ONE
        self.mma_rows = ROWS_PER_STAGE * self.ctas
        # A tile: every stage of every CTA of the pair.
        self.cta_m = self.q_stages * self.mma_rows
        masked = self.causal or self.local
        self.scheduler = TileScheduler(
            plan.scheduler_kind(mask), self.cta_m, reverse_m=masked,
            kv_bytes_per_key=(head_dim + head_dim_v) * dtype.width // 8, num_sms=hardware.NUM_SMS,
            cluster_size=self.ctas,
        )

    # --- host side -----------------------------------------------------------------------

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
        """The Hopper kernel's contract (kernels/sm90/fwd.py): mQ [b, sq, h, d], mK [b, sk, hk, d],
        mV [b, sk, hk, dv], mO [b, sq, h, dv], mLSE [b, h, sq] float32, mSeqUsedQ / mSeqUsedK [b]
        int32 or empty. The segment and mask tensors are unread (no segments variant)."""
        # (s, d, heads, batch) views; V as (dv, s, heads, batch): P·V's B operand, N-major.
        mQ, mK, mO = [permute_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mO)]
        mV = permute_modes(mV, (3, 1, 2, 0))
        mLSE = permute_modes(mLSE, (2, 1, 0))

        mma_tiler_qk = (self.mma_rows, self.tile_n, self.head_dim)
        mma_tiler_pv = (self.mma_rows, self.head_dim_v, self.tile_n)
        tiled_mma_qk, tiled_mma_pv = self.tiled_mmas()
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, mma_tiler_qk, self.dtype, self.q_stages)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, mma_tiler_qk, self.dtype, self.kv_stages)
        tP_layout = self.probs_layout(tiled_mma_pv)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, mma_tiler_pv, self.dtype, self.kv_stages)
        if cutlass.const_expr(self.head_dim_v != self.head_dim):
            # K and V take turns in one ring: V's stages at K's (wider) stage stride.
            sV_layout = cute.append(
                cute.select(sV_layout, mode=[0, 1, 2]),
                cute.make_layout(self.kv_stages, stride=cute.cosize(cute.select(sK_layout, mode=[0, 1, 2]))))

        cluster = self.cluster_layout(tiled_mma_qk)
        load_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster.shape)
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mK, cute.select(sK_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster.shape)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mV, cute.select(sV_layout, mode=[0, 1, 2]), mma_tiler_pv, tiled_mma_pv, cluster.shape)
        # O_i is staged in Q_i's buffer: the stage's last P·V completes after every MMA that read
        # Q (one thread's tcgen05 MMAs complete in order), so it is free when O_i is final.
        sO_layout = sm100_utils.make_smem_layout_epi(self.dtype, utils.LayoutEnum.ROW_MAJOR,
                                                     (ROWS_PER_STAGE, self.head_dim_v), 1)
        sO_layout = cute.select(sO_layout, mode=[0, 1])
        assert cute.cosize(sO_layout) <= cute.cosize(cute.select(sQ_layout, mode=[0, 1, 2])), "O_i exceeds Q_i's buffer"
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (ROWS_PER_STAGE, self.head_dim_v))
        # What one stage's full barrier expects: a pair's loads of both CTAs complete on the
        # leader's (plan.Pipeline.full_at).
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2])) * self.ctas
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2])) * self.ctas
        self.tma_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2])) * self.ctas

        dtype = self.dtype
        # A full and an empty barrier per stage of every pipeline of the plan.
        num_mbarriers = 2 * sum(pipe.stages for pipe in plan.pipelines(self.config))

        @cute.struct
        class SharedStorage:
            mbarriers: cute.struct.MemRange[cutlass.Int64, num_mbarriers]
            # A pair's MMA warps free their TMEM together (TmemAllocator's handshake).
            tmem_dealloc: cutlass.Int64
            tmem_address: Int32
            row_stats: cute.struct.MemRange[Float32, self.q_stages * NUM_STATS * ROWS_PER_STAGE]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= hardware.SMEM_BYTES, (
            f"{self.config}: {SharedStorage.size_in_bytes()} bytes of shared memory")

        score_prescale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)

        grid = self.scheduler.grid(cute.size(mQ.shape[0]), cute.size(mK.shape[0]), cute.size(mQ.shape[2]),
                                   cute.size(mK.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_o, tma_o, mLSE, mSeqUsedQ, mSeqUsedK, sQ_layout, sK_layout, tP_layout, sV_layout,
            sO_layout,
            score_prescale, scale_log2, window_left, window_right, top_left,
        ).launch(grid=grid, block=[self.roles.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
                 min_blocks_per_mp=1, cluster=[self.ctas, 1, 1] if self.config.cta_pair else None)

    def tiled_mmas(self):
        """The two MMAs: S = Q·Kᵀ with both operands in shared memory, O += P·V with P from
        TMEM (tcgen05's TS form); each of a CTA pair's kind for a pair."""
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K,
            Float32, self.cta_group, (self.mma_rows, self.tile_n),
        )
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN,
            Float32, self.cta_group, (self.mma_rows, self.head_dim_v), tcgen05.OperandSource.TMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    def probs_layout(self, tiled_mma_pv):
        """P's layout as P·V's A operand (a 128-row, tile_n-key tile of 16-bit P)."""
        return sm100_utils.make_smem_layout_a(tiled_mma_pv, (self.mma_rows, self.head_dim_v, self.tile_n),
                                              self.dtype, 1)

    def cluster_layout(self, tiled_mma_qk):
        """The cluster as (CTA in the pair, m, n, k): static, one CTA or two."""
        return cute.tiled_divide(cute.make_layout((self.ctas, 1, 1)), (tiled_mma_qk.thr_id.shape,))

    # --- device side -----------------------------------------------------------------------

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
        tP_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        score_prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        top_left: Int32,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        roles = self.roles
        load_warp = roles.role(Role.LOAD).warps[0]
        mma_warp = roles.role(Role.MMA).warps[0]
        if warp == load_warp:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        pair = self.config.cta_pair
        # This CTA's place in its pair (0, the leader, issues the pair's MMAs), 0 without one.
        cta_in_pair = cute.arch.block_idx_in_cluster() if cutlass.const_expr(pair) else 0
        cluster = self.cluster_layout(tiled_mma_qk)
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        sync = Sync(self.make_pipelines(storage, cluster), {"Q": self.tma_bytes_q, "KV": self.tma_bytes_kv})
        tmem_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM), num_threads=roles.threads(*roles.tmem_users))
        tmem = utils.TmemAllocator(storage.tmem_address.ptr, barrier_for_retrieve=tmem_barrier,
                                   allocator_warp_id=mma_warp, is_two_cta=pair,
                                   two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr if pair else None)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V's stages are K's bytes (at K's stage stride), seen through V's own layout.
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        # O_i in Q_i's bytes, seen through O's own layout.
        q_stage_elems = cute.cosize(cute.select(sQ_layout.outer, mode=[0, 1, 2]))
        sO = tuple(cute.make_tensor(cute.recast_ptr(sQ.iterator + i * q_stage_elems, sO_layout.inner),
                                    sO_layout.outer) for i in range(self.q_stages))
        row_stats = storage.row_stats.get_tensor(
            cute.make_layout((ROWS_PER_STAGE, NUM_STATS, self.q_stages)))

        # Each role derives its tiles after its setmaxnreg: values live across the MMA and load
        # warps' drop to 48 registers would be spilled.
        tile_problem = functools.partial(self.tile_problem, mQ, mK, mSeqUsedQ, mSeqUsedK, window_left,
                                         window_right, top_left, cta_in_pair)
        tile_count = functools.partial(self.tile_count, mQ)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)

        if warp >= mma_warp:
            # The MMA, load and idle warps share the last warp group's budget.
            self.set_registers(Role.MMA)
        if warp == load_warp:
            self.load(_LoadResources(tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, sQ, sK, sV, tiled_mma_qk,
                                     tiled_mma_pv, self.tma_bytes_v),
                      sync, _Tiles(tile_problem, tile_count()))
        if warp == mma_warp:
            # A pair's two MMA warps allocate the same columns together; the leader's issues.
            tmem.allocate(self.tmem.alloc_columns)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            if cta_in_pair == 0:
                self.mma(_MmaResources(tiled_mma_qk, tiled_mma_pv, tP_layout, tmem_ptr, sQ, sK, sV), sync,
                         _Tiles(tile_problem, tile_count()))
            tmem.relinquish_alloc_permit()
            tmem_barrier.arrive_and_wait()
            _tcgen05_after_sync()
            tmem.free(tmem_ptr)
        for stage, softmax_role in enumerate(roles.softmax):
            group = roles.role(softmax_role).warps
            if warp >= group[0] and warp <= group[-1]:
                self.set_registers(softmax_role)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.softmax(stage, _SoftmaxResources(tiled_mma_qk, tmem_ptr, row_stats, score_prescale, scale_log2),
                             sync, _Tiles(tile_problem, tile_count()))
                _tcgen05_before_sync()
                tmem_barrier.arrive()
        correction = roles.role(Role.CORRECTION).warps
        if warp >= correction[0] and warp <= correction[-1]:
            self.set_registers(Role.CORRECTION)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction(_CorrectionResources(tiled_mma_pv, tmem_ptr, row_stats,
                                                 _Epilogue(tma_atom_o, mO, sO, mLSE), scale_log2),
                            sync, _Tiles(tile_problem, tile_count()))
            _tcgen05_before_sync()
            tmem_barrier.arrive()
        if cutlass.const_expr(pair):
            # Neither CTA leaves while its partner may still arrive on its barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def role_calls(self) -> dict:
        """Each warp role's method and its leading static arguments, as the kernel entry calls
        it (then its resources, the Sync and its tiles); the protocol recorder makes the same
        calls (kernels/common/recording.py)."""
        calls = {Role.LOAD: ("load", ()), Role.MMA: ("mma", ()), Role.CORRECTION: ("correction", ())}
        for stage, softmax_role in enumerate(self.roles.softmax):
            calls[softmax_role] = ("softmax", (stage,))
        return calls

    def set_registers(self, role: Role):
        """The warp group's setmaxnreg to its role's budget: up from the launch's count, or down."""
        budget = self.roles.role(role).registers
        if budget > self.roles.launch_registers:
            cute.arch.setmaxregister_increase(budget)
        else:
            cute.arch.setmaxregister_decrease(budget)

    def _arrivals(self, roles, landing, threads=None) -> pipeline.CooperativeGroup:
        """The arrivals that complete a pipeline barrier's phase for `roles`: one for the load
        warp (its TMA unit's transaction; a pair's partner adds bytes, not an arrival) and the
        MMA warp (one elected tcgen05.commit), `threads` where the plan names how many of the
        roles' threads arrive, else every thread of them, of both CTAs where a pair's arrivals
        land on the leader's barrier (plan.Pipeline.full_at / empty_at)."""
        if roles in ((Role.LOAD,), (Role.MMA,)):
            arrivals = 1
        else:
            arrivals = (threads or self.roles.threads(*roles)) * (self.ctas if landing == "leader" else 1)
        return pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals)

    def make_pipelines(self, storage, cluster) -> dict:
        """One pipeline per entry of plan.pipelines, in its order over the shared barriers: TMA
        loads (K/V into the MMA warp; Q to the MMA warp and, for its release, the correction),
        the MMA warp's commits out to threads, and thread to thread. `cluster` makes a pair's
        loads expect both CTAs' bytes on the leader's barrier, its commits multicast to both
        CTAs and its threads' releases arrive on the leader's."""
        pipes, barriers = {}, storage.mbarriers.data_ptr()
        tx_bytes = {"Q": self.tma_bytes_q, "KV": self.tma_bytes_kv}
        for pipe in plan.pipelines(self.config):
            groups = dict(num_stages=pipe.stages, producer_group=self._arrivals(pipe.producer, pipe.full_at),
                          consumer_group=self._arrivals(pipe.consumers, pipe.empty_at, pipe.consumer_threads),
                          barrier_storage=barriers, defer_sync=True)
            if pipe.producer == (Role.LOAD,):
                pipes[pipe.name] = pipeline.PipelineTmaUmma.create(tx_count=tx_bytes[pipe.name],
                                                                   cta_layout_vmnk=cluster, **groups)
            elif pipe.producer == (Role.MMA,):
                pipes[pipe.name] = pipeline.PipelineUmmaAsync.create(cta_layout_vmnk=cluster, **groups)
                if cutlass.const_expr(self.config.cta_pair):
                    # The threads' releases go to the leader, rank plan.LEADER of a cluster of
                    # two: a constant, where CUTLASS derives it from the CTA's rank (a value
                    # live through every role, which ptxas spilled to local memory).
                    pipes[pipe.name] = dataclasses.replace(pipes[pipe.name], consumer_mask=Int32(plan.LEADER))
            else:
                pipes[pipe.name] = pipeline.PipelineAsync.create(**groups)
            barriers = barriers + 2 * pipe.stages
        return pipes

    @cute.jit
    def tile_count(self, mQ):
        """How many tiles this CTA computes (persistent: its share of the order; "lpt_grid": one,
        or none past the last L2 section)."""
        return self.scheduler.tile_count(cute.size(mQ.shape[0]), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))

    @cute.jit
    def tile_problem(self, mQ, mK, mSeqUsedQ, mSeqUsedK, window_left, window_right, top_left, cta_in_pair,
                     tile_index):
        """This CTA's tile_index-th tile and what every role derives from it (`_Tile`)."""
        seqlen_q_buf, seqlen_k_buf = cute.size(mQ.shape[0]), cute.size(mK.shape[0])
        num_heads, num_heads_kv, batch_size = cute.size(mQ.shape[2]), cute.size(mK.shape[2]), cute.size(mQ.shape[3])
        m_block, head, batch = self.scheduler.tile(tile_index, seqlen_q_buf, seqlen_k_buf, num_heads,
                                                   num_heads_kv, batch_size)
        seqlen_q = entry_length(mSeqUsedQ, batch, seqlen_q_buf)
        seqlen_k = entry_length(mSeqUsedK, batch, seqlen_k_buf)
        bounds = MaskBounds(window_left, window_right, top_left)
        block_info = BlockInfo(self.cta_m, self.tile_n, self.causal, self.local, bounds)
        n_block_min, n_block_max = block_info.n_block_range(m_block, seqlen_q, seqlen_k)
        # A tile whose rows see no key still runs one key block, fully masked (its rows come out
        # 0 with LSE −inf), so that every role does the same for every tile.
        n_blocks = cutlass.max(n_block_max - n_block_min, 1)
        mask = AttentionMask(ROWS_PER_STAGE, self.tile_n, self.causal, self.local, bounds)
        stage_blocks = BlockInfo(ROWS_PER_STAGE, self.tile_n, self.causal, self.local, bounds)
        head_kv = head // (num_heads // num_heads_kv)
        return _Tile(m_block=m_block, cta_in_pair=cta_in_pair, head=head, head_kv=head_kv, batch=batch,
                     seqlen_q=seqlen_q, seqlen_k=seqlen_k, seqlen_q_buf=seqlen_q_buf,
                     n_block_min=n_block_min, n_blocks=n_blocks, mask=mask, stage_blocks=stage_blocks,
                     ragged_k=mSeqUsedK.shape[0] > 0)

    @action
    def row_block(self, tile, stage: int):
        """The ROWS_PER_STAGE-row block of the query rows that this CTA's stage `stage` holds
        (a pair's CTA: its rows of each stage after the leader's)."""
        return (tile.m_block * self.q_stages + stage) * self.ctas + tile.cta_in_pair

    # --- load warp ---------------------------------------------------------------------------

    @protocol
    @cute.jit
    def load(self, res, sync: Sync, tiles):
        """Per tile, Q's tiles and the blocks' K and V through the ring (K of the first
        s_lookahead blocks, then V_j and K_{j + s_lookahead}: the MMA warp's order). In a pair
        each CTA loads its own rows of Q and its half of each K and V block."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for tile_index in cutlass.range(tiles.count, unroll=1):
            tile = tiles.problem(tile_index)
            n_blocks = tile.n_blocks
            src = self.load_sources(res, tile)
            last_block = tile.n_block_min + n_blocks - 1
            self.load_block(sync, kv_state, res.tma_atom_k, src.k[None, last_block, 0], src.sk)
            kv_state.advance()
            for stage in cutlass.range_constexpr(self.q_stages):
                sync.acquire("Q", q_state)
                sync.tma_load("Q", q_state, res.tma_atom_q,
                              src.q[None, tile.m_block * self.q_stages + stage, 0], src.sq[None, stage])
                q_state.advance()
            ahead = self.config.s_lookahead
            for i in cutlass.range_constexpr(1, ahead):
                if n_blocks > i:
                    self.load_block(sync, kv_state, res.tma_atom_k, src.k[None, last_block - i, 0], src.sk)
                    kv_state.advance()
            for i in cutlass.range(n_blocks, unroll=1):
                self.load_block(sync, kv_state, res.tma_atom_v, src.v[None, 0, last_block - i], src.sv,
                                res.v_bytes)
                kv_state.advance()
                if i + ahead < n_blocks:
                    self.load_block(sync, kv_state, res.tma_atom_k, src.k[None, last_block - i - ahead, 0],
                                    src.sk)
                    kv_state.advance()
        sync.tail("KV", kv_state)

    @action
    @cute.jit
    def load_sources(self, res, tile) -> "_LoadSources":
        """The TMA partitions of one tile: Q's rows, K's and V's blocks of its (head, batch), and
        the shared-memory stages they land in (this CTA's half of each in a pair)."""
        head, head_kv, batch = tile.head, tile.head_kv, tile.batch
        thr_qk, thr_pv = res.tiled_mma_qk.get_slice(tile.cta_in_pair), res.tiled_mma_pv.get_slice(tile.cta_in_pair)
        gQ = cute.flat_divide(res.mQ[None, None, head, batch], (self.mma_rows, self.head_dim))
        gK = cute.flat_divide(res.mK[None, None, head_kv, batch], (self.tile_n, self.head_dim))
        gV = cute.flat_divide(res.mV[None, None, head_kv, batch], (self.head_dim_v, self.tile_n))
        tQsQ, tQgQ = cpasync.tma_partition(res.tma_atom_q, 0, cute.make_layout(1), cute.group_modes(res.sQ, 0, 3),
                                           cute.group_modes(thr_qk.partition_A(gQ), 0, 3))
        tKsK, tKgK = cpasync.tma_partition(res.tma_atom_k, 0, cute.make_layout(1), cute.group_modes(res.sK, 0, 3),
                                           cute.group_modes(thr_qk.partition_B(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(res.tma_atom_v, 0, cute.make_layout(1), cute.group_modes(res.sV, 0, 3),
                                           cute.group_modes(thr_pv.partition_B(gV), 0, 3))
        return _LoadSources(q=tQgQ, sq=tQsQ, k=tKgK, sk=tKsK, v=tVgV, sv=tVsV)

    @protocol
    @cute.jit
    def load_block(self, sync: Sync, state, atom, src, dst, tx_bytes=None):
        """One K or V block into the ring's next stage; V's narrower block (head_dim_v <
        head_dim) expects its own byte count on the stage's barrier."""
        sync.acquire("KV", state, tx_bytes)
        sync.tma_load("KV", state, atom, src, dst[None, state.index])

    # --- MMA warp ------------------------------------------------------------------------------

    @protocol
    @cute.jit
    def mma(self, res, sync: Sync, tiles):
        """Per tile, S_i = Q_i·Kᵀ and O_i += P_i·V for every stage. An S GEMM waits for nothing
        on S_i: the P_i·V that last read its columns waited for that use's release, and this
        thread's MMAs run in order."""
        ops = self.mma_operands(res)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        # The stages' S pipelines go through the same phases in step: one state serves all.
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.s_lookahead)
        # With one stage: the P_i·V waits on S's empty barrier (P is in), a use at a time.
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.s_lookahead)
        pv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for tile_index in cutlass.range(tiles.count, unroll=1):
            tile = tiles.problem(tile_index)
            if cutlass.const_expr(self.q_stages == 1):
                kv_state, q_state, s_state, p_state, pv_state, o_state = self.mma_tile_one_stage(
                    ops, sync, tile, kv_state, q_state, s_state, p_state, pv_state, o_state)
            else:
                kv_state, q_state, s_state, o_state = self.mma_tile_two_stages(
                    ops, sync, tile, kv_state, q_state, s_state, o_state)

    @action
    @cute.jit
    def mma_operands(self, res) -> "_MmaOperands":
        """The GEMMs' operands: Q and K fragments for S, V's and P's (in S's TMEM) for P·V, the
        S and O accumulators."""
        thr_qk, thr_pv = res.tiled_mma_qk.get_slice(0), res.tiled_mma_pv.get_slice(0)
        tStS = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.mma_rows, self.tile_n)))
        tOtO = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.mma_rows, self.head_dim_v)))
        tOrP = thr_pv.make_fragment_A(cute.make_tensor(tStS.iterator, res.tP_layout.outer))[None, None, None, 0]
        return _MmaOperands(
            tiled_mma_qk=res.tiled_mma_qk, tiled_mma_pv=res.tiled_mma_pv, thr_pv=thr_pv, sV=res.sV,
            tSrQ=res.tiled_mma_qk.make_fragment_A(res.sQ), tSrK=res.tiled_mma_qk.make_fragment_B(res.sK),
            tOrV=res.tiled_mma_pv.make_fragment_B(res.sV), tmem_ptr=res.tmem_ptr, scores_layout=tStS.layout,
            outs=tuple(cute.make_tensor(res.tmem_ptr + self.tmem.o(i), tOtO.layout) for i in range(self.q_stages)),
            probs_type=tOrP.element_type, probs_layout=tOrP.layout,
        )

    def scores_tmem(self, ops, buffer):
        """S buffer `buffer` (static or a ring index) as the S GEMM's accumulator."""
        return cute.make_tensor(ops.tmem_ptr + self.tmem.s(0) + buffer * self.tile_n, ops.scores_layout)

    def probs_tmem(self, ops, buffer):
        """P in S buffer `buffer` as P·V's A operand."""
        return cute.make_tensor(cute.recast_ptr(ops.tmem_ptr + self.tmem.p(0) + buffer * self.tile_n,
                                                dtype=ops.probs_type), ops.probs_layout)

    @action
    @cute.jit
    def s_gemm(self, ops, buffer, q_stage, k_stage):
        """S buffer `buffer` = Q_{q_stage}·Kᵀ, K from ring stage `k_stage`."""
        self.gemm(ops.tiled_mma_qk, self.scores_tmem(ops, buffer), ops.tSrQ[None, None, None, q_stage],
                  ops.tSrK[None, None, None, k_stage], accumulate=False)

    @action
    @cute.jit
    def pv_gemm(self, ops, stage, buffer, v_stage, accumulate):
        """O_{stage} (+)= P·V, P from S buffer `buffer`, V from ring stage `v_stage`."""
        self.gemm(ops.tiled_mma_pv, ops.outs[stage], self.probs_tmem(ops, buffer),
                  ops.tOrV[None, None, None, v_stage], accumulate=accumulate)

    @protocol
    @cute.jit
    def mma_tile_two_stages(self, ops, sync: Sync, tile, kv_state, q_state, s_state, o_state):
        """One tile of two stages, each with its own S buffer: per block, both stages' P_i·V_j
        then S_i of the next block into the same columns. Returns the advanced states."""
        n_blocks = tile.n_blocks
        sync.wait("KV", kv_state)
        k_state = kv_state.clone()
        kv_state.advance()
        for i in cutlass.range_constexpr(self.q_stages):
            sync.wait("Q", q_state)
            self.s_gemm(ops, i, i, k_state.index)
            sync.commit(f"S{i}", s_state)
            q_state.advance()
        s_state.advance()
        sync.release("KV", k_state)
        for block in cutlass.range(1, n_blocks, unroll=1):
            sync.wait("KV", kv_state)
            v_state = kv_state.clone()
            kv_state.advance()
            if block == 1:
                self.zero_v_past_keys(ops, v_state.index, tile)
            sync.wait("KV", kv_state)
            k_state = kv_state.clone()
            kv_state.advance()
            for i in cutlass.range_constexpr(self.q_stages):
                sync.acquire(f"S{i}", s_state)
                _tcgen05_after_sync()
                self.pv_gemm(ops, i, i, v_state.index, block > 1)
                self.s_gemm(ops, i, i, k_state.index)
                sync.commit(f"S{i}", s_state)
            s_state.advance()
            sync.release("KV", v_state)
            sync.release("KV", k_state)
        sync.wait("KV", kv_state)
        if n_blocks == 1:
            self.zero_v_past_keys(ops, kv_state.index, tile)
        for i in cutlass.range_constexpr(self.q_stages):
            sync.acquire(f"S{i}", s_state)
            _tcgen05_after_sync()
            self.pv_gemm(ops, i, i, kv_state.index, n_blocks > 1)
            sync.commit(f"O{i}", o_state)
        sync.release("KV", kv_state)
        kv_state.advance()
        o_state.advance()
        return kv_state, q_state, s_state, o_state

    @protocol
    @cute.jit
    def mma_tile_one_stage(self, ops, sync: Sync, tile, kv_state, q_state, s_state, p_state, pv_state, o_state):
        """One tile of one stage whose S is double-buffered: S of the first two blocks, then per
        block j P·V_j (once softmax has written P_j and the correction rescaled O) and S of block
        j + 2 into the buffer P_j leaves, so that the tensor core has the next S to compute
        while the correction, told by PV0 that P·V_{j-1} is done, rescales O for P·V_j.
        Returns the advanced states."""
        n_blocks = tile.n_blocks
        kv_state, s_state, q_state = self.issue_next_scores(ops, sync, kv_state, s_state, q_state)
        for first in cutlass.range_constexpr(1, self.config.s_lookahead):
            if n_blocks > first:
                kv_state, s_state, _ = self.issue_next_scores(ops, sync, kv_state, s_state)
        for block in cutlass.range(n_blocks, unroll=1):
            sync.wait("KV", kv_state)
            v_state = kv_state.clone()
            kv_state.advance()
            if block == 0:
                self.zero_v_past_keys(ops, v_state.index, tile)
            # S's empty barrier of this use: P_j is in and O is rescaled.
            sync.wait_empty("S0", p_state)
            _tcgen05_after_sync()
            self.pv_gemm(ops, 0, p_state.index, v_state.index, block > 0)
            p_state.advance()
            if block < n_blocks - 1:
                sync.acquire("PV0", pv_state)
                sync.commit("PV0", pv_state)
                pv_state.advance()
            else:
                sync.commit("O0", o_state)
                o_state.advance()
            sync.release("KV", v_state)
            if block + self.config.s_lookahead < n_blocks:
                kv_state, s_state, _ = self.issue_next_scores(ops, sync, kv_state, s_state)
        return kv_state, q_state, s_state, p_state, pv_state, o_state

    @protocol
    @cute.jit
    def issue_next_scores(self, ops, sync: Sync, kv_state, s_state, q_state=None):
        """One stage's next S = Q·Kᵀ, K from the ring's next stage, into the S buffer of
        s_state's use (free: the P·V that read it came first); a tile's first waits for Q
        (`q_state`). Returns the advanced (kv_state, s_state, q_state)."""
        sync.wait("KV", kv_state)
        k_state = kv_state.clone()
        kv_state.advance()
        if cutlass.const_expr(q_state is not None):
            sync.wait("Q", q_state)
            q_state.advance()
        self.s_gemm(ops, s_state.index, 0, k_state.index)
        sync.commit("S0", s_state)
        s_state.advance()
        sync.release("KV", k_state)
        return kv_state, s_state, q_state

    @cute.jit
    def gemm(self, tiled_mma, acc, frag_a, frag_b, accumulate):
        """acc (+)= A·B, one tcgen05 MMA per k block; `accumulate` (runtime) for the first.

        The accumulate flag is runtime state of the MMA atom, and setting it derives a new atom
        value from the old: a fresh atom per call keeps a value made inside one loop or branch
        from being read after it."""
        mma = cute.make_tiled_mma(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate if k == 0 else True)
            cute.gemm(mma, acc, frag_a[None, None, k], frag_b[None, None, k], acc)

    @action
    @cute.jit
    def zero_v_past_keys(self, ops, stage, tile):
        """A ragged entry's last key block: V rows past its keys hold the next entry's values (or
        anything), and P = 0 times a NaN there is NaN, so the MMA warp zeroes them in shared
        memory before P·V reads the block (the first block visited, the tail)."""
        if tile.ragged_k:
            last_block = tile.n_block_min + tile.n_blocks - 1
            valid_keys = tile.seqlen_k - last_block * self.tile_n
            if valid_keys < self.tile_n:
                # The stage's elements in the order of their (dv, key) coordinates' partition:
                # V's shared layout is the P·V MMA's B partition, as the TMA load wrote it.
                stage_v = ops.sV[None, None, None, stage]
                coords = ops.thr_pv.partition_B(cute.make_identity_tensor((self.head_dim_v, self.tile_n)))
                for e in cutlass.range(cute.arch.lane_idx(), cute.size(stage_v), plan.THREADS_PER_WARP,
                                       unroll=1):
                    if coords[e][1] >= valid_keys:
                        stage_v[e] = self.dtype(0.0)
                cute.arch.fence_view_async_shared()
                cute.arch.sync_warp()

    # --- softmax warp groups ---------------------------------------------------------------

    @protocol
    @cute.jit
    def softmax(self, stage: cutlass.Constexpr[int], res, sync: Sync, tiles):
        """Softmax i, per tile: S_i from TMEM, one row per thread; P_i back into TMEM; row
        statistics to the correction. The first block visited (the keys' tail), the blocks the
        causal/window band crosses and those left of the window's edge take the mask; the rest
        run unmasked, each kind in a loop of its own (a runtime choice between the two would keep
        both versions of the row's 128 scores live)."""
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.s_lookahead)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for tile_index in cutlass.range(tiles.count, unroll=1):
            tile = tiles.problem(tile_index)
            s_state, stats_state = self.softmax_tile(stage, res, sync, tile, s_state, stats_state)

    @protocol
    @cute.jit
    def softmax_tile(self, stage: cutlass.Constexpr[int], res, sync: Sync, tile, s_state, stats_state):
        """Softmax i over one tile's key blocks, with a fresh row maximum and sum. Returns the
        advanced pipeline states."""
        n_blocks = tile.n_blocks
        block = self.softmax_registers(stage, res)
        m_block = self.row_block(tile, stage)
        n_block_min = tile.n_block_min
        stage_blocks = tile.stage_blocks
        n_block = n_block_min + n_blocks - 1
        step = functools.partial(self.softmax_block, stage, block, sync, tile, m_block)
        s_state, stats_state = step(s_state, stats_state, n_block, masked=True, first=True)
        n_block -= 1
        if cutlass.const_expr(self.causal or self.local):
            right_masked = stage_blocks.n_block_min_right_masked(m_block, n_block_min, tile.seqlen_q,
                                                                 tile.seqlen_k)
            for _ in cutlass.range(n_block + 1 - right_masked, unroll=1):
                s_state, stats_state = step(s_state, stats_state, n_block, masked=True)
                n_block -= 1
        unmasked = stage_blocks.n_block_min_unmasked(m_block, n_block_min, tile.seqlen_q, tile.seqlen_k)
        for _ in cutlass.range(n_block + 1 - unmasked, unroll=1):
            s_state, stats_state = step(s_state, stats_state, n_block, masked=False)
            n_block -= 1
        if cutlass.const_expr(self.local):
            for _ in cutlass.range(n_block + 1 - n_block_min, unroll=1):
                s_state, stats_state = step(s_state, stats_state, n_block, masked=True)
                n_block -= 1
        sync.acquire(f"STATS{stage}", stats_state)
        self.publish_row_stats(stage, block)
        sync.commit(f"STATS{stage}", stats_state)
        stats_state.advance()
        return s_state, stats_state

    @action
    @cute.jit
    def softmax_registers(self, stage: cutlass.Constexpr[int], res) -> "_SoftmaxBlock":
        """Softmax i's views of its row: S_i's and P_i's TMEM columns and their copies, the
        score registers, P's chunk registers and a fresh online softmax."""
        row = cute.arch.thread_idx()[0] % ROWS_PER_STAGE
        # Either CTA of a pair sees its 128 rows of S in its own TMEM the same way.
        thr_qk = res.tiled_mma_qk.get_slice(0)
        tStS = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.mma_rows, self.tile_n)))
        scores_tmem = cute.make_tensor(res.tmem_ptr + self.tmem.s(stage), tStS.layout)[(None, None), 0, 0]
        probs_tmem = cute.make_tensor(
            scores_tmem.iterator + self.tmem.p(stage) - self.tmem.s(stage),
            cute.composition(scores_tmem.layout, cute.make_layout((ROWS_PER_STAGE, self.tile_n // 2))))
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tiled_load = tcgen05.make_tmem_copy(load_atom, scores_tmem)
        thr_load = tiled_load.get_slice(row)
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, probs_tmem).get_slice(row)
        coords = cute.make_identity_tensor((ROWS_PER_STAGE, self.tile_n))
        scores = cute.make_rmem_tensor(thr_load.partition_D(coords).shape, Float32)
        # P goes to TMEM a chunk of P_CHUNK keys at a time, so that the fp32 scores die as their
        # 16-bit P forms: the whole row of both would not fit the softmax's 192 registers.
        probs_chunk_f32 = cute.make_rmem_tensor(
            thr_store.partition_S(cute.make_identity_tensor((ROWS_PER_STAGE, self.tile_n // 2)))[
                None, None, 0].shape, Float32)
        row_view = cute.make_layout((1, self.tile_n))
        return _SoftmaxBlock(
            thr_load=thr_load, scores_tmem=thr_load.partition_S(scores_tmem), scores=scores,
            scores_row=cute.make_tensor(scores.iterator, row_view),
            coords_row=cute.composition(tiled_load.get_slice(0).partition_D(coords), row_view),
            thr_store=thr_store, probs_tmem=thr_store.partition_D(probs_tmem),
            probs_chunk_f32=probs_chunk_f32,
            probs_chunk=cute.make_tensor(cute.recast_ptr(probs_chunk_f32.iterator, dtype=self.dtype),
                                         cute.make_layout(P_CHUNK)),
            softmax=OnlineSoftmax.create(self.softmax_config, res.scale_log2, 1, lanes_per_row=1),
            row_scale=cute.make_rmem_tensor((1,), Float32), row=row, row_stats=res.row_stats,
            score_prescale=res.score_prescale,
        )

    @protocol
    @cute.jit
    def softmax_block(self, stage: cutlass.Constexpr[int], block, sync: Sync, tile, m_block, s_state, stats_state,
                      n_block, masked: cutlass.Constexpr[bool], first: cutlass.Constexpr[bool] = False):
        """One key block of softmax i: wait for S_i, mask (statically), the online softmax step,
        the row scale to the correction (not for the first block: O_i is still empty), P_i into
        TMEM, S_i's columns released. Returns the advanced states. With one stage the block's S
        and P are in the S buffer of this use (the ring's index)."""
        buffer = self.s_buffer(block, s_state.index)
        sync.wait(f"S{stage}", s_state)
        _tcgen05_after_sync()
        self.softmax_scores(block, buffer, tile, m_block, n_block, masked=masked)
        if cutlass.const_expr(not first):
            sync.acquire(f"STATS{stage}", stats_state)
            self.publish_row_scale(stage, block)
            sync.commit(f"STATS{stage}", stats_state)
            stats_state.advance()
        self.write_probs(block, buffer)
        sync.release(f"S{stage}", s_state)
        s_state.advance()
        return s_state, stats_state

    @action
    @cute.jit
    def s_buffer(self, block, index) -> "_SBuffer":
        """This thread's views of S and P in the S buffer of ring index `index` (with two stages
        each stage has one: its own)."""
        scores_tmem, probs_tmem = block.scores_tmem, block.probs_tmem
        if cutlass.const_expr(self.config.s_lookahead > 1):
            columns = index * self.tile_n
            scores_tmem = cute.make_tensor(scores_tmem.iterator + columns, scores_tmem.layout)
            probs_tmem = cute.make_tensor(probs_tmem.iterator + columns, probs_tmem.layout)
        return _SBuffer(scores_tmem, probs_tmem)

    @action
    @cute.jit
    def softmax_scores(self, block, buffer, tile, m_block, n_block, masked: cutlass.Constexpr[bool]):
        """The row of S into registers, softcapped and masked, and the online softmax's step
        (the row's new maximum, its probabilities in place, the row scale)."""
        cute.copy(block.thr_load, buffer.scores_tmem, block.scores)
        cute.arch.fence_view_async_tmem_load()
        if cutlass.const_expr(self.has_softcap):
            for c in cutlass.range_constexpr(cute.size(block.scores)):
                block.scores[c] = cute.math.tanh(block.scores[c] * block.score_prescale, fastmath=True)
        if cutlass.const_expr(masked):
            tile.mask.apply(block.scores_row, block.coords_row, block.row, Int32(0), m_block, n_block,
                            tile.seqlen_q, tile.seqlen_k)
        block.softmax.step(block.scores_row, block.row_scale)

    @action
    @cute.jit
    def publish_row_scale(self, stage: cutlass.Constexpr[int], block):
        block.row_stats[block.row, STAT_SCALE, stage] = block.row_scale[0]

    @action
    @cute.jit
    def publish_row_stats(self, stage: cutlass.Constexpr[int], block):
        block.row_stats[block.row, STAT_SUM, stage] = block.softmax.row_sum[0]
        block.row_stats[block.row, STAT_MAX, stage] = block.softmax.row_max[0]

    @action
    @cute.jit
    def write_probs(self, block, buffer):
        """P (16-bit) into the second half of the S buffer's columns, a chunk at a time, and the
        stores ordered before the release that follows."""
        scores_flat = cute.make_tensor(block.scores.iterator, cute.make_layout(self.tile_n))
        for chunk in cutlass.range_constexpr(self.tile_n // P_CHUNK):
            block.probs_chunk.store(cute.local_tile(scores_flat, (P_CHUNK,), (chunk,)).load().to(self.dtype))
            cute.copy(block.thr_store, block.probs_chunk_f32, buffer.probs_tmem[None, None, chunk])
        cute.arch.fence_view_async_tmem_store()
        _tcgen05_before_sync()

    # --- correction warp group ----------------------------------------------------------------

    @protocol
    @cute.jit
    def correction(self, res, sync: Sync, tiles):
        """Per tile, O_i's rescales in TMEM, then O = O_i / ℓ through shared memory and a TMA
        store, and LSE, one row per thread; then Q's buffers back to the load warp once the
        stores have read them."""
        regs = self.correction_registers(res)
        # The stages' pipelines go through the same phases in step: one state each.
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.s_lookahead)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        for tile_index in cutlass.range(tiles.count, unroll=1):
            tile = tiles.problem(tile_index)
            n_blocks = tile.n_blocks
            for i in cutlass.range_constexpr(self.q_stages):
                self.release_o(sync, i, s_state)
            s_state.advance()
            for block in cutlass.range(1, n_blocks, unroll=1):
                for i in cutlass.range_constexpr(self.q_stages):
                    sync.wait(f"STATS{i}", stats_state)
                    scale = self.read_row_scale(regs, i)
                    sync.release(f"STATS{i}", stats_state)
                    if cutlass.const_expr(self.config.s_lookahead > 1):
                        # The S GEMM softmax waited for came before the previous P·V: wait
                        # for that P·V to have added into O.
                        sync.wait(f"PV{i}", pv_state)
                    self.rescale_o(regs, i, scale)
                    if cutlass.const_expr(self.config.s_lookahead > 1):
                        _tcgen05_before_sync()
                        sync.release(f"PV{i}", pv_state)
                    self.release_o(sync, i, s_state)
                stats_state.advance()
                pv_state.advance()
                s_state.advance()
            for i in cutlass.range_constexpr(self.q_stages):
                sync.wait(f"STATS{i}", stats_state)
                stats = self.read_row_stats(regs, i)
                sync.release(f"STATS{i}", stats_state)
                sync.wait(f"O{i}", o_state)
                _tcgen05_after_sync()
                self.store_final_stage(regs, tile, i, stats)
            stats_state.advance()
            # The next tile's first P_i·V overwrites O_i in TMEM only after this warp group's
            # next release of S_i (`release_o`, fenced after these reads).
            o_state.advance()
            for i in cutlass.range_constexpr(self.q_stages):
                # Stage i's store (of the q_stages this thread just issued) has read Q_i's
                # buffer.
                sync.release_after_bulk_store("Q", q_state, self.q_stages - 1 - i, regs.row)
                q_state.advance()

    @action
    @cute.jit
    def correction_registers(self, res) -> "_CorrectionRegisters":
        """The correction's views: each stage's O in TMEM as 16-column chunks of this thread's
        row, their copies and registers, and the epilogue's destinations."""
        row = cute.arch.thread_idx()[0] % ROWS_PER_STAGE
        # Either CTA of a pair sees its 128 rows of O in its own TMEM the same way.
        thr_pv = res.tiled_mma_pv.get_slice(0)
        tOtO = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.mma_rows, self.head_dim_v)))
        outs = [cute.make_tensor(res.tmem_ptr + self.tmem.o(i), tOtO.layout)[(None, None), 0, 0]
                for i in range(self.q_stages)]
        chunk_layout = cute.make_layout((ROWS_PER_STAGE, O_CHUNK))
        chunk = cute.composition(outs[0], chunk_layout)
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32)
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, chunk).get_slice(row)
        thr_store = tcgen05.make_tmem_copy(store_atom, chunk).get_slice(row)
        chunk_regs = cute.make_rmem_tensor(
            thr_load.partition_D(cute.make_identity_tensor((ROWS_PER_STAGE, O_CHUNK))).shape, Float32)
        return _CorrectionRegisters(
            row=row, thr_load=thr_load, thr_store=thr_store, chunk_regs=chunk_regs,
            loads=tuple(thr_load.partition_S(cute.composition(outs[i], chunk_layout)) for i in range(self.q_stages)),
            stores=tuple(thr_store.partition_D(cute.composition(outs[i], chunk_layout)) for i in range(self.q_stages)),
            row_stats=res.row_stats, epilogue=res.epilogue, scale_log2=res.scale_log2)

    @action
    @cute.jit
    def read_row_scale(self, regs, stage: cutlass.Constexpr[int]):
        return regs.row_stats[regs.row, STAT_SCALE, stage]

    @action
    @cute.jit
    def rescale_o(self, regs, stage: cutlass.Constexpr[int], scale):
        """O_i's row times `scale` in TMEM, when any row of the warp moved its maximum (the
        warp's 32 rows share its TMEM lanes: rescale them all if any moved)."""
        if cute.arch.vote_any_sync(scale != Float32(1.0)):
            _tcgen05_after_sync()
            for c in cutlass.range_constexpr(self.head_dim_v // O_CHUNK):
                self.o_chunk_copy(regs.thr_load, regs.loads[stage], regs.chunk_regs, c, to_registers=True)
                for e in cutlass.range_constexpr(cute.size(regs.chunk_regs)):
                    regs.chunk_regs[e] = regs.chunk_regs[e] * scale
                self.o_chunk_copy(regs.thr_store, regs.stores[stage], regs.chunk_regs, c, to_registers=False)
            cute.arch.fence_view_async_tmem_store()

    @action
    @cute.jit
    def read_row_stats(self, regs, stage: cutlass.Constexpr[int]) -> OnlineSoftmax:
        """The row's final sum and maximum, as an online softmax's state."""
        stats = OnlineSoftmax.create(self.softmax_config, regs.scale_log2, 1, lanes_per_row=1)
        stats.row_sum[0] = regs.row_stats[regs.row, STAT_SUM, stage]
        stats.row_max[0] = regs.row_stats[regs.row, STAT_MAX, stage]
        return stats

    @action
    @cute.jit
    def store_final_stage(self, regs, tile, stage: cutlass.Constexpr[int], stats):
        """Stage i's O / ℓ and LSE out (`store_stage`)."""
        inv_sum = cute.make_rmem_tensor((1,), Float32)
        lse = cute.make_rmem_tensor((1,), Float32)
        stats.finalize(inv_sum, lse)
        self.store_stage(regs.thr_load, regs.loads[stage], regs.chunk_regs, regs.epilogue, tile, stage, regs.row,
                         inv_sum[0], lse[0])

    @protocol
    @cute.jit
    def release_o(self, sync: Sync, stage: cutlass.Constexpr[int], state):
        """O_i is rescaled for the next P_i·V (arrives on S_i's empty barrier)."""
        _tcgen05_before_sync()
        sync.release(f"S{stage}", state)

    @cute.jit
    def o_chunk_copy(self, thr_copy, tmem_part, regs, chunk: cutlass.Constexpr[int],
                     to_registers: cutlass.Constexpr[bool]):
        """Columns [chunk·16, chunk·16 + 16) of this thread's O row, TMEM <-> registers."""
        shifted = cute.make_tensor(tmem_part.iterator + chunk * O_CHUNK, tmem_part.layout)
        if cutlass.const_expr(to_registers):
            cute.copy(thr_copy, shifted, regs)
            cute.arch.fence_view_async_tmem_load()
        else:
            cute.copy(thr_copy, regs, shifted)

    @cute.jit
    def store_stage(self, thr_load, tmem_part, chunk_regs, epilogue, tile, stage: cutlass.Constexpr[int],
                    row_in_stage, inv_sum, lse):
        """Stage i's rows: this thread's O·(1/ℓ) (0 past the entry's rows) into sO[i], its LSE
        (−inf there) to global memory, then, once the warp group's rows are all in, one thread's
        TMA store of the stage's tile (it stops at the buffer's rows)."""
        row = self.row_block(tile, stage) * ROWS_PER_STAGE + row_in_stage
        live = row < tile.seqlen_q
        if not live:
            inv_sum = Float32(0.0)
            lse = Float32(-math.inf)
        sO_row = epilogue.sO[stage][row_in_stage, None]
        out_chunk = cute.make_rmem_tensor((O_CHUNK,), self.dtype)
        for c in cutlass.range_constexpr(self.head_dim_v // O_CHUNK):
            self.o_chunk_copy(thr_load, tmem_part, chunk_regs, c, to_registers=True)
            for e in cutlass.range_constexpr(O_CHUNK):
                out_chunk[e] = (chunk_regs[e] * inv_sum).to(self.dtype)
            if not live:
                out_chunk.fill(0.0)
            cute.autovec_copy(out_chunk, cute.local_tile(sO_row, (O_CHUNK,), (c,)))
        if row < tile.seqlen_q_buf:
            epilogue.mLSE[row, tile.head, tile.batch] = lse
        # Ordinary stores made visible to the TMA (the async proxy), then the group's rows joined.
        cute.arch.fence_view_async_shared()
        pipeline.NamedBarrier(barrier_id=int(Barrier.O_STORE), num_threads=self.roles.threads(Role.CORRECTION)).arrive_and_wait()
        if row_in_stage == 0:
            gO = cute.flat_divide(epilogue.mO[None, None, tile.head, tile.batch], (ROWS_PER_STAGE, self.head_dim_v))
            tOsO, tOgO = cpasync.tma_partition(epilogue.tma_atom_o, 0, cute.make_layout(1),
                                               cute.group_modes(epilogue.sO[stage], 0, 2),
                                               cute.group_modes(gO, 0, 2))
            cute.copy(epilogue.tma_atom_o, tOsO, tOgO[None, self.row_block(tile, stage), 0])
            cute.arch.cp_async_bulk_commit_group()
