"""Generate the C++ dispatch tables (build/aot/dispatch.cc): the compiled variants, the routes and
the archs whose kernels are unverified.

Each exported header declares variant-specific argument structs and a launcher; the generated code
wraps every launcher with the uniform signature of ffi/dispatch.h, filling the structs from
`compile.TENSORS` and `compile.SCALARS` of the variant's kind (the same description its fake
arguments came from). The routes are the arch menus' (fa4_jax.abi.routing.Route), in order.
"""
from __future__ import annotations

import re

from fa4_jax.aot.compile import DYNAMIC_DIMS, SCALARS, STATIC_DIMS, TENSORS
from fa4_jax.abi.workspace import BWD_MAX_DQ_COPIES, BWD_SEMAPHORE_ROWS, BWD_SEQ_PAD
from fa4_jax.abi.segment_layout import SPAN_CHUNK, SPAN_FIELDS

# Fa4Args fields of the dynamic dims and of the tensors (ffi/dispatch.h).
_ARGS_FIELD = {"b": "b", "sq": "seqlen_q", "sk": "seqlen_k", "h": "heads", "hk": "heads_k",
               "sq_pad": "seqlen_q_pad", "m_blocks": "semaphore_blocks", "copies": "dq_copies",
               "b_lengths": "b_lengths", "b_dlse": "b_dlse", "b_segments": "b_segments",
               "q_chunks": "q_chunks", "k_chunks": "k_chunks", "b_mask": "b_mask",
               "k_words": "k_words"}
_PTR_FIELD = {"mQ": "q", "mK": "k", "mV": "v", "mO": "out", "mLSE": "lse", "mdO": "d_out",
              "mdLSE": "d_lse", "mdQ": "dq", "mdK": "dk", "mdV": "dv", "mdQaccum": "dq_accum",
              "mdPsum": "dpsum", "mLSElog2": "lse_log2", "mSemaphore": "semaphore",
              "mSeqUsedQ": "seq_used_q", "mSeqUsedK": "seq_used_k", "mQSegmentIds": "q_segment_ids",
              "mKSegmentIds": "kv_segment_ids", "mRowSpans": "row_spans", "mKeySpans": "key_spans",
              "mMaskBits": "mask_bits"}
_KIND = {"fwd": "Fa4Kind::kFwd", "bwd": "Fa4Kind::kBwd"}
_DTYPE = {"bf16": "Fa4Dtype::kBF16", "fp16": "Fa4Dtype::kF16"}
assert set(_ARGS_FIELD) == set(DYNAMIC_DIMS)


def _dim(name: str, variant) -> str:
    if name == "d":
        return str(variant.head_dim)
    if name == "dv":
        return str(variant.head_dim_v)
    if name == "span":
        return str(SPAN_FIELDS)
    return f"int64_t(a.{_ARGS_FIELD[name]})"


