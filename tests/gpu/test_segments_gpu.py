"""GPU tier: segment ids read in the kernels (the segments variants), forward and gradients.

Random packings as MaxText and Levanter build them: documents of random lengths (empty and
one-token ones among them) packed into each row, padding ids that match nothing (-1 for
queries, -2 for keys), and also ids that do not run in one piece, which the span tables cannot
narrow. The oracle is the definition: a dense softmax with the pairs of equal ids visible (and
the causal/window rules and lengths), in fp32 and in the inputs' dtype for docs/design.md's
rule. Rows that see no key must come out exactly 0 with lse -inf; outputs are poisoned by XLA's
reuse of buffers anyway, so every one of them must have been written.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import WINDOWS_AND_SOFTCAP, mask_options, qkv, require_kernels
from tests.numerics import assert_close_by_rule, naive_attention_jax, visible_mask

pytestmark = pytest.mark.gpu

# Longer than several tiles of every kernel, a multiple of none.
SEQLEN = 1000


def _packing(rng, length, kind, sizes=(0, 1, 2, 7, 63, 64, 65, 129, 300)):
    """int32 [length] ids: "packed" documents in order then padding (-1), or "shuffled" ids."""
    if kind == "shuffled":
        return rng.integers(0, 3, length).astype(np.int32)
    ids, doc = [], 0
    while len(ids) < length:
        ids += [doc] * int(rng.choice(sizes))
        doc += 1
    ids = np.array(ids[:length], np.int32)
    ids[length - int(rng.integers(0, length // 4 + 1)):] = -1
    return ids


def _segment_ids(rng, batch, seqlen_q, seqlen_k, kind, **packing):
    q_ids = np.stack([_packing(rng, seqlen_q, kind, **packing) for _ in range(batch)])
    if seqlen_q == seqlen_k:
        kv_ids = np.where(q_ids < 0, -2, q_ids)
    else:
        kv_ids = np.stack([_packing(rng, seqlen_k, kind, **packing) for _ in range(batch)])
    return jnp.asarray(q_ids), jnp.asarray(np.where(kv_ids < 0, -2, kv_ids).astype(np.int32))


@functools.cache
def _kernel_fn(option_items, ragged):
    options = dict(option_items)

    @jax.jit
    def forward_and_vjp(q, k, v, d_out, d_lse, q_ids, kv_ids, *lengths):
        lengths = dict(zip(("query_seq_lengths", "key_value_seq_lengths"), lengths))

        def attend(q, k, v):
            return fa4_jax.attention(q, k, v, return_lse=True, implementation="cute",
                                     query_segment_ids=q_ids, kv_segment_ids=kv_ids, **lengths, **options)

        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    return forward_and_vjp


@functools.cache
def _oracle_fn(softcap, softmax_scale):
    @jax.jit
    def forward_and_vjp(q, k, v, d_out, d_lse, visible):
        (out, lse), pullback = jax.vjp(
            lambda q, k, v: naive_attention_jax(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                                                visible=visible), q, k, v)
        return (out, lse, *pullback((d_out, d_lse.astype(lse.dtype))))

    return forward_and_vjp


def _visible(q_ids, kv_ids, q_len, kv_len, **options):
    """Bool [b, 1, sq, sk]: equal ids, the mask of `options` on each entry's lengths."""
    batch, seqlen_q = q_ids.shape
    seqlen_k = kv_ids.shape[1]
    visible = np.zeros((batch, 1, seqlen_q, seqlen_k), bool)
    for b in range(batch):
        rows, keys = int(q_len[b]), int(kv_len[b])
        visible[b, 0, :rows, :keys] = visible_mask(rows, keys, **mask_options(**options))
    return visible & (np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :])


def _check(next_key, rng, heads_q=2, heads_kv=1, head_dim=128, dtype=jnp.bfloat16, head_dim_v=None,
           batch=2, seqlen_q=SEQLEN, seqlen_k=SEQLEN, kind="packed", ragged=False, packing=None, ids=None,
           **options):
    head_dim_v = head_dim_v or head_dim
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, head_dim_v)
    d_out = jax.random.normal(next_key(), (batch, seqlen_q, heads_q, head_dim_v), dtype)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, seqlen_q), jnp.float32)
    q_ids, kv_ids = ids or _segment_ids(rng, batch, seqlen_q, seqlen_k, kind, **(packing or {}))
    q_len = np.full(batch, seqlen_q, np.int32)
    kv_len = np.full(batch, seqlen_k, np.int32)
    lengths = ()
    if ragged:
        q_len = rng.integers(0, seqlen_q + 1, batch).astype(np.int32)
        kv_len = rng.integers(0, seqlen_k + 1, batch).astype(np.int32)
        lengths = (jnp.asarray(q_len), jnp.asarray(kv_len))
    require_kernels(q, k, v, **options)
    got = _kernel_fn(tuple(sorted(options.items())), ragged)(q, k, v, d_out, d_lse, q_ids, kv_ids, *lengths)
    visible = jnp.asarray(_visible(q_ids, kv_ids, q_len, kv_len, **options))
    oracle = _oracle_fn(options.get("softcap"), 1 / math.sqrt(head_dim))
    ref = oracle(*(x.astype(jnp.float32) for x in (q, k, v, d_out)), d_lse, visible)
    ref_lowp = oracle(q, k, v, d_out, d_lse, visible)
    factor = 3 if options.get("softcap") else 2
    for name, result, want, want_lowp in zip(("out", "lse", "dq", "dk", "dv"), got, ref, ref_lowp):
        assert_close_by_rule(result, want, want_lowp, factor=factor, name=name)
    # Rows that see no key (padding ids, rows past the lengths): exactly 0 and -inf.
    empty = ~np.asarray(visible).any(axis=-1)[:, 0]
    out, lse, dq = (np.asarray(x, np.float32) for x in got[:3])
    assert np.all(out[empty] == 0.0) and np.all(dq[empty] == 0.0)
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty]))
    return (q, k, v, d_out, d_lse, q_ids, kv_ids, *lengths), got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_head_dims(next_key, seed, head_dim, head_dim_v, causal):
    _check(next_key, np.random.default_rng(seed), head_dim=head_dim, head_dim_v=head_dim_v, causal=causal)


