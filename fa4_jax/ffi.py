"""Loads the built kernel library and exposes the FFI custom calls.

Contract used by `vjp.py` and `api.py`:

- `is_available() -> bool`: the library is built, loads, and its targets are registered for CUDA,
  and the default device is a CUDA device of a compiled arch. Never raises.
- `unsupported_reason(q, k, v, params, kind="fwd") -> str | None`: None when a compiled variant
  of `kind` ("fwd" or "bwd") serves this call on the current default device, else a sentence
  saying why not (names the missing variant). Ragged calls take the same variants as the
  others.
- `forward(q, k, v, params, seq_lengths=None) -> (out, lse)`: the `fa4_fwd_v1` custom call;
  grouped-query calls with few query rows run GQA-packed (`fa4_jax.pack_gqa`), and calls with
  too few tiles to fill the GPU split their keys (`fa4_jax.split_kv`).
- `backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths=None) -> (dq, dk, dv)`: the
  `fa4_bwd_v1` custom call (d_lse None: lse not differentiated); its fp32 workspaces are
  extra results XLA allocates and this function drops.

`seq_lengths` is None or (q_len, kv_len), int32 [batch] each, clamped to [0, seqlen] (a ragged
batch, `backends.forward`). Both calls always pass the two length operands (`seq_used_q`,
`seq_used_k`), so ragged and dense calls share one compiled variant; a dense call passes them
empty ([0] each), so that XLA builds nothing before the call and the kernels read no lengths
(kernels/common/ragged.py). A TMA tile load cannot stop at a per-entry length, so padding reaches
the kernels, and a masked P = 0 times a NaN or inf of the padding would still be NaN. The forward
kernel makes the K/V padding harmless itself (the mask overwrites the scores, V's padding rows are
zeroed in shared memory); ragged calls still zero the padding of q (forward and backward) and of
d_out, k and v (backward) with one elementwise pass over each.

The library is fa4_jax/_lib/libfa4_jax.so (FA4_JAX_LIBRARY overrides), built by
`python -m fa4_jax.aot.build`; fa4_jax/_lib/variants.json lists the variants compiled into it.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os

import numpy as np

from fa4_jax import pack_gqa as packing
from fa4_jax import split_kv as splitting

FWD_TARGET = "fa4_fwd_v1"
BWD_TARGET = "fa4_bwd_v1"
_LIB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib")
# Compute capability -> the arch the variants are compiled for.
_ARCH_OF_CC = {"9.0": "sm_90a", "10.0": "sm_100a"}
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}


def library_path() -> str:
    return os.environ.get("FA4_JAX_LIBRARY") or os.path.join(_LIB_DIR, "libfa4_jax.so")


@functools.cache
def _load() -> tuple[frozenset[str], str | None]:
    """(names of compiled variants, None) once loaded and registered, else ((), reason)."""
    path = library_path()
    if not os.path.exists(path):
        return frozenset(), f"the fa4_jax kernel library is not built ({path} is missing)"
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        manifest = os.path.join(os.path.dirname(path), "variants.json")
        with open(manifest) as f:
            compiled = frozenset(v["name"] for v in json.load(f))
        import jax.ffi

        for target, instantiate, execute in (
                (FWD_TARGET, lib.Fa4FwdInstantiate, lib.Fa4FwdExecute),
                (BWD_TARGET, lib.Fa4BwdInstantiate, lib.Fa4BwdExecute)):
            jax.ffi.register_ffi_target(
                target,
                {"instantiate": jax.ffi.pycapsule(instantiate),
                 "execute": jax.ffi.pycapsule(execute)},
                platform="CUDA")
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        return frozenset(), f"the fa4_jax kernel library at {path} does not load: {e}"
    return compiled, None


def _device_arch() -> tuple[str | None, str | None]:
    """(arch of the default device, None), or (None, why there is none)."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError as e:
        return None, f"no JAX device: {e}"
    cc = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or cc is None:
        return None, f"the default device is {device.platform}, not a CUDA GPU"
    arch = _ARCH_OF_CC.get(cc)
    if arch is None:
        return None, f"the default device {device.device_kind} (compute capability {cc}) has no kernels"
    return arch, None


def _sm_count() -> int:
    """Multiprocessors of the default device (132 on an H100/H200 SXM, if JAX does not say)."""
    import jax

    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def is_available() -> bool:
    try:
        compiled, reason = _load()
        if reason is not None:
            return False
        arch, _ = _device_arch()
        return arch is not None and any(name.startswith(f"fwd_{arch.replace('_', '')}_")
                                        for name in compiled)
    except Exception:  # noqa: BLE001 - the contract: never raises
        return False


def _variant(q, k, v, params, arch: str, kind: str, tuning: str = "default"):
    from fa4_jax.aot.variants import select

    return select(_DTYPE_NAMES[str(q.dtype)], q.shape[-1], v.shape[-1], params.causal,
                  params.window_left, params.window_right, params.softcap is not None, arch=arch,
                  kind=kind, tuning=tuning)


