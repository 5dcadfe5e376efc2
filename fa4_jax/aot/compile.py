"""Compile one Variant ahead of time: fake tensors -> cute.compile -> export_to_c (+ kept cubin).

`fake_args` is the single description of the kernel's argument types; the C++ dispatch
(`fa4_jax/aot/codegen.py`) fills the exported structs from the header this produces, so the two
cannot drift. Run as `python -m fa4_jax.aot.compile JOB_JSON` with the runtime shim preloaded
(see `toolchain.compile_env`): export_to_c resolves the launcher's runtime symbols in-process.
"""
from __future__ import annotations

import importlib
import json
import sys

# Which kernel class implements an arch. sm_100a is plumbed through but has no kernel yet.
KERNELS = {"sm_90a": "fa4_jax.kernels.sm90.fwd:FlashAttentionForwardSm90"}

# Base pointers of XLA buffers are at least 16-byte aligned; TMA needs exactly that.
_ALIGN = 16


# The kernel's tensor arguments: name, dtype ("io" = the variant's dtype) and row-major dims.
# Lower-case dims are dynamic (runtime values from the buffers' shapes); "d"/"dv" are the
# variant's static head dims. ffi codegen reads this too, to fill the exported structs.
TENSORS = (
    ("mQ", "io", ("b", "sq", "h", "d")),
    ("mK", "io", ("b", "sk", "hk", "d")),
    ("mV", "io", ("b", "sk", "hk", "dv")),
    ("mO", "io", ("b", "sq", "h", "dv")),
    ("mLSE", "f32", ("b", "h", "sq")),
)
STATIC_DIMS = ("d", "dv")


def fake_args(variant):
    """Fake (q, k, v, out, lse, softmax_scale, softcap, window_left, window_right, stream).

    Row-major compact tensors as JAX lays them out. b, sq, sk, h, hk are dynamic, one sym_int
    each, shared between tensors where they are equal; d and dv are static, so every stride of
    q/k/v/o but the last is a known multiple of d (>= 8 elements = 16 bytes), as TMA requires.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dims = {s: cute.sym_int(symbol=s) for s in ("b", "sq", "sk", "h", "hk")}
    dims.update(d=variant.head_dim, dv=variant.head_dim_v)
    dtypes = {"io": _dsl_dtype(variant.dtype), "f32": cutlass.Float32}

    def row_major(dtype, names):
        order = tuple(reversed(range(len(names))))  # last mode fastest
        return make_fake_compact_tensor(dtypes[dtype], tuple(dims[n] for n in names),
                                        stride_order=order, assumed_align=_ALIGN)

    tensors = tuple(row_major(dtype, names) for _, dtype, names in TENSORS)
    return (*tensors, cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0),
            cutlass.Int32(0), make_fake_stream())


def _dsl_dtype(dtype: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]


def compile_variant(variant, kernel: str, out_dir: str) -> None:
    """Writes NAME.h, NAME.o and the kernel cubin(s) into out_dir; kernel is "module:Class"."""
    import cutlass.cute as cute

    module, cls = kernel.split(":")
    kernel_cls = getattr(importlib.import_module(module), cls)
    kernel_obj = kernel_cls(_dsl_dtype(variant.dtype), variant.head_dim, variant.head_dim_v,
                            variant.mask, variant.softcap)
    # --keep-cubin writes into CUTE_DSL_DUMP_DIR, read when the DSL is imported: the caller sets it.
    compiled = cute.compile(kernel_obj, *fake_args(variant),
                            options=f"--gpu-arch {variant.arch} --keep-cubin")
    compiled.export_to_c(out_dir, variant.name, function_prefix=variant.name)


def main(argv: list[str]) -> None:
    from fa4_jax.aot.variants import Variant

    job = json.loads(argv[0])  # {"variant": fields, "kernel": "module:Class", "out_dir": path}
    compile_variant(Variant(**job["variant"]), job["kernel"], job["out_dir"])


if __name__ == "__main__":
    main(sys.argv[1:])
