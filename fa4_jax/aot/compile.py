"""Compile one Variant ahead of time: fake tensors -> cute.compile -> export_to_c (+ kept cubin).

`fake_args` is the single description of the kernel's argument types; the C++ dispatch
(`fa4_jax/aot/codegen.py`) fills the exported structs from the header this produces, so the two
cannot drift. Run as `python -m fa4_jax.aot.compile --serve`, a build worker, with the runtime
shim preloaded (see `toolchain.compile_env`): export_to_c resolves the launcher's runtime symbols
in-process. A worker compiles job after job (one JSON line each on stdin), so the DSL's import
and warm-up (about 5 s, more than most variants' own compile) are paid once per worker.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
import traceback

from fa4_jax.abi.segment_layout import SPAN_FIELDS

# Base pointers of XLA buffers are at least 16-byte aligned; TMA needs exactly that.
_ALIGN = 16


# Each kind's tensor arguments, in call order: name, dtype ("io" = the variant's dtype) and
# row-major dims. Lower-case dims are dynamic (runtime values the handler derives from the
# buffers' shapes); "d"/"dv" are the variant's static head dims. ffi codegen reads this too, to
# fill the exported structs.
#   sq_pad   = seqlen_q rounded up to BWD_SEQ_PAD (fa4_jax/abi/workspace.py)
#   m_blocks = sq_pad / BWD_SEMAPHORE_ROWS
#   copies   = dQ accumulators per query block: 1, or 2 for some deterministic calls
#              (BWD_MAX_DQ_COPIES; routing.dq_copies picks)
#   b_lengths = b for a ragged batch, 0 for a dense one (mSeqUsedQ / mSeqUsedK below)
#   b_dlse   = b when the caller differentiates through lse, 0 when not (mdLSE below)
# Backward workspaces (results of the FFI call, so XLA owns them; the kernels own them, the
# preprocess zeroing what needs zeros): mdQaccum accumulates dS·K in fp32 (dQ =
# softmax_scale · the sum of its copies, written to mdQ by the last pass), mdPsum holds
# D = rowsum(dO ∘ O) - dLSE, mLSElog2 holds lse · log2(e), and mSemaphore orders the dQ
# accumulation in deterministic mode (one counter per copy and 64 query rows).
# mSeqUsedQ / mSeqUsedK: each batch entry's valid query rows and keys (FlashAttention's
# seqused_q / seqused_k; the ragged batch), which the kernels clamp to sq / sk. A dense call
# passes them empty and the kernels read none (kernels/common/ragged.py), so one compiled variant
# serves both. mdLSE, the cotangent of lse, is empty ([0, h, sq]) when only out is differentiated
# (the common case: vjp.py's symbolic zeros), and the preprocess then reads none.
# mQSegmentIds / mKSegmentIds and the span tables mRowSpans / mKeySpans (fa4_jax/abi/segment_layout.py;
# q_chunks = ceil(sq / 64), k_chunks = ceil(sk / 64)): read by the segments variants only; the
# others take them empty (b_segments = 0) and pass them to no kernel. mMaskBits: a boolean
# mask packed 32 keys to a word (k_words = ceil(sk / 32); fa4_jax/runtime/mask_bits.py), read by the
# mask_array variants only, empty (b_mask = 0) for the others.
_SEGMENT_TENSORS = (
    ("mQSegmentIds", "i32", ("b_segments", "sq")),
    ("mKSegmentIds", "i32", ("b_segments", "sk")),
    ("mRowSpans", "i32", ("b_segments", "q_chunks", "span")),
    ("mKeySpans", "i32", ("b_segments", "k_chunks", "span")),
    ("mMaskBits", "i32", ("b_mask", "sq", "k_words")),
)
TENSORS = {
    "fwd": (
        ("mQ", "io", ("b", "sq", "h", "d")),
        ("mK", "io", ("b", "sk", "hk", "d")),
        ("mV", "io", ("b", "sk", "hk", "dv")),
        ("mO", "io", ("b", "sq", "h", "dv")),
        ("mLSE", "f32", ("b", "h", "sq")),
        ("mSeqUsedQ", "i32", ("b_lengths",)),
        ("mSeqUsedK", "i32", ("b_lengths",)),
        *_SEGMENT_TENSORS,
    ),
    "bwd": (
        ("mQ", "io", ("b", "sq", "h", "d")),
        ("mK", "io", ("b", "sk", "hk", "d")),
        ("mV", "io", ("b", "sk", "hk", "dv")),
        ("mO", "io", ("b", "sq", "h", "dv")),
        ("mdO", "io", ("b", "sq", "h", "dv")),
        ("mLSE", "f32", ("b", "h", "sq")),
        ("mdLSE", "f32", ("b_dlse", "h", "sq")),
        ("mdQ", "io", ("b", "sq", "h", "d")),
        ("mdK", "io", ("b", "sk", "hk", "d")),
        ("mdV", "io", ("b", "sk", "hk", "dv")),
        ("mdQaccum", "f32", ("copies", "b", "h", "sq_pad", "d")),
        ("mdPsum", "f32", ("b", "h", "sq_pad")),
        ("mLSElog2", "f32", ("b", "h", "sq_pad")),
        ("mSemaphore", "i32", ("copies", "b", "h", "m_blocks")),
        ("mSeqUsedQ", "i32", ("b_lengths",)),
        ("mSeqUsedK", "i32", ("b_lengths",)),
        *_SEGMENT_TENSORS,
    ),
}
DYNAMIC_DIMS = ("b", "sq", "sk", "h", "hk", "sq_pad", "m_blocks", "copies", "b_lengths",
                "b_dlse", "b_segments", "q_chunks", "k_chunks", "b_mask", "k_words")
STATIC_DIMS = ("d", "dv", "span")

# Each kind's scalar arguments after the tensors (then the CUDA stream): name and dtype.
# top_left is 0 or 1: 1 aligns the causal/window masks to the top-left corner (diagonal offset 0)
# instead of the bottom-right (seqlen_k − seqlen_q, per batch entry).
# deterministic is 0 or 1: 1 fixes the order of every floating-point reduction across CTAs.
# num_sms: the device's multiprocessors, so CTAs of one backward kernel (one per SM) that run at
# once; the deterministic order may then rotate chains of key blocks that fit (bwd.py).
SCALARS = {
    "fwd": (("softmax_scale", "f32"), ("softcap", "f32"), ("window_left", "i32"),
            ("window_right", "i32"), ("top_left", "i32")),
    "bwd": (("softmax_scale", "f32"), ("softcap", "f32"), ("window_left", "i32"),
            ("window_right", "i32"), ("top_left", "i32"), ("deterministic", "i32"), ("num_sms", "i32")),
}


def fake_args(variant):
    """Fake tensors of TENSORS[variant.kind], then SCALARS[variant.kind], then a stream.

    Row-major compact tensors as JAX lays them out. Dynamic dims are one sym_int each, shared
    between tensors; d and dv are static, so every stride of q/k/v/o but the last is a known
    multiple of d (>= 8 elements = 16 bytes), as TMA requires.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dims = {s: cute.sym_int(symbol=s) for s in DYNAMIC_DIMS}
    dims.update(d=variant.head_dim, dv=variant.head_dim_v, span=SPAN_FIELDS)
    dtypes = {"io": _dsl_dtype(variant.dtype), "f32": cutlass.Float32, "i32": cutlass.Int32}

    def row_major(dtype, names):
        order = tuple(reversed(range(len(names))))  # last mode fastest
        return make_fake_compact_tensor(dtypes[dtype], tuple(dims[n] for n in names),
                                        stride_order=order, assumed_align=_ALIGN)

    tensors = tuple(row_major(dtype, names) for _, dtype, names in TENSORS[variant.kind])
    scalars = tuple(dtypes[dtype](0) for _, dtype in SCALARS[variant.kind])
    return (*tensors, *scalars, make_fake_stream())


