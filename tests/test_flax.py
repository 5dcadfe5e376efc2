"""fa4_jax.flax: Flax's attention modules give the same outputs and gradients with fa4_jax.

Each test draws fresh random inputs and parameters from conftest's `seed` fixture (replay a
failure with FA4_JAX_TEST_SEED; the seed is also in the assertion message) and
compares the module driven by fa4_jax's attention_fn against the same module, with the same
parameters, driven by Flax's own dot_product_attention.
"""
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fa4_jax import FallbackWarning
from fa4_jax.flax import attention_fn, make_attention_fn

NUM_HEADS = 4
FEATURES = 64  # head_dim 16
# Both sides compute in fp32 on CPU and differ only in summation order.
FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def random_inputs(seed, shape):
    # numpy, not jax.random: no compilation per new shape, which keeps the suite fast.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def assert_trees_close(actual, expected, seed, **tol):
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def
    for a, e in zip(actual_leaves, expected_leaves):
        assert np.all(np.isfinite(a)), f"non-finite values (seed {seed})"
        np.testing.assert_allclose(a, e, err_msg=f"seed {seed}", **tol)


# ----------------------------------------------------------------------------------------- linen

def linen_outputs_and_grads(module, params, x, mask, cotangent):
    """(output, d<output, cotangent>/d params) of a linen module, jitted."""

    @jax.jit
    def run(params):
        def projected(p):
            out = module.apply({"params": p}, x, mask=mask)
            return jnp.sum(out * cotangent), out

        (_, out), grads = jax.value_and_grad(projected, has_aux=True)(params)
        return out, grads

    return run(params)


@pytest.mark.parametrize(
    "causal, batch_dims",
    [(False, (2,)), (True, (2,)), (True, (2, 3))],
    ids=["full", "causal", "causal_extra_batch_dims"],
)
def test_linen_matches_flax_attention(causal, batch_dims, seed):
    x = random_inputs(seed, batch_dims + (24, FEATURES))
    cotangent = random_inputs(seed + 1, x.shape)
    flax_module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS)
    fa4_module = nn.MultiHeadDotProductAttention(
        num_heads=NUM_HEADS, attention_fn=make_attention_fn(causal=causal))
    params = flax_module.init(jax.random.key(seed + 2), x)["params"]
    flax_mask = nn.make_causal_mask(jnp.ones(x.shape[:-1])) if causal else None

    expected = linen_outputs_and_grads(flax_module, params, x, flax_mask, cotangent)
    actual = linen_outputs_and_grads(fa4_module, params, x, None, cotangent)
    assert_trees_close(actual, expected, seed, **FP32_TOL)


def test_linen_causal_differs_from_full(seed):
    # Guards the comparison above: a causal module must not agree with a full one.
    x = random_inputs(seed, (2, 16, FEATURES))
    full = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, attention_fn=attention_fn)
    causal = nn.MultiHeadDotProductAttention(
        num_heads=NUM_HEADS, attention_fn=make_attention_fn(causal=True))
    params = full.init(jax.random.key(seed), x)["params"]
    difference = np.abs(full.apply({"params": params}, x) - causal.apply({"params": params}, x))
    assert difference.max() > 1e-3, f"seed {seed}"


def test_linen_dropout_rate_with_deterministic_true_runs_without_dropout(seed):
    x = random_inputs(seed, (2, 16, FEATURES))
    flax_module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, dropout_rate=0.1,
                                                  deterministic=True)
    fa4_module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, dropout_rate=0.1,
                                                 deterministic=True, attention_fn=attention_fn)
    params = flax_module.init(jax.random.key(seed), x)["params"]
    assert_trees_close(fa4_module.apply({"params": params}, x),
                       flax_module.apply({"params": params}, x), seed, **FP32_TOL)


# ------------------------------------------------------------------------------------------- nnx

def nnx_attention(seed, attention_fn=None, **kwargs):
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(num_heads=NUM_HEADS, in_features=FEATURES, decode=False,
                                  rngs=nnx.Rngs(seed), **extra, **kwargs)


