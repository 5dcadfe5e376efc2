"""The cuDNN route: calls the kernels cannot serve on a CUDA GPU run on cuDNN's flash attention
through `jax.nn.dot_product_attention(implementation="cudnn")`, where it has the same semantics.

That function aligns masks top-left, has no softcap, returns no differentiable logsumexp and
takes value with key's shape; cuDNN's flash attention needs an sm_80 GPU or newer and head dims
that are multiples of 8 up to 128 (256 from sm_90). `unsupported_reason` checks each; the calls
it refuses run on the reference. JAX differentiates the cuDNN call itself (cuDNN's backward),
and its own partitioning rules shard it.
"""
from __future__ import annotations

from fa4_jax.core.params import AttentionParams


def unsupported_reason(query, key, value, params: AttentionParams, ragged: bool, return_lse: bool,
                       compute_capability: str | None) -> str | None:
    """None when cuDNN computes exactly what fa4_jax.attention would for this call."""
    if compute_capability is None:
        return "cuDNN needs a CUDA GPU"
    major = int(compute_capability.split(".")[0])
    if major < 8:
        return f"cuDNN flash attention needs sm_80 or newer, the GPU is compute capability {compute_capability}"
    if str(query.dtype) not in ("bfloat16", "float16"):
        return f"cuDNN flash attention takes bfloat16 or float16, not {query.dtype}"
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    max_head_dim = 256 if major >= 9 else 128
    if head_dim != head_dim_v or head_dim > max_head_dim or head_dim % 8:
        return (f"cuDNN flash attention needs one head dim, a multiple of 8 up to {max_head_dim}; "
                f"got {head_dim} and {head_dim_v}")
    if params.softcap is not None:
        return "jax.nn.dot_product_attention has no softcap"
    if params.deterministic:
        return "cuDNN's backward is not known to be deterministic"
    if return_lse:
        return "jax.nn.dot_product_attention returns no differentiable logsumexp"
    if ragged:
        # cuDNN's rows past the lengths and its fully masked rows are not fa4_jax's (0, lse −inf).
        return "ragged batches run on cuDNN only once its padded rows are known to be fa4_jax's"
    seqlen_q, seqlen_k = query.shape[1], key.shape[1]
    masked = params.causal or params.window_left is not None or params.window_right is not None
    if masked and not (params.top_left or seqlen_q == seqlen_k):
        return "jax's masks align top-left; this call's bottom-right mask differs when seqlen_q != seqlen_k"
    if params.window_right is not None:
        return "cuDNN takes a sliding window only as a left bound beside a causal mask"
    if params.window_left is not None and seqlen_q > seqlen_k + params.window_left:
        # Rows past the keys' end plus the window see no key: fa4_jax gives them 0.
        return "a window leaves some query rows without keys, which cuDNN does not give fa4_jax's zeros"
    return None


def attention(query, key, value, params: AttentionParams):
    """fa4_jax.attention's output (no lse) by cuDNN; `unsupported_reason` must be None."""
    import jax

    window = None if params.window_left is None else (params.window_left, 0)
    return jax.nn.dot_product_attention(query, key, value, scale=params.softmax_scale,
                                        is_causal=params.causal, local_window_size=window,
                                        implementation="cudnn")
