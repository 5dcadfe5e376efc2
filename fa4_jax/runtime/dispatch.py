"""Run-time policy for the kernels: whether they serve a call, and how a call is shaped for them.

- `unsupported_reason(q, k, v, params, kind)`: None when the installed library has a kernel of
  `kind` for this call on the default device, else a sentence saying why not.
- `forward(q, k, v, params, seq_lengths, segment_ids)`: the forward kernel call, with
  grouped-query calls of few query rows GQA-packed (`fa4_jax.runtime.pack_gqa`) and calls with too few
  tiles to fill the GPU split over their keys (`fa4_jax.runtime.split_kv`). Calls with segment ids (the
  ids and their span tables, `fa4_jax.runtime.segments.operands`) run the segments kernels, unpacked and
  unsplit.
- `backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths, segment_ids)`: the backward
  kernel call, with the dQ workspace's copies from the arch menu's rule (`routing.dq_copies`).
- `explain_forward(...)`, `explain_variant(...)`: how `forward` runs a call, and the variant the
  handler's routing rule picks for it (`fa4_jax.abi.routing`).

Head dims without a compiled kernel of their own run on the narrowest wider one
(`routing.serving_head_dims`), q, k and v zero-padded on the head-dim axis and the results sliced
back: one copy of each operand and result, against a kernel whose work grows by the padded
share (docs/perf-log.md, "Every head dim: served zero-padded").

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

from fa4_jax.runtime import ffi, gate
from fa4_jax.abi import routing, targets
from fa4_jax.runtime import pack_gqa as packing
from fa4_jax.runtime import split_kv as splitting
from fa4_jax.abi.segment_layout import WIDEST_BACKWARD_TILE_M

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}


def compute_capability() -> str | None:
    """The default device's compute capability ("9.0"), or None when it is not a CUDA GPU."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    cc = getattr(device, "compute_capability", None)
    return None if device.platform != "gpu" or cc is None else str(cc)


def device_arch() -> tuple[str | None, str | None]:
    """(arch of the default device as the variants name it, None), or (None, why there is none)."""
    import jax

    cc = compute_capability()
    if cc is None:
        try:
            platform = jax.devices()[0].platform
        except RuntimeError as e:
            return None, f"no JAX device: {e}"
        return None, f"the default device is {platform}, not a CUDA GPU"
    major, minor = (int(x) for x in cc.split("."))
    return routing.arch_name(major, minor), None


def sm_count() -> int | None:
    """Multiprocessors of the default device, if JAX says."""
    import jax

    return getattr(jax.devices()[0], "core_count", None) or None


def kernel_call(q, k, v, params, kind: str, arch: str, ragged: bool, segments: bool = False,
                mask_array: bool = False) -> routing.Call:
    return routing.Call(
        kind=kind, arch=arch, dtype=_DTYPE_NAMES[str(q.dtype)], head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        mask=routing.mask_kind(params.causal, params.window_left, params.window_right),
        softcap=params.softcap is not None, seqlen_q=q.shape[1], seqlen_k=k.shape[1], ragged=ragged,
        top_left=params.top_left, segments=segments, mask_array=mask_array)


def served_head_dims(q, v, params, kind: str, arch: str, library: ffi.Library,
                     segments: bool = False, mask_array: bool = False) -> tuple[int, int] | None:
    """The compiled (head_dim, head_dim_v) whose `kind` kernels (with segment ids or not, a mask
    array or not) serve a call with q's and v's head dims (`routing.serving_head_dims`), or None
    when no compiled pair is wide enough."""
    call = kernel_call(q, q, v, params, kind, arch, ragged=False, segments=segments,
                       mask_array=mask_array)  # k's head dim is q's
    compiled = [pair for pair in library.head_dims.get(arch, ())
                if dataclasses.replace(call, head_dim=pair[0], head_dim_v=pair[1]).variant().name
                in library.compiled]
    return routing.serving_head_dims(call.head_dim, call.head_dim_v, compiled)


