"""fa4_jax.attention / dot_product_attention: validation, defaults, backend choice, jax parity."""
import functools
import itertools
import warnings
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.api import validation
from fa4_jax.runtime import device
from fa4_jax.runtime.operands import KernelOperands
from fa4_jax.fallbacks.reference import attention_reference


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


def test_default_backend_falls_back_to_reference_and_says_why(next_key):
    # A new shape class, so that this process has not said it yet.
    q, k, v = _qkv(next_key, dtype=jnp.float16, head_dim=40)
    with pytest.warns(fa4_jax.FallbackWarning, match="float16 d40 no mask calls run on the pure-JAX reference.*not a CUDA GPU"):
        out = fa4_jax.attention(q, k, v)
    np.testing.assert_array_equal(out, fa4_jax.attention(q, k, v, implementation="reference"))


def test_a_chosen_reference_says_nothing(next_key, recwarn):
    q, k, v = _qkv(next_key, dtype=jnp.float16, head_dim=48)
    fa4_jax.attention(q, k, v, implementation="reference")
    assert not [w for w in recwarn if issubclass(w.category, fa4_jax.FallbackWarning)]


# -------------------------------------------------------------- backends on a mocked CUDA device

@pytest.fixture
def gpu_without_kernels(monkeypatch):
    """The default device reads as a CUDA GPU of compute capability `cc` (default 8.0, an A100)
    with no fa4_jax kernel; cuDNN's attention is the fp32 reference, recording its calls."""
    from fa4_jax.api import attention as api
    from fa4_jax.fallbacks import cudnn
    from fa4_jax.runtime import device, dispatch

    state = {"cc": "8.0", "cudnn_calls": []}
    monkeypatch.setattr(device, "compute_capability", lambda: state["cc"])
    monkeypatch.setattr(dispatch, "unsupported_reason",
                        lambda *args, **kwargs: f"no kernels for compute capability {state['cc']}")

    def fake_cudnn(query, key, value, params):
        state["cudnn_calls"].append(params)
        return attention_reference(query, key, value, softmax_scale=params.softmax_scale,
                                   causal=params.causal, window_left=params.window_left,
                                   top_left=params.top_left)[0]

    monkeypatch.setattr(cudnn, "attention", fake_cudnn)
    monkeypatch.setattr(api.notices, "_SAID", set())
    return state


CUDNN_SERVES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window_size=(5, None)),
    "gqa_scale": dict(softmax_scale=0.2),
}
CUDNN_DOES_NOT_SERVE = {
    "softcap": (dict(softcap=5.0), {}, "softcap"),
    "deterministic": (dict(deterministic=True), {}, "deterministic"),
    "lse": (dict(return_lse=True), {}, "logsumexp"),
    "right_window": (dict(window_size=(None, 4)), {}, "left bound"),
    "bottom_right_unequal": (dict(causal=True), dict(seqlen_k=24), "top-left"),
    "head_dim_v": (dict(), dict(head_dim_v=8), "one head dim"),
    "ragged": (dict(key_value_seq_lengths=jnp.array([3, 16], jnp.int32)), {}, "ragged"),
}


@pytest.mark.parametrize("options", CUDNN_SERVES.values(), ids=CUDNN_SERVES.keys())
def test_a_gpu_without_kernels_runs_cudnn_where_it_means_the_same(next_key, gpu_without_kernels, options):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16)
    with pytest.warns(fa4_jax.FallbackWarning, match=r"run on cuDNN .*no kernels for compute capability 8.0"):
        out = fa4_jax.attention(q, k, v, **options)
    assert len(gpu_without_kernels["cudnn_calls"]) == 1
    np.testing.assert_array_equal(out, fa4_jax.attention(q, k, v, implementation="reference", **options))


@pytest.mark.parametrize("case", CUDNN_DOES_NOT_SERVE.values(), ids=CUDNN_DOES_NOT_SERVE.keys())
def test_a_gpu_without_kernels_runs_the_reference_where_cudnn_differs(next_key, gpu_without_kernels, case):
    options, shapes, why = case
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16, **shapes)
    with pytest.warns(fa4_jax.FallbackWarning, match=f"run on the pure-JAX reference.*not cuDNN: .*{why}"):
        fa4_jax.attention(q, k, v, **options)
    assert gpu_without_kernels["cudnn_calls"] == []


