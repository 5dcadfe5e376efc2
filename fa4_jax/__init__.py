"""fa4_jax: FlashAttention-4 kernels for JAX.

Public surface: `attention` (the full-featured entry point, padded ragged batches included),
`varlen_attention` (packed variable-length sequences), `dot_product_attention`
(a drop-in for `jax.nn.dot_product_attention`), and for multi-device work `ring_attention`
(context parallelism inside `shard_map`) with the zig-zag layout helpers; `ReshardWarning` (an
input sharding the op cannot keep, docs/multi_gpu.md) and `FallbackWarning` (a call runs on
cuDNN or the reference instead of the kernels, and why) with `explain` (the backend, kernels and
reason of a call, without running it) and `which_backend` (its backend and reason);
`export_disabled_checks` (what `jax.export` needs to serialize a program that
calls the kernels).
"""
from fa4_jax.api.attention import Explanation, attention, explain, which_backend
from fa4_jax.api.dot_product import dot_product_attention
from fa4_jax.api.ring import from_zigzag_layout, ring_attention, to_zigzag_layout
from fa4_jax.api.varlen import varlen_attention
from fa4_jax.core.notices import FallbackWarning
from fa4_jax.ops.sharding import ReshardWarning
from fa4_jax.runtime.ffi import export_disabled_checks

__version__ = "0.2.0"

# Register the installed library's custom call targets now, so that a program that reaches them
# without calling fa4_jax first (a deserialized `jax.export` artifact) finds them, and let its
# handlers run the kernels of unverified archs that passed their first-use check on this GPU
# (fa4_jax.runtime.gate); calls load it themselves when this finds none.
from fa4_jax.runtime import ffi as _ffi  # noqa: E402
from fa4_jax.runtime import gate as _gate  # noqa: E402

try:
    _gate.push_when_ready(_ffi.load())
except _ffi.LibraryUnavailable:
    pass

__all__ = [
    "attention",
    "varlen_attention",
    "dot_product_attention",
    "ring_attention",
    "to_zigzag_layout",
    "from_zigzag_layout",
    "ReshardWarning",
    "FallbackWarning",
    "export_disabled_checks",
    "which_backend",
    "explain",
    "Explanation",
    "__version__",
]
