"""Run-time policy for the kernels: whether they serve a call, and how a call is shaped for them.

- `unsupported_reason(q, k, v, params, kind)`: None when the installed library has a kernel of
  `kind` for this call on the default device, else a sentence saying why not.
- `forward(q, k, v, params, seq_lengths)`: the forward kernel call, with grouped-query calls of
  few query rows GQA-packed (`fa4_jax.pack_gqa`) and calls with too few tiles to fill the GPU
  split over their keys (`fa4_jax.split_kv`).
- `backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths)`: the backward kernel call,
  with the dQ workspace's copies from the arch menu's rule (`routing.dq_copies`).
- `explain_variant(...)`: the variant the handler's routing rule picks (`fa4_jax.routing`).

A ragged batch's padding reaches the kernels (a TMA tile load cannot stop at a per-entry length),
and a masked P = 0 times a NaN or inf of the padding would still be NaN. The forward kernel makes
the K/V padding harmless itself (the mask overwrites the scores, V's padding rows are zeroed in
shared memory); ragged calls still zero the padding of q (forward and backward) and of d_out, k
and v (backward) with one elementwise pass over each.

`library` arguments default to the shipping library; the benchmarks pass their development
library (benchmarks/ablations.py) and a `tuning` name.
"""
from __future__ import annotations

import numpy as np

from fa4_jax import ffi, routing
from fa4_jax import pack_gqa as packing
from fa4_jax import split_kv as splitting

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
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}", None


def sm_count() -> int | None:
    """Multiprocessors of the default device, if JAX says."""
    import jax

    return getattr(jax.devices()[0], "core_count", None) or None


def kernel_call(q, k, v, params, kind: str, arch: str, ragged: bool) -> routing.Call:
    return routing.Call(
        kind=kind, arch=arch, dtype=_DTYPE_NAMES[str(q.dtype)], head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        mask=routing.mask_kind(params.causal, params.window_left, params.window_right),
        softcap=params.softcap is not None, seqlen_q=q.shape[1], seqlen_k=k.shape[1], ragged=ragged,
        top_left=params.top_left)


def unsupported_reason(q, k, v, params, kind: str = "fwd", library: ffi.Library | None = None) -> str | None:
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
    default = kernel_call(q, k, v, params, kind, arch, ragged=False).variant()
    if default.name not in library.compiled:
        return (f"no {kind} kernel for {default.arch} {default.dtype} at head dim "
                f"{default.head_dim} (head dim of v {default.head_dim_v}): {default.name} is not "
                f"compiled into {library.path}")
    return None


def explain_variant(q, k, v, params, kind: str = "fwd", ragged: bool = False,
                    library: ffi.Library | None = None) -> routing.Variant:
    """The compiled variant the handler runs for this call (as the kernel sees it: pass the
    GQA-packed or split shapes that `forward` passes on)."""
    library = library or ffi.load()
    arch, reason = device_arch()
    if reason is not None:
        raise ffi.LibraryUnavailable(reason)
    return library.choose(kernel_call(q, k, v, params, kind, arch, ragged))


def _zero_padding(x, lengths):
    """x [b, s, ...] with its rows at or past lengths[b] set to zero (see the module docstring)."""
    import jax.numpy as jnp

    valid = jnp.arange(x.shape[1], dtype=np.int32)[None, :] < lengths[:, None]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def _length_operands(seq_lengths, by_query, by_key):
    """((seq_used_q, seq_used_k), by_query, by_key) for a kernel call.

    by_query / by_key: tuples of arrays whose axis 1 runs over query rows / keys. A ragged call
    gets them back with their padding zeroed (module docstring), a dense call unchanged.
    """
    seq_used_q, seq_used_k = ffi.seq_used(seq_lengths)
    if seq_lengths is not None:
        by_query = tuple(_zero_padding(x, seq_used_q) for x in by_query)
        by_key = tuple(_zero_padding(x, seq_used_k) for x in by_key)
    return (seq_used_q, seq_used_k), by_query, by_key


def _require(q, k, v, params, kind: str, library: ffi.Library) -> None:
    reason = unsupported_reason(q, k, v, params, kind, library)
    if reason is not None:
        raise RuntimeError(f"fa4_jax {kind} kernel unavailable: {reason}")


def forward(q, k, v, params, seq_lengths=None, *, library: ffi.Library | None = None,
            tuning: str | None = None, pack_gqa: bool | None = None, split_kv: int | None = None):
    """(out [b, sq, h, dv] in q's dtype, lse [b, h, sq] float32) from the forward kernel.

    seq_lengths: None, or (q_len, kv_len) of a ragged batch, int32 [batch] each, clamped to
    [0, seqlen]. `pack_gqa`: run the query heads of each key/value head as one tile's rows;
    None packs where `pack_gqa.packs` says it pays, False never. `split_kv`: run the keys as this
    many chunks and combine them (it must divide seqlen_k); None splits where
    `split_kv.num_splits` says the call has too few tiles for the GPU, 1 never. The explicit
    settings, `library` and `tuning` are the benchmark's.
    """
    library = library or ffi.load()
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
    # K and V go in unzeroed: the kernel masks the padding keys and zeroes their V rows itself
    # (a decode step would otherwise copy its whole KV cache twice over).
    lengths, (q,), () = _length_operands(seq_lengths, (q,), ())
    return ffi.forward_call(library, q, k, v, lengths, ffi.attributes(params), tuning)


def dq_copies(q, k, params, library: ffi.Library) -> int:
    """The dQ accumulators of a backward call: the arch menu's rule."""
    arch, _ = device_arch()
    return routing.dq_copies(library.dq_copies_max_keys.get(arch, {}), q.shape[-1], k.shape[1],
                             params.deterministic)


def backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths=None, *,
             library: ffi.Library | None = None, tuning: str | None = None,
             copies: int | None = None):
    """(dq, dk, dv), each in its input's shape and dtype, from the backward kernels.

    out and lse are the statistics the gradient is taken at (see `backends.backward`); d_lse is
    the cotangent of lse, or None when lse is not differentiated (docs/perf-log.md, "The dLSE
    cotangent as a symbolic zero"). `params.deterministic` selects the fixed-order dQ
    accumulation. seq_lengths: as for `forward`; rows of dq past q_len and of dk, dv past kv_len
    come out zero. `copies` overrides the dQ accumulators' count (`dq_copies`), for the
    benchmark's measurement of that rule.
    """
    library = library or ffi.load()
    _require(q, k, v, params, "bwd", library)
    d_out = d_out.astype(q.dtype)
    lengths, (q, d_out), (k, v) = _length_operands(seq_lengths, (q, d_out), (k, v))
    copies = copies or dq_copies(q, k, params, library)
    return ffi.backward_call(library, q, k, v, out, lse, d_out, d_lse, lengths, ffi.attributes(params),
                             params.deterministic, copies, tuning)


def available() -> bool:
    """The library loads and the default device is a CUDA GPU it has forward kernels for."""
    try:
        library = ffi.load()
    except ffi.LibraryUnavailable:
        return False
    arch, _ = device_arch()
    return arch is not None and any(name.startswith(routing.name_prefix("fwd", arch))
                                    for name in library.compiled)