def unsupported_reason(q, k, v, params, kind: str = "fwd", tuning: str = "default") -> str | None:
    compiled, reason = _load()
    if reason is not None:
        return reason
    arch, reason = _device_arch()
    if reason is not None:
        return reason
    if str(q.dtype) not in _DTYPE_NAMES:
        return f"dtype {q.dtype} has no kernel (bfloat16 and float16 do)"
    if len({str(x.dtype) for x in (q, k, v)}) != 1:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if k.shape[-1] != q.shape[-1]:
        return f"head dims of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ"
    variant = _variant(q, k, v, params, arch, kind, tuning)
    if variant.name not in compiled:
        return (f"variant {variant.name} (head dim {variant.head_dim}, head dim of v "
                f"{variant.head_dim_v}) is not compiled into {library_path()}")
    return None


def _window(w: int | None) -> np.int32:
    return np.int32(-1 if w is None else w)


def _static_attrs(params, tuning: str) -> dict:
    return dict(softmax_scale=np.float32(params.softmax_scale),
                causal=bool(params.causal),
                window_left=_window(params.window_left),
                window_right=_window(params.window_right),
                softcap=np.float32(params.softcap or 0.0),
                tuning=tuning)


def _seq_used(seq_lengths):
    """The seq_used_q, seq_used_k operands: the ragged lengths, or empty ones for a dense call.

    Empty, not full: full lengths were a broadcast kernel that XLA ran ahead of every call
    (docs/perf-log.md, "dense calls pass no lengths"); a zero-sized array is no work at all.
    Built by jnp, not numpy: a numpy array would be a closed-over constant, which
    custom_partitioning (sharding.py) rejects.
    """
    import jax.numpy as jnp

    if seq_lengths is None:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
    return tuple(lengths.astype(np.int32) for lengths in seq_lengths)


def _zero_padding(x, lengths):
    """x [b, s, ...] with its rows at or past lengths[b] set to zero (see the module docstring)."""
    import jax.numpy as jnp

    valid = jnp.arange(x.shape[1], dtype=np.int32)[None, :] < lengths[:, None]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def _length_operands(seq_lengths, q, k, by_query, by_key):
    """((seq_used_q, seq_used_k), by_query, by_key) for a kernel call.

    by_query / by_key: tuples of arrays whose axis 1 runs over query rows / keys. A ragged call
    gets them back with their padding zeroed (module docstring), a dense call unchanged.
    """
    seq_used_q, seq_used_k = _seq_used(seq_lengths)
    if seq_lengths is not None:
        by_query = tuple(_zero_padding(x, seq_used_q) for x in by_query)
        by_key = tuple(_zero_padding(x, seq_used_k) for x in by_key)
    return (seq_used_q, seq_used_k), by_query, by_key


def _forward_tuning(q, k, v, params, tuning: str, ragged: bool = False) -> str:
    """`tuning`, or the decode, short-call or tail variant that `variants.call_tuning` picks for
    the call's shape, when that variant is compiled. Raises ValueError for a tuning the call's
    shape may not run (`variants.narrowing_mismatch`)."""
    from fa4_jax.aot.variants import call_tuning, mask_kind, narrowing_mismatch

    mask = mask_kind(params.causal, params.window_left, params.window_right)
    chosen = call_tuning("fwd", mask, q.shape[-1], q.shape[1], k.shape[1], tuning, ragged)
    if chosen != tuning and unsupported_reason(q, k, v, params, "fwd", chosen) is None:
        return chosen
    reason = narrowing_mismatch(tuning, mask, q.shape[-1], q.shape[1], k.shape[1], ragged)
    if reason is not None:
        raise ValueError(f"tuning: {reason}")
    return tuning


def _result_type(operand):
    """ShapeDtypeStruct(shape, dtype) for a custom call's results, varying over the same manual
    mesh axes as `operand`.

    Inside `shard_map`, ffi_call checks that its operands vary over one set of manual axes but
    gives its results none; a custom_vjp whose backward returns such a dq for a q that varies
    (ring attention's) is then refused for mismatched types.
    """
    import jax

    operand_type = jax.typeof(operand)
    if not operand_type.mat.varying:
        return jax.ShapeDtypeStruct
    # A manual axis type is only valid together with a sharding on the mesh that has the axes.
    sharding = jax.sharding.NamedSharding(operand_type.sharding.mesh, jax.sharding.PartitionSpec())
    axis_type = jax.sharding.ManualAxisType(varying=operand_type.mat.varying)
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding,
                                                     manual_axis_type=axis_type)


def _require(q, k, v, params, kind: str, tuning: str) -> None:
    reason = unsupported_reason(q, k, v, params, kind, tuning)
    if reason is not None:
        raise RuntimeError(f"fa4_jax {kind} kernel unavailable: {reason}")


