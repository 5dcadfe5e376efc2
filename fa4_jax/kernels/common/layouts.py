"""Register-fragment views of WGMMA accumulators, shared by the Hopper and Blackwell kernels.

A Hopper WGMMA accumulator fragment has the per-thread layout ((2, 2, V), MMA_M, MMA_N): two
adjacent columns, two rows eight apart, and V groups of eight columns. Softmax wants it as a
(rows, cols) matrix; the P·V GEMM wants the same registers as an A operand,
((2, 2, 2), MMA_M, K/16), where each pair of eight-column groups forms one k16 block. Both are
re-indexings of the same registers (no data moves), so P never leaves the register file.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def _compose(layout, view_shape, view_stride):
    """`layout` re-indexed by a view expressed on its compact column-major domain."""
    return cute.composition(layout, cute.make_layout(view_shape, stride=view_stride))


def acc_rows_cols(tensor: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) accumulator-shaped tensor -> ((2, M), (2, V, N)) rows x cols view."""
    compact = cute.make_layout(tensor.layout.shape)
    sh, st = compact.shape, compact.stride
    layout = _compose(
        tensor.layout,
        ((sh[0][1], sh[1]), (sh[0][0], sh[0][2], sh[2])),
        ((st[0][1], st[1]), (st[0][0], st[0][2], st[2])),
    )
    return cute.make_tensor(tensor.iterator, layout)


def acc_as_operand_a(tensor: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) accumulator-shaped tensor -> ((2, 2, 2), M, (V/2, N)) WGMMA A fragment."""
    compact = cute.make_layout(tensor.layout.shape)
    sh, st = compact.shape, compact.stride
    groups = sh[0][2]
    assert groups % 2 == 0, "P·V needs whole k16 blocks: the tile's N must be a multiple of 16"
    layout = _compose(
        tensor.layout,
        ((sh[0][0], sh[0][1], 2), sh[1], (groups // 2, sh[2])),
        ((st[0][0], st[0][1], st[0][2]), st[1], (2 * st[0][2], st[2])),
    )
    return cute.make_tensor(tensor.iterator, layout)


def acc_prefix(tensor: cute.Tensor, shape) -> cute.Tensor:
    """The first columns of a ((2, 2, V), 1, 1) accumulator (one WGMMA's) as a fragment of
    `shape`, ((2, 2, W), 1, 1) with W <= V: exactly the registers that a WGMMA of the narrower N
    writes, since a column's eight-column group is the outermost register mode."""
    compact = cute.make_layout(shape)
    return cute.make_tensor(tensor.iterator, cute.composition(tensor.layout, compact))


def opaque_int32(x):
    """x, through an asm statement the compiler may neither hoist nor merge with another copy.

    Per-thread addresses derived from it are computed where they are used. In a persistent
    kernel the epilogue's 32 swizzled shared-memory addresses depend only on the thread index,
    so LLVM hoists them out of the tile loop and holds them across the whole main loop, which
    pushes the MMA warp groups past their register budget (ptxas then serialises the WGMMAs).
    """
    return Int32(
        llvm.inline_asm(
            T.i32(), [Int32(x).ir_value()], "mov.b32 $0, $1;", "=r,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


_PTX_PAIR_TYPES = {cutlass.BFloat16: "bf16", cutlass.Float16: "f16"}


def convert_pairs(src: cute.Tensor, dst: cute.Tensor) -> None:
    """dst = src (fp32) rounded to dst's 16-bit dtype, two adjacent elements per `cvt`, each
    through an asm statement.

    Both fragments are compact and alike in layout, so elements 2i and 2i+1 share one 32-bit
    register of dst (one register of a WGMMA A operand). Why not `dst.store(src.load().to(...))`:
    in the forward's main loop P is converted at the end of one step and read by the next step's
    P·V WGMMA, so after mem2reg P is a loop phi fed by two conversions (the first block's and the
    loop's). LLVM folds phi(cvt a, cvt b) into cvt(phi a b), which carries the fp32 exponentials
    across the back edge and converts them after the next Q·Kᵀ WGMMA is issued, while that WGMMA
    rewrites S's registers: at d128 with 176-key blocks, 113 spill stores. An asm statement is
    not folded, so the packed P crosses the back edge instead (no spills, 219 registers).
    """
    ptx_type = _PTX_PAIR_TYPES[dst.element_type]
    packed = cute.recast_tensor(dst, Int32)
    for i in range(cute.size(packed)):
        packed[i] = Int32(
            llvm.inline_asm(
                T.i32(), [Float32(src[2 * i]).ir_value(), Float32(src[2 * i + 1]).ir_value()],
                f"cvt.rn.{ptx_type}x2.f32 $0, $2, $1;", "=r,f,f",
                has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            )
        )


FRAGMENT_GROUP_THREADS = 128  # a warp group: the threads one WGMMA accumulator spreads over


def fragment_order_view(slab: cute.Pointer, acc_shape, thread, groups: int) -> cute.Tensor:
    """Thread `thread`'s accumulator (shape `acc_shape`, fp32) inside `slab`, a tile of the
    accumulators of `groups` warp groups stored in fragment order: warp group g's registers fill
    chunk g of the slab, and within it register j of the group's thread t sits at
    512·(j div 4) + 4·t + j mod 4.

    Each thread's four consecutive registers are one 16-byte vector, and a warp's vectors are
    512 contiguous bytes: register <-> memory copies are 128-bit and free of bank conflicts, and
    a chunk goes to global memory as one plain bulk copy. The element order is no longer the
    tile's, so whoever reads it back uses this same view with the same tiled MMA (the backward's
    dQ postprocess). `thread` counts from the first thread of the accumulator's tiled MMA.
    """
    regs = cute.size(acc_shape)
    lanes = FRAGMENT_GROUP_THREADS
    # Sliced by (thread, group) rather than offset by hand, so that CuTe knows every thread's
    # start is a whole vector (16-byte aligned) and vectorizes the copies through global memory.
    slab_tensor = cute.make_tensor(slab, cute.make_layout(
        (4, lanes, regs // 4, groups), stride=(1, 4, 4 * lanes, lanes * regs)))
    mine = slab_tensor[None, thread % lanes, None, thread // lanes]
    return cute.make_tensor(mine.iterator, cute.composition(mine.layout, cute.make_layout(acc_shape)))


def permute_modes(tensor: cute.Tensor, order) -> cute.Tensor:
    """The same memory with its modes reordered (a view; no data moves)."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=list(order)))