def unsupported_reason(q, k, v, params, kind: str = "fwd", library: ffi.Library | None = None,
                       segments: bool = False, mask_array: bool = False) -> str | None:
    arch, reason = device_arch()
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
    call = kernel_call(q, k, v, params, kind, arch, ragged=False, segments=segments, mask_array=mask_array)
    served = served_head_dims(q, v, params, kind, arch, library, segments, mask_array)
    if served is None:
        default = call.variant()
        operands = ' with a mask array' if mask_array else ' with segment ids' if segments else ''
        return (f"no {kind} kernel for {default.arch} {default.dtype} {default.mask}"
                f"{' softcap' if default.softcap else ''}{operands} "
                f"at head dim {default.head_dim} (head dim of v {default.head_dim_v}) or wider is "
                f"compiled into {library.path}")
    variant = library.choose(dataclasses.replace(call, head_dim=served[0], head_dim_v=served[1]))
    return gate.failure_reason(variant, library)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How the kernels run a forward call: the head dims of the compiled kernels (the call's
    own, or wider ones it runs zero-padded to), the key chunks it is split into (1: none),
    whether it is GQA-packed, and the variant the handler picks for the resulting call."""

    head_dims: tuple[int, int]
    split_kv: int
    pack_gqa: bool
    variant: routing.Variant


def explain_forward(q, k, v, params, ragged: bool = False,
                    library: ffi.Library | None = None, segments: bool = False,
                    mask_array: bool = False) -> KernelPlan:
    """The `KernelPlan` that `forward` follows for a call of these shapes (q, k, v: arrays or
    ShapeDtypeStructs) on the default device, with segment ids or a mask array or neither; the
    kernels must serve it."""
    import jax

    library = library or ffi.load()
    arch, reason = device_arch()
    if reason is not None:
        raise ffi.LibraryUnavailable(reason)
    head_dims = served_head_dims(q, v, params, "fwd", arch, library, segments, mask_array)
    q, k, v = (jax.ShapeDtypeStruct(x.shape[:-1] + (width,), x.dtype)
               for x, width in ((q, head_dims[0]), (k, head_dims[0]), (v, head_dims[1])))
    sms = sm_count()
    splits = 1 if sms is None or segments else splitting.num_splits(q.shape, k.shape, params, sms)
    if splits > 1:
        q, k, v = jax.eval_shape(lambda *qkv: splitting.split(*qkv, params, None, splits)[:3], q, k, v)
        params = splitting.chunk_params(params)
    packed = not segments and packing.packs(q.shape, k.shape, params)
    if packed:
        q = jax.eval_shape(lambda q, k: packing.pack(q, k, params)[0], q, k)
        params = packing.packed_params(params)
    call = kernel_call(q, k, v, params, "fwd", arch, ragged, segments, mask_array)
    return KernelPlan(head_dims, splits, packed, library.choose(call))


def explain_variant(q, k, v, params, kind: str = "fwd", ragged: bool = False,
                    library: ffi.Library | None = None, segments: bool = False,
                    mask_array: bool = False) -> routing.Variant:
    """The compiled variant the handler runs for a call of exactly these shapes (as the kernel
    sees it: pass the GQA-packed or split shapes that `forward` passes on), head dims widened
    to the compiled ones that serve them."""
    library = library or ffi.load()
    arch, reason = device_arch()
    if reason is not None:
        raise ffi.LibraryUnavailable(reason)
    call = kernel_call(q, k, v, params, kind, arch, ragged, segments, mask_array)
    head_dims = (served_head_dims(q, v, params, kind, arch, library, segments, mask_array)
                 or (call.head_dim, call.head_dim_v))
    return library.choose(dataclasses.replace(call, head_dim=head_dims[0], head_dim_v=head_dims[1]))


def filter_kinds(segment_ids) -> tuple[bool, bool]:
    """(segments, mask_array) of a call's segment operands: None, the four of segment ids, or
    five with a mask's bits (`targets.OPTIONAL_OPERANDS`)."""
    if segment_ids is None:
        return False, False
    return True, len(segment_ids) > targets.SEGMENT_OPERANDS


def _widen(x, width: int):
    """x zero-padded on its last (head-dim) axis to `width`."""
    import jax.numpy as jnp

    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _padded_head_dims(q, v, params, kind: str, library: ffi.Library,
                      segments: bool = False, mask_array: bool = False) -> tuple[int, int] | None:
    """The wider compiled head dims a call runs at, or None when it runs at its own."""
    arch, reason = device_arch()
    if reason is not None or str(q.dtype) not in _DTYPE_NAMES:
        return None
    served = served_head_dims(q, v, params, kind, arch, library, segments, mask_array)
    return None if served in (None, (q.shape[-1], v.shape[-1])) else served


def _require(q, k, v, params, kind: str, library: ffi.Library, segments: bool = False,
             mask_array: bool = False) -> None:
    reason = unsupported_reason(q, k, v, params, kind, library, segments, mask_array)
    if reason is not None:
        raise RuntimeError(f"fa4_jax {kind} kernel unavailable: {reason}")