def test_cudnn_head_dims_follow_the_gpu(next_key, gpu_without_kernels):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16, head_dim=192)
    with pytest.warns(fa4_jax.FallbackWarning, match="not cuDNN: .*up to 128"):
        fa4_jax.attention(q, k, v)
    gpu_without_kernels["cc"] = "10.0"  # Blackwell: up to 256
    with pytest.warns(fa4_jax.FallbackWarning, match="run on cuDNN"):
        fa4_jax.attention(q, k, v)
    gpu_without_kernels["cc"] = "7.5"  # Turing: no flash attention in cuDNN
    with pytest.warns(fa4_jax.FallbackWarning, match="not cuDNN: .*sm_80"):
        fa4_jax.attention(q, k, v)


def test_the_drop_in_runs_cudnn_with_its_top_left_masks(next_key, gpu_without_kernels):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16, seqlen_q=8, seqlen_k=24)
    with pytest.warns(fa4_jax.FallbackWarning, match="run on cuDNN"):
        out = fa4_jax.dot_product_attention(q, k, v, is_causal=True)
    assert gpu_without_kernels["cudnn_calls"][0].top_left
    np.testing.assert_array_equal(out, fa4_jax.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="reference"))


@pytest.fixture
def forward_kernels_only(monkeypatch):
    """The kernels serve the forward (computed by the reference) and not the backward."""
    from fa4_jax.ops import bodies
    from fa4_jax.runtime import dispatch

    monkeypatch.setattr(dispatch, "unsupported_reason",
                        lambda q, k, v, params, kind="fwd", library=None, kinds=None:
                        None if kind == "fwd" else "no backward kernel for this arch yet")
    monkeypatch.setattr(dispatch, "forward", lambda q, k, v, params, operands=KernelOperands(), **kwargs:
                        bodies._reference_fp32(q, k, v, params, operands))
    from fa4_jax.api import attention as api

    monkeypatch.setattr(api.notices, "_SAID", set())


def test_cute_raises_when_the_backward_cannot_run_on_the_kernels(next_key, forward_kernels_only):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16)
    out = fa4_jax.attention(q, k, v, implementation="cute")  # inference is fine
    assert out.shape == q.shape
    loss = lambda q: fa4_jax.attention(q, k, v, implementation="cute").astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(ValueError, match="cannot run the backward of this call: no backward kernel"):
        jax.grad(loss)(q)


def test_default_takes_the_reference_backward_and_says_so(next_key, forward_kernels_only):
    q, k, v = _qkv(next_key, dtype=jnp.bfloat16)
    loss = lambda q, impl: fa4_jax.attention(q, k, v, implementation=impl).astype(jnp.float32).sum()  # noqa: E731
    with pytest.warns(fa4_jax.FallbackWarning, match="reference backward.*no backward kernel"):
        grad = jax.grad(loss)(q, None)
    np.testing.assert_array_equal(grad, jax.grad(loss)(q, "reference"))


def test_public_surface():
    assert set(fa4_jax.__all__) == {
        "attention",
        "varlen_attention",
        "dot_product_attention",
        "ring_attention",
        "to_zigzag_layout",
        "from_zigzag_layout",
        "ReshardWarning",
        "FallbackWarning",
        "which_backend",
        "explain",
        "Explanation",
        "export_disabled_checks",
        "__version__",
    }
    assert all(hasattr(fa4_jax, name) for name in fa4_jax.__all__)
    assert isinstance(fa4_jax.__version__, str)


# ------------------------------------------------------- the drop-in against jax's own function

def _jax_pair(q, k, v, **kwargs):
    """(fa4_jax's, jax's XLA implementation's) (out, residual), both jitted (the lengths as
    traced arguments, the masks static)."""
    static = {name: kwargs.pop(name) for name in ("is_causal", "local_window_size") if name in kwargs}
    ours = jax.jit(lambda q, k, v, kw: fa4_jax.dot_product_attention(q, k, v, return_residual=True, **kw, **static))
    theirs = jax.jit(lambda q, k, v, kw: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kw, **static))
    return ours(q, k, v, kwargs), theirs(q, k, v, kwargs)


def _assert_matches_jax(q, k, v, **kwargs):
    (out, residual), (want, want_residual) = _jax_pair(q, k, v, **kwargs)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    # Rows that see no key: jax's residual is the logsumexp of S large negative scores.
    np.testing.assert_allclose(residual, want_residual, atol=2e-5, rtol=2e-5)


