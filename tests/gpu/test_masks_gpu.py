"""GPU tier: jax's boolean `mask=` read in the kernels (the mask_array variants), forward and
gradients, against `jax.nn.dot_product_attention`.

Masks of every kind jax's and Flax's users pass: a causal array, key and query padding, the
block diagonal of packed documents, a random mask (every tile partial, so the walk skips
nothing and every score reads its bit), masks of rank 2 and 3 that jax broadcasts, rows the
mask hides entirely (jax gives them the mean of the values), masks combined with is_causal, a
local window and per-entry lengths, and masks that differ between heads. The oracle is jax's XLA
path in f32 at full matmul precision, the same path in bf16 the low-precision reference
(docs/design.md's rule).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule

pytestmark = pytest.mark.gpu


def _documents(rng, length, sizes=(1, 17, 64, 130, 300)):
    ids, doc = [], 0
    while len(ids) < length:
        ids += [doc] * int(rng.choice(sizes))
        doc += 1
    return np.array(ids[:length])


def _mask(rng, kind, batch, seqlen_q, seqlen_k):
    """A bool mask of `kind`, in the shape jax's callers give it (broadcast to [B, N, T, S])."""
    rows, keys = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    if kind == "causal_array":
        return (keys <= rows)[None, None]
    if kind == "key_padding":
        valid = rng.integers(1, seqlen_k + 1, batch)
        return (np.arange(seqlen_k)[None, :] < valid[:, None])[:, None, None, :]
    if kind == "query_and_key_padding":
        q_valid = rng.integers(0, seqlen_q + 1, batch)[:, None, None, None]
        k_valid = rng.integers(1, seqlen_k + 1, batch)[:, None, None, None]
        return (rows[None, None] < q_valid) & (keys[None, None] < k_valid)
    if kind == "documents":
        q_docs = np.stack([_documents(rng, seqlen_q) for _ in range(batch)])
        k_docs = q_docs if seqlen_q == seqlen_k else np.stack([_documents(rng, seqlen_k) for _ in range(batch)])
        return (q_docs[:, None, :, None] == k_docs[:, None, None, :]) & (keys <= rows)
    if kind == "random":
        return rng.random((batch, 1, seqlen_q, seqlen_k)) < 0.5
    if kind == "rank2_band":
        return np.abs(rows - keys) < 100
    if kind == "rank3_hidden_rows":
        mask = rng.random((1, seqlen_q, seqlen_k)) < 0.9
        mask[:, rng.integers(0, seqlen_q, 20)] = False
        return mask
    raise ValueError(kind)


KINDS = ("causal_array", "key_padding", "query_and_key_padding", "documents", "random",
         "rank2_band", "rank3_hidden_rows")


def _out_and_grads(attention, q, k, v, d_out):
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(lambda q, k, v: (attention(q, k, v), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)


def _check(next_key, mask, batch=2, seqlen_q=700, seqlen_k=700, heads_q=4, heads_kv=2, head_dim=128,
           dtype=jnp.bfloat16, dk_factor=2, **options):
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
    d_out = jax.random.normal(next_key(), q.shape, dtype)
    mask = jnp.asarray(mask)
    # implementation="cute": the kernels must take the call, or it raises.
    got = _out_and_grads(functools.partial(fa4_jax.dot_product_attention, mask=mask, implementation="cute",
                                           **options), q, k, v, d_out)
    xla = functools.partial(jax.nn.dot_product_attention, mask=mask, implementation="xla", **options)
    with jax.default_matmul_precision("highest"):
        ref = _out_and_grads(xla, *(x.astype(jnp.float32) for x in (q, k, v)), d_out)
    lowp = _out_and_grads(xla, q, k, v, d_out)
    # Rows the mask hides entirely take the mean of the values: their share of dv is added to
    # the kernel's dv in the inputs' dtype, one rounding more than jax makes.
    for name, result, want, want_lowp in zip(("out", "dq", "dk", "dv"), got, ref, lowp):
        factor = {"dv": 3, "dk": dk_factor}.get(name, 2)
        assert_close_by_rule(result, want, want_lowp, name=name, factor=factor)


@pytest.mark.parametrize("kind", KINDS)
def test_masks_match_jax(next_key, seed, kind):
    rng = np.random.default_rng(seed)
    _check(next_key, _mask(rng, kind, 2, 700, 700))


@pytest.mark.parametrize("kind", ["key_padding", "documents", "random"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 1000), (1000, 389)])
def test_cross_attention_masks(next_key, seed, kind, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seed)
    _check(next_key, _mask(rng, kind, 2, seqlen_q, seqlen_k), seqlen_q=seqlen_q, seqlen_k=seqlen_k)


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
def test_head_dims(next_key, seed, head_dim):
    rng = np.random.default_rng(seed)
    _check(next_key, _mask(rng, "documents", 2, 700, 700), head_dim=head_dim)


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(local_window_size=(50, 20)),
                                     dict(is_causal=True, local_window_size=(64, 0))],
                         ids=["is_causal", "window", "causal_window"])
@pytest.mark.parametrize("kind", ["key_padding", "random"])
def test_with_jax_causal_and_window(next_key, seed, kind, options):
    rng = np.random.default_rng(seed)
    _check(next_key, _mask(rng, kind, 2, 500, 640), seqlen_q=500, seqlen_k=640, **options)


def test_with_lengths(next_key, seed):
    rng = np.random.default_rng(seed)
    lengths = dict(query_seq_lengths=jnp.asarray([0, 700, 1, 350], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([700, 0, 260, 699], jnp.int32))
    _check(next_key, _mask(rng, "documents", 4, 700, 700), batch=4, **lengths)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 1), (6, 6)])