def forward(q, k, v, params, seq_lengths=None, segment_ids=None, *, library: ffi.Library | None = None,
            tuning: str | None = None, pack_gqa: bool | None = None, split_kv: int | None = None):
    """(out [b, sq, h, dv] in q's dtype, lse [b, h, sq] float32) from the forward kernel.

    seq_lengths: None, or (q_len, kv_len) of a ragged batch, int32 [batch] each, clamped to
    [0, seqlen]. segment_ids: None, the four segment operands (`fa4_jax.runtime.segments.operands`:
    the ids and their span tables): a row sees only keys of its own id, or those and a mask's
    bits (`fa4_jax.runtime.mask_bits.operands`); never packed or split. `pack_gqa`: run the query heads
    of each key/value head as one tile's rows; None packs where `pack_gqa.packs` says it pays, False never. `split_kv`: run the keys as this
    many chunks and combine them (it must divide seqlen_k); None splits where
    `split_kv.num_splits` says the call has too few tiles for the GPU, 1 never. The explicit
    settings, `library` and `tuning` are the benchmark's.
    """
    library = library or ffi.load()
    segmented, masked = filter_kinds(segment_ids)
    padded = _padded_head_dims(q, v, params, "fwd", library, segmented, masked)
    if padded is not None:
        out, lse = forward(_widen(q, padded[0]), _widen(k, padded[0]), _widen(v, padded[1]), params,
                           seq_lengths, segment_ids, library=library, tuning=tuning, pack_gqa=pack_gqa,
                           split_kv=split_kv)
        return out[..., :v.shape[-1]], lse
    if segmented:
        _require(q, k, v, params, "fwd", library, segments=True, mask_array=masked)
        return ffi.forward_call(library, q, k, v, ffi.seq_used(seq_lengths), ffi.attributes(params), tuning,
                                segments=segment_ids)
    if split_kv is None:
        sms = sm_count()
        split_kv = 1 if sms is None else splitting.num_splits(q.shape, k.shape, params, sms)
    if split_kv > 1:
        chunks = splitting.split(q, k, v, params, seq_lengths, split_kv)
        out, lse = forward(*chunks, library=library, tuning=tuning, pack_gqa=pack_gqa, split_kv=1)
        return splitting.combine(out, lse, split_kv)
    if pack_gqa is None:
        pack_gqa = packing.packs(q.shape, k.shape, params)
    if pack_gqa:
        packed_q, packed_params, packed_lengths = packing.pack(q, k, params, seq_lengths)
        out, lse = forward(packed_q, k, v, packed_params, packed_lengths, library=library,
                           tuning=tuning, pack_gqa=False, split_kv=1)
        return packing.unpack(out, lse, q.shape[2])
    _require(q, k, v, params, "fwd", library)
    # Q, K and V go in unzeroed: the kernel masks the padding keys, zeroes their V rows and
    # replaces the rows past an entry's queries itself (a decode step would otherwise copy its
    # whole KV cache twice over).
    return ffi.forward_call(library, q, k, v, ffi.seq_used(seq_lengths), ffi.attributes(params), tuning)


def dq_copies(q, k, params, library: ffi.Library) -> int:
    """The dQ accumulators of a backward call: the arch menu's rule."""
    arch, _ = device_arch()
    return routing.dq_copies(library.dq_copies_max_keys.get(arch, {}), q.shape[-1], k.shape[1],
                             params.deterministic)


def backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths=None, segment_ids=None, *,
             library: ffi.Library | None = None, tuning: str | None = None,
             copies: int | None = None):
    """(dq, dk, dv), each in its input's shape and dtype, from the backward kernels.

    out and lse are the statistics the gradient is taken at (see `backends.backward`); d_lse is
    the cotangent of lse, or None when lse is not differentiated (docs/perf-log.md, "The dLSE
    cotangent as a symbolic zero"). `params.deterministic` selects the fixed-order dQ
    accumulation. seq_lengths: as for `forward`; rows of dq past q_len and of dk, dv past kv_len
    come out zero. segment_ids: as for `forward`. `copies` overrides the dQ accumulators' count
    (`dq_copies`), for the benchmark's measurement of that rule.
    """
    library = library or ffi.load()
    segmented, masked = filter_kinds(segment_ids)
    padded = _padded_head_dims(q, v, params, "bwd", library, segmented, masked)
    if padded is not None:
        width, width_v = padded
        dq, dk, dv = backward(_widen(q, width), _widen(k, width), _widen(v, width_v),
                              _widen(out, width_v), lse, _widen(d_out, width_v), d_lse, params,
                              seq_lengths, segment_ids, library=library, tuning=tuning, copies=copies)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    _require(q, k, v, params, "bwd", library, segmented, masked)
    if segmented and params.deterministic:
        segment_ids = _deterministic_walk(q, k, v, params, seq_lengths is not None, segment_ids, library, masked)
    d_out = d_out.astype(q.dtype)
    copies = copies or dq_copies(q, k, params, library)
    return ffi.backward_call(library, q, k, v, out, lse, d_out, d_lse, ffi.seq_used(seq_lengths), ffi.attributes(params),
                             params.deterministic, copies, tuning, segments=segment_ids)


def _deterministic_walk(q, k, v, params, ragged: bool, segment_ids, library: ffi.Library, masked: bool):
    """segment_ids with the key spans a deterministic backward walks (`segments.deterministic_walk`),
    at the query tile of the variant that runs the call (the widest backward tile, which walks a
    superset for any, when the manifest does not say)."""
    from fa4_jax.runtime import segments

    arch, _ = device_arch()
    variant = library.choose(kernel_call(q, k, v, params, "bwd", arch, ragged, segments=True, mask_array=masked))
    tile_m = library.segments_backward_tile_m.get(variant.name, WIDEST_BACKWARD_TILE_M)
    q_ids, kv_ids, row_spans, key_spans, *bits = segment_ids
    return (q_ids, kv_ids, row_spans, segments.deterministic_walk(row_spans, key_spans, tile_m), *bits)


def available() -> bool:
    """The library loads and the default device is a CUDA GPU it has forward kernels for."""
    try:
        library = ffi.load()
    except ffi.LibraryUnavailable:
        return False
    arch, _ = device_arch()
    return arch is not None and any(name.startswith(routing.name_prefix("fwd", arch))
                                    for name in library.compiled)
