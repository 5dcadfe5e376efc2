"""Ragged batches (sequence lengths) and packed variable-length attention, on the reference.

The oracle is the definition: each batch entry (each packed sequence) attended on its own,
truncated to its lengths: a dense softmax with each entry's own mask, or (packed sequences)
the reference without lengths, sequence by sequence.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.runtime import ffi
from fa4_jax.fallbacks.reference import attention_reference
from tests.numerics import assert_close_by_rule, naive_attention_jax, visible_mask

# Entry lengths covering: offset < 0 (causal masks leading rows), offset > 0, no query rows,
# no keys, a single query row. Shuffled per test so entries move between batch positions.
Q_LENGTHS = (12, 7, 0, 1, 5)
KV_LENGTHS = (10, 10, 4, 6, 0)
SEQLEN_Q, SEQLEN_K = 12, 10


def _lengths(next_key):
    order = jax.random.permutation(next_key(), len(Q_LENGTHS))
    return (jnp.asarray(Q_LENGTHS, jnp.int32)[order],
            jnp.asarray(KV_LENGTHS, jnp.int32)[order])


def _inputs(next_key, heads_q, heads_kv, dtype, batch=len(Q_LENGTHS), head_dim=16):
    """q, k, v and cotangents for out and lse."""
    q = jax.random.normal(next_key(), (batch, SEQLEN_Q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, SEQLEN_K, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, SEQLEN_K, heads_kv, head_dim), dtype)
    d_out = jax.random.normal(next_key(), q.shape, dtype)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, SEQLEN_Q), jnp.float32)
    return q, k, v, d_out, d_lse


def _reference_options(options, head_dim):
    left, right = options.get("window_size", (None, None))
    return dict(
        softmax_scale=1 / math.sqrt(head_dim),
        causal=options.get("causal", False),
        window_left=left,
        window_right=right,
        softcap=options.get("softcap"),
    )


def _entry_by_entry(q, k, v, d_out, d_lse, q_len, kv_len, *, causal=False, window_left=None,
                    window_right=None, **scale_and_softcap):
    """(out, lse, dq, dk, dv) of each entry attended alone, truncated: the dense oracle in
    the inputs' dtype, with each entry's own mask (nothing visible past its lengths)."""
    visible = np.zeros((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
    for b, (rows, keys) in enumerate(zip(np.asarray(q_len), np.asarray(kv_len))):
        visible[b, 0, :rows, :keys] = visible_mask(rows, keys, causal, window_left, window_right)

    @jax.jit
    def forward_and_vjp(q, k, v, d_out, d_lse):
        (out, lse), pullback = jax.vjp(
            lambda q, k, v: naive_attention_jax(q, k, v, visible=visible, **scale_and_softcap),
            q, k, v,
        )
        return (out, lse, *pullback((d_out, d_lse.astype(lse.dtype))))

    return forward_and_vjp(q, k, v, d_out, d_lse)


def _ragged(q, k, v, d_out, d_lse, q_len, kv_len, **options):
    """(out, lse, dq, dk, dv) of fa4_jax.attention with lengths, cotangents on out and lse."""

    def attend(q, k, v, q_len, kv_len):
        return fa4_jax.attention(q, k, v, return_lse=True, query_seq_lengths=q_len,
                                 key_value_seq_lengths=kv_len, **options)

    def forward_and_vjp(q, k, v, d_out, d_lse, q_len, kv_len):
        (out, lse), pullback = jax.vjp(lambda q, k, v: attend(q, k, v, q_len, kv_len), q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    return jax.jit(forward_and_vjp)(q, k, v, d_out, d_lse, q_len, kv_len)


# (heads_q, heads_kv, options of fa4_jax.attention)
RAGGED_CASES = {
    "causal": (2, 2, {"causal": True}),
    "window": (2, 2, {"window_size": (3, 1)}),
    "softcap_causal": (2, 2, {"softcap": 1.5, "causal": True}),
    "gqa_causal_window": (4, 1, {"causal": True, "window_size": (4, 0)}),
}


@pytest.mark.parametrize("case", RAGGED_CASES.values(), ids=RAGGED_CASES.keys())
def test_ragged_batch_equals_each_entry_truncated(next_key, case):
    heads_q, heads_kv, options = case
    inputs = _inputs(next_key, heads_q, heads_kv, jnp.bfloat16)
    q_len, kv_len = _lengths(next_key)
    reference_options = _reference_options(options, inputs[0].shape[-1])

    results = _ragged(*inputs, q_len, kv_len, **options)
    ref = _entry_by_entry(*(x.astype(jnp.float32) for x in inputs), q_len, kv_len,
                          **reference_options)
    ref_lowp = _entry_by_entry(*inputs, q_len, kv_len, **reference_options)

    factor = 3 if "softcap" in options else 2
    for name, result, want, want_lowp in zip(("out", "lse", "dq", "dk", "dv"), results, ref,
                                             ref_lowp):
        assert_close_by_rule(result, want, want_lowp, factor=factor, name=name)


def test_padding_gives_exact_zeros_and_is_never_read(next_key):
    """Padded rows: out 0, lse -inf, zero gradients; padded keys: zero dk, dv; and NaN in
    the padding changes nothing."""
    q, k, v, d_out, d_lse = _inputs(next_key, 2, 2, jnp.float32)
    q_len, kv_len = _lengths(next_key)
    q_pad = np.arange(SEQLEN_Q)[None, :] >= np.asarray(q_len)[:, None]  # [batch, seq]
    kv_pad = np.arange(SEQLEN_K)[None, :] >= np.asarray(kv_len)[:, None]

    def poisoned(x, pad):
        return jnp.where(pad[:, :, None, None], jnp.nan, x)

    clean = _ragged(q, k, v, d_out, d_lse, q_len, kv_len, causal=True)
    out, lse, dq, dk, dv = _ragged(poisoned(q, q_pad), poisoned(k, kv_pad), poisoned(v, kv_pad),
                                   d_out, d_lse, q_len, kv_len, causal=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, (out, lse, dq, dk, dv)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: the padding's contents leaked")
    assert np.all(np.asarray(out)[q_pad] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[q_pad]))
    assert np.all(np.asarray(dq)[q_pad] == 0.0)
    assert np.all(np.asarray(dk)[kv_pad] == 0.0) and np.all(np.asarray(dv)[kv_pad] == 0.0)


def test_one_length_alone_means_the_other_is_full(next_key):
    q, k, v, _, _ = _inputs(next_key, 2, 2, jnp.float32, batch=2)
    lengths = jnp.array([3, 8], jnp.int32)
    only_kv = fa4_jax.attention(q, k, v, causal=True, key_value_seq_lengths=lengths)
    both = fa4_jax.attention(q, k, v, causal=True, key_value_seq_lengths=lengths,
                             query_seq_lengths=jnp.full((2,), SEQLEN_Q, jnp.int32))
    np.testing.assert_array_equal(only_kv, both)


def test_out_of_range_lengths_are_clamped(next_key):
    q, k, v, _, _ = _inputs(next_key, 2, 2, jnp.float32, batch=2)
    attend = jax.jit(lambda q_len, kv_len: fa4_jax.attention(
        q, k, v, causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len))
    np.testing.assert_array_equal(
        attend(jnp.array([-3, 99], jnp.int32), jnp.array([99, -1], jnp.int32)),
        attend(jnp.array([0, SEQLEN_Q], jnp.int32), jnp.array([SEQLEN_K, 0], jnp.int32)),
    )


def test_new_length_values_need_no_retrace(next_key):
    q, k, v, _, _ = _inputs(next_key, 2, 2, jnp.float32, batch=2)
    traces = []

    @jax.jit
    def attend(q_len, kv_len):
        traces.append(None)
        return fa4_jax.attention(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

    first = attend(jnp.array([2, 5], jnp.int32), jnp.array([4, 4], jnp.int32))
    second = attend(jnp.array([12, 1], jnp.int32), jnp.array([1, 10], jnp.int32))
    assert len(traces) == 1
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"query_seq_lengths": np.ones((3,), np.int32)}, ValueError,
     r"query_seq_lengths must have shape \[batch\] = \(2,\), got shape \(3,\)"),
    ({"key_value_seq_lengths": np.ones((2, 1), np.int32)}, ValueError,
     r"key_value_seq_lengths must have shape \[batch\]"),
    ({"query_seq_lengths": np.ones((2,), np.float32)}, TypeError,
     r"query_seq_lengths must be an integer array"),
    ({"key_value_seq_lengths": np.ones((2,), bool)}, TypeError,
     r"key_value_seq_lengths must be an integer array"),
], ids=["q_shape", "kv_rank", "q_float", "kv_bool"])
def test_length_errors_name_the_argument(kwargs, error, message):
    q = jax.ShapeDtypeStruct((2, SEQLEN_Q, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, SEQLEN_K, 2, 16), jnp.float32)
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v: fa4_jax.attention(q, k, v, **kwargs), q, kv, kv)


def test_dense_calls_pass_empty_lengths_that_cost_no_op():
    # The kernels' length operands are built inside the op that sharding.py wraps in
    # custom_partitioning, which rejects closed-over constants (a numpy array would be one). A
    # dense call's are empty, so XLA compiles them to constants and launches nothing for them
    # (full lengths were a broadcast kernel before every call).
    jaxpr = jax.make_jaxpr(lambda: ffi.seq_used(None))()
    assert not jaxpr.consts
    dense = jax.jit(lambda: ffi.seq_used(None))
    for lengths in dense():
        assert lengths.shape == (0,) and lengths.dtype == jnp.int32
    compiled = dense.lower().compile().as_text()
    assert "broadcast(" not in compiled and "fusion(" not in compiled, compiled
    q_len, kv_len = jnp.array([1, 0, 8]), jnp.array([5, 3, 0])
    seq_used_q, seq_used_k = ffi.seq_used((q_len, kv_len))
    np.testing.assert_array_equal(seq_used_q, q_len)
    np.testing.assert_array_equal(seq_used_k, kv_len)
    assert seq_used_q.dtype == seq_used_k.dtype == jnp.int32


def test_ring_attention_rejects_lengths(next_key):
    q, k, v, _, _ = _inputs(next_key, 2, 2, jnp.float32, batch=2)
    with pytest.raises(NotImplementedError, match="ring_attention does not support "
                                                  "key_value_seq_lengths"):
        fa4_jax.ring_attention(q, k, v, mesh_axis="seq",
                               key_value_seq_lengths=jnp.array([3, 4], jnp.int32))


# Packed sequences: (query lengths, key lengths) per sequence, with an empty sequence, a
# sequence of one query row, and key-less queries.
VARLEN_Q = (5, 0, 1, 7, 3)
VARLEN_K = (6, 2, 4, 7, 0)


def _cu_seqlens(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


# The ways varlen_attention runs: a mask on queries and keys packed apart (rows that align each
# sequence's diagonal with the row's), one packing for both (segment ids, in place), no mask
# (segment ids, in place).
VARLEN_PATHS = {
    "causal_apart": ({"causal": True}, False),
    "window_softcap_apart": ({"window_size": (2, 1), "softcap": 2.0}, False),
    "causal_one_packing": ({"causal": True}, True),
    "window_softcap_one_packing": ({"window_size": (2, 1), "softcap": 2.0}, True),
    "softcap_apart": ({"softcap": 2.0}, False),
}


def _check_varlen_against_each_sequence(next_key, lengths_q, lengths_k, options, one_packing,
                                        extra_q_tokens=0):
    """varlen_attention's out, lse and gradients against the reference on each sequence alone;
    query tokens past the last sequence (extra_q_tokens) must give out 0 and lse -inf."""
    heads_q, heads_kv, head_dim = 4, 2, 16
    q = jax.random.normal(next_key(), (sum(lengths_q) + extra_q_tokens, heads_q, head_dim), jnp.float32)
    k = jax.random.normal(next_key(), (sum(lengths_k), heads_kv, head_dim), jnp.float32)
    v = jax.random.normal(next_key(), (sum(lengths_k), heads_kv, head_dim), jnp.float32)
    d_out = jax.random.normal(next_key(), q.shape, jnp.float32)
    d_lse = jax.random.normal(next_key(), (heads_q, q.shape[0]), jnp.float32)
    cu_q, cu_k = _cu_seqlens(lengths_q), _cu_seqlens(lengths_k)

    @jax.jit
    def forward_and_vjp(q, k, v, cu_q, cu_k):
        def attend(q, k, v):
            return fa4_jax.varlen_attention(q, k, v, cu_q, cu_q if one_packing else cu_k, max_seqlen_q=8,
                                            max_seqlen_k=7, return_lse=True, **options)

        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    out, lse, dq, dk, dv = forward_and_vjp(q, k, v, cu_q, cu_k)

    reference_options = _reference_options(options, head_dim)
    for s in range(len(lengths_q)):
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        keys = slice(int(cu_k[s]), int(cu_k[s + 1]))
        if lengths_k[s] == 0:
            # Its keys get no gradient, and its rows (if any) see no key.
            assert np.all(np.asarray(out[rows]) == 0) and np.all(np.isneginf(lse[:, rows]))
            continue
        if lengths_q[s] == 0:
            assert np.all(np.asarray(dk[keys]) == 0) and np.all(np.asarray(dv[keys]) == 0)
            continue
        (want_out, want_lse), pullback = jax.vjp(
            lambda q, k, v: attention_reference(q[None], k[None], v[None], **reference_options),
            q[rows], k[keys], v[keys])
        want_grads = pullback((d_out[None, rows], d_lse[None, :, rows]))
        np.testing.assert_allclose(out[rows], want_out[0], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(dq[rows], want_grads[0], atol=2e-5, rtol=2e-5)
        for name, grad, want in (("dk", dk, want_grads[1]), ("dv", dv, want_grads[2])):
            np.testing.assert_allclose(grad[keys], want, atol=2e-5, rtol=2e-5, err_msg=name)
    past = slice(int(cu_q[-1]), q.shape[0])
    assert np.all(np.asarray(out[past]) == 0) and np.all(np.isneginf(lse[:, past]))
    assert np.all(np.asarray(dq[past]) == 0)


@pytest.mark.parametrize("options, one_packing", VARLEN_PATHS.values(), ids=VARLEN_PATHS.keys())
def test_varlen_equals_each_sequence_alone(next_key, options, one_packing):
    _check_varlen_against_each_sequence(next_key, VARLEN_Q, VARLEN_Q if one_packing else VARLEN_K,
                                        options, one_packing)


@pytest.mark.parametrize("draw", range(2))
@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (3, 0)}, {"window_size": (1, 2)}],
                         ids=["causal", "window_left", "window_both"])
def test_varlen_apart_with_a_mask_on_random_packings(next_key, seed, draw, options):
    # Queries and keys packed apart under a mask, the aligned rows' case: random packings with
    # empty sequences on either side, length-1 ones, more keys than queries and fewer, and
    # query tokens past the last sequence. The packings are drawn from the test's seed, new on
    # every run (FA4_JAX_TEST_SEED replays one), rather than four fixed ones per mask.
    rng = np.random.default_rng([seed, draw])
    count = int(rng.integers(1, 12))
    lengths_q = tuple(int(x) for x in rng.integers(0, 9, count))
    lengths_k = tuple(int(x) for x in rng.integers(0, 9, count))
    _check_varlen_against_each_sequence(next_key, lengths_q, lengths_k, options, one_packing=False,
                                        extra_q_tokens=int(rng.integers(0, 3)))


def test_varlen_apart_one_sequence_spanning_all_tokens(next_key):
    _check_varlen_against_each_sequence(next_key, (13,), (9,), {"causal": True}, one_packing=False)


def test_varlen_needs_no_max_seqlen(next_key):
    # FlashAttention's bounds are checked, not used: a sequence longer than its bound is attended
    # whole on every path (before, the masked path with two packings padded to the bound).
    q = jax.random.normal(next_key(), (9, 2, 16), jnp.float32)
    cu_q, cu_k = _cu_seqlens((3, 6)), _cu_seqlens((3, 6))
    tight = fa4_jax.varlen_attention(q, q, q, cu_q, cu_k, max_seqlen_q=4, max_seqlen_k=6, causal=True)
    loose = fa4_jax.varlen_attention(q, q, q, cu_q, cu_k, max_seqlen_q=6, max_seqlen_k=6, causal=True)
    in_place = fa4_jax.varlen_attention(q, q, q, cu_q, cu_q, max_seqlen_q=4, max_seqlen_k=6, causal=True)
    assert not np.isnan(tight).any()
    np.testing.assert_array_equal(tight, loose)
    np.testing.assert_allclose(tight, in_place, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"cu_seqlens_q": np.zeros((3, 1), np.int32)}, ValueError,
     r"cu_seqlens_q must have shape \[num_sequences \+ 1\]"),
    ({"cu_seqlens_k": np.array([0, 4.0])}, TypeError, r"cu_seqlens_k must be an integer array"),
    ({"cu_seqlens_k": np.array([0, 2, 4], np.int32)}, ValueError,
     r"same number of sequences"),
    ({"max_seqlen_q": 0}, ValueError, r"max_seqlen_q must be a static Python int >= 1"),
    ({"max_seqlen_k": 4.0}, TypeError, r"max_seqlen_k must be a static Python int"),
], ids=["cu_rank", "cu_float", "cu_count", "max_zero", "max_float"])
def test_varlen_errors_name_the_argument(kwargs, error, message):
    x = jax.ShapeDtypeStruct((4, 2, 16), jnp.float32)
    arguments = dict(cu_seqlens_q=np.array([0, 4], np.int32),
                     cu_seqlens_k=np.array([0, 4], np.int32), max_seqlen_q=4, max_seqlen_k=4)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda x: fa4_jax.varlen_attention(x, x, x, **arguments), x)


def test_vmap_maps_lengths_with_the_inputs(next_key):
    q, k, v, _, _ = _inputs(next_key, 2, 2, jnp.float32, batch=4)
    q_len, kv_len = (x[:4] for x in _lengths(next_key))

    def attend(q, k, v, q_len, kv_len):
        return fa4_jax.attention(q, k, v, causal=True, query_seq_lengths=q_len,
                                 key_value_seq_lengths=kv_len)

    def pairs(x):  # [4, ...] -> [2, 2, ...]
        return x.reshape(2, 2, *x.shape[1:])

    mapped = jax.vmap(attend)(*map(pairs, (q, k, v, q_len, kv_len)))
    np.testing.assert_array_equal(mapped, pairs(attend(q, k, v, q_len, kv_len)))


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_without_keys_gives_rows_that_see_none(next_key, causal):
    q = jax.random.normal(next_key(), (5, 2, 16), jnp.float32)
    kv = jnp.zeros((0, 2, 16), jnp.float32)
    out, lse = fa4_jax.varlen_attention(q, kv, kv, _cu_seqlens((2, 3)), _cu_seqlens((0, 0)), max_seqlen_q=3,
                                        max_seqlen_k=1, causal=causal, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse)) and lse.shape == (2, 5)


def test_varlen_without_queries_gives_empty_results(next_key):
    kv = jax.random.normal(next_key(), (7, 2, 16), jnp.float32)
    out, lse = fa4_jax.varlen_attention(jnp.zeros((0, 4, 16), jnp.float32), kv, kv, _cu_seqlens((0,)),
                                        _cu_seqlens((7,)), max_seqlen_q=1, max_seqlen_k=7, causal=True,
                                        return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
