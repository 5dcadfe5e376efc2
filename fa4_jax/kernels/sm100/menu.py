"""Blackwell's part of the shipping menu: the sm100 forward, built for the sm_100f family
(B200/GB200, compute capability 10.0, and B300/GB300, 10.3: one cubin serves both).

NOT YET RUN ON BLACKWELL HARDWARE: these kernels are compiled and statically checked only
(docs/blackwell.md). VERIFIED is False, so on a Blackwell GPU each variant is first checked
against the reference in the process that uses it (fa4_jax.runtime.gate) and routed to cuDNN or
the reference if it disagrees. The backward has no sm100 kernel yet: Blackwell's backward calls
run the reference backward (or cuDNN's, through implementation="cudnn").
"""
from __future__ import annotations

import itertools

from fa4_jax.kernels.sm100 import plan
from fa4_jax.abi.routing import DTYPES, MASKS, Route, Variant

ARCH = "sm_100f"
# Whether a GPU of this arch has run the shipped kernels through the GPU tier. False: the
# dispatch checks each variant on first use (fa4_jax.runtime.gate).
VERIFIED = False
KERNELS = {"fwd": "fa4_jax.kernels.sm100.fwd:FlashAttentionForwardSm100"}
# (head_dim, head_dim_v) of the forward kernels, each with an entry in plan.TILE_CONFIGS. TMEM
# holds two 128-key S tiles and two O tiles up to dv 128 (DeepSeek's 192/128 included); d256's
# O fills the rest alone, so its kernel runs one query tile with S double-buffered
# (plan.TileConfig.q_stages). Other dims run zero-padded on the narrowest wider pair
# (routing.serving_head_dims).
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
# Settings of the tuned variants, as overrides of the tile tables (plan.TileConfig).
TUNINGS: dict[str, dict] = {
    "default": {},
    # A CTA pair per MMA (plan.PAIR_TILE_CONFIGS: half of each K and V block per CTA).
    "cta_pair": {"cta_pair": True},
}
# Dense calls without a mask at d128, d192/dv128 and d256 run on CTA pairs, where FA4 upstream
# finds them faster, once they have more rows than one single-CTA tile (FA4 upstream's rule:
# fewer leave half of the pair's tile empty where one CTA's tile holds them); ragged
# batches stay on single CTAs (a pair's partner could not zero the V padding of its half
# before the leader's P·V reads it, and its keyless tiles would wait on a Q barrier the leader
# owns).
ROUTES: tuple[Route, ...] = tuple(
    Route("cta_pair", "none", d, min_rows=plan.TILE_CONFIGS[(d, dv)].q_stages * plan.ROWS_PER_STAGE + 1, dense=True)
    for d, dv in plan.PAIR_TILE_CONFIGS
)
DQ_COPIES_MAX_KEYS: dict[int, int] = {}

MENU: tuple[Variant, ...] = tuple(
    Variant(ARCH, dtype, d, dv, mask, softcap, "fwd")
    for dtype, (d, dv), mask, softcap in itertools.product(DTYPES, HEAD_DIMS, MASKS, (False, True))
) + tuple(
    Variant(ARCH, dtype, d, dv, "none", softcap, "fwd", "cta_pair")
    for dtype, (d, dv), softcap in itertools.product(DTYPES, plan.PAIR_TILE_CONFIGS, (False, True))
)
