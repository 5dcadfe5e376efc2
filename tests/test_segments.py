"""Segment ids for the kernels: the span tables (fa4_jax.runtime.segments) against a brute-force count,
and the kernels' use of them (kernels/common/segments.py, modelled here in Python with the same
integer arithmetic) against the pairs that are visible.

What the kernels rely on, checked over random packings (contiguous documents, padding ids that
match nothing, non-contiguous ids, ragged lengths, empty and one-token documents):
- a block outside a tile's visit range holds no pair visible to a counted row of the tile;
- a block inside its full range is visible to every counted row of the tile, whole;
- for packed documents in self-attention (one packing on both sides) the visit range is exactly
  the blocks that hold a visible pair, so the work is the useful work's, rounded to blocks.
"""
import functools

import numpy as np
import pytest

from fa4_jax.runtime import segments
from fa4_jax.abi.segment_layout import FULL_HI, FULL_LO, HI, LO, NO_SPAN, SPAN_CHUNK

# Tile shapes the kernels use: forward (tile_m, tile_n) and backward (tile_m, tile_n).
TILES = ((128, 128), (192, 128), (128, 176), (64, 64), (64, 128), (128, 64))


def _brute_table(ids, partner_ids, count, partner_count):
    """The table's definition, one position at a time."""
    chunks = -(-len(ids) // SPAN_CHUNK)
    table = np.tile(np.array([NO_SPAN, 0, 0, NO_SPAN], np.int64), (chunks, 1))
    for i in range(min(count, len(ids))):
        partners = [j for j in range(partner_count) if partner_ids[j] == ids[i]]
        row = table[i // SPAN_CHUNK]
        if partners:
            row[LO] = min(row[LO], partners[0])
            row[HI] = max(row[HI], partners[-1] + 1)
        if partners and partners[-1] - partners[0] + 1 == len(partners):
            row[FULL_LO] = max(row[FULL_LO], partners[0])
            row[FULL_HI] = min(row[FULL_HI], partners[-1] + 1)
        else:
            row[FULL_LO], row[FULL_HI] = NO_SPAN, 0
    return table


def _packing(rng, length, kind):
    """Segment ids of one row: documents in order ("packed"), then padding; or shuffled ids."""
    if kind == "shuffled":
        return rng.integers(0, 4, length)
    ids, doc = [], 0
    while len(ids) < length:
        size = int(rng.choice([0, 1, 2, 5, 40, 64, 65, 130, 300]))
        ids += [doc] * size
        doc += 1
    ids = np.array(ids[:length])
    if kind == "padded":
        ids[length - int(rng.integers(0, length // 2 + 1)):] = -1
    return ids


def _rows(rng, batch, seqlen_q, seqlen_k, kind, ragged):
    q_ids = np.stack([_packing(rng, seqlen_q, kind) for _ in range(batch)]).astype(np.int32)
    if seqlen_q == seqlen_k and kind != "shuffled":
        kv_ids = np.where(q_ids < 0, -2, q_ids)  # self-attention: the same packing, padding apart
    else:
        kv_ids = np.stack([_packing(rng, seqlen_k, kind) for _ in range(batch)]).astype(np.int32)
    q_len = rng.integers(0, seqlen_q + 1, batch) if ragged else np.full(batch, seqlen_q)
    kv_len = rng.integers(0, seqlen_k + 1, batch) if ragged else np.full(batch, seqlen_k)
    return q_ids, kv_ids, q_len.astype(np.int32), kv_len.astype(np.int32)


CASES = [(seqlen_q, seqlen_k, kind, ragged)
         for seqlen_q, seqlen_k in ((1, 1), (64, 64), (300, 300), (1000, 1000), (200, 700), (513, 129))
         for kind in ("packed", "padded", "shuffled") for ragged in (False, True)]


@pytest.mark.parametrize("seqlen_q, seqlen_k, kind, ragged", CASES)
def test_span_tables_count_what_their_definition_says(seqlen_q, seqlen_k, kind, ragged):
    rng = np.random.default_rng([seqlen_q, seqlen_k, len(kind), ragged])
    q_ids, kv_ids, q_len, kv_len = _rows(rng, 2, seqlen_q, seqlen_k, kind, ragged)
    row_spans, key_spans = (np.asarray(t) for t in segments.span_tables(q_ids, kv_ids, (q_len, kv_len)))
    for b in range(2):
        np.testing.assert_array_equal(row_spans[b], _brute_table(q_ids[b], kv_ids[b], q_len[b], kv_len[b]))
        np.testing.assert_array_equal(key_spans[b], _brute_table(kv_ids[b], q_ids[b], kv_len[b], q_len[b]))


def _check_blocks(table, ids, partner_ids, count, partner_count, tile, other_tile, packed):
    """The kernels' skip and no-compare rules hold for every tile of one side."""
    visible = (ids[:count, None] == partner_ids[None, :partner_count])
    ranges = [np.asarray(r)[0] for r in _tile_ranges(np.asarray(table)[None], tile, other_tile)]
    # A tile wholly past the length visits nothing (the mask's block range is empty).
    for block in range(-(-count // tile)):
        lo, hi, full_lo, full_hi = (int(r[block]) for r in ranges)
        rows = visible[block * tile:(block + 1) * tile]
        holds_pair = [rows[:, n * other_tile:(n + 1) * other_tile].any() for n in
                      range(-(-len(partner_ids) // other_tile))]
        for n, pair in enumerate(holds_pair):
            if pair:
                assert lo <= n < hi, (block, n, "a block with a visible pair is skipped")
            if full_lo <= n < full_hi:
                cols = rows[:, n * other_tile:(n + 1) * other_tile]
                assert cols.shape[1] == other_tile and cols.all(), (block, n, "a full block hides a pair")
        if packed:
            assert [n for n, pair in enumerate(holds_pair) if pair] == list(range(lo, max(lo, hi))), \
                (block, "packed documents: the visit range is not exactly the blocks with pairs")


@pytest.mark.parametrize("tile_m, tile_n", TILES)
@pytest.mark.parametrize("seqlen_q, seqlen_k, kind, ragged", CASES)
def test_kernels_skip_only_blocks_without_pairs_and_compare_all_but_full_ones(
        tile_m, tile_n, seqlen_q, seqlen_k, kind, ragged):
    rng = np.random.default_rng([tile_m, tile_n, seqlen_q, seqlen_k, len(kind), ragged])
    q_ids, kv_ids, q_len, kv_len = _rows(rng, 2, seqlen_q, seqlen_k, kind, ragged)
    row_spans, key_spans = (np.asarray(t) for t in segments.span_tables(q_ids, kv_ids, (q_len, kv_len)))
    # The same packing on both sides (self-attention): the visit ranges are tight.
    packed = kind != "shuffled" and seqlen_q == seqlen_k
    for b in range(2):
        # The forward's walk (query tiles over key blocks) and the backward's (key blocks over
        # query tiles); the backward's tile_n is a multiple of the span chunk.
        _check_blocks(row_spans[b], q_ids[b], kv_ids[b], q_len[b], kv_len[b], tile_m, tile_n, packed)
        if tile_n % SPAN_CHUNK == 0:
            _check_blocks(key_spans[b], kv_ids[b], q_ids[b], kv_len[b], q_len[b], tile_n, tile_m, packed)


def test_a_mutated_table_is_caught():
    # The check above can fail: widen one chunk's full range by a block and it reports the pair
    # that a kernel would then leave uncompared.
    rng = np.random.default_rng(7)
    q_ids, kv_ids, q_len, kv_len = _rows(rng, 1, 1000, 1000, "packed", False)
    row_spans = np.array(segments.span_tables(q_ids, kv_ids)[0][0])
    chunk = next(c for c, (_, _, full_lo, full_hi) in enumerate(row_spans)
                 if full_lo < full_hi <= 1000 - SPAN_CHUNK)
    row_spans[chunk][FULL_HI] += SPAN_CHUNK
    with pytest.raises(AssertionError, match="a full block hides a pair"):
        _check_blocks(row_spans, q_ids[0], kv_ids[0], q_len[0], kv_len[0], SPAN_CHUNK, SPAN_CHUNK, True)


def test_one_long_document_among_many_short_ones_visits_only_its_own_blocks():
    # One 8k document and 255 of 32 tokens in a 16k row: a query tile of a short document
    # visits its own block (or two), the long one's tiles its own 64 blocks at most.
    ids = np.concatenate([np.zeros(8192, np.int32), np.repeat(np.arange(1, 256, dtype=np.int32), 32)])
    ids = np.concatenate([ids, np.full(16384 - len(ids), -1, np.int32)])[None]
    row_spans = np.asarray(segments.span_tables(ids, np.where(ids < 0, -2, ids))[0][0])
    lo, hi, _, _ = (np.asarray(r)[0] for r in _tile_ranges(row_spans[None], 128, 128))
    visits = [int(h - l) for l, h in zip(lo, hi)]
    assert max(visits[:64]) == 64 and max(visits[64:]) <= 2
    assert sum(visits) == 64 * 64 + sum(visits[64:])


def _counted_but_not_walked(row_spans, walk_spans, tile_m, tile_n):
    """The (query tile, key block) pairs of one entry where the key block is in the tile's key
    hull, so that the tile's deterministic turns count it, but the key block's walk over the
    key spans misses the tile: each would leave the tile's later turns waiting forever."""
    hull_lo, hull_hi, _, _ = (np.asarray(r)[0] for r in _tile_ranges(np.asarray(row_spans)[None], tile_m, tile_n))
    walk_lo, walk_hi, _, _ = (np.asarray(r)[0] for r in _tile_ranges(np.asarray(walk_spans)[None], tile_n, tile_m))
    return [(m, n) for m in range(len(hull_lo)) for n in range(hull_lo[m], hull_hi[m])
            if not walk_lo[n] <= m < walk_hi[n]]


def test_a_key_blocks_own_hull_misses_a_query_tile_that_counts_it():
    # The hazard the deterministic walk exists for: a query tile of ids 1 and 3 has the keys of
    # id 2 in its hull, and no row that sees them, so key block 1's own span (the rows that see
    # it) is empty. The transposed walk visits the tile.
    q_ids = np.repeat(np.array([1, 3], np.int32), 32)[None]
    kv_ids = np.repeat(np.array([1, 2, 3], np.int32), 64)[None]
    row_spans, key_spans = (np.asarray(t)[0] for t in segments.span_tables(q_ids, kv_ids))
    assert _counted_but_not_walked(row_spans, key_spans, 64, 64) == [(0, 1)]
    walk = np.asarray(segments.deterministic_walk(row_spans[None], key_spans[None], 64))[0]
    assert _counted_but_not_walked(row_spans, walk, 64, 64) == []


@pytest.mark.parametrize("tile_m, tile_n", [(64, 64), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, kind, ragged", CASES)
def test_the_deterministic_walk_visits_every_query_tile_that_counts_a_key_block(
        tile_m, tile_n, seqlen_q, seqlen_k, kind, ragged):
    rng = np.random.default_rng([tile_m, tile_n, seqlen_q, seqlen_k, len(kind), ragged, 1])
    q_ids, kv_ids, q_len, kv_len = _rows(rng, 2, seqlen_q, seqlen_k, kind, ragged)
    row_spans, key_spans = segments.span_tables(q_ids, kv_ids, (q_len, kv_len))
    exact = np.asarray(segments.deterministic_walk(row_spans, key_spans, tile_m))
    widest = np.asarray(segments.deterministic_walk(row_spans, key_spans))
    packed = kind != "shuffled" and seqlen_q == seqlen_k
    for b in range(2):
        for walk in (exact[b], widest[b]):
            assert _counted_but_not_walked(row_spans[b], walk, tile_m, tile_n) == []
            # Still every visible pair (dK and dV), and the full ranges untouched.
            _check_blocks(walk, kv_ids[b], q_ids[b], kv_len[b], q_len[b], tile_n, tile_m, packed=False)
        np.testing.assert_array_equal(exact[b][:, 2:], np.asarray(key_spans)[b][:, 2:])
        # Packed documents: the walk at the kernel's tile is exactly the tiles with pairs.
        _check_blocks(exact[b], kv_ids[b], q_ids[b], kv_len[b], q_len[b], tile_n, tile_m, packed)


def test_a_deterministic_backward_gets_the_walk_at_its_kernels_query_tile(next_key, segment_kernels, monkeypatch):
    # Through the API: the deterministic d64 backward (128-row query tiles) gets the walk at 128
    # rows, the default one the plain key spans, and both gradients match the reference on ids
    # whose hulls disagree (ids 0-3 shuffled).
    import jax
    import jax.numpy as jnp

    import fa4_jax
    from fa4_jax.runtime import ffi

    passed = []
    modelled = ffi.backward_call

    def recording_backward(*args, segments=None, **kwargs):
        jax.debug.callback(lambda key_spans: passed.append(np.asarray(key_spans)), segments[3])
        return modelled(*args, segments=segments, **kwargs)

    monkeypatch.setattr(ffi, "backward_call", recording_backward)
    rng = np.random.default_rng(11)
    q_ids, kv_ids, _, _ = _rows(rng, 2, 400, 400, "shuffled", False)
    q, k, v = (jax.random.normal(next_key(), (2, 400, 2, 64), jnp.bfloat16) for _ in range(3))
    row_spans, key_spans = segments.span_tables(q_ids, kv_ids)

    def grads(implementation, deterministic):
        def loss(q, k, v):
            out = fa4_jax.attention(q, k, v, causal=True, implementation=implementation, deterministic=deterministic,
                                    query_segment_ids=q_ids, kv_segment_ids=kv_ids)
            return jnp.sum(out.astype(jnp.float32) * jnp.sin(jnp.arange(out.size).reshape(out.shape)))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    want = grads("reference", False)
    for deterministic in (False, True):
        for g, w in zip(grads("cute", deterministic), want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)
    assert len(passed) == 2
    np.testing.assert_array_equal(passed[0], key_spans)
    np.testing.assert_array_equal(passed[1], segments.deterministic_walk(row_spans, key_spans, 128))
    assert not np.array_equal(passed[0], passed[1])


def _tile_ranges(table, tile, other_tile):
    """SegmentIds._reduce for every tile at once: [b, tiles] arrays (visit lo, hi, full lo, hi)
    over the other side's blocks, from a [b, chunks, 4] table."""
    import jax.numpy as jnp

    chunks = tile // SPAN_CHUNK
    tiles = -(-table.shape[1] // chunks)
    # The reductions' identities (a literal array would be a constant, which the partitioned
    # op around the kernel call refuses).
    pad = jnp.zeros((table.shape[0], tiles * chunks - table.shape[1], 4), jnp.int32)
    pad = pad + jnp.where(jnp.arange(4) % 3 == 0, NO_SPAN, 0)
    grouped = jnp.concatenate([table, pad], axis=1).reshape(table.shape[0], tiles, chunks, 4)
    lo, hi = grouped[..., LO].min(-1), grouped[..., HI].max(-1)
    full_lo, full_hi = grouped[..., FULL_LO].max(-1), grouped[..., FULL_HI].min(-1)
    return lo // other_tile, (hi + other_tile - 1) // other_tile, \
        (full_lo + other_tile - 1) // other_tile, full_hi // other_tile


def _kernel_mask(q_ids, kv_ids, table, tile_of_row, tile_of_key, transposed, bits=None):
    """[b, sq, sk]: what a kernel walking the table computes for each pair: inside a visited
    block, and either in a full block or of equal ids (with mask bits: shown by the mask).
    transposed: the backward's walk (key blocks over query tiles, the key spans)."""
    import jax.numpy as jnp

    from fa4_jax.runtime import mask_bits

    rows, keys = jnp.arange(q_ids.shape[1]), jnp.arange(kv_ids.shape[1])
    if transposed:
        lo, hi, full_lo, full_hi = _tile_ranges(table, tile_of_key, tile_of_row)
        walker, walked = keys // tile_of_key, rows // tile_of_row
        inside = lambda a, b: (a[:, None, walker] <= walked[None, :, None]) & (walked[None, :, None] < b[:, None, walker])
    else:
        lo, hi, full_lo, full_hi = _tile_ranges(table, tile_of_row, tile_of_key)
        walker, walked = rows // tile_of_row, keys // tile_of_key
        inside = lambda a, b: (a[:, walker, None] <= walked[None, None, :]) & (walked[None, None, :] < b[:, walker, None])
    if bits is None:
        same = q_ids[:, :, None] == kv_ids[:, None, :]
    else:
        same = mask_bits.unpack(bits, kv_ids.shape[1])
    return inside(lo, hi) & (inside(full_lo, full_hi) | same)


@pytest.fixture
def segment_kernels(monkeypatch):
    """The segments custom calls replaced by a model of the kernels: each computes only the pairs
    its walk over the span tables reaches (the forward: query tiles of 128 rows over key blocks
    of 128; the backward: key blocks of 128 over query tiles of 64), comparing ids (or reading
    a mask's bits) only outside the full blocks, in fp32. The sm90 menu is the library, as on
    an H200. Returns the list of calls made ("fwd", "bwd")."""
    import jax
    import jax.numpy as jnp

    from fa4_jax.runtime import ffi
    from fa4_jax.fallbacks.reference import attention_reference
    from tests.h200_menu import use_h200_menu

    calls = []

    def reference(q, k, v, attrs, lengths, mask):
        ragged_call = lengths[0].shape[0] > 0
        window = {name: None if attrs[name] < 0 else int(attrs[name]) for name in ("window_left", "window_right")}
        return attention_reference(
            q, k, v, softmax_scale=float(attrs["softmax_scale"]), causal=attrs["causal"], **window,
            softcap=float(attrs["softcap"]) or None, top_left=attrs["top_left"], mask=mask[:, None],
            query_seq_lengths=lengths[0] if ragged_call else None,
            key_value_seq_lengths=lengths[1] if ragged_call else None, compute_dtype=jnp.float32)

    def fake_forward(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        q_ids, kv_ids, row_spans, _, *bits = segments
        calls.append("fwd")
        return reference(q, k, v, attrs, lengths, _kernel_mask(q_ids, kv_ids, row_spans, 128, 128, False, *bits))

    def fake_backward(library, q, k, v, out, lse, d_out, d_lse, lengths, attrs, deterministic, dq_copies,
                      tuning=None, segments=None):
        q_ids, kv_ids, _, key_spans, *bits = segments
        calls.append("bwd")
        mask = _kernel_mask(q_ids, kv_ids, key_spans, 64, 128, True, *bits)
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, attrs, lengths, mask), q, k, v)
        d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse
        return tuple(g.astype(x.dtype) for g, x in zip(vjp((d_out.astype(q.dtype), d_lse)), (q, k, v)))

    use_h200_menu(monkeypatch)
    monkeypatch.setattr(ffi, "forward_call", fake_forward)
    monkeypatch.setattr(ffi, "backward_call", fake_backward)
    # A call traced before with the same shapes and params (every mask call's params are the
    # folded ones) would reuse its lowering and never reach the fakes, which record the calls.
    jax.clear_caches()
    return calls


@pytest.mark.parametrize("causal, ragged, kind", [(True, False, "padded"), (False, True, "packed"),
                                                  (True, True, "shuffled")])
def test_segment_calls_reach_the_segments_kernels_and_match_the_reference(next_key, segment_kernels, causal,
                                                                          ragged, kind):
    # attention(query_segment_ids=, kv_segment_ids=) on the modelled kernels against the
    # reference with the ids, values and gradients: a table that skips a block with a pair, or
    # calls a block full that is not, fails here.
    import jax
    import jax.numpy as jnp

    import fa4_jax

    rng = np.random.default_rng([causal, ragged, len(kind)])
    q_ids, kv_ids, q_len, kv_len = _rows(rng, 2, 400, 400, kind, ragged)
    lengths = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len) if ragged else {}
    q = jax.random.normal(next_key(), (2, 400, 4, 64), jnp.float32)
    k, v = (jax.random.normal(next_key(), (2, 400, 2, 64), jnp.float32) for _ in range(2))
    options = dict(causal=causal, query_segment_ids=q_ids, kv_segment_ids=kv_ids, **lengths)
    # The kernels take bf16; the model computes in fp32, so compare at fp32 against fp32.
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert fa4_jax.explain(*bf16, **options).forward_variant == "fwd_sm90a_bf16_d64_dv64" + (
        "_causal" if causal else "") + "_segments"

    def loss(implementation, q, k, v):
        out = fa4_jax.attention(q, k, v, implementation=implementation, **options)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    got = jax.value_and_grad(lambda *x: loss("cute", *x), argnums=(0, 1, 2))(*bf16)
    want = jax.value_and_grad(lambda *x: loss("reference", *x), argnums=(0, 1, 2))(*bf16)
    assert segment_kernels == ["fwd", "bwd"]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("axis_sizes, axis_names, q_spec, kv_spec, ids_spec", [
    ((8,), ("data",), ("data",), ("data",), ("data",)),
    ((2, 4), ("data", "model"), ("data", None, "model"), ("data", None, "model"), ("data",)),
], ids=["batch", "batch_and_heads"])
def test_segment_ids_travel_with_the_batch(next_key, segment_kernels, axis_sizes, axis_names, q_spec,
                                           kv_spec, ids_spec):
    # Sharded over batch (and heads), each device runs the segments call on its own entries'
    # ids and span tables: no collective, and the unsharded results.
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fa4_jax
    from tests.multi_device import collectives_in, cpu_mesh

    mesh = cpu_mesh(axis_sizes, axis_names)
    q_ids, kv_ids, _, _ = _rows(np.random.default_rng(len(axis_sizes)), 8, 256, 256, "padded", False)
    q = jax.random.normal(next_key(), (8, 256, 8, 64), jnp.bfloat16)
    k, v = (jax.random.normal(next_key(), (8, 256, 4, 64), jnp.bfloat16) for _ in range(2))
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)

    def step(q, k, v, d_out, q_ids, kv_ids):
        def attend(q, k, v):
            return fa4_jax.attention(q, k, v, causal=True, query_segment_ids=q_ids, kv_segment_ids=kv_ids)

        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(d_out))

    q_sharding, kv_sharding, ids_sharding = (NamedSharding(mesh, P(*spec)) for spec in (q_spec, kv_spec, ids_spec))
    sharded = jax.jit(step, in_shardings=(q_sharding, kv_sharding, kv_sharding, q_sharding, ids_sharding,
                                          ids_sharding))
    inputs = (q, k, v, d_out, jnp.asarray(q_ids), jnp.asarray(kv_ids))
    compiled = sharded.lower(*inputs).compile()
    assert collectives_in(compiled.as_text()) == []
    for got, want in zip(compiled(*inputs), jax.jit(step)(*inputs)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert "fwd" in segment_kernels and "bwd" in segment_kernels


@pytest.mark.parametrize("kind, options", [
    ("documents", dict(is_causal=True)), ("random", dict()), ("padding", dict(local_window_size=(100, 30))),
    ("documents", dict(query_seq_lengths=np.array([300, 0, 17], np.int32),
                       key_value_seq_lengths=np.array([250, 300, 299], np.int32)))],
    ids=["documents_causal", "random", "padding_window", "documents_lengths"])
def test_mask_calls_reach_the_mask_array_kernels_and_match_jax(next_key, segment_kernels, kind, options):
    # dot_product_attention(mask=) on the modelled kernels (the walk over the mask's span
    # tables, bits read outside the full blocks) against jax's own, values and gradients: a
    # table that skips a block with a visible pair, or calls a block full that is not, fails.
    import jax
    import jax.numpy as jnp

    import fa4_jax

    rng = np.random.default_rng(len(kind))
    rows, keys = np.arange(300)[:, None], np.arange(300)[None, :]
    if kind == "documents":
        q_ids = np.stack([_packing(rng, 300, "packed") for _ in range(3)])
        mask = (q_ids[:, None, :, None] == q_ids[:, None, None, :]) & (keys <= rows)
    elif kind == "random":
        mask = rng.random((3, 1, 300, 300)) < 0.4
    else:
        mask = (np.arange(300)[None, :] < np.array([300, 131, 7])[:, None])[:, None, None, :]
    mask = jnp.asarray(mask)
    q, k, v = (jax.random.normal(next_key(), (3, 300, 4, 64), jnp.bfloat16) for _ in range(3))
    lengths = {name: jnp.asarray(x) for name, x in options.items() if name.endswith("lengths")}
    static = {name: x for name, x in options.items() if not name.endswith("lengths")}

    d_out = jax.random.normal(next_key(), q.shape, jnp.float32)

    def out_and_grads(attend, q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, mask=mask, **lengths, **static), q, k, v)
        return (out, *pullback(d_out.astype(out.dtype)))

    got = out_and_grads(functools.partial(fa4_jax.dot_product_attention, implementation="cute"), q, k, v)
    want = out_and_grads(functools.partial(jax.nn.dot_product_attention, implementation="xla"),
                         *(x.astype(jnp.float32) for x in (q, k, v)))
    assert segment_kernels == ["fwd", "bwd"]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=3e-2, atol=3e-2, err_msg=name)


def test_a_mask_with_segment_ids_folds_the_ids_into_the_mask(next_key, segment_kernels):
    # attention(mask=, query_segment_ids=, kv_segment_ids=, causal=True): the ids fold into the
    # mask's bits (the mask kernels read no ids); against the reference with all three.
    import jax
    import jax.numpy as jnp

    import fa4_jax

    rng = np.random.default_rng(5)
    q_ids, kv_ids = (jnp.asarray(np.stack([_packing(rng, 300, "padded") for _ in range(2)]), jnp.int32)
                     for _ in range(2))
    mask = jnp.asarray(rng.random((2, 1, 300, 300)) < 0.7)
    q, k, v = (jax.random.normal(next_key(), (2, 300, 4, 64), jnp.bfloat16) for _ in range(3))
    options = dict(causal=True, mask=mask, query_segment_ids=q_ids, kv_segment_ids=kv_ids)
    got = fa4_jax.attention(q, k, v, implementation="cute", return_lse=True, **options)
    want = fa4_jax.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="reference",
                             return_lse=True, **options)
    assert segment_kernels == ["fwd"]
    for name, g, w in zip(("out", "lse"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=2e-2, atol=2e-2, err_msg=name)
