"""CPU tier: the LPT tile order is a permutation of the tiles, longest first, L2-sectioned.

The kernel runs `TileScheduler.decode` on DSL integers; here the same code runs on Python ints.
"""
import itertools

import pytest

# The kernels' modules import the DSL; the GPU machine runs the built library without it.
pytest.importorskip("cutlass")

from fa4_jax.kernels.common.tile_scheduler import SCHEDULERS, TileScheduler

SHAPES = [  # seqlen_q, seqlen_k, heads, heads_kv, batch
    (1, 1, 1, 1, 1), (1000, 1000, 4, 4, 2), (4097, 4097, 8, 2, 1), (16384, 16384, 16, 16, 1),
    (1024, 1024, 16, 1, 16), (300, 100, 4, 2, 2), (4096, 131072, 6, 3, 3),
    # Partial last L2 sections (4 KV heads of 16k keys per section): 6 pairs in sections of 4
    # and 2; with GQA, 12 pairs in sections of 8 and 4.
    (300, 16384, 6, 6, 1), (300, 16384, 12, 6, 1),
]


def _order(sched, sq, sk, h, hk, b):
    num_m = -(-sq // sched.tile_m)
    return [sched.decode(t, sq, sk, h, hk, b) for t in range(num_m * h * b)], num_m


@pytest.mark.parametrize("reverse_m", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_order_is_a_permutation(shape, reverse_m):
    sched = TileScheduler("lpt", 128, reverse_m, kv_bytes_per_key=512)
    order, num_m = _order(sched, *shape)
    h, b = shape[2], shape[4]
    assert sorted(order) == sorted(itertools.product(range(num_m), range(h), range(b)))


@pytest.mark.parametrize("shape", SHAPES)
def test_heaviest_first_within_a_section(shape):
    sched = TileScheduler("lpt", 128, True, kv_bytes_per_key=512)
    order, _ = _order(sched, *shape)
    # Within one L2 section the m-blocks never grow: the bottom (heaviest causal) rows go first.
    sections = {}
    for i, (m, _, _) in enumerate(order):
        sections.setdefault(_section(sched, shape, i), []).append(m)
    for ms in sections.values():
        assert ms == sorted(ms, reverse=True)


def _section(sched, shape, tile_idx):
    sq, sk, h, hk, b = shape
    num_m = -(-sq // sched.tile_m)
    kv_heads = max(sched.l2_bytes // sched.kv_bytes_per_key // max(sk, 1), 1)
    return tile_idx // (kv_heads * (h // hk) * num_m)


def test_section_keeps_kv_within_the_l2_budget():
    sched = TileScheduler("lpt", 128, True, kv_bytes_per_key=(128 + 128) * 2)
    sq = sk = 4096
    h = hk = 64
    order, num_m = _order(sched, sq, sk, h, hk, 1)
    # 32 MiB / (4096 keys * 512 B) = 16 KV heads per section: the first 16 * num_m tiles use
    # heads 0..15 only, starting with the last (heaviest) m-block of each.
    first = order[: 16 * num_m]
    assert {head for _, head, _ in first} == set(range(16))
    assert [m for m, _, _ in order[:16]] == [num_m - 1] * 16


def _persistent_shares(sched, sq, sk, h, hk, b):
    """Each persistent cluster's tiles (a CTA's, without clusters), as the kernel walks them:
    cluster c takes positions c, c + clusters, ... of the order (TileScheduler.tile_count and
    tile), the clusters those of TileScheduler.grid."""
    num_tiles = -(-sq // sched.tile_m) * h * b
    clusters = sched.grid(sq, sk, h, hk, b)[0] // sched.cluster_size
    return [[sched.decode(c + i * clusters, sq, sk, h, hk, b)
             for i in range((num_tiles - c + clusters - 1) // clusters)] for c in range(clusters)]


def test_persistent_ctas_split_the_tiles():
    sched = TileScheduler("lpt", 128, True, kv_bytes_per_key=512)
    sq, sk, h, hk, b = 4096, 4096, 16, 16, 2
    seen = [tile for share in _persistent_shares(sched, sq, sk, h, hk, b) for tile in share]
    assert len(seen) == len(set(seen)) == 32 * h * b


@pytest.mark.parametrize("reverse_m", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_grid_order_is_the_decoded_order(shape, reverse_m):
    # "lpt_grid" CTAs in the hardware's dispatch order (x fastest, then y, then z), less those
    # past the last section's pairs (tile_count 0), visit the tiles in `decode`'s LPT order.
    sq, sk, h, hk, b = shape
    sched = TileScheduler("lpt_grid", 128, reverse_m, kv_bytes_per_key=512)
    section_heads, num_m, sections = sched.grid(sq, sk, h, hk, b)
    visited = [sched.grid_tile((x, y, z), section_heads, num_m, h)
               for z in range(sections) for y in range(num_m) for x in range(section_heads)
               if z * section_heads + x < h * b]
    order, _ = _order(TileScheduler("lpt", 128, reverse_m, kv_bytes_per_key=512), *shape)
    assert visited == order


def test_grid_sections_fit_the_l2_budget():
    # d128 at 4k keys: 16 KV heads (32 MiB / 2 MiB) per section, so 4 sections of 64 pairs;
    # with fewer pairs than a section holds, one section of all of them.
    sched = TileScheduler("lpt_grid", 128, True, kv_bytes_per_key=(128 + 128) * 2)
    assert sched.grid(4096, 4096, 16, 16, 4) == (16, 32, 4)
    assert sched.grid(4096, 4096, 4, 4, 1) == (4, 32, 1)
    assert sched.grid(4096, 4096, 16, 2, 3) == (48, 32, 1)  # GQA: all 48 pairs in one section


def test_clusters_of_two_split_the_tiles_on_even_grids():
    # A Blackwell CTA pair computes each of its tiles together: 74 clusters on 148 SMs, and a
    # grid of whole clusters however few the tiles.
    sched = TileScheduler("lpt", 512, False, kv_bytes_per_key=512, num_sms=148, cluster_size=2)
    sq, sk, h, hk, b = 4096, 4096, 16, 16, 2
    assert sched.grid(sq, sk, h, hk, b) == (148, 1, 1)
    assert sched.grid(300, 333, 3, 1, 1) == (6, 1, 1)
    shares = _persistent_shares(sched, sq, sk, h, hk, b)
    seen = [tile for share in shares for tile in share]
    assert len(shares) == 74 and len(seen) == len(set(seen)) == 8 * h * b


def test_clusters_need_the_persistent_order_on_whole_clusters_of_sms():
    with pytest.raises(ValueError, match="clusters"):
        TileScheduler("lpt_grid", 512, False, 512, cluster_size=2)
    with pytest.raises(ValueError, match="clusters"):
        TileScheduler("lpt", 512, False, 512, num_sms=133, cluster_size=2)


def test_unknown_scheduler_is_refused():
    assert SCHEDULERS == ("linear", "lpt", "lpt_grid")
    with pytest.raises(ValueError):
        TileScheduler("dynamic", 128, False, 512)


@pytest.mark.parametrize("mask, tuning", [("none", "default"), ("none", "cta_pair"), ("causal", "default"),
                                          ("local", "default")])
def test_the_blackwell_first_use_batch_covers_the_schedulers_cases(mask, tuning):
    # The first-use probes' batch of many tiles (fa4_jax.runtime.probe.problems, "many", as routed to
    # the variant) must run, on a Blackwell GPU, the sm100 kernel's tile-to-tile hand-overs on
    # every CTA of its persistent grid (no mask), and tiles without any key (under a mask, more
    # rows than keys: one tile per CTA in LPT order there).
    import cutlass

    from fa4_jax.aot import menu
    from fa4_jax.kernels.sm100 import menu as sm100
    from fa4_jax.kernels.sm100 import plan
    from fa4_jax.kernels.sm100.fwd import FlashAttentionForwardSm100
    from fa4_jax.runtime.probe import problems
    from fa4_jax.abi.routing import Variant

    sched = FlashAttentionForwardSm100(cutlass.BFloat16, 128, 128, mask, False, **sm100.TUNINGS[tuning]).scheduler
    assert sched.kind == plan.scheduler_kind(mask)
    variant = Variant(sm100.ARCH, "bf16", 128, 128, mask, False, tuning=tuning)
    serves = problems.routing_rule(menu.routes(), {v.name for v in menu.MENU})
    many = next(p for p in problems.for_variant(variant, serves) if p.kind == "many")
    sq, sk, batch = many.seqlen_q, many.seqlen_k, many.batch
    h, hk = problems.HEADS_Q, problems.HEADS_KV
    num_m = -(-sq // sched.tile_m)
    if mask == "none":
        assert sched.persistent and sched.num_sms == 148
        assert sched.cluster_size == (2 if tuning == "cta_pair" else 1)
        shares = _persistent_shares(sched, sq, sk, h, hk, batch)
        assert min(len(share) for share in shares) >= 2
        order = [tile for share in shares for tile in share]
        assert sorted(order) == sorted(itertools.product(range(num_m), range(h), range(batch)))
    else:
        assert sched.kind == "lpt_grid" and sched.reverse_m
        # Bottom-right alignment: row i sees keys up to i + (sk - sq) + right (right = 0 causal).
        right = problems.WINDOW[1] if mask == "local" else 0
        last_rows = [min((m + 1) * sched.tile_m, sq) - 1 for m in range(num_m)]
        assert any(row + sk - sq + right < 0 for row in last_rows), "no tile of the probe is keyless"
