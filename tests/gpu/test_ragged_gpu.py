"""GPU tier: ragged batches (query_seq_lengths / key_value_seq_lengths) through the kernels.

The kernels read each entry's valid lengths (seq_used_q / seq_used_k operands) and align the
masks to them; the oracle is the definition, as in tests/test_ragged.py: a dense softmax with each
entry's own mask (nothing visible past its lengths), in fp32 and in the inputs' dtype for
docs/design.md's rule. Every test first confirms that the forward and backward kernels serve the call
(skipping with the library's reason otherwise). Oracle and kernel run under one cached jax.jit
per option set, so each test costs a compile of each once.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import WINDOWS_AND_SOFTCAP, mask_options, require_kernels
from tests.numerics import assert_close_by_rule, naive_attention_jax, visible_mask

pytestmark = pytest.mark.gpu

# Buffers longer than one tile in both modes and not multiples of any tile (128, 192 query rows;
# 64, 96, 128 keys); lengths per entry: full, empty on either side, a single row and key, a tile
# boundary plus and minus one, offsets of both signs.
SEQLEN_Q, SEQLEN_K = 300, 389
LENGTHS = ((300, 389), (0, 57), (1, 1), (173, 0), (129, 127), (257, 388), (63, 200), (300, 65))


def _lengths(next_key, count=len(LENGTHS)):
    """(q_len, kv_len) int32 [count]: LENGTHS shuffled, so entries move between batch slots."""
    order = np.asarray(jax.random.permutation(next_key(), len(LENGTHS)))[:count]
    q_len, kv_len = (np.asarray(x, np.int32)[order] for x in zip(*LENGTHS))
    return jnp.asarray(q_len), jnp.asarray(kv_len)


def _inputs(next_key, batch, heads_q, heads_kv, head_dim, dtype, head_dim_v=None):
    """q, k, v and the cotangents of out and lse."""
    head_dim_v = head_dim_v or head_dim
    q = jax.random.normal(next_key(), (batch, SEQLEN_Q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, SEQLEN_K, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, SEQLEN_K, heads_kv, head_dim_v), dtype)
    d_out = jax.random.normal(next_key(), (batch, SEQLEN_Q, heads_q, head_dim_v), dtype)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, SEQLEN_Q), jnp.float32)
    return q, k, v, d_out, d_lse


def _kernel(q, k, v, d_out, d_lse, q_len, kv_len, **options):
    """(out, lse, dq, dk, dv) of the kernels; q_len / kv_len None for a dense call."""
    ragged = q_len is not None
    fn = _kernel_fn(ragged, tuple(sorted(options.items())))
    return fn(q, k, v, d_out, d_lse, *((q_len, kv_len) if ragged else ()))


@functools.cache
def _kernel_fn(ragged, option_items):
    options = dict(option_items)

    def forward_and_vjp(q, k, v, d_out, d_lse, *lengths):
        lengths = dict(zip(("query_seq_lengths", "key_value_seq_lengths"), lengths))

        def attend(q, k, v):
            return fa4_jax.attention(q, k, v, return_lse=True, implementation="cute",
                                     **lengths, **options)

        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    return jax.jit(forward_and_vjp)


def _oracle(q, k, v, d_out, d_lse, q_len, kv_len, **options):
    """(out, lse, dq, dk, dv) of each entry attended alone, truncated to its lengths."""
    mask = mask_options(**options)
    visible = np.zeros((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
    for b, (rows, keys) in enumerate(zip(np.asarray(q_len), np.asarray(kv_len))):
        visible[b, 0, :rows, :keys] = visible_mask(int(rows), int(keys), **mask)
    return _oracle_fn(options.get("softcap"), 1 / math.sqrt(q.shape[-1]))(
        q, k, v, d_out, d_lse, jnp.asarray(visible))


@functools.cache
def _oracle_fn(softcap, softmax_scale):
    @jax.jit
    def forward_and_vjp(q, k, v, d_out, d_lse, visible):
        (out, lse), pullback = jax.vjp(
            lambda q, k, v: naive_attention_jax(q, k, v, softmax_scale=softmax_scale,
                                                softcap=softcap, visible=visible),
            q, k, v)
        return (out, lse, *pullback((d_out, d_lse.astype(lse.dtype))))

    return forward_and_vjp


def _padding(q_len, kv_len):
    """Bool [batch, SEQLEN_Q] of padded query rows, [batch, SEQLEN_K] of padded keys."""
    q_pad = np.arange(SEQLEN_Q)[None, :] >= np.asarray(q_len)[:, None]
    kv_pad = np.arange(SEQLEN_K)[None, :] >= np.asarray(kv_len)[:, None]
    return q_pad, kv_pad


def _check(next_key, heads_q, heads_kv, head_dim, dtype=jnp.bfloat16, head_dim_v=None,
           batch=len(LENGTHS), **options):
    q, k, v, d_out, d_lse = _inputs(next_key, batch, heads_q, heads_kv, head_dim, dtype,
                                    head_dim_v)
    q_len, kv_len = _lengths(next_key, batch)
    require_kernels(q, k, v, **options)
    got = _kernel(q, k, v, d_out, d_lse, q_len, kv_len, **options)
    f32 = (x.astype(jnp.float32) for x in (q, k, v, d_out))
    ref = _oracle(*f32, d_lse, q_len, kv_len, **options)
    ref_lowp = _oracle(q, k, v, d_out, d_lse, q_len, kv_len, **options)
    factor = 3 if options.get("softcap") else 2
    for name, result, want, want_lowp in zip(("out", "lse", "dq", "dk", "dv"), got, ref,
                                             ref_lowp):
        assert_close_by_rule(result, want, want_lowp, factor=factor, name=name)
    # The padding's results are exact: out, dq 0 and lse -inf on padded rows; dk, dv 0 on
    # padded keys (XLA does not zero results: every row must have been written).
    out, lse, dq, dk, dv = (np.asarray(x, np.float32) for x in got)
    q_pad, kv_pad = _padding(q_len, kv_len)
    assert np.all(out[q_pad] == 0.0) and np.all(dq[q_pad] == 0.0)
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[q_pad]))
    assert np.all(dk[kv_pad] == 0.0) and np.all(dv[kv_pad] == 0.0)
    return q, k, v, d_out, d_lse, q_len, kv_len, got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (96, 96), (128, 128), (192, 128),
                                                 (256, 256)])
def test_head_dims(next_key, head_dim, head_dim_v, causal):
    _check(next_key, 2, 1, head_dim, head_dim_v=head_dim_v, causal=causal)


@pytest.mark.parametrize("options", WINDOWS_AND_SOFTCAP.values(), ids=WINDOWS_AND_SOFTCAP.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_windows_and_softcap(next_key, head_dim, options):
    _check(next_key, 2, 2, head_dim, **options)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_and_mqa(next_key, heads_q, heads_kv, dtype):
    _check(next_key, heads_q, heads_kv, 128, dtype, batch=4, causal=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_the_padding_reaches_no_output(next_key, causal, head_dim):
    """Poisoned padding gives the clean call's bits, with nothing zeroed before the kernels: the
    forward masks the padding keys, zeroes their V rows in shared memory and replaces the rows
    past an entry's queries; the backward zeroes the padding rows of Q, dO, K and V in shared
    memory as they land.

    Deterministic mode: the default mode's dQ reduce-adds land in any order, so two clean
    calls can differ in the last bit too.
    """
    q, k, v, d_out, d_lse, q_len, kv_len, clean = _check(next_key, 2, 2, head_dim, causal=causal,
                                                         deterministic=True)
    q_pad, kv_pad = _padding(q_len, kv_len)

    def poisoned(x, pad, value):
        return jnp.where(pad[:, :, None, None], jnp.asarray(value, x.dtype), x)

    dirty = _kernel(poisoned(q, q_pad, jnp.nan), poisoned(k, kv_pad, jnp.inf),
                    poisoned(v, kv_pad, jnp.nan), poisoned(d_out, q_pad, jnp.nan), d_lse, q_len,
                    kv_len, causal=causal, deterministic=True)
    for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), clean, dirty):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                      err_msg=f"{name}: the padding's contents leaked")


@pytest.mark.parametrize("causal", [False, True])
def test_full_lengths_give_the_dense_calls_bits(next_key, causal):
    """A ragged call whose lengths are all full runs the same kernels on the same values
    (deterministic mode, so that dQ's order of additions is fixed too)."""
    q, k, v, d_out, d_lse = _inputs(next_key, 2, 4, 2, 128, jnp.bfloat16)
    q_len = jnp.full((2,), SEQLEN_Q, jnp.int32)
    kv_len = jnp.full((2,), SEQLEN_K, jnp.int32)
    require_kernels(q, k, v, causal=causal)
    ragged = _kernel(q, k, v, d_out, d_lse, q_len, kv_len, causal=causal, deterministic=True)
    dense = _kernel(q, k, v, d_out, d_lse, None, None, causal=causal, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ragged, dense):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_is_bitwise_repeatable(next_key, causal):
    q, k, v, d_out, d_lse, q_len, kv_len, first = _check(
        next_key, 4, 2, 128, causal=causal, deterministic=True)
    first = [np.asarray(x) for x in first]
    for _ in range(4):
        again = _kernel(q, k, v, d_out, d_lse, q_len, kv_len, causal=causal, deterministic=True)
        for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), first, again):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


