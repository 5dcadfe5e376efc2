"""GPU tier: split-KV forward calls (fa4_jax/runtime/split_kv.py) against the reference.

The chunks' partial outputs come back in bf16, so the combined output carries one more bf16
rounding than a single pass; docs/design.md's rule (twice the bf16 reference's error) must still hold.
Lengths and chunk boundaries are chosen so chunks end mid-block, entries end mid-chunk, and
whole chunks see no key.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.runtime import device, dispatch, split_kv
from fa4_jax.runtime.operands import KernelOperands
from fa4_jax.api.attention import attention_params
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule, reference_pair

pytestmark = pytest.mark.gpu


def _forward(q, k, v, params, seq_lengths, **settings):
    reason = dispatch.unsupported_reason(q, k, v, params)
    if reason is not None:
        pytest.skip(reason)
    return jax.jit(lambda q, k, v, lengths: dispatch.forward(q, k, v, params, KernelOperands() if lengths is None else KernelOperands(*lengths), **settings))(
        q, k, v, seq_lengths)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads_q,heads_kv,options,settings", [
    (32, 8, dict(causal=True), dict()),  # the rule's choice (pinned below), packed
    (16, 1, dict(softcap=20.0), dict(split_kv=6)),  # MQA, chunks of 1366 keys: mid-block ends
    (8, 8, dict(), dict(split_kv=4)),  # no group: split without packing
    (32, 8, dict(), dict(split_kv=4, pack_gqa=False)),
])
def test_split_decode(next_key, head_dim, heads_q, heads_kv, options, settings):
    batch, seqlen_k = 2, 8196
    q, k, v = qkv(next_key, batch, 1, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    params = attention_params(q, k, v, implementation="cute", **options)
    if not settings:
        assert split_kv.num_splits(q.shape, k.shape, params, device.sm_count()) > 1
    out, lse = _forward(q, k, v, params, None, **settings)
    (ref, ref_lse), (lowp, lowp_lse) = jax.jit(lambda q, k, v: reference_pair(
        q, k, v, causal=options.get("causal", False), softcap=options.get("softcap")))(q, k, v)
    factor = 3 if options.get("softcap") else 2
    assert_close_by_rule(out, ref, lowp, factor=factor, name="out")
    assert_close_by_rule(lse, ref_lse, lowp_lse, factor=factor, name="lse")


def test_split_ragged_decode(next_key):
    batch, seqlen_k, heads_q, heads_kv, head_dim, n = 4, 4096, 16, 4, 128, 4
    q, k, v = qkv(next_key, batch, 1, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    # Ends mid-chunk, on a chunk boundary, before the first chunk ends; one entry without a row.
    q_len = jnp.asarray([1, 1, 1, 0], jnp.int32)
    kv_len = jnp.asarray([2500, 2048, 700, 4096], jnp.int32)
    params = attention_params(q, k, v, causal=True, implementation="cute")
    out, lse = _forward(q, k, v, params, (q_len, kv_len), split_kv=n)
    assert np.all(np.asarray(out[3], np.float32) == 0.0) and np.all(np.isneginf(np.asarray(lse[3])))
    for b in range(3):
        keys = int(kv_len[b])
        (ref, ref_lse), (lowp, lowp_lse) = reference_pair(
            q[b:b + 1], k[b:b + 1, :keys], v[b:b + 1, :keys], causal=True)
        assert_close_by_rule(out[b:b + 1], ref, lowp, name=f"out[{b}]")
        assert_close_by_rule(lse[b:b + 1], ref_lse, lowp_lse, name=f"lse[{b}]")