def _lengths(next_key, kind, batch, seqlen):
    """int32 [batch] lengths: random, all equal to the buffer, all zero, or a mix of the ends."""
    if kind == "full":
        return jnp.full((batch,), seqlen, jnp.int32)
    if kind == "zero":
        return jnp.zeros((batch,), jnp.int32)
    if kind == "ends":
        return jnp.asarray([0, seqlen, 1, seqlen - 1][:batch], jnp.int32)
    return jax.random.randint(next_key(), (batch,), 0, seqlen + 1).astype(jnp.int32)


# (T, S, N, K): equal and unequal lengths, GQA and MQA.
DROP_IN_SHAPES = {"square": (16, 16, 4, 4), "q_shorter_gqa": (12, 20, 8, 2),
                  "q_longer_mqa": (20, 12, 4, 1)}
# (is_causal, local_window_size): jax's masks, all top-left.
DROP_IN_MASKS = {"none": (False, None), "causal": (True, None), "window_pair": (False, (3, 2)),
                 "window_int": (False, 4), "causal_window": (True, (5, 3)),
                 "window_past_keys": (False, (1, 0))}


@pytest.mark.parametrize("mask", DROP_IN_MASKS.values(), ids=DROP_IN_MASKS.keys())
@pytest.mark.parametrize("shape", DROP_IN_SHAPES.values(), ids=DROP_IN_SHAPES.keys())
def test_dot_product_attention_matches_jax_xla(next_key, shape, mask):
    seqlen_q, seqlen_k, heads_q, heads_kv = shape
    is_causal, window = mask
    q, k, v = _qkv(next_key, batch=3, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q,
                   heads_kv=heads_kv)
    _assert_matches_jax(q, k, v, is_causal=is_causal, local_window_size=window)


LENGTH_KINDS = ("random", "full", "zero", "ends")
# Every pair of (query lengths, key lengths) kinds, query lengths also absent: 20 pairs, two per
# (mask, shape) case below, so that each pair meets a different mask and shape.
LENGTH_PAIRS = list(itertools.product(LENGTH_KINDS + (None,), LENGTH_KINDS))
LENGTH_MASKS = {"none": (False, None), "causal": (True, None), "causal_window": (True, (4, 0)),
                "window": (False, (2, 5))}
LENGTH_SHAPES = {"square": (16, 16, 4, 2), "q_shorter": (12, 20, 4, 2), "q_longer": (20, 12, 4, 4)}


@pytest.mark.parametrize("shape_index", range(len(LENGTH_SHAPES)), ids=LENGTH_SHAPES.keys())
@pytest.mark.parametrize("mask_index", range(len(LENGTH_MASKS)), ids=LENGTH_MASKS.keys())
def test_dot_product_attention_lengths_match_jax_xla(next_key, mask_index, shape_index):
    # Lengths random, full, zero or at both ends, alone or paired, with every mask, whatever T
    # and S: jax's top-left rule everywhere, padded rows 0, key-less rows the mean of all
    # values, as jax's XLA path gives them.
    seqlen_q, seqlen_k, heads_q, heads_kv = list(LENGTH_SHAPES.values())[shape_index]
    is_causal, window = list(LENGTH_MASKS.values())[mask_index]
    case = mask_index * len(LENGTH_SHAPES) + shape_index
    for q_kind, kv_kind in (LENGTH_PAIRS[(2 * case) % len(LENGTH_PAIRS)],
                            LENGTH_PAIRS[(2 * case + 1) % len(LENGTH_PAIRS)]):
        q, k, v = _qkv(next_key, batch=4, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q,
                       heads_kv=heads_kv)
        lengths = {"key_value_seq_lengths": _lengths(next_key, kv_kind, 4, seqlen_k)}
        if q_kind is not None:
            lengths["query_seq_lengths"] = _lengths(next_key, q_kind, 4, seqlen_q)
        _assert_matches_jax(q, k, v, is_causal=is_causal, local_window_size=window, **lengths)


