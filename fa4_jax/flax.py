"""Flax adapters: fa4_jax attention as the `attention_fn` of Flax's multi-head attention modules.

One callable serves both Flax APIs:

    import flax.linen as nn
    from flax import nnx
    from fa4_jax.flax import make_attention_fn

    causal_attention = make_attention_fn(causal=True)
    layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=causal_attention)
    y = layer.apply(params, x)  # mask=None: causality comes from the factory

    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                   attention_fn=causal_attention, rngs=nnx.Rngs(0))
    y = layer(x)  # or: attention_fn=attention_fn and layer(x, is_causal=True)

Why a factory instead of masks: Flax describes masking with a dense boolean array
`[batch..., heads, q_len, kv_len]`. Under `jit` that array is a tracer, so its intent (causal?
a window?) cannot be read back, and materialising it is what FlashAttention exists to avoid. The
mask pattern is therefore chosen when the function is made, and the adapters refuse a `mask=`
array (NotImplementedError) rather than ignore it. Likewise they refuse what the kernels cannot
honour - attention bias, dropout while training, sowing the attention weights, quantised einsum
overrides - naming the argument, so nothing is silently computed differently from Flax.

The adapters themselves import nothing from Flax: they are plain JAX functions with Flax's
`dot_product_attention` calling convention. Linen passes only the keywords this function's
signature names; NNX passes its keywords unfiltered (`module=`, and `is_causal=` in recent
versions), so the signature covers the union of both.
"""
from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp

from fa4_jax.api import _attention


def make_attention_fn(
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    implementation: str | None = None,
) -> Callable:
    """Returns an `attention_fn` for `nn.MultiHeadDotProductAttention` / `nnx.MultiHeadAttention`.

    Args:
      causal: key j is visible to query i when j <= i + (kv_len - q_len), i.e. bottom-right
        aligned like FlashAttention; for self-attention (q_len == kv_len) this is exactly
        `nn.make_causal_mask`. Callers pass `mask=None` to the module.
      window_size: (left, right) sliding-window bounds around the (aligned) diagonal, ints >= 0
        or None for unbounded; see `fa4_jax.attention`.
      softcap: if not None, scores become softcap * tanh(scores / softcap) before the softmax.
      implementation: forwarded to `fa4_jax.attention` (None: kernels on a supported GPU, else
        the pure-JAX reference).

    The returned function takes query [batch..., q_len, heads, head_dim], key
    [batch..., kv_len, kv_heads, head_dim] and value [batch..., kv_len, kv_heads, head_dim_v]
    (any number of leading batch dims, the same for all three) and returns
    [batch..., q_len, heads, head_dim_v]. The softmax scale is 1/sqrt(head_dim), as in Flax.
    """

    def fa4_attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout: bool = True,
        dropout_rng=None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax: bool = False,
        einsum_dot_general=None,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
        is_causal: bool = False,
        input_positions=None,
    ):
        """Flax `dot_product_attention` contract, computed by `fa4_jax.attention`.

        Honoured: query/key/value, `dtype` (inputs are cast to it; default: their common
        dtype), `dropout_rate` with `deterministic=True` (no dropout is applied), NNX's
        `is_causal` (Flax's top-left causal mask, tril over [q_len, kv_len]). Accepted and not
        forwarded: `precision`
        (fa4_jax fixes its own: fp32 accumulation and softmax statistics), and
        `force_fp32_for_softmax`, `broadcast_dropout`, `dropout_rng` (the softmax is always fp32
        and there is no dropout). Everything else raises NotImplementedError.
        """
        _reject_unsupported(
            bias=bias,
            mask=mask,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            module=module,
            einsum_overrides={
                "einsum_dot_general": einsum_dot_general,
                "qk_attn_weights_einsum": qk_attn_weights_einsum,
                "attn_weights_value_einsum": attn_weights_value_einsum,
            },
            input_positions=input_positions,
        )
        _check_same_batch_dims(query, key, value)
        factory_masked = causal or window_size != (None, None)
        if is_causal and factory_masked and query.shape[-3] != key.shape[-3]:
            raise NotImplementedError(
                "is_causal=True with a function made with causal/window_size and q_len != "
                "kv_len: Flax aligns is_causal's mask top-left, make_attention_fn's masks align "
                "bottom-right, and one call cannot take both; use one of the two."
            )
        compute_dtype = dtype if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (x.astype(compute_dtype) for x in (query, key, value))

        batch_dims = query.shape[:-3]
        out = _attention(
            _fold_batch_dims(query),
            _fold_batch_dims(key),
            _fold_batch_dims(value),
            causal=causal or is_causal,
            softmax_scale=None,
            window_size=window_size,
            softcap=softcap,
            deterministic=False,
            return_lse=False,
            implementation=implementation,
            query_seq_lengths=None,
            key_value_seq_lengths=None,
            top_left=is_causal and not factory_masked,
        )
        return out.reshape(batch_dims + out.shape[1:])

    return fa4_attention_fn


attention_fn = make_attention_fn()
"""Non-causal, unwindowed fa4_jax attention with Flax's `attention_fn` contract."""


def _reject_unsupported(*, bias, mask, dropout_rate, deterministic, module, einsum_overrides,
                        input_positions):
    """Raises NotImplementedError for Flax options the fa4_jax kernels cannot honour."""
    if bias is not None:
        raise NotImplementedError(
            "bias: fa4_jax attention has no additive attention bias; use softcap/window "
            "options of make_attention_fn, or flax's dot_product_attention."
        )
    if mask is not None:
        raise NotImplementedError(
            "mask: fa4_jax cannot read the pattern of a dense mask array (it is a tracer under "
            "jit). Pass mask=None and choose the pattern when making the function, e.g. "
            "make_attention_fn(causal=True) instead of nn.make_causal_mask, or "
            "make_attention_fn(window_size=(left, right)). (NNX decode=True builds such a mask "
            "for its KV cache and is unsupported for the same reason.)"
        )
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"dropout_rate={dropout_rate} with deterministic=False: fa4_jax attention has no "
            "attention-weight dropout; set dropout_rate=0 or call with deterministic=True."
        )
    if module is not None:
        raise NotImplementedError(
            "module (sow_weights=True): fa4_jax never materialises the attention weights, so "
            "there is nothing to sow; call without sow_weights."
        )
    for name, override in einsum_overrides.items():
        if override is not None:
            raise NotImplementedError(
                f"{name}: fa4_jax computes attention in fused kernels; custom (e.g. quantised) "
                "einsums cannot be substituted."
            )
    if input_positions is not None:
        raise NotImplementedError(
            "input_positions: fa4_jax attention applies no positional encoding (RoPE); apply it "
            "to query/key before attention."
        )


def _check_same_batch_dims(query, key, value):
    """Flax allows any leading batch dims, but query, key and value must share them."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(
                f"{name} must be [batch..., seq, heads, head_dim] (rank >= 3), got shape {x.shape}"
            )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            "query, key and value must have the same leading batch dims, got "
            f"{query.shape[:-3]}, {key.shape[:-3]} and {value.shape[:-3]}"
        )


def _fold_batch_dims(x):
    """[batch..., seq, heads, dim] -> [prod(batch...), seq, heads, dim] (rank 3 gets batch 1)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
