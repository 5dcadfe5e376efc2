"""fa4_jax.attention / dot_product_attention: validation, defaults, backend choice, jax parity."""
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.reference import attention_reference


def _qkv(next_key, batch=2, seqlen_q=16, seqlen_k=16, heads_q=4, heads_kv=2, head_dim=16,
         head_dim_v=None, dtype=jnp.float32):
    q = jax.random.normal(next_key(), (batch, seqlen_q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim_v or head_dim), dtype)
    return q, k, v


def _shapes(q=(2, 16, 4, 16), k=(2, 16, 2, 16), v=None, dtype=jnp.bfloat16):
    """Abstract inputs: validation runs at trace time, so no data is needed."""
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in (q, k, v or k))


def _trace(*arrays, **kwargs):
    return jax.eval_shape(lambda q, k, v: fa4_jax.attention(q, k, v, **kwargs), *arrays)


SHAPE_ERRORS = {
    "query_rank": (dict(q=(2, 16, 64)), ValueError, "query must have rank 4"),
    "key_rank": (dict(k=(2, 16, 2, 16, 1)), ValueError, "key must have rank 4"),
    "value_rank": (dict(v=(16, 2, 16)), ValueError, "value must have rank 4"),
    "batch": (dict(k=(3, 16, 2, 16)), ValueError, "same batch size"),
    "kv_seqlen": (dict(v=(2, 15, 2, 16)), ValueError, "key and value must have the same sequence"),
    "kv_heads": (dict(v=(2, 16, 1, 16)), ValueError, "key and value must have the same number of heads"),
    "gqa_ratio": (dict(q=(2, 16, 3, 16)), ValueError, r"query heads \(3\) must be a multiple"),
    "qk_head_dim": (dict(k=(2, 16, 2, 32), v=(2, 16, 2, 16)), ValueError, "same head_dim"),
    "head_dim_multiple": (dict(q=(2, 16, 4, 12), k=(2, 16, 2, 12)), ValueError, "multiple of 8"),
    "head_dim_max": (dict(q=(2, 16, 4, 264), k=(2, 16, 2, 264)), ValueError, "at most 256"),
    "value_head_dim": (dict(v=(2, 16, 2, 20)), ValueError, "value head_dim"),
}


@pytest.mark.parametrize("case", SHAPE_ERRORS.values(), ids=SHAPE_ERRORS.keys())
def test_shape_errors_name_the_argument(case):
    shapes, error, message = case
    with pytest.raises(error, match=message):
        _trace(*_shapes(**shapes))


def test_dtypes_must_match():
    q, k, v = _shapes()
    with pytest.raises(TypeError, match="query, key and value must share one dtype"):
        _trace(q, k, jax.ShapeDtypeStruct(v.shape, jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.float8_e4m3fn])
def test_dtype_must_be_supported(dtype):
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        _trace(*_shapes(dtype=dtype))


