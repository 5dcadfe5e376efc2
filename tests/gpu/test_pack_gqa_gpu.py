"""GPU tier: GQA-packed forward calls (fa4_jax/runtime/pack_gqa.py) against the reference.

Each case first pins that the call packs (`pack_gqa.packs`), then compares the kernel's packed
result, and the same kernel run unpacked, with the fp32 reference under docs/design.md's rule. Key
lengths are odd (a partial last key block) and fresh inputs are drawn per case.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.runtime import dispatch, pack_gqa
from fa4_jax.runtime.operands import KernelOperands
from fa4_jax.api.attention import attention_params
from tests.gpu.cases import mask_options, qkv
from tests.numerics import assert_close_by_rule, reference_pair

pytestmark = pytest.mark.gpu


def _forward(q, k, v, params, seq_lengths, pack):
    reason = dispatch.unsupported_reason(q, k, v, params)
    if reason is not None:
        pytest.skip(reason)
    return jax.jit(lambda q, k, v, lengths: dispatch.forward(q, k, v, params, KernelOperands() if lengths is None else KernelOperands(*lengths), pack_gqa=pack))(
        q, k, v, seq_lengths)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,heads_q,heads_kv,options", [
    (1, 32, 8, dict(causal=True)),  # decode
    (1, 16, 1, dict(softcap=20.0)),  # MQA
    (13, 8, 2, dict()),
    (64, 12, 4, dict()),
])
def test_packed_forward(next_key, head_dim, seqlen_q, heads_q, heads_kv, options):
    batch, seqlen_k = 3, 1037
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    params = attention_params(q, k, v, implementation="cute", **options)
    assert pack_gqa.packs(q.shape, k.shape, params)
    (ref, ref_lse), (lowp, lowp_lse) = jax.jit(lambda q, k, v: reference_pair(
        q, k, v, softcap=options.get("softcap"), **mask_options(**options)))(q, k, v)
    factor = 3 if options.get("softcap") else 2
    for pack in (True, False):
        out, lse = _forward(q, k, v, params, None, pack)
        assert_close_by_rule(out, ref, lowp, factor=factor, name=f"out (packed: {pack})")
        assert_close_by_rule(lse, ref_lse, lowp_lse, factor=factor, name=f"lse (packed: {pack})")


def test_packed_ragged_decode(next_key):
    # One query row per entry or none; keys from none to a partial last block; the keys past
    # each entry's length are inf (K) and NaN (V).
    batch, seqlen_k, heads_q, heads_kv, head_dim = 5, 700, 16, 4, 128
    q, k, v = qkv(next_key, batch, 1, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    q_len = jnp.asarray([1, 0, 1, 1, 1], jnp.int32)
    kv_len = jnp.asarray([700, 300, 0, 1, 129], jnp.int32)
    # A KV cache's padding may hold anything: the kernel must keep it out of every output.
    padding = (jnp.arange(seqlen_k)[None, :] >= kv_len[:, None])[:, :, None, None]
    k = jnp.where(padding, jnp.asarray(jnp.inf, k.dtype), k)
    v = jnp.where(padding, jnp.asarray(jnp.nan, v.dtype), v)
    out, lse = jax.jit(lambda *a: fa4_jax.attention(
        *a[:3], causal=True, return_lse=True, implementation="cute",
        query_seq_lengths=a[3], key_value_seq_lengths=a[4]))(q, k, v, q_len, kv_len)
    params = attention_params(q, k, v, causal=True, implementation="cute")
    assert pack_gqa.packs(q.shape, k.shape, params)
    for b in range(batch):
        rows, keys = int(q_len[b]), int(kv_len[b])
        if rows == 0 or keys == 0:
            # No query row or no key: out 0, lse -inf.
            assert np.all(np.asarray(out[b], np.float32) == 0.0)
            assert np.all(np.isneginf(np.asarray(lse[b])))
            continue
        (ref, ref_lse), (lowp, lowp_lse) = reference_pair(
            q[b:b + 1], k[b:b + 1, :keys], v[b:b + 1, :keys], causal=True)
        assert_close_by_rule(out[b:b + 1], ref, lowp, name=f"out[{b}]")
        assert_close_by_rule(lse[b:b + 1], ref_lse, lowp_lse, name=f"lse[{b}]")