def test_dot_product_attention_jaxs_causal_padding_case(next_key):
    # jax's own testDotProductAttentionMask, mask mode ('causal', 'padding'): unequal lengths per
    # entry, the case where a bottom-right rule differs from jax's by up to 3.1.
    batch, seqlen, heads, head_dim = 2, 128, 4, 32
    q, k, v = _qkv(next_key, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=heads,
                   heads_kv=heads, head_dim=head_dim)
    lengths = dict(query_seq_lengths=jnp.asarray([seqlen // 2, seqlen // 4], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([seqlen // 4, seqlen // 2], jnp.int32))
    _assert_matches_jax(q, k, v, is_causal=True, **lengths)
    # The alignment matters here: fa4_jax.attention's bottom-right rule gives other rows.
    bottom_right = fa4_jax.attention(q, k, v, causal=True, query_seq_lengths=lengths["query_seq_lengths"],
                                     key_value_seq_lengths=lengths["key_value_seq_lengths"])
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla", **lengths)
    assert np.abs(np.asarray(bottom_right) - np.asarray(want)).max() > 0.1


@pytest.mark.parametrize("case", [
    dict(is_causal=True, seqlen_q=12, seqlen_k=20),
    dict(is_causal=True, seqlen_q=20, seqlen_k=12, query_seq_lengths=[20, 5, 9]),
    dict(local_window_size=(3, 1), seqlen_q=16, seqlen_k=16, key_value_seq_lengths=[4, 0, 16]),
    dict(is_causal=True, local_window_size=(2, 0), seqlen_q=16, seqlen_k=16,
         query_seq_lengths=[16, 3, 7], key_value_seq_lengths=[9, 16, 0]),
], ids=["causal", "causal_q_lengths", "window_kv_lengths", "causal_window_both_lengths"])
def test_dot_product_attention_gradients_match_jax_xla(next_key, case):
    case = dict(case)
    seqlen_q, seqlen_k = case.pop("seqlen_q"), case.pop("seqlen_k")
    q, k, v = _qkv(next_key, batch=3, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=4, heads_kv=2)
    static = {name: case.pop(name) for name in ("is_causal", "local_window_size") if name in case}
    lengths = {name: jnp.asarray(value, jnp.int32) for name, value in case.items()}
    d_out = jax.random.normal(next_key(), q.shape, q.dtype)

    def grads(attention):
        def loss(q, k, v, lengths):
            return jnp.sum(attention(q, k, v, **lengths, **static) * d_out)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, lengths)

    ours = grads(fa4_jax.dot_product_attention)
    theirs = grads(functools.partial(jax.nn.dot_product_attention, implementation="xla"))
    for name, got, want in zip(("dq", "dk", "dv"), ours, theirs):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)


def test_dot_product_attention_gives_keyless_rows_the_mean_of_the_values(next_key):
    # An entry with no keys: every valid row sees none, and jax's XLA path averages all S
    # values (its masked scores are a finite large negative number); padded rows stay 0.
    q, k, v = _qkv(next_key, batch=2)
    out = fa4_jax.dot_product_attention(q, k, v, query_seq_lengths=jnp.asarray([16, 5], jnp.int32),
                                        key_value_seq_lengths=jnp.asarray([16, 0], jnp.int32))
    mean = np.repeat(np.asarray(v[1]).mean(axis=0), 2, axis=0)  # kv head h serves q heads 2h, 2h+1
    np.testing.assert_allclose(np.asarray(out[1, :5]), np.broadcast_to(mean, (5,) + mean.shape), atol=1e-6)
    assert np.all(np.asarray(out[1, 5:]) == 0.0)


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


# jax's own mask modes (its tests/nn_test.py): a custom bool mask of each broadcast rank, a bias,
# and each with is_causal, padding lengths and a sliding window.
DROP_IN_SCORE_ARRAYS = {
    "mask_bnts": dict(mask=(3, 8, 12, 20)),
    "mask_b1ts": dict(mask=(3, 1, 12, 20)),
    "mask_nts_rank3": dict(mask=(8, 12, 20)),
    "mask_ts_rank2": dict(mask=(12, 20)),
    "mask_11_1s": dict(mask=(1, 1, 1, 20)),
    "bias": dict(bias=(1, 8, 12, 20)),
    "bias_and_mask": dict(bias=(3, 1, 12, 20), mask=(3, 8, 12, 20)),
    "mask_causal": dict(mask=(3, 1, 12, 20), is_causal=True),
    "mask_padding": dict(mask=(3, 8, 12, 20), lengths=True),
    "mask_causal_padding": dict(mask=(1, 8, 12, 20), is_causal=True, lengths=True),
    "bias_window": dict(bias=(3, 8, 12, 20), local_window_size=(3, 2)),
    "mask_everything_hidden": dict(mask=(3, 8, 12, 20), hidden=True),
}


@pytest.mark.parametrize("case", DROP_IN_SCORE_ARRAYS.values(), ids=DROP_IN_SCORE_ARRAYS.keys())
def test_dot_product_attention_masks_and_bias_match_jax_xla(next_key, case):
    q, k, v = _qkv(next_key, batch=3, seqlen_q=12, seqlen_k=20, heads_q=8, heads_kv=2)
    kwargs = {name: case[name] for name in ("is_causal", "local_window_size") if name in case}
    if "mask" in case:
        mask = jax.random.bernoulli(next_key(), 0.5, case["mask"])
        # Some rows the mask hides entirely: jax gives them the mean of the values.
        kwargs["mask"] = jnp.zeros_like(mask) if case.get("hidden") else mask.at[..., 3, :].set(False)
    if "bias" in case:
        kwargs["bias"] = jax.random.normal(next_key(), case["bias"], jnp.float32)
    if case.get("lengths"):
        kwargs["query_seq_lengths"] = jnp.asarray([12, 5, 0], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray([20, 7, 3], jnp.int32)
    _assert_matches_jax(q, k, v, **kwargs)
    # Gradients, the bias's included, against jax's.
    d_out = jax.random.normal(next_key(), q.shape, jnp.float32)
    static = {name: kwargs.pop(name) for name in ("is_causal", "local_window_size") if name in kwargs}
    names = ["q", "k", "v"] + (["bias"] if "bias" in kwargs else [])

    def loss(fn, *diff):
        named = dict(zip(names, diff))
        rest = {key: value for key, value in kwargs.items() if key not in named}
        out = fn(named["q"], named["k"], named["v"], **static, **rest,
                 **({"bias": named["bias"]} if "bias" in named else {}))
        return jnp.sum(out * d_out)

    args = (q, k, v) + ((kwargs["bias"],) if "bias" in kwargs else ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa4_jax.FallbackWarning)
        ours = jax.grad(lambda *a: loss(fa4_jax.dot_product_attention, *a), argnums=tuple(range(len(args))))(*args)
    theirs = jax.grad(lambda *a: loss(functools.partial(jax.nn.dot_product_attention, implementation="xla"), *a),
                      argnums=tuple(range(len(args))))(*args)
    for name, got, want in zip(names, ours, theirs):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5, err_msg=name)


def test_a_bias_runs_on_the_reference_and_says_so(next_key, monkeypatch):
    from fa4_jax.core import notices

    monkeypatch.setattr(notices, "_SAID", set())
    q, k, v = _qkv(next_key)
    with pytest.raises(ValueError, match="implementation='cute' cannot serve this call: the kernels do not read a bias"):
        fa4_jax.dot_product_attention(q, k, v, bias=jnp.zeros((1, 1, 16, 16), q.dtype), implementation="cute")
    with pytest.warns(fa4_jax.FallbackWarning, match="do not read a bias array"):
        fa4_jax.dot_product_attention(q, k, v, bias=jnp.zeros((1, 1, 16, 16), q.dtype))
    mask = jnp.ones((2, 1, 16, 16), bool)
    with pytest.raises(ValueError, match="mask dtype should be bool"):
        fa4_jax.dot_product_attention(q, k, v, mask=mask.astype(jnp.float32))
    with pytest.raises(ValueError, match="mask must be broadcastable"):
        fa4_jax.dot_product_attention(q, k, v, mask=jnp.ones((2, 3, 16, 16), bool))


@pytest.mark.parametrize("lengths", [False, True])
def test_a_per_head_mask_runs_each_head_as_an_entry_of_its_own(next_key, lengths):
    # The kernels read one mask per batch entry: a per-head mask's call becomes b * h entries of
    # one head each (kv heads repeated), and the results go back. Run here on the reference, the
    # fold and unfold (values, lse, gradients) must give the direct call's.
    from fa4_jax.api import attention as api

    q, k, v = _qkv(next_key, batch=2, seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2)
    mask = jax.random.uniform(next_key(), (1, 4, 24, 40)) < 0.6
    seq_lengths = (jnp.asarray([24, 9], jnp.int32), jnp.asarray([3, 40], jnp.int32)) if lengths else (None, None)

    def folded(q, k, v):
        params, visibility = validation.describe_call(
            q, k, v, causal=True, softmax_scale=0.3, window_size=(None, None), softcap=None,
            deterministic=False, implementation="reference", mask=mask, query_seq_lengths=seq_lengths[0],
            key_value_seq_lengths=seq_lengths[1])
        return api._per_head_mask_attention(q, k, v, params, visibility)

    def direct(q, k, v):
        return fa4_jax.attention(q, k, v, mask=mask, causal=True, softmax_scale=0.3, implementation="reference",
                                 query_seq_lengths=seq_lengths[0], key_value_seq_lengths=seq_lengths[1],
                                 return_lse=True)

    d_out = jax.random.normal(next_key(), q.shape[:3] + (v.shape[-1],), q.dtype)
    for got, want in zip(folded(q, k, v), direct(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    grads = [jax.grad(lambda *a: jnp.sum(f(*a)[0] * d_out), argnums=(0, 1, 2))(q, k, v) for f in (folded, direct)]
    for name, got, want in zip("qkv", *grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=name)


def test_segment_ids_attend_within_their_segment(next_key):
    # Two documents packed in each row, and padding (-1 / -2 match nothing): the same as
    # attending each document on its own.
    q, k, v = _qkv(next_key, batch=2, seqlen_q=16, seqlen_k=16, heads_q=4, heads_kv=2)
    ids = np.r_[np.zeros(6), np.ones(7), np.full(3, -1)].astype(np.int32)
    q_ids = jnp.asarray(np.stack([ids, ids]))
    kv_ids = jnp.asarray(np.stack([np.where(ids < 0, -2, ids)] * 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa4_jax.FallbackWarning)
        out, lse = fa4_jax.attention(q, k, v, causal=True, return_lse=True,
                                     query_segment_ids=q_ids, kv_segment_ids=kv_ids)
    for start, stop in ((0, 6), (6, 13)):
        want = fa4_jax.attention(q[:, start:stop], k[:, start:stop], v[:, start:stop], causal=True,
                                 implementation="reference")
        np.testing.assert_allclose(out[:, start:stop], want, atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out[:, 13:]) == 0.0) and np.all(np.isneginf(np.asarray(lse[:, :, 13:])))
    with pytest.raises(ValueError, match="both query_segment_ids and kv_segment_ids"):
        fa4_jax.attention(q, k, v, query_segment_ids=q_ids)
    with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \[batch, seq\] = \(2, 16\)"):
        fa4_jax.attention(q, k, v, query_segment_ids=q_ids, kv_segment_ids=kv_ids[:, :8])
    # The kernels read segment ids: the reason is any such call's (float32 here), not the ids.
    explanation = fa4_jax.explain(q, k, v, query_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert explanation.backend == "reference" and "segment" not in explanation.reason


DROP_IN_ERRORS = {
    # jax refuses these too.
    "lengths_int16": (dict(key_value_seq_lengths=np.array([3, 4], np.int16)), ValueError,
                      "key_value_seq_lengths must be an int32 array of shape"),
    "lengths_shape": (dict(query_seq_lengths=jnp.array([3, 4, 5], jnp.int32)), ValueError,
                      r"query_seq_lengths must be an int32 array of shape \(2,\)"),
    "value_head_dim": (dict(value_head_dim=8), ValueError, "value must have key's shape"),
    # fa4_jax's own limits.
    "negative_window": (dict(local_window_size=(-1, 2)), NotImplementedError, "negative bounds"),
    "window_type": (dict(local_window_size=(1.5, 2)), TypeError, "local_window_size"),
    "scale": (dict(scale=-1.0), ValueError, "^scale must be"),
    "is_causal_type": (dict(is_causal=1), TypeError, "is_causal must be"),
}


@pytest.mark.parametrize("case", DROP_IN_ERRORS.values(), ids=DROP_IN_ERRORS.keys())
def test_dot_product_attention_errors_name_the_argument(next_key, case):
    kwargs, error, message = case
    q, k, v = _qkv(next_key, heads_kv=4, head_dim_v=kwargs.pop("value_head_dim", None))
    with pytest.raises(error, match=message):
        fa4_jax.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_dot_product_attention_jax_backends_point_to_jax(next_key, implementation):
    q, k, v = _qkv(next_key)
    with pytest.raises(ValueError, match="jax.nn.dot_product_attention"):
        fa4_jax.dot_product_attention(q, k, v, implementation=implementation)


def test_which_backend_says_what_attention_runs_and_warns():
    # No GPU here: the reference, with the FallbackWarning's own reason; the same errors as a call.
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    backend, reason = fa4_jax.which_backend(q, q, q, causal=True)
    assert backend == "reference" and "not a CUDA GPU" in reason
    assert fa4_jax.which_backend(q, q, q, implementation="reference") == ("reference", None)
    f32 = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.float32)
    assert "got float32" in fa4_jax.which_backend(f32, f32, f32)[1]
    with pytest.raises(ValueError, match="window_size"):
        fa4_jax.which_backend(q, q, q, causal=True, window_size=(4, 3))
    with pytest.raises(ValueError, match="implementation='cute'"):
        fa4_jax.which_backend(q, q, q, implementation="cute")


def test_explain_names_the_kernels_and_the_padding(monkeypatch):
    # The shipping menu's Hopper variants, as if on an H200: a d88 call runs d96's kernels.
    from fa4_jax.runtime import dispatch, ffi
    from fa4_jax.kernels.sm90 import menu as sm90

    library = ffi.Library(path="(menu)", compiled=frozenset(v.name for v in sm90.MENU), routes=(),
                          dq_copies_max_keys={}, tuning_targets=False,
                          head_dims={sm90.ARCH: frozenset(sm90.HEAD_DIMS)})
    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: library)
    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    monkeypatch.setattr(device, "sm_count", lambda: 132)
    q = jax.ShapeDtypeStruct((1, 4096, 16, 88), jnp.bfloat16)
    explanation = fa4_jax.explain(q, q, q, causal=True)
    assert explanation == fa4_jax.Explanation(
        "cute", None, "fwd_sm90a_bf16_d96_dv96_causal", "bwd_sm90a_bf16_d96_dv96_causal", (96, 96),
        True, 1, False)
    assert "zero-padded to head dims 96/96" in str(explanation)
    assert fa4_jax.which_backend(q, q, q, causal=True) == ("cute", None)
    own = fa4_jax.explain(jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16), q.update(shape=(1, 4096, 16, 128)),
                          q.update(shape=(1, 4096, 16, 128)))
    assert own.head_dims == (128, 128) and not own.padded
    # A decode step: keys split, query heads packed, the decode tuning is not routed here (no routes).
    step = fa4_jax.explain(q.update(shape=(2, 1, 16, 128)), q.update(shape=(2, 8192, 2, 128)),
                           q.update(shape=(2, 8192, 2, 128)))
    assert (step.split_kv, step.pack_gqa, step.forward_variant) == (8, True, "fwd_sm90a_bf16_d128_dv128")
    assert str(fa4_jax.explain(q, q, q, implementation="reference")) == "reference: asked for"


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (3, 0)}],
                         ids=["none", "causal", "window"])