def nnx_outputs_and_grads(module, x, cotangent, **call_kwargs):
    @nnx.jit
    def run(module):
        def projected(m):
            out = m(x, **call_kwargs)
            return jnp.sum(out * cotangent), out

        (_, out), grads = nnx.value_and_grad(projected, has_aux=True)(module)
        return out, grads

    return run(module)


@pytest.mark.parametrize(
    "causal, batch_dims", [(False, (2,)), (True, (2, 3))], ids=["full", "causal_extra_batch_dims"]
)
def test_nnx_matches_flax_attention(causal, batch_dims, seed):
    x = random_inputs(seed, batch_dims + (24, FEATURES))
    cotangent = random_inputs(seed + 1, x.shape)
    flax_module = nnx_attention(seed + 2)
    fa4_module = nnx_attention(seed + 2, make_attention_fn(causal=causal))
    flax_mask = nnx.make_causal_mask(jnp.ones(x.shape[:-1])) if causal else None

    expected = nnx_outputs_and_grads(flax_module, x, cotangent, mask=flax_mask)
    actual = nnx_outputs_and_grads(fa4_module, x, cotangent)
    assert_trees_close(actual, expected, seed, **FP32_TOL)


NNX_HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters


@pytest.mark.skipif(not NNX_HAS_IS_CAUSAL, reason="this flax's nnx attention has no is_causal")
def test_nnx_is_causal_call_argument(seed):
    x = random_inputs(seed, (2, 24, FEATURES))
    cotangent = random_inputs(seed + 1, x.shape)
    expected = nnx_outputs_and_grads(nnx_attention(seed + 2), x, cotangent, is_causal=True)
    actual = nnx_outputs_and_grads(nnx_attention(seed + 2, attention_fn), x, cotangent,
                                   is_causal=True)
    assert_trees_close(actual, expected, seed, **FP32_TOL)


# ------------------------------------------------------------------------- what is not supported

def small_qkv(seed, q_len=8, kv_len=8, batch_dims=(2,)):
    q = random_inputs(seed, batch_dims + (q_len, NUM_HEADS, 16))
    kv = random_inputs(seed + 1, batch_dims + (kv_len, NUM_HEADS, 16))
    return q, kv, kv


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(dropout_rate=0.1, deterministic=False), "dropout_rate"),
        (dict(module=object()), "module"),
        (dict(qk_attn_weights_einsum=jnp.einsum), "qk_attn_weights_einsum"),
        (dict(attn_weights_value_einsum=jnp.einsum), "attn_weights_value_einsum"),
        (dict(einsum_dot_general=jax.lax.dot_general), "einsum_dot_general"),
        (dict(input_positions=jnp.arange(8)), "input_positions"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_arguments_raise_naming_them(kwargs, named, seed):
    with pytest.raises(NotImplementedError, match=named):
        attention_fn(*small_qkv(seed), **kwargs)


@pytest.mark.parametrize("q_len, kv_len", [(8, 16), (16, 8)])
def test_is_causal_with_unequal_lengths_is_flaxs_top_left_mask(q_len, kv_len, seed):
    # Flax's is_causal is tril over [q_len, kv_len]: query i sees keys j <= i.
    q, k, v = small_qkv(seed, q_len=q_len, kv_len=kv_len)
    want = nnx.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(attention_fn(q, k, v, is_causal=True), want, **FP32_TOL)
    # Against the other alignment: the comparison would catch a bottom-right mask.
    assert np.abs(np.asarray(make_attention_fn(causal=True)(q, k, v)) - np.asarray(want)).max() > 1e-3


def test_is_causal_beside_a_bottom_right_factory_mask_raises(seed):
    with pytest.raises(NotImplementedError, match="is_causal"):
        make_attention_fn(causal=True)(*small_qkv(seed, q_len=8, kv_len=16), is_causal=True)


def test_mismatched_batch_dims_raise_value_error(seed):
    q, _, _ = small_qkv(seed, batch_dims=(2, 3))
    _, k, v = small_qkv(seed, batch_dims=(6,))
    with pytest.raises(ValueError, match="leading batch dims"):
        attention_fn(q, k, v)


@pytest.fixture
def fresh_notices(monkeypatch):
    """FallbackWarnings said again (they are said once per process and shape class)."""
    from fa4_jax.core import notices

    monkeypatch.setattr(notices, "_SAID", set())


def _padding_mask(seed, batch_dims, length):
    """Flax's padding mask of random valid lengths, one entry with no valid token at all."""
    lengths = np.random.default_rng(seed).integers(1, length + 1, batch_dims)
    lengths.reshape(-1)[0] = 0
    valid = jnp.asarray(np.arange(length) < lengths[..., None])
    return nn.make_attention_mask(valid, valid)


@pytest.mark.parametrize("masks", ["causal", "padding", "causal_and_padding"])
@pytest.mark.parametrize("batch_dims", [(3,), (2, 2)], ids=["batch", "extra_batch_dims"])
def test_linen_with_flaxs_mask_arrays_gives_flaxs_result(masks, batch_dims, seed, fresh_notices):
    # Existing model code: the module called with nn.make_causal_mask / make_attention_mask
    # runs unchanged with fa4_jax's attention_fn, outputs and gradients,
    # fully masked rows (the entry with no valid token) included.
    x = random_inputs(seed, batch_dims + (24, FEATURES))
    cotangent = random_inputs(seed + 1, x.shape)
    flax_module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS)
    fa4_module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, attention_fn=attention_fn)
    params = flax_module.init(jax.random.key(seed + 2), x)["params"]
    causal = nn.make_causal_mask(jnp.ones(x.shape[:-1]))
    padding = _padding_mask(seed + 3, batch_dims, 24)
    mask = {"causal": causal, "padding": padding,
            "causal_and_padding": nn.combine_masks(causal, padding)}[masks]
    expected = linen_outputs_and_grads(flax_module, params, x, mask, cotangent)
    with pytest.warns(FallbackWarning, match="the kernels take bfloat16 or float16"):
        actual = linen_outputs_and_grads(fa4_module, params, x, mask, cotangent)
    assert_trees_close(actual, expected, seed, **FP32_TOL)


