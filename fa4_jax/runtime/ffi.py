"""Loads the built kernel library, registers its XLA FFI targets, and builds the custom calls.

Nothing here chooses anything: which calls reach the kernels, and how they are shaped (GQA
packing, split-KV, the dQ workspace's copies), is `fa4_jax.runtime.dispatch`'s; which compiled variant
serves a call is the handler's routing rule (`fa4_jax.abi.routing`).

The library is fa4_jax/_lib/libfa4_jax.so (FA4_JAX_LIBRARY overrides), built by
`python -m fa4_jax.aot.build`, beside its manifest.json (the compiled variants and their routes).
It has one handler per kind; `fa4_jax.abi.targets` names the custom call targets bound to it:
the current one, which every call here names, and those of earlier releases, registered too so
that programs they exported still run. A call passes the kind's fixed operands, then its optional
ones: none, the four of segment ids (the ids and their span tables, `fa4_jax.runtime.segments`),
or those and a boolean mask's bits (`fa4_jax.runtime.mask_bits`), whose count its
`optional_operands` attribute repeats for the handler's instantiate stage, which sees no operands.
The other attributes describe the problem (softmax scale, mask, window, softcap, alignment,
deterministic) and never a tuning, so a `jax.export`ed program keeps working after a retune. A
development library (benchmarks/ablations.py) registers the same handlers under names of its own,
and they take a `tuning` attribute.

Both calls always pass the two length operands (`seq_used_q`, `seq_used_k`), so ragged and dense
calls share one compiled variant; a dense call passes them empty ([0] each), so that XLA builds
nothing before the call and the kernels read no lengths (kernels/common/ragged.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os

import numpy as np

from fa4_jax.abi import routing, targets
from fa4_jax.abi.workspace import BWD_SEMAPHORE_ROWS, BWD_SEQ_PAD

_LIB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_lib")


def export_disabled_checks() -> list:
    """The `disabled_checks` that `jax.export.export` needs for a program with fa4_jax's kernels.

    jax.export refuses custom calls it does not know to be stable; fa4_jax's targets are, by
    their version suffix (a changed ABI gets a new name), the earlier releases' names included:

        jax.export.export(jax.jit(f), disabled_checks=fa4_jax.export_disabled_checks())(*specs)
    """
    import jax

    return [jax.export.DisabledSafetyCheck.custom_call(t.name) for t in targets.registered()]


class LibraryUnavailable(RuntimeError):
    """The kernel library is not built, does not load, or lacks what a call needs."""


@dataclasses.dataclass(frozen=True)
class Library:
    """A loaded, registered kernel library and its manifest."""

    path: str
    compiled: frozenset  # variant names
    routes: tuple  # (arch, routing.Route) pairs, in order
    dq_copies_max_keys: dict  # arch -> {head_dim: keys}
    # A development library: its targets are `fa4_jax.abi.targets`' development names, and take a
    # `tuning` attribute.
    tuning_targets: bool
    head_dims: dict = dataclasses.field(default_factory=dict)  # arch -> {(head_dim, head_dim_v)}
    # Archs whose kernels no GPU of the arch has run: checked on first use (fa4_jax.runtime.gate).
    unverified_arches: frozenset = frozenset()
    # Segments backward variant name -> its query tile's rows (the deterministic walk's tile).
    segments_backward_tile_m: dict = dataclasses.field(default_factory=dict)

    def routes_for(self, arch: str) -> tuple:
        return tuple(route for route_arch, route in self.routes if route_arch == arch)

    def choose(self, call: routing.Call) -> routing.Variant:
        return routing.choose(call, self.routes_for(call.arch), self.compiled)


def library_path() -> str:
    return os.environ.get("FA4_JAX_LIBRARY") or os.path.join(_LIB_DIR, "libfa4_jax.so")


def read_manifest(path: str) -> dict:
    """The manifest.json beside the library at `path`."""
    with open(os.path.join(os.path.dirname(path), "manifest.json")) as f:
        return json.load(f)


def _register(lib, development: bool) -> None:
    """Registers every target of `fa4_jax.abi.targets` the library serves, each with the handler
    pair the table binds it to."""
    import jax.ffi

    for target in targets.registered(development):
        jax.ffi.register_ffi_target(
            target.name,
            {"instantiate": jax.ffi.pycapsule(getattr(lib, f"{target.handler}Instantiate")),
             "execute": jax.ffi.pycapsule(getattr(lib, f"{target.handler}Execute"))},
            platform="CUDA")


@functools.cache
def load(path: str | None = None, tuning_targets: bool = False) -> Library:
    """The library at `path` (default `library_path()`), loaded and its targets registered for
    CUDA, once per process. Raises LibraryUnavailable with the reason."""
    path = path or library_path()
    if not os.path.exists(path):
        raise LibraryUnavailable(f"the fa4_jax kernel library is not built ({path} is missing)")
    try:
        lib = ctypes.CDLL(path)
        library = describe(path, tuning_targets)
        _register(lib, tuning_targets)
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        raise LibraryUnavailable(f"the fa4_jax kernel library at {path} does not load: {e}") from e
    return library


def describe(path: str, tuning_targets: bool = False) -> Library:
    """The Library at `path` as its manifest describes it, neither loaded nor registered (the
    probe process's view: fa4_jax.runtime.probe)."""
    manifest = read_manifest(path)
    routes = tuple((entry.pop("arch"), routing.Route(**entry)) for entry in manifest["routes"])
    return Library(
        path=path,
        compiled=frozenset(v["name"] for v in manifest["variants"]),
        routes=routes,
        dq_copies_max_keys={arch: {int(d): keys for d, keys in rule.items()}
                            for arch, rule in manifest["dq_copies_max_keys"].items()},
        tuning_targets=tuning_targets,
        head_dims=_head_dims(manifest["variants"]),
        unverified_arches=frozenset(manifest.get("unverified_arches", ())),
        segments_backward_tile_m=dict(manifest.get("segments_backward_tile_m", {})),
    )


def manifest_variants(path: str) -> dict[str, routing.Variant]:
    """name -> routing.Variant of every variant in the manifest of the library at `path`."""
    return {entry["name"]: routing.Variant(**{k: v for k, v in entry.items() if k != "name"})
            for entry in read_manifest(path)["variants"]}


def mark_verified(library: Library, variant: str) -> None:
    """Lets the handlers run `variant` in this process (ffi/gate.h): it passed its first-use check
    on this GPU (fa4_jax.runtime.gate)."""
    if ctypes.CDLL(library.path).Fa4MarkVerified(variant.encode()) != 0:
        raise LibraryUnavailable(f"{library.path} has no variant {variant}")


def cuda_driver_version(library: Library) -> int:
    """The CUDA version the installed driver supports (12080 for 12.8), or -1; creates no CUDA
    context."""
    return ctypes.CDLL(library.path).Fa4CudaDriverVersion()


def _head_dims(variants) -> dict:
    """arch -> the (head_dim, head_dim_v) pairs the manifest's variants are built for."""
    pairs: dict = {}
    for variant in variants:
        pairs.setdefault(variant["arch"], set()).add((variant["head_dim"], variant["head_dim_v"]))
    return {arch: frozenset(arch_pairs) for arch, arch_pairs in pairs.items()}


def seq_used(seq_lengths):
    """The seq_used_q, seq_used_k operands: the ragged lengths, or empty ones for a dense call.

    Empty, not full: full lengths were a broadcast kernel that XLA ran ahead of every call
    (docs/perf-log.md, "Dense calls pass no lengths"); a zero-sized array is no work at all.
    Built by jnp, not numpy: a numpy array would be a closed-over constant, which
    custom_partitioning (sharding.py) rejects.
    """
    import jax.numpy as jnp

    if seq_lengths is None:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
    return tuple(lengths.astype(np.int32) for lengths in seq_lengths)


def _window(w: int | None) -> np.int32:
    return np.int32(-1 if w is None else w)


def attributes(params) -> dict:
    """The custom calls' problem attributes of an `AttentionParams`."""
    return dict(softmax_scale=np.float32(params.softmax_scale),
                causal=bool(params.causal),
                window_left=_window(params.window_left),
                window_right=_window(params.window_right),
                softcap=np.float32(params.softcap or 0.0),
                top_left=bool(params.top_left))


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


def _tuning_attr(library: Library, tuning: str | None) -> dict:
    if library.tuning_targets:
        return {"tuning": tuning or "default"}
    if tuning not in (None, "default"):
        raise ValueError(f"tuning={tuning!r} needs a development library (benchmarks/ablations.py); "
                         f"{library.path} routes calls itself")
    return {}


def _target(library: Library, kind: str) -> str:
    """The custom call of `kind`: the current target, or the development library's name for it."""
    kind_targets = targets.TARGETS[kind]
    return (kind_targets.development if library.tuning_targets else kind_targets.current).name


def _optional_operands(segments) -> dict:
    """The attribute that counts a call's optional operands, `segments`: none, the four of
    segment ids, or five with a mask's bits. The handler's instantiate stage reads it to load the
    variants that read them."""
    count = len(segments or ())
    if count not in targets.OPTIONAL_OPERANDS:
        raise ValueError(f"{count} optional operands; the custom calls take "
                         f"{', '.join(map(str, targets.OPTIONAL_OPERANDS))}")
    return {"optional_operands": np.int32(count)}


def forward_call(library: Library, q, k, v, lengths, attrs: dict, tuning: str | None = None,
                 segments=None):
    """The forward custom call: (out [b, sq, h, dv] in q's dtype, lse [b, h, sq] float32).

    lengths: the (seq_used_q, seq_used_k) operands (`seq_used`). segments: the optional operands:
    None, the four segment operands (`fa4_jax.runtime.segments.operands`), which run the segments
    variants, or those and a mask's bits (`fa4_jax.runtime.mask_bits.operands`), which run the
    mask_array variants."""
    import jax

    b, sq, h, _ = q.shape
    result = _result_type(q)
    call = jax.ffi.ffi_call(_target(library, "fwd"),
                            (result((b, sq, h, v.shape[-1]), q.dtype), result((b, h, sq), np.float32)))
    return call(q, k, v, *lengths, *(segments or ()), **attrs, **_optional_operands(segments),
                **_tuning_attr(library, tuning))


def backward_call(library: Library, q, k, v, out, lse, d_out, d_lse, lengths, attrs: dict,
                  deterministic: bool, dq_copies: int, tuning: str | None = None, segments=None):
    """The backward custom call: (dq, dk, dv), each in its input's shape and dtype.

    d_lse None: lse not differentiated, passed as an empty [0, h, sq] operand so that the
    preprocess reads none. The fp32 workspaces (dQ accumulators [dq_copies, b, h, sq_pad, d], D
    and lse·log2(e) [b, h, sq_pad], semaphores [dq_copies, b, h, sq_pad / 64]) are results of
    the call, so XLA owns and reuses their memory; they are dropped here. segments: as for
    `forward_call`."""
    import jax
    import jax.numpy as jnp

    b, sq, h, d = q.shape
    sq_pad = -(-sq // BWD_SEQ_PAD) * BWD_SEQ_PAD
    f32 = np.float32
    result = _result_type(q)
    results = (
        result(q.shape, q.dtype),
        result(k.shape, k.dtype),
        result(v.shape, v.dtype),
        result((dq_copies, b, h, sq_pad, d), f32),
        result((b, h, sq_pad), f32),
        result((b, h, sq_pad), f32),
        result((dq_copies, b, h, sq_pad // BWD_SEMAPHORE_ROWS), np.int32),
    )
    call = jax.ffi.ffi_call(_target(library, "bwd"), results)
    d_lse = jnp.zeros((0, h, sq), f32) if d_lse is None else d_lse.astype(f32)
    dq, dk, dv, *_workspaces = call(
        q, k, v, out.astype(q.dtype), d_out.astype(q.dtype), lse.astype(f32), d_lse, *lengths,
        *(segments or ()), deterministic=bool(deterministic), **attrs, **_optional_operands(segments),
        **_tuning_attr(library, tuning))
    return dq, dk, dv
