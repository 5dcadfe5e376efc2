"""Numerics helpers shared by the test tiers: docs/design.md's comparison rule and the oracles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.core import numerics
from fa4_jax.fallbacks.reference import attention_reference, dense_attention  # noqa: F401 (the tests' oracle)


def assert_close_by_rule(out, ref, ref_lowp, factor=2, name="out"):
    """docs/design.md's rule (fa4_jax.core.numerics, the one the selftest and the first-use
    probes judge by): max|out - ref| <= factor * max|ref_lowp - ref|, at least one rounding
    step of out's dtype at the largest magnitude, + 1e-5.

    NaN in `out` never passes. Infinite entries of `ref` (lse -inf of fully masked rows) must
    be matched exactly; the bound applies to the finite rest. NaN in ref_lowp leaves no bound.
    """
    comparison = numerics.compare(out, ref, ref_lowp, factor)
    assert comparison.passed, f"{comparison.describe(name)} (factor {factor})"


def reference_pair(q, k, v, **options):
    """((out, lse) in fp32 math, (out, lse) in the input dtype's math) for the rule."""
    ref = attention_reference(q, k, v, compute_dtype=jnp.float32, **options)
    ref_lowp = attention_reference(q, k, v, compute_dtype=q.dtype, **options)
    return ref, ref_lowp


def reference_grad_pair(q, k, v, d_out, **options):
    """((dq, dk, dv) in fp32 math, same in the input dtype's math) for cotangent d_out."""

    def grads(compute_dtype):
        def out_only(q, k, v):
            return attention_reference(q, k, v, compute_dtype=compute_dtype, **options)[0]

        return jax.vjp(out_only, q, k, v)[1](d_out)

    return grads(jnp.float32), grads(q.dtype)


def visible_mask(seqlen_q, seqlen_k, causal=False, window_left=None, window_right=None):
    """Bool [seqlen_q, seqlen_k] written straight from AttentionParams' docstring."""
    row = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    col = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), bool)
    if causal:
        visible &= col <= row
    if window_left is not None:
        visible &= col >= row - window_left
    if window_right is not None:
        visible &= col <= row + window_right
    return visible


def naive_attention_fp64(q, k, v, *, softmax_scale, softcap=None, visible=None, bias=None,
                         **mask_options):
    """Dense softmax attention in float64 numpy: (out [b, sq, hq, dv], lse [b, hq, sq]).
    visible: a bool mask broadcasting to [b, hq, sq, sk] instead of the one of mask_options;
    bias: added to the scores after the scale and softcap."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    if visible is None:
        visible = visible_mask(q.shape[1], k.shape[1], **mask_options)
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isinf(row_max), 0.0, row_max)
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    empty = total == 0
    out = np.einsum("bhqk,bkhd->bqhd", weights / np.where(empty, 1.0, total), v)
    lse = np.where(empty, -np.inf, row_max + np.log(np.where(empty, 1.0, total)))[..., 0]
    return out, lse


def naive_attention_jax(q, k, v, *, softmax_scale, softcap=None, visible=None, **mask_options):
    """Dense softmax attention in jnp (in the inputs' dtype), differentiable: the gradient
    oracle. visible: a bool mask broadcasting to [batch, heads, seqlen_q, seqlen_k] instead
    of the one of mask_options (e.g. per batch entry, [batch, 1, seqlen_q, seqlen_k])."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * softmax_scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if visible is None:
        visible = visible_mask(q.shape[1], k.shape[1], **mask_options)
    scores = jnp.where(visible, scores, -jnp.inf)
    empty = ~visible.any(axis=-1, keepdims=True)
    safe_scores = jnp.where(empty, 0.0, scores)
    lse = jax.nn.logsumexp(safe_scores, axis=-1, keepdims=True)
    probs = jnp.where(empty, 0.0, jnp.exp(safe_scores - lse))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")
    lse = jnp.where(empty[..., 0], -jnp.inf, lse[..., 0])
    return out.astype(q.dtype), lse
