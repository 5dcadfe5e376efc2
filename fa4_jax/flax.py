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

Masks: Flax describes masking with a dense boolean array `[batch..., heads, q_len, kv_len]`
(`nn.make_causal_mask`, `nn.make_attention_mask`), and an additive `bias=` likewise. The adapters
take both with Flax's semantics: a row that Flax's own masking (the mask, and NNX's is_causal)
hides entirely gets the mean of the values, as Flax's uniform softmax over the dtype's minimum
gives it. A row that sees no key because of the function's own rules
(`make_attention_fn(causal=True)` with more queries than keys, or a window) gets 0, with or
without a mask, as `fa4_jax.attention` gives it; with such rules, the mean goes to the rows the
mask alone hides entirely. A mask shared by the heads (what
`nn.make_causal_mask` and `nn.make_attention_mask` build) runs on the kernels, packed to bits
(`fa4_jax.runtime.mask_bits`), and so does a per-head mask (each batch entry and head run as an entry of
its own); a bias runs on the pure-JAX reference, chunked, with a FallbackWarning. A mask is packed on every call, so where the pattern is known when the function
is made, `make_attention_fn(causal=True)` or `make_attention_fn(window_size=(left, right))` costs
less than the same mask as an array. The adapters refuse
what they cannot honour - dropout while training, sowing the attention weights, quantised
einsum overrides - naming the argument, so nothing is silently computed differently from Flax.

The adapters themselves import nothing from Flax: they are plain JAX functions with Flax's
`dot_product_attention` calling convention. Linen passes only the keywords this function's
signature names; NNX passes its keywords unfiltered (`module=`, and `is_causal=` in recent
versions), so the signature covers the union of both.
"""
from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp

from fa4_jax.api.attention import run
from fa4_jax.api.dot_product import keyless_rows_see_every_key


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

        Honoured: query/key/value, `mask` and `bias` (broadcast as Flax does; a mask on the
        kernels, a bias on the reference), `dtype` (inputs are cast to it; default: their common
        dtype), `dropout_rate` with `deterministic=True` (no dropout is applied), NNX's
        `is_causal` (Flax's top-left causal mask, tril over [q_len, kv_len]). Accepted and not
        forwarded: `precision`
        (fa4_jax fixes its own: fp32 accumulation and softmax statistics), and
        `force_fp32_for_softmax`, `broadcast_dropout`, `dropout_rng` (the softmax is always fp32
        and there is no dropout). Everything else raises NotImplementedError.
        """
        _reject_unsupported(
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
        folded_value = _fold_batch_dims(value)
        # Flax's masks are float by default (nn.make_causal_mask), read as nonzero = visible.
        mask = None if mask is None else _fold_score_array(jnp.asarray(mask) != 0, batch_dims)
        # Flax fills the scores its masking hides with the dtype's minimum: a row that the mask
        # (and is_causal) hide entirely gets a uniform softmax over every key. Rows that see no
        # key for the function's own rules (causal or window_size, aligned bottom-right) get 0,
        # mask or not, as fa4_jax.attention gives them.
        flax_rows = mask is not None and not factory_masked
        result = run(
            _fold_batch_dims(query),
            _fold_batch_dims(key),
            folded_value,
            return_lse=flax_rows,
            implementation=implementation,
            bias=_fold_score_array(bias, batch_dims),
            top_left=is_causal and not factory_masked,
            causal=causal or is_causal,
            softmax_scale=None,
            window_size=window_size,
            softcap=softcap,
            deterministic=False,
            mask=mask,
        )
        out = result
        if flax_rows:
            out = keyless_rows_see_every_key(result[0], jnp.isneginf(result[1]), folded_value)
        elif mask is not None:
            out = keyless_rows_see_every_key(out, ~jnp.any(mask, axis=-1), folded_value)
        return out.reshape(batch_dims + out.shape[1:])

    return fa4_attention_fn


attention_fn = make_attention_fn()
"""Non-causal, unwindowed fa4_jax attention with Flax's `attention_fn` contract."""


def _reject_unsupported(*, dropout_rate, deterministic, module, einsum_overrides, input_positions):
    """Raises NotImplementedError for Flax options the fa4_jax kernels cannot honour."""
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


def _fold_score_array(x, batch_dims):
    """A Flax mask or bias [batch... | 1, heads | 1, q_len, kv_len] (leading dims broadcast, as
    Flax's do) as [prod(batch...) | 1, heads | 1, q_len, kv_len]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * max(0, len(batch_dims) + 3 - x.ndim) + x.shape)
    lead = x.shape[:-3]
    if all(n == 1 for n in lead):
        return x.reshape((1,) + x.shape[-3:])
    return jnp.broadcast_to(x, batch_dims + x.shape[-3:]).reshape((-1,) + x.shape[-3:])


def _fold_batch_dims(x):
    """[batch..., seq, heads, dim] -> [prod(batch...), seq, heads, dim] (rank 3 gets batch 1)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
