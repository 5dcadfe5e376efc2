"""Export FA4 upstream's Hopper backward (flash-attn-4's FlashAttentionBackwardPreprocess,
FlashAttentionBackwardSm90 and the dQ FlashAttentionBackwardPostprocess, unchanged) for one head
dim and mask through the DSL's export_to_c, as one entry that launches the three kernels in
upstream's order. Run by build.py in the environment export_fwd.py runs in (same imports, same
torch stub: export_fwd.import_upstream).

    python export_bwd.py FLASH_ATTN_SRC OUT_DIR HEAD_DIM CAUSAL

What upstream's `_flash_attn_bwd` does on sm90 for bf16 without GQA, window, softcap, score or
mask mods, block sparsity, ragged lengths, learnable sink or dLSE, non-deterministic, is what the
entry does: the tile is upstream's (`_tile_size_bwd_sm90`), the kernel objects are built with the
arguments upstream gives them (q_subtile_factor 2 without block sparsity, the dQ postprocess on
one warpgroup when dQ_single_wg, else on the main kernel's MMA warpgroups), and the fake tensors
are the ones upstream compiles its preprocess and postprocess from (`make_fake_bwd_tensors`:
every dim dynamic, 16-byte divisibility on the contiguous mode). The caller owns upstream's
workspaces, shaped as upstream allocates them (QUERY_ROWS = seqlen_q rounded up to tile_m,
ACCUM_HEAD_DIM = head_dim rounded up to `hdim_multiple_of`):

    mdQaccum  f32 [b, h, QUERY_ROWS * ACCUM_HEAD_DIM]  dQ accumulated by the main kernel; zeroed
                                                       by the preprocess kernel, as upstream does
    mdPsum    f32 [b, h, QUERY_ROWS]                   rowsum(dO * O), by the preprocess kernel
    mLSElog2  f32 [b, h, QUERY_ROWS]                   lse * log2(e), by the preprocess kernel

The tile (and so the workspace shape) is written beside the export as NAME.json for build.py.
"""
import json
import os
import sys

from export_fwd import import_upstream

ARCH = 90  # what upstream's _get_device_arch() reads on an H100/H200


def main(flash_attn_src: str, out_dir: str, head_dim: int, causal: bool) -> None:
    import_upstream(flash_attn_src)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess
    from flash_attn.cute.flash_bwd_preprocess import FlashAttentionBackwardPreprocess
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.interface import _tile_size_bwd_sm90, make_fake_bwd_tensors
    from flash_attn.cute.utils import AuxData

    config = _tile_size_bwd_sm90(head_dim, head_dim, causal, False)
    num_threads = (config.num_wg + 1) * 128
    # interface.py: "Keep accumulator allocation, zeroing, and readback aligned with SM90's
    # swapped MMA."
    hdim_multiple_of = 64 if config.dKV_swapAB else 32
    accum_head_dim = -(-head_dim // hdim_multiple_of) * hdim_multiple_of
    preprocess = FlashAttentionBackwardPreprocess(
        BFloat16, head_dim, head_dim, config.m_block_size, use_padded_offsets=True,
        nheads_major=False, pack_gqa=False, qhead_per_kvhead=1, nheads_kv=1,
        hdim_multiple_of=hdim_multiple_of)
    kernel = FlashAttentionBackwardSm90(
        BFloat16, head_dim, head_dim, 1, causal, is_local=False, deterministic=False,
        tile_m=config.m_block_size, tile_n=config.n_block_size, Q_stage=config.num_stages_Q,
        dO_stage=config.num_stages_dO, PdS_stage=config.num_stages_PdS,
        SdP_swapAB=config.SdP_swapAB, dKV_swapAB=config.dKV_swapAB, dQ_swapAB=config.dQ_swapAB,
        AtomLayoutMSdP=config.AtomLayoutMSdP, AtomLayoutNdKV=config.AtomLayoutNdKV,
        AtomLayoutMdQ=config.AtomLayoutMdQ, num_threads=num_threads, V_in_regs=False,
        score_mod=None, score_mod_bwd=None, mask_mod=None, has_aux_tensors=False,
        q_subtile_factor=2, dQ_single_wg=config.dQ_single_wg)
    postprocess = FlashAttentionBackwardPostprocess(
        BFloat16, head_dim, ARCH, config.m_block_size,
        128 if config.dQ_single_wg else config.num_wg * 128, config.AtomLayoutMdQ,
        config.dQ_swapAB, use_2cta_instrs=False, cluster_size=1,
        hdim_multiple_of=hdim_multiple_of, accum_order=None)

    (mQ, mK, mV, mO, mdO, mdQ, mdK, mdV, mLSE, mLSElog2, mdPsum, mdQaccum,
     *_) = make_fake_bwd_tensors(BFloat16, has_gqa=False, varlen_q=False, varlen_k=False)

    @cute.jit
    def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
              mdO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
              mdV: cute.Tensor, mdQaccum: cute.Tensor, mdPsum: cute.Tensor,
              mLSElog2: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        # dPsum, lse·log2(e), dQaccum := 0 (no ragged lengths, dLSE, row max or O residual;
        # upstream passes softmax_scale 1.0, read only with the row max).
        preprocess(mO, mdO, mdPsum, mLSE, mLSElog2, mdQaccum, None, None, None, None, None,
                   Float32(1.0), None, None, stream)
        # dK, dV and dQaccum (no ragged lengths, window, semaphores, aux data or block sparsity).
        kernel(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, softmax_scale, None, None,
               None, None, None, None, None, None, None, AuxData(None, None), None, None, stream)
        # dQ = softmax_scale * dQaccum, in bf16 (no ragged lengths or learnable sink).
        postprocess(mdQaccum, mdQ, softmax_scale, None, None, None, None, stream)

    name = f"upstream_bwd_d{head_dim}" + ("_causal" if causal else "")
    compiled = cute.compile(entry, mQ, mK, mV, mO, mdO, mLSE, mdQ, mdK, mdV, mdQaccum, mdPsum,
                            mLSElog2, Float32(0.0), cute.runtime.make_fake_stream(),
                            options="--gpu-arch sm_90a")
    compiled.export_to_c(out_dir, name, function_prefix=name)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"tile_m": config.m_block_size, "tile_n": config.n_block_size,
                   "accum_head_dim": accum_head_dim}, f)
    print(f"{name}: tile {config.m_block_size} x {config.n_block_size}, dQ accumulator head dim "
          f"{accum_head_dim}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