def forward(q, k, v, params, seq_lengths=None, tuning: str = "default", pack_gqa: bool | None = None,
            split_kv: int | None = None):
    """(out [b, sq, h, dv] in q's dtype, lse [b, h, sq] float32) from the compiled kernel.

    seq_lengths: None, or (q_len, kv_len) of a ragged batch (module docstring).

    `tuning` names a kernel setting from `fa4_jax.aot.variants.TUNINGS` ("default" is what
    `fa4_jax.attention` runs; the others exist for the benchmark's ablations). `pack_gqa`: run
    the query heads of each key/value head as one tile's rows (`fa4_jax.pack_gqa`); None packs
    where `pack_gqa.packs` says it pays, False never. `split_kv`: run the keys as this many
    chunks and combine them (`fa4_jax.split_kv`; it must divide seqlen_k); None splits where
    `split_kv.num_splits` says the call has too few tiles for the GPU, 1 never. The explicit
    settings are the benchmark's baselines.
    """
    if split_kv is None:
        split_kv = splitting.num_splits(q.shape, k.shape, params, _sm_count())
    if split_kv > 1:
        chunks = splitting.split(q, k, v, params, seq_lengths, split_kv)
        out, lse = forward(*chunks, tuning=tuning, pack_gqa=pack_gqa, split_kv=1)
        return splitting.combine(out, lse, split_kv)
    if pack_gqa is None:
        pack_gqa = packing.packs(q.shape, k.shape, params)
    if pack_gqa:
        packed_q, packed_params, packed_lengths = packing.pack(q, k, params, seq_lengths)
        out, lse = forward(packed_q, k, v, packed_params, packed_lengths, tuning, pack_gqa=False,
                           split_kv=1)
        return packing.unpack(out, lse, q.shape[2])
    return _forward(q, k, v, params, seq_lengths, tuning)


def _forward(q, k, v, params, seq_lengths, tuning: str):
    import jax

    tuning = _forward_tuning(q, k, v, params, tuning, ragged=seq_lengths is not None)
    _require(q, k, v, params, "fwd", tuning)
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    result = _result_type(q)
    call = jax.ffi.ffi_call(FWD_TARGET, (result((b, sq, h, dv), q.dtype), result((b, h, sq), np.float32)))
    # K and V go in unzeroed: the kernel masks the padding keys and zeroes their V rows itself
    # (a decode step would otherwise copy its whole KV cache twice over).
    lengths, (q,), () = _length_operands(seq_lengths, q, k, (q,), ())
    return call(q, k, v, *lengths, **_static_attrs(params, tuning))


def backward(q, k, v, out, lse, d_out, d_lse, params, seq_lengths=None, tuning: str = "default"):
    """(dq, dk, dv), each in its input's shape and dtype, from the compiled backward kernels.

    out and lse are the statistics the gradient is taken at (see `backends.backward`); d_lse is
    the cotangent of lse, or None when lse is not differentiated: the call then passes an empty
    [0, h, sq] operand and the preprocess reads no dLSE, where zeros were a b·h·sq fp32
    broadcast kernel ahead of every backward (docs/perf-log.md, "the dLSE cotangent as a
    symbolic zero"). `params.deterministic` selects
    the fixed-order dQ accumulation. seq_lengths: as for `forward`; rows of dq past q_len and
    of dk, dv past kv_len come out zero. The fp32 workspaces (dQ accumulators
    [copies, b, h, sq_pad, d], D and lse·log2(e) [b, h, sq_pad], semaphores
    [copies, b, h, sq_pad / 64]; copies from `variants.dq_copies`) are results of the call, so
    XLA owns and reuses their memory.
    """
    import jax
    import jax.numpy as jnp

    from fa4_jax.aot.variants import dq_copies
    from fa4_jax.kernels.bwd_workspace import BWD_SEMAPHORE_ROWS, BWD_SEQ_PAD

    _require(q, k, v, params, "bwd", tuning)
    b, sq, h, d = q.shape
    sq_pad = -(-sq // BWD_SEQ_PAD) * BWD_SEQ_PAD
    copies = dq_copies(d, k.shape[1], tuning, params.deterministic)
    f32 = np.float32
    result = _result_type(q)
    results = (
        result(q.shape, q.dtype),
        result(k.shape, k.dtype),
        result(v.shape, v.dtype),
        result((copies, b, h, sq_pad, d), f32),
        result((b, h, sq_pad), f32),
        result((b, h, sq_pad), f32),
        result((copies, b, h, sq_pad // BWD_SEMAPHORE_ROWS), np.int32),
    )
    call = jax.ffi.ffi_call(BWD_TARGET, results)
    d_out = d_out.astype(q.dtype)
    lengths, (q, d_out), (k, v) = _length_operands(seq_lengths, q, k, (q, d_out), (k, v))
    d_lse = jnp.zeros((0, h, sq), f32) if d_lse is None else d_lse.astype(f32)
    dq, dk, dv, *_workspaces = call(
        q, k, v, out.astype(q.dtype), d_out, lse.astype(f32), d_lse, *lengths,
        deterministic=bool(params.deterministic), **_static_attrs(params, tuning))
    return dq, dk, dv