OPTION_ERRORS = {
    "window_not_pair": (dict(window_size=5), TypeError, "window_size must be a"),
    "window_triple": (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a"),
    "window_float": (dict(window_size=(1.5, None)), TypeError, "window_size left"),
    "window_negative": (dict(window_size=(None, -1)), ValueError, "window_size right"),
    "causal_right_window": (dict(causal=True, window_size=(4, 2)), ValueError, "causal=True"),
    "causal_not_bool": (dict(causal=1), TypeError, "causal must be"),
    "softcap_zero": (dict(softcap=0.0), ValueError, "softcap"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "softcap_string": (dict(softcap="1"), TypeError, "softcap"),
    "scale_zero": (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "scale_inf": (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    "deterministic_not_bool": (dict(deterministic=None), TypeError, "deterministic"),
    "return_lse_not_bool": (dict(return_lse="yes"), TypeError, "return_lse"),
    "implementation_unknown": (dict(implementation="xla"), ValueError, "implementation"),
}


@pytest.mark.parametrize("case", OPTION_ERRORS.values(), ids=OPTION_ERRORS.keys())
def test_option_errors_name_the_argument(case):
    options, error, message = case
    with pytest.raises(error, match=message):
        _trace(*_shapes(), **options)


def test_traced_softmax_scale_is_rejected(next_key):
    q, k, v = _qkv(next_key)
    with pytest.raises(TypeError, match="softmax_scale must be None or a static"):
        jax.jit(lambda scale: fa4_jax.attention(q, k, v, softmax_scale=scale))(0.5)


def test_validation_happens_at_trace_time():
    # eval_shape never executes; the error must come from tracing alone.
    with pytest.raises(ValueError, match="query must have rank 4"):
        jax.eval_shape(lambda: fa4_jax.attention(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3))))


def test_default_scale_and_explicit_scale(next_key):
    q, k, v = _qkv(next_key, head_dim=32)
    default = fa4_jax.attention(q, k, v)
    np.testing.assert_array_equal(default, fa4_jax.attention(q, k, v, softmax_scale=1 / math.sqrt(32)))
    want, _ = attention_reference(q, k, v, softmax_scale=0.3)
    np.testing.assert_allclose(fa4_jax.attention(q, k, v, softmax_scale=0.3), want, atol=1e-6)
    assert np.abs(np.asarray(default) - np.asarray(want)).max() > 1e-3


def test_return_lse_shapes_and_dtypes(next_key):
    q, k, v = _qkv(next_key, seqlen_q=12, seqlen_k=20, head_dim_v=24, dtype=jnp.bfloat16)
    out, lse = fa4_jax.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 12, 4, 24) and out.dtype == jnp.bfloat16
    assert lse.shape == (2, 4, 12) and lse.dtype == jnp.float32
    want_out, want_lse = attention_reference(q, k, v, causal=True)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    assert fa4_jax.attention(q, k, v).shape == (2, 12, 4, 24)


def test_right_window_zero_is_causal(next_key):
    q, k, v = _qkv(next_key, seqlen_q=12, seqlen_k=20)
    causal = fa4_jax.attention(q, k, v, causal=True, window_size=(5, None))
    np.testing.assert_array_equal(causal, fa4_jax.attention(q, k, v, window_size=(5, 0)))
    np.testing.assert_array_equal(causal, fa4_jax.attention(q, k, v, causal=True, window_size=(5, 0)))


def test_cute_on_a_machine_without_kernels_says_why(next_key):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cute' cannot serve this call: .+"):
        fa4_jax.attention(q, k, v, implementation="cute")


def test_cute_rejects_float32_with_the_reason():
    with pytest.raises(ValueError, match="bfloat16 or float16, got float32"):
        _trace(*_shapes(dtype=jnp.float32), implementation="cute")


def test_default_backend_falls_back_to_reference_and_logs_why(next_key, caplog):
    q, k, v = _qkv(next_key, dtype=jnp.float16)
    with caplog.at_level(logging.DEBUG, logger="fa4_jax"):
        out = fa4_jax.attention(q, k, v)
    assert any("reference backend" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(out, fa4_jax.attention(q, k, v, implementation="reference"))


def test_public_surface():
    assert set(fa4_jax.__all__) == {
        "attention",
        "varlen_attention",
        "dot_product_attention",
        "ring_attention",
        "to_zigzag_layout",
        "from_zigzag_layout",
        "ReshardWarning",
        "__version__",
    }
    assert isinstance(fa4_jax.__version__, str)


# (T, S, N, K, is_causal, local_window_size): the cases where jax's top-left masks translate.
JAX_PARITY = {
    "plain": (16, 16, 4, 4, False, None),
    "causal": (16, 16, 4, 4, True, None),
    "local_pair": (24, 24, 4, 4, False, (3, 2)),
    "local_int": (24, 24, 4, 4, False, 4),
    "causal_local": (24, 24, 4, 2, True, (5, 3)),
    "gqa_causal": (16, 16, 8, 2, True, None),
    "mqa": (16, 16, 4, 1, False, None),
    "causal_q_longer": (20, 12, 4, 2, True, None),
    "local_q_shorter": (8, 12, 4, 2, False, (2, 6)),
}


@pytest.mark.parametrize("case", JAX_PARITY.values(), ids=JAX_PARITY.keys())
def test_dot_product_attention_matches_jax_xla(next_key, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, is_causal, window = case
    q, k, v = _qkv(next_key, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q,
                   heads_kv=heads_kv)
    kwargs = dict(is_causal=is_causal, local_window_size=window, return_residual=True)
    out, residual = jax.jit(lambda *qkv: fa4_jax.dot_product_attention(*qkv, **kwargs))(q, k, v)
    want, want_residual = jax.jit(
        lambda *qkv: jax.nn.dot_product_attention(*qkv, implementation="xla", **kwargs)
    )(q, k, v)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(residual, want_residual, atol=2e-5, rtol=2e-5)


def test_dot_product_attention_accepts_unbatched_inputs(next_key):
    q, k, v = (x[0] for x in _qkv(next_key, batch=1))
    out = jax.jit(lambda *qkv: fa4_jax.dot_product_attention(*qkv, is_causal=True, scale=0.2))(
        q, k, v
    )
    want = jax.jit(
        lambda *qkv: jax.nn.dot_product_attention(*qkv, is_causal=True, scale=0.2, implementation="xla")
    )(q, k, v)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["bias", "mask"])
def test_dot_product_attention_unsupported_arguments(next_key, name):
    q, k, v = _qkv(next_key)
    arrays = {
        "bias": jnp.ones((2, 4, 16, 16)),
        "mask": jnp.ones((2, 4, 16, 16), bool),
    }
    with pytest.raises(NotImplementedError, match=name):
        fa4_jax.dot_product_attention(q, k, v, **{name: arrays[name]})


# (T, S, is_causal, local_window_size, which lengths): where jax's semantics and fa4_jax's
# agree. Masks need equal lengths per entry; without one, either length may come alone.
JAX_LENGTH_PARITY = {
    "query_only": (16, 12, False, None, "q"),
    "key_only": (12, 16, False, None, "kv"),
    "both_differ": (12, 16, False, None, "both"),
    "causal_equal": (16, 16, True, None, "equal"),
    "window_equal_q_longer": (16, 12, False, (3, 2), "equal"),
}


@pytest.mark.parametrize("case", JAX_LENGTH_PARITY.values(), ids=JAX_LENGTH_PARITY.keys())
def test_dot_product_attention_lengths_match_jax_xla(next_key, case):
    seqlen_q, seqlen_k, is_causal, window, which = case
    q, k, v = _qkv(next_key, batch=3, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    # Every row keeps at least one key: jax gives key-less rows the mean of all values.
    q_len = jax.random.randint(next_key(), (3,), 0, seqlen_q + 1)
    kv_len = jax.random.randint(next_key(), (3,), 1, seqlen_k + 1)
    if which == "equal":
        q_len = kv_len = jnp.minimum(kv_len, seqlen_q)
    lengths = {
        "q": dict(query_seq_lengths=q_len),
        "kv": dict(key_value_seq_lengths=kv_len),
    }.get(which, dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len))
    kwargs = dict(is_causal=is_causal, local_window_size=window, return_residual=True)
    out, residual = jax.jit(
        lambda q, k, v, lengths: fa4_jax.dot_product_attention(q, k, v, **lengths, **kwargs)
    )(q, k, v, lengths)
    want, want_residual = jax.jit(
        lambda q, k, v, lengths: jax.nn.dot_product_attention(
            q, k, v, implementation="xla", **lengths, **kwargs)
    )(q, k, v, lengths)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    # jax's residual of a padded row is a large negative number, fa4_jax's -inf.
    rows = np.asarray(lengths.get("query_seq_lengths", np.full(3, seqlen_q)))
    valid = np.arange(seqlen_q)[None, :] < rows[:, None]
    np.testing.assert_allclose(np.asarray(residual)[valid], np.asarray(want_residual)[valid],
                               atol=2e-5, rtol=2e-5)
    assert np.all(np.isneginf(np.asarray(residual)[~valid]))


def test_dot_product_attention_mask_with_one_length_is_rejected(next_key):
    q, k, v = _qkv(next_key)
    with pytest.raises(NotImplementedError, match="pass both"):
        fa4_jax.dot_product_attention(q, k, v, is_causal=True,
                                      key_value_seq_lengths=jnp.array([3, 16], jnp.int32))


def test_dot_product_attention_untranslatable_mask(next_key):
    q, k, v = _qkv(next_key, seqlen_q=8, seqlen_k=12)
    with pytest.raises(NotImplementedError, match="top-left"):
        fa4_jax.dot_product_attention(q, k, v, is_causal=True)


def test_dot_product_attention_scale_error_names_scale(next_key):
    q, k, v = _qkv(next_key)
    with pytest.raises(ValueError, match="^scale must be"):
        fa4_jax.dot_product_attention(q, k, v, scale=-1.0)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_dot_product_attention_jax_backends_point_to_jax(next_key, implementation):
    q, k, v = _qkv(next_key)
    with pytest.raises(ValueError, match="jax.nn.dot_product_attention"):
        fa4_jax.dot_product_attention(q, k, v, implementation=implementation)