def test_a_bias_is_added_to_the_scores_as_flax_adds_it(seed, fresh_notices):
    q, k, v = small_qkv(seed, q_len=8, kv_len=16)
    bias = random_inputs(seed + 5, (2, NUM_HEADS, 8, 16))
    mask = random_inputs(seed + 6, (2, 1, 8, 16)) > 0
    want = nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
    with pytest.warns(FallbackWarning):
        got = attention_fn(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    grad = jax.grad(lambda b: jnp.sum(attention_fn(q, k, v, bias=b) ** 2))(bias)
    want_grad = jax.grad(lambda b: jnp.sum(nn.dot_product_attention(q, k, v, bias=b) ** 2))(bias)
    np.testing.assert_allclose(grad, want_grad, **FP32_TOL)


def test_linen_dropout_while_training_raises(seed):
    x = random_inputs(seed, (2, 16, FEATURES))
    module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, dropout_rate=0.1,
                                             attention_fn=attention_fn)
    with pytest.raises(NotImplementedError, match="dropout_rate"):
        module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x,
                    deterministic=False)


def test_linen_sow_weights_raises(seed):
    x = random_inputs(seed, (2, 16, FEATURES))
    module = nn.MultiHeadDotProductAttention(num_heads=NUM_HEADS, attention_fn=attention_fn)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        module.init(jax.random.key(0), x, sow_weights=True)


def test_nnx_decode_with_its_cache_mask_gives_flaxs_steps(seed, fresh_notices):
    # NNX's decode mode attends each new token to its KV cache through a mask of the filled
    # positions: the same steps as Flax's own attention.
    steps = random_inputs(seed, (2, 5, FEATURES))
    modules = []
    for attention in (None, attention_fn):
        module = nnx_attention(seed + 1, attention)
        module.init_cache((2, 16, FEATURES))
        modules.append(module)
    for t in range(steps.shape[1]):
        x = steps[:, t:t + 1]
        want = modules[0](x, decode=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            got = modules[1](x, decode=True)
        np.testing.assert_allclose(got, want, err_msg=f"step {t}, seed {seed}", **FP32_TOL)
