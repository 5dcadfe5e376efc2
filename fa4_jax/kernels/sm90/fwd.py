"""STAND-IN for the Hopper forward kernel: the real one replaces this file on merge.

It has exactly the entry contract of the real kernel (constructor and `__call__` signature) so the
AOT build, the C++ dispatch and the FFI handler can be built and tested before that kernel lands.
It is deliberately naive: one thread per query row, fp32 loops, no tensor cores (so it holds no
HGMMA, which tests/test_build.py expects to fail until the real kernel is merged).
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

_THREADS = 128
_LOG2E = math.log2(math.e)


class FlashAttentionForwardSm90:
    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int, head_dim_v: int, mask: str,
                 has_softcap: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.mask = mask
        self.has_softcap = has_softcap

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: cutlass.Float32, softcap: cutlass.Float32,
                 window_left: cutlass.Int32, window_right: cutlass.Int32, stream: cuda.CUstream):
        b, sq, h, _ = mQ.shape
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right).launch(
            grid=((sq + _THREADS - 1) // _THREADS, h, b), block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale: cutlass.Float32, softcap: cutlass.Float32,
               window_left: cutlass.Int32, window_right: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bq, hi, bi = cute.arch.block_idx()
        i = bq * _THREADS + tidx
        sq = mQ.shape[1]
        sk = mK.shape[1]
        hki = hi // (mQ.shape[2] // mK.shape[2])
        if i < sq:
            lo = 0
            hi_k = sk
            diag = i + sk - sq
            if cutlass.const_expr(self.mask == "causal"):
                hi_k = cutlass.min(sk, diag + 1)
            if cutlass.const_expr(self.mask == "local"):
                lo = cutlass.max(0, diag - window_left)
                hi_k = cutlass.min(sk, diag + window_right + 1)
            acc = cute.make_rmem_tensor((self.head_dim_v,), cutlass.Float32)
            acc.fill(0.0)
            row_max = -cutlass.Float32.inf
            row_sum = cutlass.Float32(0.0)
            for j in cutlass.range(lo, hi_k, 1):
                s = cutlass.Float32(0.0)
                for c in cutlass.range_constexpr(self.head_dim):
                    s += mQ[bi, i, hi, c].to(cutlass.Float32) * mK[bi, j, hki, c].to(cutlass.Float32)
                s = s * softmax_scale
                if cutlass.const_expr(self.has_softcap):
                    s = softcap * cute.math.tanh(s / softcap)
                new_max = cutlass.max(row_max, s)
                corr = cute.math.exp2((row_max - new_max) * _LOG2E)
                p = cute.math.exp2((s - new_max) * _LOG2E)
                row_sum = row_sum * corr + p
                for c in cutlass.range_constexpr(self.head_dim_v):
                    acc[c] = acc[c] * corr + p * mV[bi, j, hki, c].to(cutlass.Float32)
                row_max = new_max
            inv = cutlass.Float32(0.0)
            lse = -cutlass.Float32.inf
            if row_sum > 0.0:
                inv = 1.0 / row_sum
                lse = row_max + cute.math.log(row_sum)
            for c in cutlass.range_constexpr(self.head_dim_v):
                mO[bi, i, hi, c] = (acc[c] * inv).to(self.dtype)
            mLSE[bi, hi, i] = lse
