"""GPU tier: every head dim (multiples of 8 up to 256) on the kernels, forward and gradients.

Dims without a compiled kernel of their own run zero-padded on the narrowest wider one
(`routing.serving_head_dims`); these tests check the results against the reference at the
call's own dims under docs/design.md's numerics rule, and that the kernels, not a fallback, ran.
"""
import warnings

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from tests.gpu.test_attention_gpu import _check_forward
from fa4_jax.fallbacks.reference import attention_reference
from tests.gpu.test_backward_gpu import _check_backward
from tests.numerics import assert_close_by_rule

pytestmark = pytest.mark.gpu

HEAD_DIMS = tuple(range(8, 257, 8))
# head_dim_v != head_dim: narrower and wider than q's, each served by a different pair.
HEAD_DIM_PAIRS = ((40, 24), (64, 32), (80, 160), (136, 72), (160, 128), (200, 96), (256, 8))


def _runs_on_the_kernels(head_dim, head_dim_v, **options):
    q = jax.ShapeDtypeStruct((1, 256, 4, head_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 2, head_dim_v), jnp.bfloat16)
    k = q.update(shape=(1, 256, 2, head_dim))
    explanation = fa4_jax.explain(q, k, v, **options)
    assert explanation.backend == "cute", explanation
    assert explanation.backward_variant is not None, explanation
    assert explanation.padded == (explanation.head_dims != (head_dim, head_dim_v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_head_dim_forward_and_gradients(next_key, head_dim, causal):
    _runs_on_the_kernels(head_dim, head_dim, causal=causal)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fa4_jax.FallbackWarning)
        _check_forward(next_key, 1, 300, 333, 4, 2, head_dim, jnp.bfloat16, causal=causal)
        _check_backward(next_key, 1, 300, 333, 4, 2, head_dim, jnp.bfloat16, causal=causal)


@pytest.mark.parametrize("head_dim,head_dim_v", HEAD_DIM_PAIRS)
def test_value_head_dims_that_differ(next_key, head_dim, head_dim_v):
    _runs_on_the_kernels(head_dim, head_dim_v, causal=True)
    _check_forward(next_key, 1, 257, 300, 4, 2, head_dim, jnp.float16, head_dim_v=head_dim_v,
                   causal=True)
    _check_backward(next_key, 1, 257, 300, 4, 2, head_dim, jnp.float16, head_dim_v=head_dim_v,
                    causal=True)


@pytest.mark.parametrize("options", [dict(window_size=(64, 16)), dict(softcap=20.0),
                                     dict(deterministic=True, causal=True)],
                         ids=["window", "softcap", "deterministic"])
@pytest.mark.parametrize("head_dim", [32, 80, 160])
def test_padded_head_dims_with_every_option(next_key, head_dim, options):
    _check_forward(next_key, 2, 211, 517, 4, 1, head_dim, jnp.bfloat16, **options)
    _check_backward(next_key, 2, 211, 517, 4, 1, head_dim, jnp.bfloat16, **options)


def test_padded_ragged_decode(next_key):
    # A decode step at d72: padded, then split over the keys and GQA-packed, with ragged lengths.
    q = jax.random.normal(next_key(), (2, 1, 8, 72), jnp.bfloat16)
    k, v = (jax.random.normal(next_key(), (2, 4096, 2, 72), jnp.bfloat16) for _ in range(2))
    lengths = dict(query_seq_lengths=jnp.array([1, 1], jnp.int32),
                   key_value_seq_lengths=jnp.array([4096, 1500], jnp.int32))
    explanation = fa4_jax.explain(q, k, v, **lengths)
    assert explanation.padded and explanation.pack_gqa and explanation.split_kv > 1, explanation
    out = fa4_jax.attention(q, k, v, implementation="cute", **lengths)
    ref, lowp = (attention_reference(q, k, v, compute_dtype=dtype, **lengths)[0]
                 for dtype in (jnp.float32, jnp.bfloat16))
    assert_close_by_rule(out, ref, lowp, name="out")
