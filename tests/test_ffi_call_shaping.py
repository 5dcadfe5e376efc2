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


@pytest.mark.parametrize("head_dim,head_dim_v,seqlen_k,deterministic,tuning,copies", [
    (128, 128, 300, True, "default", 1),
    (256, 256, 300, False, "default", 1),
    (256, 256, 300, True, "default", 2),
    (192, 128, 8192, True, "default", 2),
    (192, 128, 8193, True, "default", 1),
    (256, 256, 300, True, "det_one_copy", 1),
])
def test_backward_workspaces_hold_the_dq_copies_of_the_call(monkeypatch, head_dim, head_dim_v,
                                                            seqlen_k, deterministic, tuning, copies):
    # Deterministic d192/d256 calls of up to 8k keys get two dQ accumulators and two semaphore
    # sets; the handler reads the count off dq_accum, so these shapes are the whole of the choice.
    results = []

    def fake_ffi_call(target, result_types):
        results.extend(result_types)
        return lambda *operands, **attrs: tuple(jnp.zeros(r.shape, r.dtype) for r in result_types)

    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    monkeypatch.setattr(ffi, "_require", lambda *args: None)
    b, s, h = 2, 300, 4
    q = jnp.zeros((b, s, h, head_dim), jnp.bfloat16)
    k = jnp.zeros((b, seqlen_k, h, head_dim), jnp.bfloat16)
    v = jnp.zeros((b, seqlen_k, h, head_dim_v), jnp.bfloat16)
    out = jnp.zeros((b, s, h, head_dim_v), jnp.bfloat16)
    lse = jnp.zeros((b, h, s), jnp.float32)
    params = attention_params(q, k, v, deterministic=deterministic, implementation="reference")
    ffi.backward(q, k, v, out, lse, out, lse, params, tuning=tuning)
    dq_accum, dpsum, _, semaphore = (r.shape for r in results[3:])
    assert dq_accum == (copies, b, h, 384, head_dim)
    assert dpsum == (b, h, 384)
    assert semaphore == (copies, b, h, 384 // 64)
