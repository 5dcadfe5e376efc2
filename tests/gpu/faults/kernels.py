"""Deliberately broken sm_90a forward kernels, for the GPU tier's proof that the first-use check
survives what a never-run kernel may do on first contact with hardware (tests/gpu/test_faults_gpu.py).

Each takes the forward's arguments (fa4_jax/aot/compile.py's TENSORS and SCALARS), so the build
exports and links it as an ordinary variant of the forward problem class it is named for:

- `RegisterPoolHang`: the shipped Hopper forward with its two MMA warp groups' setmaxnreg budgets
  raised from 240 to 248: 24 + 248 + 248 per thread slot over 384 threads launched at 168
  registers asks 66,560 of the CTA's pool of 64,512, so the second increase waits forever (the
  register rule of kernels/common/registers.py, which the shipped 240 keeps);
- `WrongScale`: the shipped forward with its softmax scale 1.25 times the call's;
- `Trap`: a kernel that executes `trap`;
- `BadAddress`: a kernel that stores far outside any allocation;
and a module that cannot load is the shipped forward's object with its image corrupted
(`build.py`).
"""
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

from fa4_jax.kernels.sm90.fwd import FlashAttentionForwardSm90

# The MMA warp groups' budget that no longer fits the pool (the shipped one is 240).
OVER_POOL_MMA_REGISTERS = 248
WRONG_SCALE = 1.25


class RegisterPoolHang(FlashAttentionForwardSm90):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.num_threads == 384, "the pool's arithmetic above is for two MMA warp groups"
        self.mma_registers = OVER_POOL_MMA_REGISTERS


class WrongScale(FlashAttentionForwardSm90):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, mQSegmentIds: cute.Tensor,
                 mKSegmentIds: cute.Tensor, mRowSpans: cute.Tensor, mKeySpans: cute.Tensor, mMaskBits: cute.Tensor,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 top_left: Int32, stream: cuda.CUstream):
        FlashAttentionForwardSm90.__call__(self, mQ, mK, mV, mO, mLSE, mSeqUsedQ, mSeqUsedK, mQSegmentIds,
                                           mKSegmentIds, mRowSpans, mKeySpans, mMaskBits,
                                           softmax_scale * Float32(WRONG_SCALE), softcap, window_left,
                                           window_right, top_left, stream)


class _OneWarp:
    """A one-warp kernel with the forward's arguments, whose body is `fault`."""

    def __init__(self, dtype, head_dim, head_dim_v, mask, has_softcap, segments=False, mask_array=False):
        pass

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, mQSegmentIds: cute.Tensor,
                 mKSegmentIds: cute.Tensor, mRowSpans: cute.Tensor, mKeySpans: cute.Tensor, mMaskBits: cute.Tensor,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 top_left: Int32, stream: cuda.CUstream):
        self.kernel(mLSE).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLSE: cute.Tensor):
        self.fault(mLSE)


class Trap(_OneWarp):
    @cute.jit
    def fault(self, mLSE: cute.Tensor):
        llvm.intr_trap()


class BadAddress(_OneWarp):
    @cute.jit
    def fault(self, mLSE: cute.Tensor):
        # 16 TiB past LSE's buffer: no allocation is there.
        far = cute.make_ptr(Float32, mLSE.iterator.toint() + (1 << 44), cute.AddressSpace.gmem)
        cute.make_tensor(far, cute.make_layout(1))[0] = Float32(1.0)
