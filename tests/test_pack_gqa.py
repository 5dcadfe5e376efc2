"""GQA packing (fa4_jax/runtime/pack_gqa.py): the rule, and the layout transform checked on the reference.

The transform test runs the fp32 reference on the packed problem (heads_kv heads, sq · group
rows, the packed params and lengths), unpacks, and compares with the reference on the original
call: a wrong row order, head order or length scaling moves rows between heads or queries and
fails by O(1). The kernel path is tested in tests/gpu/test_pack_gqa_gpu.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.runtime import pack_gqa
from fa4_jax.api.attention import attention_params
from fa4_jax.ops.bodies import _reference_fp32
from fa4_jax.runtime.operands import KernelOperands


def _reference(q, k, v, params, seq_lengths=None):
    return _reference_fp32(q, k, v, params, KernelOperands() if seq_lengths is None else KernelOperands(*seq_lengths))


HEADS_Q, HEADS_KV, HEAD_DIM, SEQLEN_K = 8, 2, 32, 40


def _qkv(next_key, batch, seqlen_q, heads_kv=HEADS_KV):
    shapes = ((batch, seqlen_q, HEADS_Q, HEAD_DIM), (batch, SEQLEN_K, heads_kv, HEAD_DIM),
              (batch, SEQLEN_K, heads_kv, HEAD_DIM))
    return tuple(jax.random.normal(next_key(), s, jnp.float32) for s in shapes)


@pytest.mark.parametrize("seqlen_q,heads_kv,options,ragged", [
    (1, HEADS_KV, dict(causal=True), False),  # decode
    (1, 1, dict(softcap=5.0), False),  # MQA
    (7, HEADS_KV, dict(), False),
    (7, HEADS_KV, dict(), True),
    (1, HEADS_KV, dict(causal=True), True),
])
def test_packed_call_equals_the_original(next_key, seqlen_q, heads_kv, options, ragged):
    batch = 3
    q, k, v = _qkv(next_key, batch, seqlen_q, heads_kv)
    params = attention_params(q, k, v, implementation="reference", **options)
    assert pack_gqa.packs(q.shape, k.shape, params)
    seq_lengths = None
    if ragged:
        seq_lengths = (jnp.asarray([seqlen_q, 0, max(seqlen_q - 2, 1)], jnp.int32),
                       jnp.asarray([SEQLEN_K, 17, 0], jnp.int32))
    want_out, want_lse = _reference(q, k, v, params, seq_lengths)
    packed_q, packed_params, packed_lengths = pack_gqa.pack(q, k, params, seq_lengths)
    assert packed_q.shape == (batch, seqlen_q * HEADS_Q // heads_kv, heads_kv, HEAD_DIM)
    out, lse = pack_gqa.unpack(*_reference(packed_q, k, v, packed_params, packed_lengths), HEADS_Q)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-5)


@pytest.mark.parametrize("seqlen_q,heads_kv,options,want", [
    (1, HEADS_KV, dict(causal=True), True),
    (64, HEADS_KV, dict(), True),
    (65, HEADS_KV, dict(), False),  # tiles fill without packing
    (2, HEADS_KV, dict(causal=True), False),  # the mask differs between the packed rows
    (1, HEADS_KV, dict(window_size=(8, 0)), False),
    (1, HEADS_Q, dict(), False),  # no group to pack
])
def test_which_calls_pack(next_key, seqlen_q, heads_kv, options, want):
    q, k, v = _qkv(next_key, 1, seqlen_q, heads_kv)
    params = attention_params(q, k, v, implementation="reference", **options)
    assert pack_gqa.packs(q.shape, k.shape, params) is want