def test_no_keys_gives_rows_that_see_none_as_jax_does(next_key, options):
    # seqlen_k = 0 (an empty cache, say): every row sees no key. jax's dot_product_attention
    # gives zeros; the kernels and the reference would tile an empty axis, so no call reaches them.
    q = jax.random.normal(next_key(), (2, 5, 4, 16), jnp.float32)
    kv = jnp.zeros((2, 0, 2, 16), jnp.float32)
    out, lse = fa4_jax.attention(q, kv, kv, return_lse=True, **options)
    assert out.shape == (2, 5, 4, 16) and lse.shape == (2, 4, 5)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))
    grads = jax.grad(lambda q, k, v: fa4_jax.attention(q, k, v, **options).sum(), argnums=(0, 1, 2))(q, kv, kv)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape] and not np.any(np.asarray(grads[0]))
    want = jax.nn.dot_product_attention(q, kv, kv, implementation="xla")
    np.testing.assert_array_equal(fa4_jax.dot_product_attention(q, kv, kv), want)


def test_an_empty_batch_gives_empty_results_as_jax_does():
    q, kv = jnp.zeros((0, 5, 4, 16), jnp.float32), jnp.zeros((0, 7, 2, 16), jnp.float32)
    out, lse = fa4_jax.attention(q, kv, kv, causal=True, return_lse=True)
    assert out.shape == (0, 5, 4, 16) and lse.shape == (0, 4, 5)
    assert fa4_jax.dot_product_attention(q, kv, kv).shape == jax.nn.dot_product_attention(
        q, kv, kv, implementation="xla").shape
