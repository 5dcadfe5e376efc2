"""One plan per call: which backend runs it and why, asked once, before the op.

The kernels serve a call when the installed library has a forward kernel for its problem class
on this GPU (`fa4_jax.runtime.dispatch.unsupported_reason`); the backward is asked at the same
time, so the op's backward rule and its per-device bodies read the answer from the params
instead of asking again. A call the kernels do not serve runs on cuDNN where cuDNN computes
exactly what fa4_jax would (`fa4_jax.fallbacks.cudnn`), else on the reference.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fa4_jax.core.params import AttentionParams
from fa4_jax.core.visibility import Visibility
from fa4_jax.fallbacks import cudnn as cudnn_route
from fa4_jax.runtime import device, dispatch
from fa4_jax.runtime.operands import kernel_view

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BACKEND_NAMES = {"cute": "fa4_jax's kernels", "cudnn": "cuDNN (jax.nn.dot_product_attention)",
                 "reference": "the pure-JAX reference (float32 math)"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """backend: "cute", "cudnn" or "reference". reason: why not the kernels (the FallbackWarning's
    text), None when they run the call or the reference was asked for. params: the call's, with
    `implementation` (the op's backend) and `backward_reason` resolved."""

    backend: str
    reason: str | None
    params: AttentionParams


def plan(query, key, value, params: AttentionParams, visibility: Visibility, *,
         implementation: str | None, return_lse: bool = False, bias=None, cudnn: bool = True) -> Plan:
    """The plan of a validated call (query, key, value: arrays or ShapeDtypeStructs).

    implementation: the caller's (None: the kernels when they serve the call, "cute": only
    them, else a ValueError saying why, "reference"). A call with a bias, segment ids or a mask
    that the kernels do not serve runs on the reference, as does one cuDNN would compute
    differently, and every call when `cudnn` is False (an entry point that needs the op's
    logsumexp)."""
    if implementation == "reference":
        return Plan("reference", None, dataclasses.replace(params, implementation="reference"))
    reason = forward_reason(query, key, value, params, visibility, bias)
    if reason is None:
        return Plan("cute", None, dataclasses.replace(
            params, implementation="cute", require_kernels=implementation == "cute",
            backward_reason=kernel_reason(query, key, value, params, visibility, "bwd")))
    if implementation == "cute":
        raise ValueError(f"implementation='cute' cannot serve this call: {reason}")
    params = dataclasses.replace(params, implementation="reference")
    if not cudnn or bias is not None or visibility.segmented or visibility.masked:
        return Plan("reference", reason, params)
    compute_capability = device.compute_capability()
    cudnn_reason = cudnn_route.unsupported_reason(query, key, value, params, visibility.ragged, return_lse,
                                            compute_capability)
    if cudnn_reason is None:
        return Plan("cudnn", reason, params)
    if compute_capability is not None:
        reason = f"{reason}; not cuDNN: {cudnn_reason}"
    return Plan("reference", reason, params)


def forward_reason(query, key, value, params, visibility, bias=None) -> str | None:
    """Why the kernels do not run this call's forward, or None."""
    if bias is not None:
        return "the kernels do not read a bias array yet"
    if query.dtype not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16, got {query.dtype}"
    return kernel_reason(query, key, value, params, visibility, "fwd")


def kernel_reason(query, key, value, params, visibility, kind: str) -> str | None:
    """Why the library has no `kind` kernel for the call on this GPU, or None: the call as its
    kernels see it (`kernel_view`: a mask's rules folded into its bits)."""
    params, kinds = kernel_view(visibility, params)
    return dispatch.unsupported_reason(query, key, value, params, kind, kinds=kinds)
