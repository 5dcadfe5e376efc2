"""CPU tier: P's TMEM address as P·V's A operand. The kernel builds it by recasting an fp32
column pointer (`FlashAttentionForwardSm100.probs_tmem`); FA4 upstream moves the TS MMA
fragment's own 16-bit iterator by twice P's column offset. Both are evaluated here by the DSL's
own pointer arithmetic, in a host function compiled and run on the CPU, for every S buffer of
every shipped tile shape: equal at TMEM base 0 (every shipped variant allocates all 512 columns,
so its base is column 0), and the kernel's form also carries any other base along, which the
fragment's (anchored at 0) would not."""
import types

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor  # noqa: E402

from fa4_jax.kernels.sm100 import fwd, hardware, menu as sm100, plan  # noqa: E402

SHAPES = sorted({(v.head_dim, v.head_dim_v, v.tuning) for v in sm100.MENU})


def p_addresses(kernel):
    """A host function of a TMEM base column that writes, per S buffer, the column of P as the
    kernel computes it and as the fragment's 16-bit iterator does."""

    @cute.jit
    def addresses(out: cute.Tensor):
        tiled_mma_qk, tiled_mma_pv = kernel.tiled_mmas()
        thr_qk, thr_pv = tiled_mma_qk.get_slice(0), tiled_mma_pv.get_slice(0)
        tStS = thr_qk.make_fragment_C(thr_qk.partition_shape_C((kernel.mma_rows, kernel.tile_n)))
        tOrP = thr_pv.make_fragment_A(cute.make_tensor(tStS.iterator, kernel.probs_layout(tiled_mma_pv).outer))[
            None, None, None, 0]
        base = cute.make_ptr(Float32, out[0], cute.AddressSpace.tmem)
        ops = types.SimpleNamespace(tmem_ptr=base, probs_type=tOrP.element_type, probs_layout=tOrP.layout)
        halves_per_column = Float32.width // kernel.dtype.width
        for buffer in range(plan.S_BUFFERS):
            ours = kernel.probs_tmem(ops, buffer)
            assert ours.layout == tOrP.layout
            out[1 + 2 * buffer] = ours.iterator.toint()
            out[2 + 2 * buffer] = (tOrP.iterator + kernel.tmem.p(buffer) * halves_per_column).toint()

    compiled = cute.compile(addresses, make_fake_compact_tensor(cutlass.Int32, (1 + 2 * plan.S_BUFFERS,)))

    def run(base: int) -> np.ndarray:
        out = np.zeros(1 + 2 * plan.S_BUFFERS, np.int32)
        out[0] = base
        compiled(from_dlpack(out))
        return out[1:].reshape(plan.S_BUFFERS, 2)

    return run


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "_".join(map(str, s)))
def test_p_is_where_the_fragment_form_puts_it(shape):
    head_dim, head_dim_v, tuning = shape
    kernel = fwd.FlashAttentionForwardSm100(cutlass.BFloat16, head_dim, head_dim_v, "none", False,
                                            **sm100.TUNINGS[tuning])
    assert kernel.tmem.alloc_columns == hardware.TMEM_COLUMNS  # so the allocation's base is column 0
    addresses = p_addresses(kernel)
    expected = [kernel.tmem.p(buffer) for buffer in range(plan.S_BUFFERS)]
    ours, upstream = addresses(0).T
    assert list(ours) == list(upstream) == expected
    # The kernel's form follows the base; the fragment's stays at column 0's offsets.
    ours, upstream = addresses(256).T
    assert list(ours) == [256 + p for p in expected] and list(upstream) == expected
