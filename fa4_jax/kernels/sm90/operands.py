"""What the Hopper forward and backward kernels both build: WGMMA shared-memory operand layouts,
the GEMM issue of one WGMMA batch, and the TMA-filled shared-memory rings."""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def _swizzle_width(dtype, cols: int) -> int:
    """Elements per row of the widest swizzle atom (128, 64 or 32 bytes; else 16) that tiles cols."""
    return next(w for w in (128, 64, 32, 16) if cols % (w * 8 // dtype.width) == 0) * 8 // dtype.width


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None, split: int | None = None):
    """Row-major, swizzled tile (cols contiguous), as TMA writes it and WGMMA reads it.

    `split`: the column slice one warp group reads (as an MN-major WGMMA operand, or writes from
    its registers); the swizzle atom is narrowed when the natural one cuts across slices (bf16
    d96: 48 of 96, d192: 96 of 192; fp32 d96: 48 of 96).
    """
    major = cols
    if split is not None:
        natural = _swizzle_width(dtype, cols)
        if split % natural != 0 and natural % split != 0:
            major = split
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


@cute.jit
def wgmma_gemm(tiled_mma, acc, frag_a, frag_b, zero_init: cutlass.Constexpr[bool],
               wait_group: cutlass.Constexpr[int], k_blocks: cutlass.Constexpr[int] = 0):
    """acc (+)= A·B over the k blocks (the first `k_blocks` of them, if nonzero) as one WGMMA
    batch; then wait until at most `wait_group` batches are in flight (-1: don't wait)."""
    warpgroup.fence()
    # A fresh atom per GEMM: its ACCUMULATE field is mutated across the k loop.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(k_blocks or cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait_group >= 0):
        warpgroup.wait_group(wait_group)


def tma_pipeline(barriers, num_stages: int, consumer_arrivals: int, tx_count: int):
    """A ring of num_stages shared buffers that one producer thread fills by TMA.

    `barriers` is the ring's mbarrier storage (2 per stage); a stage frees after
    `consumer_arrivals` arrivals: the number of consumer warps (the pipeline elects one lane per
    warp), or 1 for a buffer that one thread releases. Barrier initialisation is deferred to the
    kernel's one `pipeline_init_arrive` / `pipeline_init_wait` pair.
    """
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(), num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
        tx_count=tx_count, defer_sync=True,
    )


def swizzled_tensor(storage_field, layout):
    """A shared-memory struct field viewed through a swizzled (composed) layout."""
    return storage_field.get_tensor(layout.outer, swizzle=layout.inner)
