"""Hopper's part of the shipping menu: its kernels, the tunings the router sends calls to, the
routes, and the variants built for them.

Pure Python (no DSL): the build, its tests and the ablation menu import it. Every variant here
is reachable from `fa4_jax.attention`: the defaults by problem class, the tunings through ROUTES.
The measurements behind each route are in docs/perf-log.md under the section named.
"""
from __future__ import annotations

import itertools

from fa4_jax.abi.routing import DTYPES, KINDS, MASKS, Route, Variant

ARCH = "sm_90a"
# Whether a GPU of this arch has run the shipped kernels through the GPU tier (an H200 has).
VERIFIED = True
# (kind) -> the kernel class, "module:Class".
KERNELS = {
    "fwd": "fa4_jax.kernels.sm90.fwd:FlashAttentionForwardSm90",
    "bwd": "fa4_jax.kernels.sm90.bwd:FlashAttentionBackwardSm90",
}
# (head_dim, head_dim_v) of the forward kernels, each with an entry in fwd.TILE_CONFIGS.
# (192, 128) is DeepSeek's shape; 32, 80 and 160 are where serving the dim zero-padded on the
# next one cost more than a kernel of its own (docs/perf-log.md, "Every head dim: served
# zero-padded"). Other dims run zero-padded on the narrowest wider pair
# (routing.serving_head_dims).
HEAD_DIMS = ((32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 128), (256, 256))
# Those of the backward kernels (bwd.TILE_CONFIGS, keyed by head_dim). d80's backward runs on
# d96's: its 64-row tiles would split dQ's 80 columns into two 40-column WGMMAs, which computed
# wrong dQ on the H200 (bwd.py's _check_config refuses them).
BACKWARD_HEAD_DIMS = tuple(dims for dims in HEAD_DIMS if dims != (80, 80))
_HEAD_DIMS_BY_KIND = {"fwd": HEAD_DIMS, "bwd": BACKWARD_HEAD_DIMS}

# Persistent CTAs in LPT order, O staged apart from Q (so the next tile's Q loads during this
# tile's epilogue), 128-key blocks: the short causal calls' kernels.
_PERSISTENT_SHORT = {"scheduler": "lpt", "separate_o": True, "tile_n": 128, "pingpong": True}
# Settings of the tuned variants, as overrides of the kernels' tile tables (fwd.TileConfig).
TUNINGS: dict[str, dict] = {
    "default": {},
    # One MMA warp group (64-row tiles) for decode-sized calls, whose few rows (a GQA-packed
    # group's heads) leave most of a 128- or 192-row tile as padding; P·V wait pinned
    # ("Decode tiles: one MMA warp group", "Dense calls pass no lengths").
    "decode": {"mma_warp_groups": 1, "pingpong": False, "pv_wait_in_branch": True},
    "short": _PERSISTENT_SHORT,
    "short_diag": {**_PERSISTENT_SHORT, "first_group_diagonal": True},
    # d64's short kernel on 128-row tiles, which divide 1k ("Padded warp groups skip their
    # GEMMs: d64's default now").
    "short_wg2": {**_PERSISTENT_SHORT, "mma_warp_groups": 2, "pv_wait_in_branch": True},
    "short_wg2_diag": {**_PERSISTENT_SHORT, "mma_warp_groups": 2, "pv_wait_in_branch": True,
                       "first_group_diagonal": True},
    # The default kernel with the first warp group's diagonal block 64 keys wide.
    "diag": {"first_group_diagonal": True},
    # 128-key blocks with the row maximum as a tree ("The wait for P·V: the row maximum as a
    # tree, on 128-key blocks").
    "n128_tree": {"tile_n": 128, "max_tree": True},
    # The last key block computed only as wide as the keys it holds.
    **{f"tail{keys}": {"tail_keys": keys} for keys in (48, 96, 128)},
}
# d128's key blocks without a mask (fwd.TILE_CONFIGS): the tail routes' block width.
_D128_TILE_N = 176
# Forward calls take the first route that fits (routing.Route); the rest run the default.
ROUTES: tuple[Route, ...] = (
    # Decode-sized calls without a mask, at every head dim.
    *(Route("decode", "none", d, max_rows=64) for d, _ in HEAD_DIMS),
    # Short causal calls ("Short causal calls: a tile shape per head dim"; "The first warp
    # group's diagonal 64 keys wide": the diagonal variants where the call's diagonal runs
    # along the 128-key blocks, dense calls without softcap).
    Route("short_wg2_diag", "causal", 64, max_len=1024, dense=True, diagonal_block=128, softcap=False),
    Route("short_wg2", "causal", 64, max_len=1024),
    Route("short_diag", "causal", 128, max_len=1024, dense=True, diagonal_block=128, softcap=False),
    Route("short", "causal", 128, max_len=1024),
    Route("diag", "causal", 128, max_len=8192, dense=True, diagonal_block=128, softcap=False),
    # Short d128 calls without a mask on 128-key blocks ("The wait for P·V: the row maximum as
    # a tree, on 128-key blocks").
    Route("n128_tree", "none", 128, max_len=1024),
    # Short d128 calls with a boolean mask (padding or causal arrays, BERT-sized batches) on the
    # short causal calls' persistent kernel ("Short calls with a mask on the persistent short
    # kernel"; at d64 it lost on padding masks, which a route cannot tell from causal ones).
    Route("short", "none", 128, max_len=1024, softcap=False, mask_array=True),
    # Longer dense d128 calls without a mask: the narrowest tail that holds the last block
    # ("d128's tail block only as wide as its keys").
    *(Route(f"tail{keys}", "none", 128, dense=True, tail_tile_n=_D128_TILE_N, tail_keys=keys)
      for keys in (48, 96, 128)),
)
# Deterministic backward calls at these head dims, with at most this many keys, give every query
# block's dQ two fp32 accumulators, so that each add waits for the add two turns back instead of
# the one just before it ("Deterministic dQ: two accumulators at d192/d256"). 8192 keys (a chain
# of 128 key blocks, all resident at once on 132 SMs) is where the gain is assumed to end.
DQ_COPIES_MAX_KEYS = {192: 8192, 256: 8192}


def _route_variants():
    head_dim_v = dict(HEAD_DIMS)
    for route in ROUTES:
        softcaps = (False, True) if route.softcap is None else (route.softcap,)
        for dtype, softcap in itertools.product(DTYPES, softcaps):
            yield Variant(ARCH, dtype, route.head_dim, head_dim_v[route.head_dim], route.mask, softcap,
                          route.kind, route.tuning, segments=route.mask_array, mask_array=route.mask_array)


# Every problem class, with and without segment ids (the segments kernels run the default
# tuning: the routes' narrowed first blocks assume the mask's own key blocks).
MENU: tuple[Variant, ...] = tuple(
    Variant(ARCH, dtype, d, dv, mask, softcap, kind, segments=segments)
    for segments in (False, True)
    for kind in KINDS
    for dtype, (d, dv), mask, softcap in itertools.product(DTYPES, _HEAD_DIMS_BY_KIND[kind], MASKS,
                                                           (False, True))
) + tuple(_route_variants()) + tuple(
    # Boolean masks (jax's `mask=`): the causal and window rules and the lengths' clip are folded
    # into the mask's bits before the call (fa4_jax/runtime/mask_bits.py), so one problem class per head
    # dim serves every mask; jax's dot_product_attention and Flax pass no softcap.
    Variant(ARCH, dtype, d, dv, "none", False, kind, segments=True, mask_array=True)
    for kind in KINDS
    for dtype, (d, dv) in itertools.product(DTYPES, _HEAD_DIMS_BY_KIND[kind])
)