def test_gqa_mqa_and_fp16(next_key, seed, heads_q, heads_kv):
    rng = np.random.default_rng(seed)
    _check(next_key, _mask(rng, "documents", 2, 700, 700), heads_q=heads_q, heads_kv=heads_kv,
           dtype=jnp.float16)


def _per_head_mask(rng, heads, batch, seqlen_q, seqlen_k):
    """A mask that differs between heads: documents, a random mask, key padding and the causal
    array in turn, each head with rows it hides entirely."""
    kinds = ("documents", "random", "key_padding", "causal_array")
    heads_masks = [np.broadcast_to(_mask(rng, kinds[h % len(kinds)], batch, seqlen_q, seqlen_k),
                                   (batch, 1, seqlen_q, seqlen_k)).copy() for h in range(heads)]
    mask = np.concatenate(heads_masks, axis=1)
    mask[:, :, rng.integers(0, seqlen_q, 10)] = False
    return mask


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 2), (6, 6)])
@pytest.mark.parametrize("options", [dict(), dict(is_causal=True)], ids=["mask", "mask_and_is_causal"])
def test_per_head_masks(next_key, seed, heads_q, heads_kv, options):
    # Each (batch, head) runs as an entry of its own on the mask_array kernels (kv heads
    # repeated for GQA): values and gradients, dk and dv summed back over a kv head's group. A
    # kv head's dk is then the sum of its group's dk in the inputs' dtype, one rounding more
    # than jax makes (seeds put it 2-4% past factor 2's bound), hence factor 3 there.
    rng = np.random.default_rng(seed)
    mask = _per_head_mask(rng, heads_q, 2, 500, 640)
    _check(next_key, mask, seqlen_q=500, seqlen_k=640, heads_q=heads_q, heads_kv=heads_kv,
           dk_factor=3 if heads_q != heads_kv else 2, **options)


def test_per_head_masks_with_lengths(next_key, seed):
    # Two heads per kv head: dk at factor 3, as in test_per_head_masks.
    rng = np.random.default_rng(seed)
    lengths = dict(query_seq_lengths=jnp.asarray([0, 700, 1, 350], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([700, 0, 260, 699], jnp.int32))
    _check(next_key, _per_head_mask(rng, 4, 4, 700, 700), batch=4, dk_factor=3, **lengths)


# Keys per case stay below 2**INDEX_BITS: a key's index in INDEX_BITS columns of its value.
INDEX_BITS = 10


def _leak_case(rng, layout, batch, seqlen_q, seqlen_k):
    """(the call's mask or segment-id arguments, bool [batch, seqlen_q, seqlen_k] visible pairs),
    every tile partial: a random mask, or random ids of three segments that do not run."""
    if layout == "mask":
        mask = _mask(rng, "random", batch, seqlen_q, seqlen_k)
        return dict(mask=jnp.asarray(mask)), mask[:, 0]
    q_ids, kv_ids = rng.integers(0, 3, (batch, seqlen_q)), rng.integers(0, 3, (batch, seqlen_k))
    arrays = dict(query_segment_ids=jnp.asarray(q_ids, jnp.int32), kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    return arrays, q_ids[:, :, None] == kv_ids[:, None, :]


@pytest.mark.parametrize("layout", ["mask", "segment_ids"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 160, 192, 256])
def test_hidden_keys_leak_nothing(seed, layout, head_dim):
    # Exact, where the numerics rule is not (one key too many in a row of 150 moves out by less
    # than a bf16 rounding): with q = 0 every visible key weighs the same, so lse = log(count of
    # the row's visible keys), out[..., j] = the share of them with bit j % 10 of their index set,
    # and dV[k] = the sum of 1 / count over the rows that see key k. A key leaked or lost moves
    # lse by log(1 + 1/700) or more, out and dV by 1 / count: 4 fp16 spacings or more.
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, heads = 2, 333, 700, 2
    head_dim_v = 128 if head_dim == 192 else head_dim
    arrays, visible = _leak_case(rng, layout, batch, seqlen_q, seqlen_k)
    index_bits = (np.arange(seqlen_k)[:, None] >> (np.arange(head_dim_v) % INDEX_BITS)[None, :]) & 1
    q = jnp.zeros((batch, seqlen_q, heads, head_dim), jnp.float16)
    k = jax.random.normal(jax.random.key(seed), (batch, seqlen_k, heads, head_dim), jnp.float16)
    v = jnp.asarray(np.broadcast_to(index_bits[None, :, None, :], (batch, seqlen_k, heads, head_dim_v)),
                    jnp.float16)
    attend = functools.partial(fa4_jax.attention, q, k, implementation="cute", **arrays)
    out, lse = jax.jit(lambda v: attend(v, return_lse=True))(v)
    dv = jax.jit(jax.grad(lambda v: jnp.sum(attend(v).astype(jnp.float32))))(v)

    count = visible.sum(axis=-1)  # [batch, seqlen_q], never 0 here
    want_lse = np.log(count)[:, None, :]
    want_out = (visible.astype(np.float64) @ index_bits / count[..., None])[:, :, None, :]
    want_dv = (visible / count[..., None]).sum(axis=1)[:, :, None, None]
    np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(want_lse, lse.shape), rtol=0, atol=1e-5)
    out = np.asarray(out, np.float64)
    spacing = np.spacing(np.abs(want_out).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(out - want_out) <= spacing), np.abs(out - want_out).max()
    np.testing.assert_allclose(np.asarray(dv, np.float64), np.broadcast_to(want_dv, dv.shape), rtol=1e-3, atol=0)