def _dynamic_strides(dims: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Row-major: stride i is the product of the later dims; dynamic if any of them is."""
    return [dims[i + 1:] for i in range(len(dims) - 1)
            if any(n not in STATIC_DIMS for n in dims[i + 1:])]


def _tensor_init(variant, param: str, dims: tuple[str, ...]) -> str:
    """`{data, {dynamic shapes}, {dynamic strides}}` in the exported struct's field order."""
    fields = [f"a.{_PTR_FIELD[param]}",
              "{" + ", ".join(f"a.{_ARGS_FIELD[n]}" for n in dims if n not in STATIC_DIMS) + "}"]
    strides = [" * ".join(_dim(n, variant) for n in later) for later in _dynamic_strides(dims)]
    if strides:
        fields.append("{" + ", ".join(strides) + "}")
    return "{" + ", ".join(fields) + "}"


def _check_header(variant, header_text: str) -> None:
    """Fail the build, not the GPU run, if the exported structs differ from what we fill in."""
    for param, _, dims in TENSORS[variant.kind]:
        m = re.search(r"typedef struct \{\s*void \*data;\s*int32_t dynamic_shapes\[(\d+)\];"
                      r"\s*(?:int64_t dynamic_strides\[(\d+)\];)?\s*\}\s*"
                      + re.escape(f"{variant.name}_Tensor_{param}_t;"), header_text)
        n_shapes = sum(n not in STATIC_DIMS for n in dims)
        n_strides = len(_dynamic_strides(dims))
        if m is None or (int(m.group(1)), int(m.group(2) or 0)) != (n_shapes, n_strides):
            raise RuntimeError(f"{variant.name}: exported struct for {param} is not "
                               f"{{data, {n_shapes} shapes, {n_strides} strides}}; "
                               "update fa4_jax/aot/codegen.py with compile.TENSORS")


def _variant_code(variant) -> str:
    n = variant.name
    tensors = TENSORS[variant.kind]
    structs = "\n".join(
        f"  {n}_Tensor_{param}_t {param}{_tensor_init(variant, param, dims)};"
        for param, _, dims in tensors)
    args = ", ".join([f"&{param}" for param, _, _ in tensors]
                     + [f"a.{name}" for name, _ in SCALARS[variant.kind]])
    return f"""
// ---- {n}
static {n}_Kernel_Module_t g_{n};
static cudaError_t load_{n}() {{
  static const cudaError_t err = [] {{  // a magic static: loads once per process, thread-safe
    g_load_error = cudaSuccess;
    {n}_Kernel_Module_Load(&g_{n});
    return g_load_error;
  }}();
  return err;
}}
static int32_t launch_{n}(const Fa4Args& a, cudaStream_t stream) {{
{structs}
  return cute_dsl_{n}_wrapper(&g_{n}, {args}, stream);
}}
"""


def _table_entry(v) -> str:
    return (f'  {{"{v.name}", {_KIND[v.kind]}, "{v.arch}", {_DTYPE[v.dtype]}, {v.head_dim}, '
            f'{v.head_dim_v}, "{v.mask}", {str(v.softcap).lower()}, "{v.tuning}", '
            f'{str(v.segments).lower()}, {str(v.mask_array).lower()}, load_{v.name}, launch_{v.name}}},')


def _route_entry(arch: str, r) -> str:
    softcap = -1 if r.softcap is None else int(r.softcap)
    return (f'  {{{_KIND[r.kind]}, "{arch}", "{r.mask}", {r.head_dim}, "{r.tuning}", {r.min_rows}, {r.max_rows}, '
            f'{r.max_len}, {str(r.dense).lower()}, {r.diagonal_block}, {r.tail_tile_n}, '
            f'{r.tail_keys}, {softcap}, {str(r.mask_array).lower()}}},')


# A zero-length array is not C++: a menu without routes gets one entry no call matches.
_NO_ROUTE = '  {Fa4Kind::kFwd, "", "", 0, "", 0, 0, 0, false, 0, 0, 0, -1, false},'


def dispatch_source(variants, headers: dict[str, str], routes=(), unverified_arches=()) -> str:
    """headers: variant name -> text of its exported header; routes: (arch, Route) pairs;
    unverified_arches: the archs whose variants the handlers run only once verified (ffi/gate.h)."""
    for v in variants:
        _check_header(v, headers[v.name])
    includes = "\n".join(f'#include "{v.name}.h"' for v in variants)
    bodies = "".join(_variant_code(v) for v in variants)
    table = "\n".join(_table_entry(v) for v in variants)
    route_table = "\n".join(_route_entry(arch, r) for arch, r in routes) or _NO_ROUTE
    # A zero-length array is not C++: no unverified arch is one null entry, counted 0.
    unverified = ", ".join(f'"{arch}"' for arch in unverified_arches) or "nullptr"
    return f"""// GENERATED by fa4_jax/aot/codegen.py from the variant menu; do not edit.
#include <cuda_runtime.h>

#include "dispatch.h"

// The exported Module_Load reports CUDA errors through this macro (printf by default); record
// the first one instead, so loading can fail with a message.
static thread_local cudaError_t g_load_error = cudaSuccess;
#define CUTE_DSL_CUDA_ERROR_CHECK(err)                                            \\
  do {{                                                                           \\
    cudaError_t e_ = (err);                                                      \\
    if (e_ != cudaSuccess && g_load_error == cudaSuccess) g_load_error = e_;     \\
  }} while (0)

{includes}
{bodies}
const int kFa4BwdSeqPad = {BWD_SEQ_PAD};
const int kFa4BwdSemaphoreRows = {BWD_SEMAPHORE_ROWS};
const int kFa4BwdMaxDqCopies = {BWD_MAX_DQ_COPIES};
const int kFa4SpanChunk = {SPAN_CHUNK};
const Fa4Variant kFa4Variants[] = {{
{table}
}};
const int kFa4VariantCount = {len(variants)};
const Fa4Route kFa4Routes[] = {{
{route_table}
}};
const int kFa4RouteCount = {len(routes)};
const char* const kFa4UnverifiedArches[] = {{{unverified}}};
const int kFa4UnverifiedArchCount = {len(unverified_arches)};
"""