@pytest.mark.parametrize("options", WINDOWS_AND_SOFTCAP.values(), ids=WINDOWS_AND_SOFTCAP.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_windows_and_softcap(next_key, seed, head_dim, options):
    _check(next_key, np.random.default_rng(seed), head_dim=head_dim, **options)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_and_mqa(next_key, seed, heads_q, heads_kv, dtype):
    _check(next_key, np.random.default_rng(seed), heads_q, heads_kv, dtype=dtype, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_with_ragged_lengths(next_key, seed, head_dim, causal):
    _check(next_key, np.random.default_rng(seed), head_dim=head_dim, ragged=True, batch=4, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_ids_that_are_not_one_run_each(next_key, seed, causal):
    # The span tables cannot narrow the walk: every block compares ids.
    _check(next_key, np.random.default_rng(seed), kind="shuffled", causal=causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 1000), (1000, 389)])
def test_queries_and_keys_packed_apart(next_key, seed, seqlen_q, seqlen_k):
    # Cross attention: each side its own packing, so ids meet in places, or not at all.
    _check(next_key, np.random.default_rng(seed), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
           packing=dict(sizes=(1, 30, 200)))


def test_thousands_of_tiny_documents(next_key, seed):
    _check(next_key, np.random.default_rng(seed), seqlen_q=4096, seqlen_k=4096, causal=True, batch=1,
           packing=dict(sizes=(1, 2, 3)))


def test_one_long_document_among_short_ones(next_key, seed):
    rng = np.random.default_rng(seed)
    _check(next_key, rng, seqlen_q=8192, seqlen_k=8192, causal=True, batch=1, head_dim=64,
           packing=dict(sizes=(5000, 17, 33)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_mode_is_bitwise_repeatable(next_key, seed, head_dim, causal):
    arrays, first = _check(next_key, np.random.default_rng(seed), head_dim=head_dim, causal=causal,
                           deterministic=True)
    fn = _kernel_fn(tuple(sorted(dict(causal=causal, deterministic=True).items())), False)
    for _ in range(3):
        again = fn(*arrays)
        for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), first, again):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_mode_where_the_two_sides_hulls_disagree(next_key, seed, head_dim, causal, ragged):
    # Queries hold the even ids 0-6 in runs of 32, over and over; keys every id in runs of 128:
    # a query tile's key hull holds key blocks of odd ids that none of its rows sees, and its
    # deterministic turns count them, so their walk must visit it anyway (else a later turn
    # waits forever: a hang, not a wrong answer). Against the oracle, then repeated bitwise.
    rng = np.random.default_rng(seed)
    ids = (jnp.asarray(np.tile(2 * ((np.arange(SEQLEN) // 32) % 4), (2, 1)), jnp.int32),
           jnp.asarray(np.tile(np.arange(SEQLEN) // 128, (2, 1)), jnp.int32))
    arrays, first = _check(next_key, rng, head_dim=head_dim, causal=causal, ragged=ragged, ids=ids,
                           deterministic=True)
    fn = _kernel_fn(tuple(sorted(dict(causal=causal, deterministic=True).items())), ragged)
    for _ in range(2):
        for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), first, fn(*arrays)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_one_segment_gives_the_dense_calls_bits(next_key):
    # All ids equal: the span tables say every block is full, so the segments kernels run the
    # dense kernels' arithmetic on the same blocks (deterministic, so dQ's order is fixed too).
    # d64 at 2000 keys: the dense call runs the default variant, no routed tuning.
    q, k, v = (jax.random.normal(next_key(), (2, 2000, 4, 64), jnp.bfloat16) for _ in range(3))
    ids = jnp.zeros((2, 2000), jnp.int32)
    require_kernels(q, k, v, causal=True)

    def loss(q, k, v, **segments):
        out = fa4_jax.attention(q, k, v, causal=True, deterministic=True, implementation="cute", **segments)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    dense = grad(q, k, v)
    packed = grad(q, k, v, query_segment_ids=ids, kv_segment_ids=ids)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(packed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
