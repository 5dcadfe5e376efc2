"""Export FA4 upstream's Hopper forward (flash-attn-4's FlashAttentionForwardSm90, unchanged) for
one head dim and mask through the DSL's export_to_c. Run by build.py in an environment that has
flash-attn-4's source, nvidia-cutlass-dsl, quack-kernels, einops and apache-tvm-ffi but no torch.

    python export_fwd.py FLASH_ATTN_SRC OUT_DIR HEAD_DIM CAUSAL

Upstream's package __init__s import torch and triton, which this machine's build has no use for:
flash_attn, flash_attn.cute and quack are registered as bare packages, and torch resolves to the
permissive stub beside this file (names only, no behaviour: upstream touches torch at import time
for dtype tables, annotations and decorators); export_bwd.py imports upstream the same way
(import_upstream). The kernel takes upstream's tile choice for the head dim
(`_tile_size_fwd_sm90`) and the fake tensors upstream's runtime makes (every dim dynamic, 16-byte
divisibility on the contiguous mode). export_to_c cannot take upstream's AuxData argument, so a
@cute.jit entry with the five tensors, the scale and the stream passes the fixed rest.
"""
import importlib.util
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def _bare_package(name: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__package__ = name
    sys.modules[name] = module
    return module


def import_upstream(flash_attn_src: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "torch_stub"))
    _bare_package("flash_attn", os.path.join(flash_attn_src, "flash_attn"))
    _bare_package("flash_attn.cute", os.path.join(flash_attn_src, "flash_attn", "cute"))
    quack_dir = os.path.dirname(importlib.util.find_spec("quack").origin)
    _bare_package("quack", quack_dir)
    import quack.dsl  # noqa: F401  (the tensor-indexing additions quack/__init__.py installs)


def main(flash_attn_src: str, out_dir: str, head_dim: int, causal: bool) -> None:
    import_upstream(flash_attn_src)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.interface import _tile_size_fwd_sm90
    from flash_attn.cute.utils import AuxData
    from quack.compile_utils import make_fake_tensor

    config = _tile_size_fwd_sm90(head_dim, head_dim, causal, False)
    kernel = FlashAttentionForwardSm90(
        BFloat16, head_dim, head_dim, 1, is_causal=causal, is_local=False, pack_gqa=False,
        tile_m=config.m_block_size, tile_n=config.n_block_size, num_stages=2, num_threads=384,
        Q_in_regs=False, intra_wg_overlap=config.intra_wg_overlap,
        mma_pv_is_rs=config.mma_pv_is_rs, mask_mod=None, score_mod=None, has_aux_tensors=False,
        q_subtile_factor=1, paged_kv_non_tma=False)
    b, sq, sk, h, d = (cute.sym_int() for _ in range(5))
    mQ, mK, mV, mO = (make_fake_tensor(BFloat16, (b, s, h, d), divisibility=8)
                      for s in (sq, sk, sk, sq))
    mLSE = make_fake_tensor(Float32, (b, h, sq), divisibility=1)

    @cute.jit
    def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
              mLSE: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        kernel(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, None, None, None,
               None, None, AuxData(None, None), None, None, stream)

    name = f"upstream_fwd_d{head_dim}" + ("_causal" if causal else "")
    compiled = cute.compile(entry, mQ, mK, mV, mO, mLSE, Float32(0.0),
                            cute.runtime.make_fake_stream(), options="--gpu-arch sm_90a")
    compiled.export_to_c(out_dir, name, function_prefix=name)
    print(f"{name}: tile {config.m_block_size} x {config.n_block_size}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