def _dsl_dtype(dtype: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]


def construct_kernel(variant, kernel: str, tuning_kwargs: dict):
    """The kernel object of a variant: kernel is "module:Class", constructed with the variant's
    problem class and `tuning_kwargs` (the build's, and the tests' check that each constructs)."""
    module, cls = kernel.split(":")
    kernel_cls = getattr(importlib.import_module(module), cls)
    return kernel_cls(_dsl_dtype(variant.dtype), variant.head_dim, variant.head_dim_v, variant.mask,
                      variant.softcap, segments=variant.segments, mask_array=variant.mask_array,
                      **tuning_kwargs)


def compile_variant(variant, kernel: str, tuning_kwargs: dict, out_dir: str) -> None:
    """Writes NAME.h, NAME.o and the kernel cubin(s) into out_dir (`construct_kernel`'s)."""
    import cutlass.cute as cute

    kernel_obj = construct_kernel(variant, kernel, tuning_kwargs)
    # --keep-cubin writes into CUTE_DSL_DUMP_DIR, read when the DSL is imported: the caller sets it.
    compiled = cute.compile(kernel_obj, *fake_args(variant),
                            options=f"--gpu-arch {variant.arch} --keep-cubin")
    compiled.export_to_c(out_dir, variant.name, function_prefix=variant.name)


RESULT = "FA4_JAX_RESULT "  # prefixes the worker's answer lines; the DSL may print others


def _collect_cubins(dump_dir: str, out_dir: str) -> None:
    """Moves what the compile kept (--keep-cubin writes into the dump dir, which the DSL reads
    once, at import) into the job's out_dir, so the next job starts from an empty dump dir."""
    for name in os.listdir(dump_dir):
        shutil.move(os.path.join(dump_dir, name), os.path.join(out_dir, name))


def serve(jobs, answer) -> None:
    """Compiles each job, {"variant": fields, "kernel": "module:Class", "tuning_kwargs": {...},
    "out_dir": path}, and answers {"seconds": s} or {"error": traceback} for each."""
    from fa4_jax.abi.routing import Variant

    dump_dir = os.environ["CUTE_DSL_DUMP_DIR"]
    for line in jobs:
        job = json.loads(line)
        start = time.monotonic()
        try:
            compile_variant(Variant(**job["variant"]), job["kernel"], job["tuning_kwargs"],
                            job["out_dir"])
            _collect_cubins(dump_dir, job["out_dir"])
            result = {"seconds": time.monotonic() - start}
        except Exception:  # one job's failure is the build's to report, not the worker's end
            result = {"error": traceback.format_exc()}
        answer(RESULT + json.dumps(result))


def main(argv: list[str]) -> None:
    if argv != ["--serve"]:
        raise SystemExit("usage: python -m fa4_jax.aot.compile --serve  (jobs on stdin)")

    def answer(text):
        print(text, flush=True)

    serve(sys.stdin, answer)


if __name__ == "__main__":
    main(sys.argv[1:])
