"""Gradients of fa4_jax.attention (custom VJP over the reference backend on CPU)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import fa4_jax
from tests.numerics import naive_attention_jax


def _qkv(next_key, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim=8, dtype=jnp.float32):
    q = jax.random.normal(next_key(), (1, seqlen_q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (1, seqlen_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (1, seqlen_k, heads_kv, head_dim), dtype)
    return q, k, v


# (seqlen_q, seqlen_k, heads_q, heads_kv, attention options); no fully masked rows, so finite
# differences of lse are defined.
GRAD_CASES = {
    "plain": (7, 9, 2, 2, {}),
    "causal": (9, 9, 2, 2, {"causal": True}),
    "causal_q_shorter": (5, 9, 2, 1, {"causal": True}),
    "window": (9, 9, 2, 2, {"window_size": (2, 1)}),
    "softcap": (7, 7, 2, 2, {"softcap": 1.5, "causal": True}),
    "gqa": (6, 6, 4, 2, {"window_size": (3, None)}),
}


@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_check_grads_of_out_and_lse(next_key, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, options = case
    q, k, v = _qkv(next_key, seqlen_q, seqlen_k, heads_q, heads_kv)
    attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **options))
    # eps 1e-3: central differences then err ~eps² in fp32, well below a 1% gradient bug.
    check_grads(attend, (q, k, v), order=1, modes=["rev"], eps=1e-3, atol=3e-3, rtol=3e-3)


def _naive_options(options, head_dim):
    left, right = options.get("window_size", (None, None))
    return dict(
        softmax_scale=1 / math.sqrt(head_dim),
        causal=options.get("causal", False),
        window_left=left,
        window_right=right,
        softcap=options.get("softcap"),
    )


NAIVE_CASES = {
    **GRAD_CASES,
    "fully_masked_rows": (13, 6, 4, 2, {"causal": True}),
    "window_masks_rows": (12, 5, 2, 1, {"window_size": (0, 0)}),
}


@pytest.mark.parametrize("case", NAIVE_CASES.values(), ids=NAIVE_CASES.keys())
def test_grads_match_dense_softmax(next_key, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, options = case
    q, k, v = _qkv(next_key, seqlen_q, seqlen_k, heads_q, heads_kv)
    weights_out = jax.random.normal(next_key(), q.shape)
    weights_lse = jax.random.normal(next_key(), (1, heads_q, seqlen_q))

    def loss(attend):
        def weighted(q, k, v):
            out, lse = attend(q, k, v)
            finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return (out * weights_out).sum() + (finite_lse * weights_lse).sum()

        return jax.jit(jax.grad(weighted, argnums=(0, 1, 2)))

    ours = loss(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **options))(q, k, v)
    want = loss(lambda q, k, v: naive_attention_jax(q, k, v, **_naive_options(options, 8)))(q, k, v)
    for name, grad, want_grad in zip("qkv", ours, want):
        assert np.all(np.isfinite(grad)), f"d{name} not finite"
        np.testing.assert_allclose(grad, want_grad, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")


def test_jit_grad_and_grad_of_jit_agree(next_key):
    q, k, v = _qkv(next_key, 8, 8, 2, 2)

    def loss(q, k, v):
        return (fa4_jax.attention(q, k, v, causal=True) ** 2).sum()

    jit_of_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    grad_of_jit = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jit_of_grad, grad_of_jit):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_low_precision_grads_keep_input_dtypes(next_key):
    q, k, v = _qkv(next_key, 8, 8, 4, 2, head_dim=16, dtype=jnp.bfloat16)

    def loss(q, k, v):
        return fa4_jax.attention(q, k, v, causal=True).astype(jnp.float32).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)


def test_vmap_over_an_extra_axis(next_key):
    q, k, v = _qkv(next_key, 8, 8, 2, 2)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    attend = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True)
    batched = jax.jit(jax.vmap(attend))(*stacked)
    # jit+vmap and eager reorder fp32 sums: agreement to rounding, not bits.
    np.testing.assert_allclose(batched[1], attend(2 * q, 2 * k, 2 * v), atol=1e-5, rtol=1e-5)


def test_deterministic_grads_are_bitwise_repeatable(next_key):
    q, k, v = _qkv(next_key, 8, 8, 2, 2)
    grad = jax.jit(jax.grad(
        lambda q: fa4_jax.attention(q, k, v, causal=True, deterministic=True).sum()
    ))
    np.testing.assert_array_equal(grad(q), grad(q))


@pytest.mark.parametrize("differentiated", ["out", "lse", "both"])
def test_lse_cotangent_reaches_the_backward_only_when_lse_is_differentiated(
        next_key, monkeypatch, differentiated):
    # vjp.py's rules see symbolic zeros: a loss of out alone must give the backward no d_lse (the
    # kernels then read none and XLA builds no zeros), and a loss of lse alone must still get
    # the exact gradient with d_out instantiated as zeros.
    q, k, v = _qkv(next_key, 9, 9, 2, 2)
    weights_out = jax.random.normal(next_key(), q.shape)
    weights_lse = jax.random.normal(next_key(), (1, 2, 9))
    seen = []
    backward = fa4_jax.ops.bodies.backward

    def recording_backward(q, k, v, out, lse, d_out, d_lse, *args, **kwargs):
        seen.append(None if d_lse is None else d_lse.shape)
        return backward(q, k, v, out, lse, d_out, d_lse, *args, **kwargs)

    monkeypatch.setattr(fa4_jax.ops.bodies, "backward", recording_backward)
    # Another test may have traced the same op at these shapes: its cached trace would not call
    # the recording backward.
    jax.clear_caches()

    def loss(attend):
        def weighted(q, k, v):
            out, lse = attend(q, k, v)
            terms = {"out": (out * weights_out).sum(), "lse": (lse * weights_lse).sum()}
            return sum(terms.values()) if differentiated == "both" else terms[differentiated]

        return jax.jit(jax.grad(weighted, argnums=(0, 1, 2)))

    ours = loss(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, causal=True))(q, k, v)
    want = loss(lambda q, k, v: naive_attention_jax(q, k, v, softmax_scale=1 / math.sqrt(8),
                                                    causal=True))(q, k, v)
    assert seen == [None if differentiated == "out" else (1, 2, 9)]
    for name, grad, want_grad in zip("qkv", ours, want):
        np.testing.assert_allclose(grad, want_grad, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")
