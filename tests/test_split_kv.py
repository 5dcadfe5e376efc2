"""Split-KV (fa4_jax/runtime/split_kv.py): the rule, and split + combine checked on the reference.

The transform test runs the fp32 reference on the split problem (b·n entries, each with its
chunk of keys and lengths), combines, and compares with the reference on the original call: a
wrong chunk order, length split or merge weight fails by O(1). The kernel path is tested in
tests/gpu/test_split_kv_gpu.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.runtime import split_kv
from fa4_jax.api.attention import attention_params
from fa4_jax.ops.bodies import _reference_fp32
from fa4_jax.runtime.operands import KernelOperands


def _reference(q, k, v, params, seq_lengths=None):
    return _reference_fp32(q, k, v, params, KernelOperands() if seq_lengths is None else KernelOperands(*seq_lengths))


HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16


@pytest.mark.parametrize("seqlen_q,seqlen_k,n,options,ragged", [
    (1, 96, 4, dict(causal=True), False),
    (1, 96, 3, dict(softcap=5.0), True),
    (5, 60, 6, dict(), False),
    (5, 60, 2, dict(), True),
])
def test_split_call_equals_the_original(next_key, seqlen_q, seqlen_k, n, options, ragged):
    batch = 3
    q = jax.random.normal(next_key(), (batch, seqlen_q, HEADS_Q, HEAD_DIM), jnp.float32)
    k, v = (jax.random.normal(next_key(), (batch, seqlen_k, HEADS_KV, HEAD_DIM), jnp.float32)
            for _ in range(2))
    params = attention_params(q, k, v, implementation="reference", **options)
    seq_lengths = None
    if ragged:
        # Lengths ending inside a chunk, on a chunk boundary, and no keys at all.
        chunk = seqlen_k // n
        seq_lengths = (jnp.asarray([seqlen_q, 0, seqlen_q], jnp.int32),
                       jnp.asarray([chunk + 3, chunk, 0], jnp.int32))
    want_out, want_lse = _reference(q, k, v, params, seq_lengths)
    chunks = split_kv.split(q, k, v, params, seq_lengths, n)
    assert chunks[1].shape == (batch * n, seqlen_k // n, HEADS_KV, HEAD_DIM)
    out, lse = split_kv.combine(*_reference(*chunks), n)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-5)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_kv,options,want", [
    (8, 1, 32768, 8, dict(causal=True), 4),  # 64 packed tiles want 5; 4 is the divisor of 32768
    (64, 1, 8192, 8, dict(), 1),  # 512 tiles fill the GPU already
    (8, 1, 1536, 8, dict(), 1),  # chunks would fall under MIN_KEYS_PER_SPLIT
    (8, 2, 32768, 8, dict(causal=True), 1),  # the causal mask differs per row
    (8, 100, 32768, 8, dict(), 1),  # not a decode-sized call
    (2, 1, 3 * 4096, 1, dict(), 12),  # MQA: 2 tiles; 12 divides 12288 and leaves 1024 keys
])
def test_how_many_splits(batch, seqlen_q, seqlen_k, heads_kv, options, want):
    q_shape = (batch, seqlen_q, 32, 128)
    k_shape = (batch, seqlen_k, heads_kv, 128)
    params = attention_params(jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16),
                              jnp.zeros(k_shape, jnp.bfloat16), implementation="reference",
                              **options)
    assert split_kv.num_splits(q_shape, k_shape, params, sm_count=132) == want