def test_all_entries_empty(next_key):
    q, k, v, d_out, d_lse = _inputs(next_key, 2, 2, 2, 64, jnp.bfloat16)
    zeros = jnp.zeros((2,), jnp.int32)
    require_kernels(q, k, v, causal=True)
    out, lse, dq, dk, dv = (np.asarray(x, np.float32)
                            for x in _kernel(q, k, v, d_out, d_lse, zeros, zeros, causal=True))
    assert np.all(out == 0.0) and np.all(np.isneginf(lse))
    assert np.all(dq == 0.0) and np.all(dk == 0.0) and np.all(dv == 0.0)


VARLEN_LENGTHS = (0, 1, 130, 77, 300)


@pytest.mark.parametrize("one_packing, key_lengths, options", [
    (True, VARLEN_LENGTHS, {"causal": True}),
    (False, VARLEN_LENGTHS, {"causal": True}),
    # Keys packed apart with other lengths: empty and single-key sequences, more keys than
    # queries and fewer, under a causal mask and a window.
    (False, (5, 0, 200, 64, 389), {"causal": True}),
    (False, (5, 0, 200, 64, 389), {"window_size": (50, 7)}),
], ids=["in_place", "apart", "apart_unequal", "apart_unequal_window"])
def test_varlen_attention_runs_on_the_kernels(next_key, one_packing, key_lengths, options):
    """Packed sequences (fa4_jax.varlen_attention): segment ids in place when queries and keys
    share one cu_seqlens array, else on rows that align each sequence's diagonal (whose layout
    the CPU tier checks against each sequence alone); kernel = reference."""
    def cu(lengths):
        return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)

    cu_seqlens = cu(VARLEN_LENGTHS)
    cu_seqlens_k = cu_seqlens if one_packing else cu(key_lengths)
    q = jax.random.normal(next_key(), (sum(VARLEN_LENGTHS), 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(next_key(), (sum(key_lengths), 4, 64), jnp.bfloat16) for _ in range(2))
    probe = q[None, :300]
    require_kernels(probe, probe, probe, **options)

    def run(implementation, x):
        return jax.jit(lambda q, k, v: fa4_jax.varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_q=300, max_seqlen_k=389,
            implementation=implementation, **options))(*x)

    got = run("cute", (q, k, v))
    ref = run("reference", tuple(x.astype(jnp.float32) for x in (q, k, v)))
    ref_lowp = run("reference", (q, k, v))
    assert_close_by_rule(got, ref, ref_lowp)
