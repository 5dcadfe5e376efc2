"""CPU tier: how `ffi.forward` shapes a kernel call (split-KV, then GQA packing) and undoes it.

The kernel call itself (`ffi._forward`) is replaced by the fp32 reference, which records the
shapes it receives; everything around it is the code the GPU runs. So a wrong order of the two
transforms, a lost length, or a merge that mixes up entries fails here against the reference of
the original call, and the recorded shapes pin which calls are split and packed.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import ffi
from fa4_jax.api import attention_params
from fa4_jax.backends import _reference_fp32 as _reference


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def fake_kernel(q, k, v, params, seq_lengths, tuning):
        calls.append((q.shape, k.shape, params.causal, seq_lengths is not None))
        return _reference(q, k, v, params, seq_lengths)

    monkeypatch.setattr(ffi, "_forward", fake_kernel)
    monkeypatch.setattr(ffi, "_sm_count", lambda: 132)
    return calls


@pytest.mark.parametrize("ragged", [False, True])
def test_decode_is_split_then_packed_and_merged_back(next_key, kernel_calls, ragged):
    batch, seqlen_k, heads_q, heads_kv, d = 2, 4096, 8, 2, 16
    q = jax.random.normal(next_key(), (batch, 1, heads_q, d), jnp.float32)
    k, v = (jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, d), jnp.float32)
            for _ in range(2))
    params = attention_params(q, k, v, causal=True, implementation="reference")
    lengths = None
    if ragged:
        lengths = (jnp.asarray([1, 1], jnp.int32), jnp.asarray([1500, 3000], jnp.int32))
    out, lse = ffi.forward(q, k, v, params, lengths)
    want_out, want_lse = _reference(q, k, v, params, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    # 4 tiles want 66 splits; 4096 keys allow 4 of 1024: one kernel call over 8 entries, each
    # with the 4 query heads of a KV head as rows, the mask dropped (one row sees every key).
    assert kernel_calls == [((batch * 4, heads_q // heads_kv, heads_kv, d),
                             (batch * 4, seqlen_k // 4, heads_kv, d), False, ragged)]


def test_long_calls_go_to_the_kernel_unchanged(next_key, kernel_calls):
    q, k, v = (jax.random.normal(next_key(), (1, 300, 4, 16), jnp.float32) for _ in range(3))
    params = attention_params(q, k[:, :, :2], v[:, :, :2], causal=True, implementation="reference")
    out, _ = ffi.forward(q, k[:, :, :2], v[:, :, :2], params)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(
        q, k[:, :, :2], v[:, :, :2], params, None)[0]), rtol=1e-6)
    assert kernel_calls == [((1, 300, 4, 16), (1, 300, 2, 16), True, False)]


def test_explicit_settings_turn_both_off(next_key, kernel_calls):
    q = jax.random.normal(next_key(), (2, 1, 8, 16), jnp.float32)
    k, v = (jax.random.normal(next_key(), (2, 4096, 2, 16), jnp.float32) for _ in range(2))
    params = attention_params(q, k, v, implementation="reference")
    ffi.forward(q, k, v, params, split_kv=1, pack_gqa=False)
    assert kernel_calls == [((2, 1, 8, 16), (2, 4096, 2, 16), False, False)]
