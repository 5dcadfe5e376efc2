"""reference.attention_reference against a dense float64 softmax, and its memory shape."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.fallbacks.reference import attention_reference
from tests.jaxprs import walk
from tests.numerics import naive_attention_fp64, naive_attention_jax, visible_mask


def _inputs(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v,
            dtype=jnp.float32):
    q = jax.random.normal(next_key(), (batch, seqlen_q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim_v), dtype)
    return q, k, v


# (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, mask/softcap options, chunk)
CASES = {
    "plain": (64, 64, 2, 2, 16, 16, {}, 16),
    "causal": (64, 64, 2, 2, 16, 16, {"causal": True}, 16),
    "causal_q_shorter": (20, 53, 2, 2, 16, 16, {"causal": True}, 8),
    "causal_q_longer_masked_rows": (53, 20, 2, 2, 16, 16, {"causal": True}, 8),
    "window_left": (40, 40, 2, 2, 16, 16, {"window_left": 5}, 8),
    "window_right": (40, 40, 2, 2, 16, 16, {"window_right": 3}, 8),
    "window_both": (33, 47, 2, 2, 16, 16, {"window_left": 4, "window_right": 2}, 8),
    "window_zero_width": (30, 30, 2, 2, 16, 16, {"window_left": 0, "window_right": 0}, 4),
    "causal_window": (47, 33, 2, 2, 16, 16, {"causal": True, "window_left": 6}, 8),
    "softcap": (32, 32, 2, 2, 16, 16, {"softcap": 0.5}, 16),
    "softcap_causal": (32, 40, 2, 2, 16, 16, {"softcap": 2.0, "causal": True}, 16),
    "gqa": (24, 24, 8, 2, 16, 16, {"causal": True}, 8),
    "mqa": (24, 31, 4, 1, 16, 16, {}, 8),
    "odd_lengths": (17, 113, 2, 2, 8, 8, {"window_left": 20}, 32),
    "single_query": (1, 37, 2, 1, 8, 8, {"causal": True}, 16),
    "head_dim_v_differs": (24, 24, 2, 2, 16, 40, {"causal": True}, 8),
    "chunk_does_not_divide": (50, 61, 2, 2, 8, 8, {"window_left": 9, "window_right": 5}, 7),
    "chunk_larger_than_seq": (9, 11, 2, 2, 8, 8, {}, 512),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_fp64_softmax(next_key, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options, chunk = case
    q, k, v = _inputs(next_key, 2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v)
    scale = 0.7 / math.sqrt(head_dim)

    out, lse = attention_reference(q, k, v, softmax_scale=scale, chunk_size=chunk, **options)
    want_out, want_lse = naive_attention_fp64(q, k, v, softmax_scale=scale, **options)

    assert out.shape == want_out.shape and out.dtype == jnp.float32
    assert lse.shape == (2, heads_q, seqlen_q) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=2e-5, rtol=2e-5)


def test_default_scale_is_inverse_sqrt_head_dim(next_key):
    q, k, v = _inputs(next_key, 1, 16, 16, 2, 2, 32, 32)
    default, _ = attention_reference(q, k, v)
    explicit, _ = attention_reference(q, k, v, softmax_scale=1 / math.sqrt(32))
    np.testing.assert_array_equal(default, explicit)


def test_fully_masked_rows_are_zero_with_zero_finite_gradients(next_key):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    seqlen_q, seqlen_k = 21, 13
    q, k, v = _inputs(next_key, 2, seqlen_q, seqlen_k, 4, 2, 8, 8)
    masked_rows = ~visible_mask(seqlen_q, seqlen_k, causal=True).any(axis=1)
    assert masked_rows.sum() == seqlen_q - seqlen_k

    out, lse = attention_reference(q, k, v, causal=True, chunk_size=4)
    assert np.all(np.asarray(out)[:, masked_rows] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, masked_rows]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~masked_rows]))

    weights_out = jax.random.normal(next_key(), out.shape)
    weights_lse = jax.random.normal(next_key(), lse.shape)

    def loss(attend, q, k, v):
        out, lse = attend(q, k, v)
        return (out * weights_out).sum() + jnp.where(jnp.isfinite(lse), lse * weights_lse, 0).sum()

    chunked = lambda q, k, v: attention_reference(q, k, v, causal=True, chunk_size=4)
    dense = lambda q, k, v: naive_attention_jax(q, k, v, softmax_scale=1 / math.sqrt(8), causal=True)
    grad_of = lambda attend: jax.jit(jax.grad(lambda *qkv: loss(attend, *qkv), argnums=(0, 1, 2)))
    grads = grad_of(chunked)(q, k, v)
    want = grad_of(dense)(q, k, v)
    for name, grad, want_grad in zip("qkv", grads, want):
        assert np.all(np.isfinite(grad)), f"d{name} is not finite"
        np.testing.assert_allclose(grad, want_grad, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
    np.testing.assert_array_equal(np.asarray(grads[0])[:, masked_rows], 0.0)


def test_every_row_masked(next_key):
    # A left window of 0 with seqlen_q > seqlen_k + ... : rows see at most one key; make the
    # offset so negative that none does.
    q, k, v = _inputs(next_key, 1, 40, 8, 2, 2, 8, 8)
    out, lse = attention_reference(q, k, v, window_left=0, window_right=0, chunk_size=8)
    expected_rows = visible_mask(40, 8, window_left=0, window_right=0).any(axis=1)
    np.testing.assert_array_equal(np.isfinite(lse[0, 0]), expected_rows)
    grads = jax.jit(jax.grad(
        lambda q, k, v: attention_reference(q, k, v, window_left=0, window_right=0)[0].sum(),
        argnums=(0, 1, 2),
    ))(q, k, v)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_low_precision_compute_rounds_but_stays_close(next_key):
    q, k, v = _inputs(next_key, 2, 64, 64, 2, 2, 32, 32, dtype=jnp.bfloat16)
    ref, _ = attention_reference(q, k, v, causal=True)
    lowp, lowp_lse = attention_reference(q, k, v, causal=True, compute_dtype=jnp.bfloat16)
    assert lowp.dtype == jnp.bfloat16 and lowp_lse.dtype == jnp.float32
    error = np.abs(np.asarray(lowp, np.float32) - np.asarray(ref, np.float32)).max()
    assert 0 < error < 0.1


def test_nan_in_a_key_propagates_only_to_rows_that_see_it(next_key):
    seqlen = 24
    q, k, v = _inputs(next_key, 1, seqlen, seqlen, 2, 2, 8, 8)
    k = k.at[:, seqlen - 3].set(jnp.nan)
    out, lse = attention_reference(q, k, v, causal=True, chunk_size=8)
    sees_nan_key = np.arange(seqlen) >= seqlen - 3
    np.testing.assert_array_equal(np.isnan(out[0, :, 0, 0]), sees_nan_key)
    np.testing.assert_array_equal(np.isnan(lse[0, 0]), sees_nan_key)


def test_nan_in_a_query_propagates_to_its_row(next_key):
    q, k, v = _inputs(next_key, 1, 16, 16, 2, 2, 8, 8)
    q = q.at[0, 5, 1, 3].set(jnp.nan)
    out, lse = attention_reference(q, k, v, chunk_size=4)
    nan_rows = np.isnan(out).any(axis=-1)[0]
    expected = np.zeros((16, 2), bool)
    expected[5, 1] = True
    np.testing.assert_array_equal(nan_rows, expected)
    assert np.isnan(lse[0, 1, 5]) and np.isfinite(np.delete(np.asarray(lse[0, 1]), 5)).all()


def _largest_intermediate(closed_jaxpr):
    """Elements of the biggest array any equation of the jaxpr (or its sub-jaxprs) makes."""
    largest = 0
    for jaxpr in walk(closed_jaxpr.jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                largest = max(largest, math.prod(shape))
    return largest


def test_long_sequence_never_materialises_the_score_matrix():
    seqlen, heads, head_dim = 32768, 1, 8
    spec = jax.ShapeDtypeStruct((1, seqlen, heads, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out, lse = attention_reference(q, k, v, causal=True)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    forward = jax.make_jaxpr(lambda q, k, v: attention_reference(q, k, v, causal=True))
    backward = jax.grad(loss, argnums=(0, 1, 2))
    # One 512x512 score tile is 2^18 elements; the score matrix would be 2^30, and a scan that
    # stacked a score tile per step would make [kv_tiles, 512, 512] = 2^24.
    limit = 4 * 512 * 512
    assert _largest_intermediate(forward(spec, spec, spec)) <= limit
    assert _largest_intermediate(jax.make_jaxpr(backward)(spec, spec, spec)) <= limit
    # And what XLA actually allocates for the backward (the fp32 score matrix is 4 GiB).
    compiled = jax.jit(backward).lower(spec, spec, spec).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20


# ------------------------------------------------ masks, bias and segment ids (the caller's arrays)

def _naive_masked(q, k, v, visible, bias=None):
    """float64 dense attention with a bool `visible` [b, h|1, sq, sk] and an additive bias."""
    return naive_attention_fp64(q, k, v, softmax_scale=1 / np.sqrt(q.shape[-1]), visible=visible,
                                bias=bias)


@pytest.mark.parametrize("mask_shape", [(2, 4, 37, 45), (2, 1, 37, 45), (1, 4, 37, 45), (1, 1, 37, 45),
                                        (2, 1, 1, 45), (1, 4, 37, 1)])
def test_a_mask_of_every_broadcast_shape(next_key, mask_shape):
    q = jax.random.normal(next_key(), (2, 37, 4, 16), jnp.float32)
    k, v = (jax.random.normal(next_key(), (2, 45, 2, 16), jnp.float32) for _ in range(2))
    mask = jax.random.bernoulli(next_key(), 0.6, mask_shape)
    bias = jax.random.normal(next_key(), (1, 4, 37, 45), jnp.float32)
    out, lse = attention_reference(q, k, v, mask=mask, bias=bias, chunk_size=16)
    visible = np.broadcast_to(np.asarray(mask), (2, 4, 37, 45))
    want_out, want_lse = _naive_masked(q, k, v, visible, bias)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)
    # Rows the mask hides entirely: out 0, lse -inf.
    empty = ~visible.any(-1)
    assert np.all(np.isneginf(np.asarray(lse)[empty]))


def test_segment_ids_with_padding_and_non_contiguous_segments(next_key):
    q, k, v = (jax.random.normal(next_key(), (2, 50, 2, 8), jnp.float32) for _ in range(3))
    # Entry 0: three packed documents and padding (-1 on queries, -2 on keys: matches nothing);
    # entry 1: segment 7 split in two runs around segment 3.
    ids0 = np.r_[np.zeros(10), np.ones(25), np.full(5, 2), np.full(10, -1)].astype(np.int32)
    ids1 = np.r_[np.full(20, 7), np.full(10, 3), np.full(20, 7)].astype(np.int32)
    q_ids = jnp.asarray(np.stack([ids0, ids1]))
    kv_ids = jnp.asarray(np.stack([np.where(ids0 < 0, -2, ids0), ids1]))
    out, lse = attention_reference(q, k, v, causal=True, query_segment_ids=q_ids,
                                   kv_segment_ids=kv_ids, chunk_size=16)
    causal = np.tril(np.ones((50, 50), bool))
    visible = (np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]) & causal
    want_out, want_lse = _naive_masked(q, k, v, visible)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(out)[0, 40:] == 0.0)


def test_gradients_through_a_mask_and_a_bias(next_key):
    q, k, v = (jax.random.normal(next_key(), (1, 33, 2, 8), jnp.float32) for _ in range(3))
    mask = jax.random.bernoulli(next_key(), 0.7, (1, 1, 33, 33))
    bias = jax.random.normal(next_key(), (1, 2, 33, 33), jnp.float32)
    d_out = jax.random.normal(next_key(), q.shape, jnp.float32)

    def chunked(q, k, v, bias):
        return jnp.sum(attention_reference(q, k, v, mask=mask, bias=bias, chunk_size=8)[0] * d_out)

    def dense(q, k, v, bias):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(8) + bias
        scores = jnp.where(mask, scores, -jnp.inf)
        weights = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision="highest")
        return jnp.sum(out * d_out)

    for got, want in zip(jax.grad(chunked, argnums=(0, 1, 2, 3))(q, k, v, bias),
                         jax.grad(dense, argnums=(0, 1, 2, 3))(q, k, v, bias)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
