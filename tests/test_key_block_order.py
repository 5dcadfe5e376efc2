"""CPU tier: the backward's key-block order is a permutation of the CTAs, heaviest first within
L2-sized sections of heads, and removes the causal tail that blockIdx's order leaves.

The kernel runs `KeyBlockOrder.decode` on DSL integers; here the same code runs on Python ints.
"""
import heapq
import itertools

import pytest

# The kernels' modules import the DSL; the GPU machine runs the built library without it.
pytest.importorskip("cutlass")

from fa4_jax.kernels.common.key_block_order import KeyBlockOrder

SHAPES = [  # key_blocks, heads_kv, batch, num_sms
    (1, 1, 1, 132), (8, 16, 16, 132), (32, 16, 4, 132), (128, 16, 1, 132), (256, 8, 1, 132),
    (5, 3, 7, 20), (200, 2, 3, 132), (7, 1, 1, 78),
]


def _order(key_blocks, heads_kv, batch, num_sms):
    return [KeyBlockOrder().decode(cta, key_blocks, heads_kv, batch, num_sms)
            for cta in range(key_blocks * heads_kv * batch)]


@pytest.mark.parametrize("shape", SHAPES)
def test_order_is_a_permutation(shape):
    key_blocks, heads_kv, batch, _ = shape
    assert sorted(_order(*shape)) == sorted(
        itertools.product(range(key_blocks), range(heads_kv), range(batch)))


@pytest.mark.parametrize("shape", SHAPES)
def test_key_blocks_never_decrease_within_a_section(shape):
    key_blocks, heads_kv, batch, num_sms = shape
    section_pairs = max(num_sms // key_blocks, 1)
    last = {}
    for n_block, head, b in _order(*shape):
        section = (b * heads_kv + head) // section_pairs
        assert n_block >= last.get(section, 0)
        last[section] = n_block


def _makespan(work, num_sms=132):
    """List scheduling in dispatch order, as the hardware hands CTAs to free SMs."""
    finish = [0.0] * num_sms
    for w in work:
        heapq.heappush(finish, heapq.heappop(finish) + w)
    return max(finish)


@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("tile_m,tile_n,head_dim", [(64, 128, 128), (64, 64, 256)])
def test_causal_tail_is_gone(seqlen, tile_m, tile_n, head_dim):
    # 16k tokens, 2048 = heads · head_dim, causal: key block n visits the query blocks from its
    # diagonal on, plus a fixed cost of about a third of a block per CTA.
    heads, batch = 2048 // head_dim, 16384 // seqlen
    key_blocks, query_blocks = seqlen // tile_n, seqlen // tile_m
    work = lambda n_block: query_blocks - n_block * tile_n // tile_m + 0.3
    ideal = sum(work(n) for n in range(key_blocks)) * heads * batch / 132
    by_grid = [work(n) for _, _, n in itertools.product(range(batch), range(heads), range(key_blocks))]
    by_order = [work(n) for n, _, _ in _order(key_blocks, heads, batch, 132)]
    assert _makespan(by_order) / ideal < 1.02
    if seqlen <= 4096:  # what the order is for: blockIdx's order leaves a 6-7% tail there
        assert _makespan(by_grid) / ideal > 1.05
