"""CPU tier: a boolean mask as the kernels read it (fa4_jax.runtime.mask_bits): its bits, its span
tables against a brute-force walk of the mask, the causal and window rules folded in against the
reference's own rule, and the routing of mask calls (masks, per-head ones too, to the mask_array
kernels, biases to the reference)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.runtime import mask_bits
from fa4_jax.core.params import AttentionParams
from fa4_jax.fallbacks.reference import attention_reference
from fa4_jax.abi.segment_layout import NO_SPAN, SPAN_CHUNK
from fa4_jax.core.visibility import Visibility
from fa4_jax.ops.vjp import attention_op
from fa4_jax.runtime.operands import kernel_operands
from tests.h200_menu import use_h200_menu


def _random_mask(rng, batch, seqlen_q, seqlen_k, density):
    mask = rng.random((batch, seqlen_q, seqlen_k)) < density
    mask[:, rng.integers(0, seqlen_q, 3)] = False  # rows that see nothing
    mask[:, :, rng.integers(0, seqlen_k, 3)] = False  # keys no row sees
    return mask


def _brute_force_table(seen, count):
    """The span table of positions (rows of `seen`) over partners (its columns), walked: the
    hull of what any counted position sees, and what every one sees when that is one run."""
    entries = []
    for start in range(0, seen.shape[0], SPAN_CHUNK):
        counted = range(start, min(start + SPAN_CHUNK, seen.shape[0], count))
        if not counted:
            entries.append((NO_SPAN, 0, 0, NO_SPAN))
            continue
        any_seen = np.flatnonzero(seen[list(counted)].any(axis=0))
        every_seen = np.flatnonzero(seen[list(counted)].all(axis=0))
        lo, hi = (any_seen[0], any_seen[-1] + 1) if any_seen.size else (NO_SPAN, 0)
        one_run = every_seen.size and every_seen[-1] - every_seen[0] + 1 == every_seen.size
        full_lo, full_hi = (every_seen[0], every_seen[-1] + 1) if one_run else (NO_SPAN, 0)
        entries.append((lo, hi, full_lo, full_hi))
    return np.array(entries)


def _blocks(table, block, tile, other_tile):
    """(visited, full) sets of blocks of other_tile that block `block` of `tile` positions walks,
    reducing the table's entries as the kernels do (kernels/common/segments.py)."""
    entries = table[block * tile // SPAN_CHUNK:(block + 1) * tile // SPAN_CHUNK]
    lo, hi = entries[:, 0].min(), entries[:, 1].max()
    full_lo, full_hi = entries[:, 2].max(), entries[:, 3].min()
    visited = set(range(lo // other_tile, -(-hi // other_tile)))
    full = set(range(-(-full_lo // other_tile), full_hi // other_tile))
    return visited, full


def _params(causal=False, window=(None, None), top_left=False):
    return AttentionParams(softmax_scale=0.3, causal=causal, window_left=window[0],
                           window_right=window[1], softcap=None, top_left=top_left, deterministic=False)


@pytest.mark.parametrize("seqlen_k", [1, 31, 32, 33, 97, 200])
def test_bits_round_trip(seed, seqlen_k):
    mask = _random_mask(np.random.default_rng(seed), 2, 70, seqlen_k, 0.5)
    bits = mask_bits.pack(jnp.asarray(mask))
    assert bits.shape == (2, 70, -(-seqlen_k // 32)) and bits.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(mask_bits.unpack(bits, seqlen_k)), mask)
    # Bit k % 32 of word k // 32, as the kernels read it.
    words = np.asarray(bits).view(np.uint32)
    b, q, k = 1, 11, seqlen_k - 1
    assert bool((words[b, q, k // 32] >> (k % 32)) & 1) == mask[b, q, k]


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("rules", [dict(), dict(causal=True), dict(window=(40, 7)),
                                   dict(causal=True, top_left=True)], ids=["none", "causal", "window", "top_left"])
def test_span_tables_are_the_masks(seed, density, rules):
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k = 3, 150, 333
    mask = _random_mask(rng, batch, seqlen_q, seqlen_k, density)
    lengths = (jnp.asarray([150, 77, 0], jnp.int32), jnp.asarray([333, 300, 5], jnp.int32))
    params = _params(**rules)
    q_ids, kv_ids, row_spans, key_spans, bits = mask_bits.operands(jnp.asarray(mask), params, lengths,
                                                                   seqlen_q, seqlen_k)
    seen = np.asarray(mask_bits.visible(jnp.asarray(mask), params, lengths, seqlen_q, seqlen_k))
    np.testing.assert_array_equal(np.asarray(mask_bits.unpack(bits, seqlen_k)), seen)
    assert not np.asarray(q_ids).any() and not np.asarray(kv_ids).any()
    for b in range(batch):
        q_len, kv_len = (int(x[b]) for x in lengths)
        np.testing.assert_array_equal(np.asarray(row_spans[b]), _brute_force_table(seen[b], q_len))
        # Key spans come in whole 64-row chunks: the same query tiles visited as the exact
        # table's, and at least its full tiles, every one of them seen whole.
        exact = _brute_force_table(seen[b].T, kv_len)
        for key_tile, query_tile in itertools.product((64, 128), (64, 128)):
            for key_block in range(-(-kv_len // key_tile)):  # the kernels visit no block past kv_len
                got = _blocks(np.asarray(key_spans[b]), key_block, key_tile, query_tile)
                want = _blocks(exact, key_block, key_tile, query_tile)
                assert got[0] == want[0], (key_block, key_tile, query_tile)
                assert want[1] <= got[1], (key_block, key_tile, query_tile)
                keys = slice(key_block * key_tile, min((key_block + 1) * key_tile, kv_len))
                for query_block in got[1]:
                    rows = slice(query_block * query_tile, (query_block + 1) * query_tile)
                    assert rows.stop <= seqlen_q and seen[b, rows, keys].all(), (key_block, query_block)


@pytest.mark.parametrize("mask_batch", [1, 3])
@pytest.mark.parametrize("rules", [dict(), dict(causal=True), dict(window=(40, 7))], ids=["none", "causal", "window"])
def test_full_lengths_fold_a_shared_mask_once(seed, mask_batch, rules):
    # Without lengths a batch-shared mask is folded once and broadcast: the same operands as the
    # mask broadcast first and folded with every entry's full lengths.
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k = 3, 150, 333
    mask = jnp.asarray(_random_mask(rng, mask_batch, seqlen_q, seqlen_k, 0.6))
    params = _params(**rules)
    full = tuple(jnp.full((batch,), n, jnp.int32) for n in (seqlen_q, seqlen_k))
    want = mask_bits.operands(jnp.broadcast_to(mask, (batch, seqlen_q, seqlen_k)), params, full, seqlen_q,
                              seqlen_k)
    got = mask_bits.operands(mask, params, None, seqlen_q, seqlen_k, batch)
    for name, a, b in zip(("q_ids", "kv_ids", "row_spans", "key_spans", "bits"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("rules", [dict(causal=True), dict(window=(30, 0)), dict(window=(None, 12)),
                                   dict(causal=True, top_left=True)], ids=["causal", "left", "right", "top_left"])
def test_the_folded_rules_are_the_references(seed, rules):
    # The kernels' call: the rules and lengths folded into the bits, params without them; run
    # here on the reference (which unpacks the bits), against the reference with the rules.
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, heads = 2, 90, 130, 2
    q, k, v = (jnp.asarray(rng.standard_normal((batch, n, heads, 16)), jnp.float32)
               for n in (seqlen_q, seqlen_k, seqlen_k))
    mask = jnp.asarray(_random_mask(rng, batch, seqlen_q, seqlen_k, 0.7))
    lengths = (jnp.asarray([90, 41], jnp.int32), jnp.asarray([101, 130], jnp.int32))
    params = _params(**rules)
    folded, operands = kernel_operands(Visibility(query_lengths=lengths[0], key_lengths=lengths[1],
                                                  mask=mask[:, None]), params, batch, seqlen_q, seqlen_k)
    assert folded == params.rules_folded() and operands.mask_array
    got = attention_op(q, k, v, folded, operands)
    want = attention_reference(q, k, v, softmax_scale=params.softmax_scale, causal=params.causal,
                               window_left=params.window_left, window_right=params.window_right,
                               top_left=params.top_left, mask=mask[:, None], query_seq_lengths=lengths[0],
                               key_value_seq_lengths=lengths[1], compute_dtype=jnp.float32)
    for name, a, b in zip(("out", "lse"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.fixture
def h200_menu(monkeypatch):
    """The shipping menu's router as on an H200, without a GPU."""
    use_h200_menu(monkeypatch)


@pytest.mark.parametrize("mask_shape", [(2, 1, 300, 500), (1, 1, 300, 500), (1, 1, 1, 500), (2, 1, 300, 1),
                                        (2, 8, 300, 500), (1, 8, 1, 500)])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(64, 0))])
def test_masks_run_the_mask_array_kernels(h200_menu, mask_shape, options):
    q = jax.ShapeDtypeStruct((2, 300, 8, 88), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 500, 2, 88), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
    explanation = fa4_jax.explain(q, kv, kv, mask=mask, **options)
    # Every mask kind folds into the bits: the "none" class, zero-padded to d96 as any d88 call.
    assert explanation.backend == "cute"
    assert explanation.forward_variant == "fwd_sm90a_bf16_d96_dv96_boolmask"
    assert explanation.backward_variant == "bwd_sm90a_bf16_d96_dv96_boolmask"
    assert explanation.split_kv == 1 and not explanation.pack_gqa


def test_what_the_mask_array_kernels_do_not_take_runs_on_the_reference(h200_menu):
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 500, 2, 128), jnp.bfloat16)
    reason = "no fwd kernel for sm_90a bf16 none softcap with a mask array"
    for mask_shape in ((2, 1, 300, 500), (2, 8, 300, 500)):
        mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
        explanation = fa4_jax.explain(q, kv, kv, mask=mask, softcap=20.0)
        assert explanation.backend == "reference" and reason in explanation.reason
        with pytest.raises(ValueError, match="implementation='cute' cannot serve this call"):
            fa4_jax.explain(q, kv, kv, mask=mask, implementation="cute", softcap=20.0)

