"""GPU tier: the cuDNN route (a CUDA GPU without kernels for a call runs cuDNN through
jax.nn.dot_product_attention where it means the same), and where jax's own two backends
disagree, the drop-in's documented choice (jax's default, XLA)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule, reference_grad_pair, reference_pair

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_kernels(monkeypatch):
    """The kernels serve nothing, as on a GPU whose arch the library has no kernels for."""
    from fa4_jax.runtime import dispatch
    from fa4_jax.core import notices

    monkeypatch.setattr(dispatch, "unsupported_reason", lambda *args, **kwargs: "no kernels (test)")
    monkeypatch.setattr(notices, "_SAID", set())


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal=True, window_size=(100, None))],
                         ids=["none", "causal", "causal_window"])
def test_calls_without_kernels_run_cudnn(next_key, no_kernels, options):
    q, k, v = qkv(next_key, 2, 512, 512, 8, 2, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    with pytest.warns(fa4_jax.FallbackWarning, match="run on cuDNN"):
        hlo = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options)).lower(q, k, v).as_text()
    assert "cudnn" in hlo.lower() and "fa4_jax_fwd" not in hlo
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa4_jax.FallbackWarning)
        out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fa4_jax.attention(q, k, v, **options).astype(jnp.float32)
                                                         * d_out.astype(jnp.float32)), argnums=(0, 1, 2)))(q, k, v)
    mask = dict(causal=options.get("causal", False), window_left=options.get("window_size", (None,))[0])
    (ref, _), (lowp, _) = reference_pair(q, k, v, **mask)
    assert_close_by_rule(out, ref, lowp, name="out")
    ref_grads, lowp_grads = reference_grad_pair(q, k, v, d_out, **mask)
    for name, got, want, want_lowp in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_close_by_rule(got, want, want_lowp, name=name)


def test_the_drop_in_follows_xla_where_jaxs_backends_disagree(next_key, capsys):
    # An entry with no keys, and NaN in the padding of V: jax's XLA path gives the key-less rows
    # the mean of all values and lets the padding's NaN reach every row; the drop-in gives the
    # mean too and never reads padding. What jax's cuDNN path gives is printed for the record.
    q, k, v = qkv(next_key, 2, 128, 128, 4, 4, 64, jnp.bfloat16)
    lengths = dict(query_seq_lengths=jnp.array([128, 64], jnp.int32),
                   key_value_seq_lengths=jnp.array([96, 0], jnp.int32))
    ours = fa4_jax.dot_product_attention(q, k, v, implementation="cute", **lengths)
    xla = jax.nn.dot_product_attention(q, k, v, implementation="xla", **lengths)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(xla, np.float32), atol=2e-2)
    poisoned = v.at[0, 96:].set(jnp.nan)
    ours_nan = fa4_jax.dot_product_attention(q, k, poisoned, implementation="cute", **lengths)
    xla_nan = jax.nn.dot_product_attention(q, k, poisoned, implementation="xla", **lengths)
    assert np.isfinite(np.asarray(ours_nan[0], np.float32)).all()
    assert np.isnan(np.asarray(xla_nan[0], np.float32)).any()
    try:
        cudnn = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **lengths)
        cudnn_nan = jax.nn.dot_product_attention(q, k, poisoned, implementation="cudnn", **lengths)
        keyless = np.asarray(cudnn[1, :64], np.float32)
        print(f"cuDNN: key-less rows max |out| {np.abs(keyless).max():.3g}, "
              f"max |out - xla| {np.abs(keyless - np.asarray(xla[1, :64], np.float32)).max():.3g}, "
              f"padded rows max |out| {np.abs(np.asarray(cudnn[1, 64:], np.float32)).max():.3g}, "
              f"NaN padding reaches rows: {bool(np.isnan(np.asarray(cudnn_nan[0], np.float32)).any())}")
    except Exception as error:  # noqa: BLE001 - the record, not the check
        print(f"cuDNN refused the case: {type(error).__name__}: {str(error)[:200]}")
    with capsys.disabled():
        pass
