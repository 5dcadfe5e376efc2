"""Run-time policy for the kernels: whether they serve a call, and how a call is shaped for them.

- `unsupported_reason(q, k, v, params, kind)`: None when the installed library has a kernel of
  `kind` for this call on the default device, else a sentence saying why not.
- `forward_plan(q, k, v, params, kinds)`: how the forward runs a call (`KernelPlan`): head dims
  without a compiled kernel of their own zero-padded to the narrowest wider one
  (`routing.serving_head_dims`), calls with too few tiles to fill the GPU split over their keys
  (`fa4_jax.runtime.split_kv`), grouped-query calls of few query rows GQA-packed
  (`fa4_jax.runtime.pack_gqa`), and the variant the handler's routing rule picks for the result.
  `forward` runs that plan and `fa4_jax.explain` reports it: one decision for both.
- `forward(q, k, v, params, operands)`, `backward(q, k, v, out, lse, d_out, d_lse, params,
  operands)`: the kernel calls. `operands` (`KernelOperands`) are the arrays the kernels read
  beside q, k and v; calls with span tables (segment ids or a mask) run the segments kernels,
  unpacked and unsplit. The backward's dQ workspace has the copies of the arch menu's rule
  (`routing.dq_copies`).

Head dims served zero-padded cost one copy of each operand and result, against a kernel whose
work grows by the padded share (docs/perf-log.md, "Every head dim: served zero-padded").

A ragged batch's padding reaches the kernels (a TMA tile load cannot stop at a per-entry length),
and a masked P = 0 times a NaN or inf of the padding would still be NaN. The kernels make the
padding harmless themselves (the forward: the mask overwrites the scores, V's padding rows are
zeroed in shared memory, rows past an entry's queries are replaced by 0 in the epilogue; the
backward: Q, dO, K and V's padding rows zeroed in shared memory as they land), so the dispatch
passes the operands as they are.

`library` arguments default to the shipping library; the benchmarks pass their development
library (benchmarks/ablations.py) and a `tuning` name.
"""
from __future__ import annotations

import dataclasses

from fa4_jax.abi import routing
from fa4_jax.abi.segment_layout import WIDEST_BACKWARD_TILE_M
from fa4_jax.runtime import device, ffi, gate, segments
from fa4_jax.runtime import pack_gqa as packing
from fa4_jax.runtime import split_kv as splitting
from fa4_jax.runtime.operands import KernelOperands, OperandKinds

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}


def kernel_call(q, k, v, params, kind: str, arch: str, kinds: OperandKinds = OperandKinds()) -> routing.Call:
    return routing.Call(
        kind=kind, arch=arch, dtype=_DTYPE_NAMES[str(q.dtype)], head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        mask=routing.mask_kind(params.causal, params.window_left, params.window_right),
        softcap=params.softcap is not None, seqlen_q=q.shape[1], seqlen_k=k.shape[1],
        ragged=kinds.ragged, top_left=params.top_left, segments=kinds.segments,
        mask_array=kinds.mask_array)


def served_head_dims(q, v, params, kind: str, arch: str, library: ffi.Library,
                     kinds: OperandKinds = OperandKinds()) -> tuple[int, int] | None:
    """The compiled (head_dim, head_dim_v) whose `kind` kernels (of these operand kinds) serve a
    call with q's and v's head dims (`routing.serving_head_dims`), or None when no compiled pair
    is wide enough."""
    call = kernel_call(q, q, v, params, kind, arch, kinds)  # k's head dim is q's
    compiled = [pair for pair in library.head_dims.get(arch, ())
                if dataclasses.replace(call, head_dim=pair[0], head_dim_v=pair[1]).variant().name
                in library.compiled]
    return routing.serving_head_dims(call.head_dim, call.head_dim_v, compiled)


def unsupported_reason(q, k, v, params, kind: str = "fwd", library: ffi.Library | None = None,
                       kinds: OperandKinds = OperandKinds()) -> str | None:
    """Why the kernels do not serve a call of this problem class, or None. kinds: the optional
    operands the call passes (`fa4_jax.runtime.operands.kernel_view`); the variant the handler
    routes the call to is the one the first-use gate is asked about."""
    arch, reason = device.device_arch()
    if reason is not None:
        return reason
    try:
        library = library or ffi.load()
    except ffi.LibraryUnavailable as e:
        return str(e)
    if str(q.dtype) not in _DTYPE_NAMES:
        return f"dtype {q.dtype} has no kernel (bfloat16 and float16 do)"
    if len({str(x.dtype) for x in (q, k, v)}) != 1:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if k.shape[-1] != q.shape[-1]:
        return f"head dims of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ"
    served = served_head_dims(q, v, params, kind, arch, library, kinds)
    if served is None:
        default = kernel_call(q, k, v, params, kind, arch, kinds).variant()
        operands = ' with a mask array' if kinds.mask_array else ' with segment ids' if kinds.segments else ''
        return (f"no {kind} kernel for {default.arch} {default.dtype} {default.mask}"
                f"{' softcap' if default.softcap else ''}{operands} "
                f"at head dim {default.head_dim} (head dim of v {default.head_dim_v}) or wider is "
                f"compiled into {library.path}")
    call = kernel_call(q, k, v, params, kind, arch, kinds)
    variant = library.choose(dataclasses.replace(call, head_dim=served[0], head_dim_v=served[1]))
    return gate.failure_reason(variant, library)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How the kernels run a forward call: the head dims of the compiled kernels (the call's
    own, or wider ones it runs zero-padded to), the key chunks it is split into (1: none),
    whether it is GQA-packed, and the variant the handler picks for the resulting call (None
    for a dtype without kernels, which the plan's shapes are still computed for)."""

    head_dims: tuple[int, int]
    split_kv: int
    pack_gqa: bool
    variant: routing.Variant | None


def _arch() -> str:
    arch, reason = device.device_arch()
    if reason is not None:
        raise ffi.LibraryUnavailable(reason)
    return arch


def forward_plan(q, k, v, params, kinds: OperandKinds = OperandKinds(),
                 library: ffi.Library | None = None, *, pack_gqa: bool | None = None,
                 split_kv: int | None = None) -> KernelPlan:
    """The `KernelPlan` of a forward call of these shapes (q, k, v: arrays or ShapeDtypeStructs)
    on the default device; the kernels must serve it. `pack_gqa`: None packs where
    `pack_gqa.packs` says it pays, False never; `split_kv`: None splits where
    `split_kv.num_splits` says the call has too few tiles for the GPU, n splits in n (the
    benchmark's settings). Calls with span tables are neither split nor packed."""
    import jax

    library = library or ffi.load()
    kernel_dtype = str(q.dtype) in _DTYPE_NAMES
    head_dims = _served(q, k, v, params, "fwd", kinds, library) if kernel_dtype else (q.shape[-1], v.shape[-1])
    q, k, v = (jax.ShapeDtypeStruct(x.shape[:-1] + (width,), x.dtype)
               for x, width in ((q, head_dims[0]), (k, head_dims[0]), (v, head_dims[1])))
    if kinds.segments:
        split_kv, pack_gqa = 1, False
    if split_kv is None:
        sms = device.sm_count()
        split_kv = 1 if sms is None else splitting.num_splits(q.shape, k.shape, params, sms)
    if split_kv > 1:
        q, k, v = jax.eval_shape(lambda *qkv: splitting.split(*qkv, params, None, split_kv)[:3], q, k, v)
        params = splitting.chunk_params(params)
    if pack_gqa is None:
        pack_gqa = packing.packs(q.shape, k.shape, params)
    if pack_gqa:
        q = jax.eval_shape(lambda q, k: packing.pack(q, k, params)[0], q, k)
        params = packing.packed_params(params)
    variant = library.choose(kernel_call(q, k, v, params, "fwd", _arch(), kinds)) if kernel_dtype else None
    return KernelPlan(head_dims, split_kv, pack_gqa, variant)


def _served(q, k, v, params, kind: str, kinds: OperandKinds, library: ffi.Library) -> tuple[int, int]:
    """The compiled head dims that serve the call; raises when none does."""
    served = served_head_dims(q, v, params, kind, _arch(), library, kinds)
    if served is None:
        reason = unsupported_reason(q, k, v, params, kind, library, kinds)
        raise RuntimeError(f"fa4_jax {kind} kernel unavailable: {reason}")
    return served


def _widen(x, width: int):
    """x zero-padded on its last (head-dim) axis to `width`."""
    import jax.numpy as jnp

    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _require(variant: routing.Variant | None, library: ffi.Library) -> None:
    """Raises when the call has no kernel (`variant` None: its dtype), or the first-use gate
    keeps `variant` from it (the handler would refuse it)."""
    if variant is None:
        raise RuntimeError("fa4_jax kernel unavailable: the call's dtype has no kernel (bfloat16 and float16 do)")
    reason = gate.failure_reason(variant, library)
    if reason is not None:
        raise RuntimeError(f"fa4_jax {variant.kind} kernel unavailable: {reason}")


def forward(q, k, v, params, operands: KernelOperands = KernelOperands(), *,
            library: ffi.Library | None = None, tuning: str | None = None,
            pack_gqa: bool | None = None, split_kv: int | None = None):
    """(out [b, sq, h, dv] in q's dtype, lse [b, h, sq] float32) from the forward kernel, run as
    `forward_plan` plans it (`pack_gqa`, `split_kv`, `library` and `tuning`: the benchmark's).

    Q, K and V go in unzeroed: the kernel masks the padding keys, zeroes their V rows and
    replaces the rows past an entry's queries itself (a decode step would otherwise copy its
    whole KV cache twice over)."""
    library = library or ffi.load()
    plan = forward_plan(q, k, v, params, OperandKinds.of(operands), library, pack_gqa=pack_gqa,
                        split_kv=split_kv)
    _require(plan.variant, library)
    width_v, heads = v.shape[-1], q.shape[2]
    q, k, v = _widen(q, plan.head_dims[0]), _widen(k, plan.head_dims[0]), _widen(v, plan.head_dims[1])
    seq_lengths = operands.seq_lengths
    if plan.split_kv > 1:
        q, k, v, params, seq_lengths = splitting.split(q, k, v, params, seq_lengths, plan.split_kv)
    if plan.pack_gqa:
        q, params, seq_lengths = packing.pack(q, k, params, seq_lengths)
    out, lse = ffi.forward_call(library, q, k, v, ffi.seq_used(seq_lengths), ffi.attributes(params), tuning,
                                segments=operands.span_operands or None)
    if plan.pack_gqa:
        out, lse = packing.unpack(out, lse, heads)
    if plan.split_kv > 1:
        out, lse = splitting.combine(out, lse, plan.split_kv)
    return (out if out.shape[-1] == width_v else out[..., :width_v]), lse


def dq_copies(q, k, params, library: ffi.Library) -> int:
    """The dQ accumulators of a backward call: the arch menu's rule."""
    arch, _ = device.device_arch()
    return routing.dq_copies(library.dq_copies_max_keys.get(arch, {}), q.shape[-1], k.shape[1],
                             params.deterministic)


def backward(q, k, v, out, lse, d_out, d_lse, params, operands: KernelOperands = KernelOperands(), *,
             library: ffi.Library | None = None, tuning: str | None = None,
             copies: int | None = None):
    """(dq, dk, dv), each in its input's shape and dtype, from the backward kernels.

    out and lse are the statistics the gradient is taken at (see `fa4_jax.ops.bodies.backward`);
    d_lse is the cotangent of lse, or None when lse is not differentiated (docs/perf-log.md, "The
    dLSE cotangent as a symbolic zero"). `params.deterministic` selects the fixed-order dQ
    accumulation. Rows of dq past an entry's query length and of dk, dv past its key length come
    out zero. `copies` overrides the dQ accumulators' count (`dq_copies`), for the benchmark's
    measurement of that rule.
    """
    library = library or ffi.load()
    kinds = OperandKinds.of(operands)
    variant = backward_variant(q, k, v, params, kinds, library)
    _require(variant, library)
    widths = q.shape[-1], k.shape[-1], v.shape[-1]
    width, width_v = variant.head_dim, variant.head_dim_v
    q, k, v, out, d_out = (_widen(x, w) for x, w in ((q, width), (k, width), (v, width_v),
                                                     (out, width_v), (d_out, width_v)))
    span_operands = operands.span_operands
    if kinds.segments and params.deterministic:
        span_operands = _deterministic_walk(span_operands, library, variant)
    d_out = d_out.astype(q.dtype)
    copies = copies or dq_copies(q, k, params, library)
    dq, dk, dv = ffi.backward_call(library, q, k, v, out, lse, d_out, d_lse, ffi.seq_used(operands.seq_lengths),
                                   ffi.attributes(params), params.deterministic, copies, tuning,
                                   segments=span_operands or None)
    return tuple(x if x.shape[-1] == w else x[..., :w] for x, w in zip((dq, dk, dv), widths))


def backward_variant(q, k, v, params, kinds: OperandKinds = OperandKinds(),
                     library: ffi.Library | None = None) -> routing.Variant:
    """The variant the handler runs for a backward call of these shapes, head dims widened to the
    compiled ones that serve them (`backward` runs it, `fa4_jax.explain` names it)."""
    library = library or ffi.load()
    width, width_v = _served(q, k, v, params, "bwd", kinds, library)
    call = kernel_call(q, k, v, params, "bwd", _arch(), kinds)
    return library.choose(dataclasses.replace(call, head_dim=width, head_dim_v=width_v))


def _deterministic_walk(span_operands, library: ffi.Library, variant: routing.Variant):
    """The span operands with the key spans a deterministic backward walks
    (`segments.deterministic_walk`), at the query tile of the variant that runs the call (the
    widest backward tile, which walks a superset for any, when the manifest does not say)."""
    tile_m = library.segments_backward_tile_m.get(variant.name, WIDEST_BACKWARD_TILE_M)
    q_ids, kv_ids, row_spans, key_spans, *bits = span_operands
    return (q_ids, kv_ids, row_spans, segments.deterministic_walk(row_spans, key_spans, tile_m), *bits)


def available() -> bool:
    """The library loads and the default device is a CUDA GPU it has forward kernels for."""
    try:
        library = ffi.load()
    except ffi.LibraryUnavailable:
        return False
    arch, _ = device.device_arch()
    return arch is not None and any(name.startswith(routing.name_prefix("fwd", arch))
                                    for name in library.compiled)
