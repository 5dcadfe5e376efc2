"""The menu of ahead-of-time compiled variants, and the rule that picks one for a call.

A forward variant has a backward twin with the same key (kind "bwd") for every head dim the
backward kernel supports (`HEAD_DIMS`); a call whose backward has no kernel is differentiated by
the reference (`backends.backward`). The selection rule is mirrored in ffi/common.cc
(`SelectMask`); change both together.
"""
from __future__ import annotations

import dataclasses
import itertools

# Every arch the build plumbing knows. sm_100a has no kernel yet, so the menu does not list it.
ARCHES = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp16")
MASKS = ("none", "causal", "local")
KINDS = ("fwd", "bwd")
# (head_dim, head_dim_v) per kind; (192, 128) is DeepSeek's shape. Each needs an entry in its
# kernel's tile table.
HEAD_DIMS = {
    "fwd": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
    "bwd": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
}
# Dense forward calls without a mask at these head dims, longer than the short rule's and with
# keys for more than one block, run the narrowest "tail{width}" tuning whose width holds their
# last key block (TileConfig.tail_keys), if one does: head dim -> the default's tile_n there
# (kernels/sm90/fwd.py's tile table; tests/test_kernel_config.py checks they agree). The widths
# cover the powers of two: 2k leaves 112 of d128's 176-key blocks, 4k 48, 8k 96, 16k 16.
TAIL_CALLS = {128: 176}
TAIL_WIDTHS = (48, 96, 128)
# Named overrides of a kernel's tuned settings, passed to its constructor as keyword arguments.
# "default" is what users get, and "short", "short_wg2", "n128_tree", "decode" and the "tail"
# tunings where `call_tuning` picks them by a call's shape (SHORT_CALLS, DECODE_ROWS, TAIL_CALLS);
# the others exist for the ablations in docs/perf-log.md, are compiled only where ABLATIONS lists
# them, and are reachable only through the benchmark (`ffi.forward(..., tuning=NAME)`,
# `--fa4-tunings`).
# On 128-key blocks: at d128 O's own buffer leaves no room for two 176-key K/V stages (240 KB).
_LPT_SEPARATE_O = {"scheduler": "lpt", "separate_o": True, "tile_n": 128}
# A tile's boundary overlapped with the next tile's start; padded warp groups then run their
# GEMMs (the skip is not implemented there).
_OVERLAP = {"pingpong": True, "overlap_tiles": True, "skip_padded_groups": False}
TUNINGS: dict[str, dict] = {
    "default": {},
    "tau0": {"rescale_threshold": 0.0},  # rescale whenever the row max grows
    "nopingpong": {"pingpong": False},
    "pingpong": {"pingpong": True},  # d128 under a mask, where its default is off
    "poly25": {"exp2_poly_share": 0.25},  # a quarter of the exponentials on the FMA pipes
    "poly12": {"exp2_poly_share": 0.125},  # an eighth
    # Every exponential on MUFU.EX2: the backward's ablation where a share is the default (d128).
    "exp2_mufu": {"exp2_poly_share": 0.0},
    # The row maximum as a tree of max instead of one chain (softmax.py), and on d128's 128-key
    # blocks, where it pays (+2-3%): the short rule's kernel since session 14 ("n128" before).
    "max_tree": {"max_tree": True},
    "n128_tree": {"tile_n": 128, "max_tree": True},
    # The wait for the previous block's P·V GEMM in O's rescale branch, below the whole softmax
    # (d128 causal's default since session 17), or before the branch, where ptxas may hoist it
    # into the softmax (the other defaults; TileConfig.pv_wait_in_branch). Both masks.
    "pv_wait_pinned": {"pv_wait_in_branch": True},
    "pv_wait_hoisted": {"pv_wait_in_branch": False},
    # Block j-1's V waited for before the ping-pong turn, with K_j (the order before session 14).
    "v_wait_first": {"v_wait_in_turn": False},
    # O staged with element stores (33 STS per thread at d128), the epilogue before session 14.
    "o_sts": {"o_stmatrix": False},
    # One CTA per tile, the first K issued before Q and after the lengths are read (before
    # session 14).
    "k_first": {"q_first": False},
    # MMA warp groups whose rows are all padding run their GEMMs anyway (d64's default skips
    # them: its 192-row tiles leave 1-2 of 3 groups padded in a sequence's last m-block).
    "no_skip_padded": {"skip_padded_groups": False},
    # A tile's first Q·Kᵀ GEMM issued in ping-pong turn, so that the groups' first softmaxes
    # are staggered instead of running together with the tensor pipe idle.
    "pp_first": {"pingpong_first_block": True},
    "lpt": {"scheduler": "lpt"},  # persistent CTAs, LPT tile order
    # One CTA per tile in the LPT order, blockIdx.x decoded (the masked default before session
    # 15), and that order with the grid in its shape (the masked default since) without a mask.
    "lpt_single": {"scheduler": "lpt_single"},
    "lpt_grid": {"scheduler": "lpt_grid"},
    "linear": {"scheduler": "linear"},  # one CTA per tile in grid order, masked calls too
    "wg2": {"mma_warp_groups": 2, "tile_n": 128},  # d64 with 128-row tiles (forward v2's shape)
    # Persistent LPT with O staged apart from Q, so the next tile's Q loads during this tile's
    # epilogue: an ablation ("lpt_so"), and what `call_tuning` picks for short causal forward
    # calls ("short").
    "lpt_so": _LPT_SEPARATE_O,
    # Ping-pong stays on in the short rule's kernel (the one measured at 1k, 321-323 TF/s at
    # d128), though the d128 default turned it off under a mask.
    "short": {**_LPT_SEPARATE_O, "pingpong": True},
    # and with 8 MB L2 sections (one d128 head at s = 16k): concurrent tiles share one head's
    # K/V, as in the linear order, which `lpt` trails by 6-9% at s >= 4k
    "lpt_so_l2s8": {**_LPT_SEPARATE_O, "l2_section_mb": 8},
    # The short rule's kernel with each tile boundary as one overlapped step (the next tile's
    # first Q·Kᵀ issued with this tile's last P·V; docs/perf-log.md, "overlap a tile's drain").
    "lpt_so_overlap": {**_LPT_SEPARATE_O, **_OVERLAP},
    # and with 8 MB L2 sections, which `lpt_so` needed to match one CTA per tile (session 12)
    "lpt_so_overlap_l2s8": {**_LPT_SEPARATE_O, **_OVERLAP, "l2_section_mb": 8},
    # and on 160-key blocks, the widest whose two stages fit beside Q and O's own buffer at d128
    # (224 KB), against the 176 of one CTA per tile; "n160" is that width without persistence.
    "lpt_so_overlap_l2s8_n160": {**_LPT_SEPARATE_O, **_OVERLAP, "l2_section_mb": 8,
                                 "tile_n": 160},
    # The short rule's kernel on 128-row tiles (two MMA warp groups, 128-key blocks): what
    # `call_tuning` picks for short causal forward calls at d64.
    # Its P·V wait pinned in the rescale branch (TileConfig.pv_wait_in_branch) since session 17:
    # d64 causal 1k 281/284 TF/s in two runs against 271-277 before (cuDNN 283-288 throughout).
    "short_wg2": {**_LPT_SEPARATE_O, "pingpong": True, "mma_warp_groups": 2, "pv_wait_in_branch": True},
    # Under a causal mask and without softcap, the first MMA warp group's diagonal block 64 keys
    # wide (TileConfig.first_group_diagonal), where SHORT_CALLS picks them: d128's default and
    # the short rule's kernels of d64 and d128.
    "diag": {"first_group_diagonal": True},
    "short_wg2_diag": {**_LPT_SEPARATE_O, "pingpong": True, "mma_warp_groups": 2, "pv_wait_in_branch": True,
                       "first_group_diagonal": True},
    "short_diag": {**_LPT_SEPARATE_O, "pingpong": True, "first_group_diagonal": True},
    # One MMA warp group (64-row tiles): what `call_tuning` picks for decode-sized calls, whose
    # few rows (a GQA-packed group's heads) leave most of a 128- or 192-row tile as padding.
    # Measured (docs/perf-log.md, "Decode tiles"): d64 decode 285 vs 435 us on 192-row tiles,
    # d128 509 vs 534 us (b=64, 8k cache, 32/8 heads). The P·V wait pinned since session 18:
    # reading no lengths in dense calls (kernels/common/ragged.py) let ptxas hoist it above every
    # exponential at d128 (41 under the GEMM before; 153 of 192 with softcap, then 17).
    "decode": {"mma_warp_groups": 1, "pingpong": False, "pv_wait_in_branch": True},
    # Key block widths (the knob sets both masks'), against the defaults: d128 176 without a mask
    # and 128 under one, d64 128, d256 64.
    "n96": {"tile_n": 96},  # d64's default before P's conversion stopped spilling
    # d128 without a mask: the default before that, and until session 14 what `call_tuning`
    # picked for short calls there (now "n128_tree"; under a mask it is the default). At d64 the
    # default's own width, under a name that escapes the short rule.
    "n128": {"tile_n": 128},
    "n176": {"tile_n": 176},  # d128 under a mask
    "n160": {"tile_n": 160},
    "n192": {"tile_n": 192},
    "n80": {"tile_n": 80},  # d256: FlashAttention-3's width, 224 of 227 KB of shared memory
    # d192/dv128, whose two 128-key stages and Q fill 208 KB: narrower blocks on two stages, or
    # 80-key blocks on three (202 KB).
    "n112": {"tile_n": 112},
    "n80_kv3": {"tile_n": 80, "kv_stages": 3},
    # A dense call's last key block computed only as wide as the keys it holds
    # (TileConfig.tail_keys), where `call_tuning` picks it (TAIL_CALLS); and the default kernel,
    # which computes it at the full width, under a name that escapes that rule.
    **{f"tail{width}": {"tail_keys": width} for width in TAIL_WIDTHS},
    "tail_full": {},
    # The default kernel under a name that escapes the diagonal rule (SHORT_CALLS' "diag").
    "diag_full": {},
    # Backward (kernels/sm90/bwd.py TileConfig): the two choices that made backward v2, each
    # turned back to v1's. det_asc changes only deterministic masked calls; the benchmark times
    # every backward tuning both ways (fa4_jax_bwd:NAME, fa4_jax_bwd_det:NAME).
    "det_asc": {"det_descending": False},  # deterministic causal/local: dQ adds in increasing order
    # dQ by per-thread red.global.add from the MMA warps.
    "dq_atomic": {"dq_tma_reduce": False},
    # d256 before the TMA dQ reduce: double-buffered Q/dO (and dSᵀ/Pᵀ) rings, dQ by atomics
    # (the reduce's 64 KB sdQ fits only with single buffers).
    "dq_atomic_2stage": {"dq_tma_reduce": False, "stages": 2, "pds_stages": 2},
    # Deterministic: sdQ freed once the dQ add is complete (one writer), not once read.
    "det_free_late": {"det_free_sdq_on_read": False, "dq_writers": 1},
    # Deterministic: one dQ writer warp instead of two taking the adds in turn, or three.
    "dq_writer1": {"dq_writers": 1},
    "dq_writers3": {"dq_writers": 3},
    # Deterministic mode without the waits for the turn (not reproducible): what the order costs.
    "det_unordered": {"det_ordered": False},
    # The next query block's Sᵀ issued before this block's dQ hand-over (d192's default), or
    # after it (the others'); the two overlaps of the hand-over exclude each other, and the
    # Sᵀ issued ahead reads no LSE before it (`lse_before_scores`).
    "scores_ahead": {"scores_ahead": True, "dq_during_dk": False, "lse_before_scores": False},
    "scores_late": {"scores_ahead": False},
    # The dQ hand-over after every GEMM of the block (dK issued before dQ: d192's and d256's
    # order), not during the dK GEMM (d64's, d96's and d128's).
    "dq_after_dk": {"dq_during_dk": False},
    # d128's order before session 13 (dV issued during dSᵀ, dK before dQ with the dQ hand-over
    # after every GEMM, LSE and D read at their use), and each of its three parts alone.
    "bwd_v11_order": {"dv_during_ds": True, "dq_during_dk": False, "row_stats_ahead": 0},
    "dv_during_ds": {"dv_during_ds": True},
    "stats_at_use": {"row_stats_ahead": 0},
    # d96's order before session 13: dV issued during dSᵀ, the next block's Sᵀ ahead.
    "d96_v11_order": {"dv_during_ds": True, "dq_during_dk": False, "scores_ahead": True},
    # d64 with LSE and D read ahead (16 of its 32 columns), which completes d96's and d128's
    # order there (d64 already issues dV after dSᵀ and hands dQ over under dK).
    "stats_ahead": {"row_stats_ahead": 16},
    # d64 on 64-row query tiles (dV issued during dSᵀ's pass), its shape before the 128-row tiles.
    "m64": {"tile_m": 64, "dv_during_ds": True},
    # sdQ and mdQaccum in the tile's order, one hand-over for both warp groups, a tensor-map
    # reduce (every head dim's default before session 10); with one writer (d64's before), and
    # sdQ freed once the add is complete (d128's before).
    "dq_tile_order": {"dq_fragment_order": False},
    "dq_tile_order_w1": {"dq_fragment_order": False, "dq_writers": 1},
    "dq_tile_order_late": {"dq_fragment_order": False, "dq_writers": 1, "det_free_sdq_on_read": False},
    # The LSE values read ahead read after the dPᵀ GEMM's issue (d128's place before session
    # 16), or before the Sᵀ GEMM's (d128's default since; an ablation at d96 and d256).
    "lse_late": {"lse_before_scores": False},
    "lse_early": {"lse_before_scores": True},
    # The step's tail in FA4 upstream's order: dV issued after dSᵀ's stores, dO released once
    # dV and dQ retire: even against the default at d128 (session 17).
    "upstream_tail": {"dv_after_ds_store": True, "do_release_early": True},
    # Deterministic without a mask: every key block walks the query blocks from the first, as
    # before session 10 (no rotation; the masked kernels are the default's).
    "det_in_order": {"det_rotated_walk": False},
    # The default kernel, called deterministically with one dQ accumulator where
    # DET_DQ_COPIES_MAX_KEYS gives two (`dq_copies`).
    "det_one_copy": {},
    # Default mode: the first add into each query block stores, claimed through its semaphore,
    # and the preprocess zeroes no mdQaccum; the walk without a mask rotated
    # (TileConfig.default_stores_first).
    "stores_first": {"default_stores_first": True},
    # The opposite, where stores_first is the default (d64 since session 20): every add adds
    # into an mdQaccum the preprocess zeroed.
    "dq_zeroed": {"default_stores_first": False},
    # The main backward kernel and its postprocess launched plainly, not as programmatic
    # dependents of the kernel before them.
    "no_pdl": {"pdl": False},
}
# (kind, head dim, tunings) of the ablations, bf16, masks none and causal. d256's row for the
# atomic dQ is dq_atomic_2stage: with atomics, its shared memory goes back to two stages.
ABLATIONS = (
    ("fwd", 128, ("tau0", "nopingpong", "pingpong", "poly25", "poly12", "pp_first", "lpt", "linear",
                  "lpt_so", "lpt_so_l2s8", "n176", "n192", "lpt_so_overlap",
                  "lpt_so_overlap_l2s8", "n160", "lpt_so_overlap_l2s8_n160", "max_tree",
                  "n128", "v_wait_first", "o_sts", "k_first", "lpt_single", "lpt_grid",
                  "pv_wait_pinned", "pv_wait_hoisted", "tail_full", "diag_full")),
    ("fwd", 64, ("wg2", "linear", "lpt", "lpt_so", "n96", "n128", "nopingpong", "lpt_so_overlap",
                 "max_tree", "v_wait_first", "o_sts", "k_first", "lpt_single", "no_skip_padded",
                 "pv_wait_pinned")),
    ("fwd", 96, ("diag", "pv_wait_hoisted")),
    ("fwd", 192, ("nopingpong", "n96", "n112", "n80_kv3", "pv_wait_hoisted", "pv_wait_pinned",
                  "max_tree", "linear")),
    ("fwd", 256, ("lpt", "linear", "n80", "max_tree", "v_wait_first", "o_sts", "lpt_single",
                  "pv_wait_pinned")),
    ("bwd", 64, ("det_asc", "dq_atomic", "m64", "det_free_late", "det_unordered", "dq_after_dk",
                 "dq_writer1", "dq_tile_order_w1", "det_in_order", "no_pdl", "stats_ahead",
                 "dq_zeroed", "poly12")),
    ("bwd", 128, ("det_asc", "dq_atomic", "det_free_late", "scores_ahead", "stats_at_use",
                  "det_unordered", "dq_after_dk", "dq_writer1", "dq_tile_order_late", "det_in_order",
                  "no_pdl", "bwd_v11_order", "dv_during_ds", "lse_late", "upstream_tail",
                  "stores_first", "exp2_mufu", "poly25")),
    ("bwd", 96, ("d96_v11_order", "dq_atomic", "det_unordered", "dq_writer1", "dq_tile_order",
                 "det_in_order", "lse_early")),
    ("bwd", 192, ("scores_late", "dq_atomic", "det_unordered", "dq_writer1", "dq_tile_order",
                  "det_in_order", "det_one_copy", "dq_writers3")),
    ("bwd", 256, ("det_asc", "dq_atomic_2stage", "det_free_late", "det_unordered", "dq_writer1",
                  "dq_tile_order", "det_in_order", "det_one_copy", "dq_writers3", "lse_early",
                  "stores_first", "poly25")),
)


# Forward calls of a (mask, head dim) run the first of its (tuning, bound) steps whose bound both
# lengths are within; longer calls run the default. Chosen by measurement (bf16, 16k tokens, TF/s).
# Causal: the persistent LPT order with O apart from Q, whose next tile's loads overlap a tile's
# tail (docs/perf-log.md "short causal calls"):
# - d64, "short_wg2" up to 4k: 211/290/353 at s = 1k/2k/4k against 183/258/334 for the default
#   (192-row tiles, one CTA per tile) and 182/279/343 for the same order on 192-row tiles. Why
#   the smaller tile wins is not established; candidates: a 192-row tile's padding (12.5% of the
#   rows at 1k) and its masked diagonal (three 96-key blocks of each tile against two 128-key).
#   Above 4k it loses: 390/412 against 395/434 at 8k/16k. Since the default's blocks widened to
#   128 keys (docs/perf-log.md, "P converted through asm") it loses at 4k too (372 vs 395), so
#   the bound was 2k. Session 12 (two runs, docs/perf-log.md "d64 short calls"): at 2k the
#   same persistent order on the default's 192-row tiles ("short" at d64) ran 347/348 against
#   327/339 for "short_wg2" (cuDNN 349/342), at 1k 248/250 against 274/270: "short_wg2" up to
#   1k, "short" up to 2k. Since padded warp groups skip their GEMMs (session 16) the default
#   wins at 2k: 349 against 336/342 for "short" (run 2), 354 against 341 (run 1, the skip
#   against "short" without it), so "short" is gone. At 1k "short_wg2" stays (271/272 against
#   249 for the default with the skip; its 128-row tiles divide 1k). Where the call's diagonal
#   is block-aligned, with the first group's diagonal 64 keys wide ("short_wg2_diag", session
#   22), five processes at 1k: 279/299/281/296/292 against 286/278/276/292/280 (+2.4% on
#   average, single pairs −2.4 to +7.5%).
# - d128, "short" up to 1k: 321/414 against 275/388 at 1k/2k; at 4k even (481 vs 480 without
#   ping-pong), at 8k/16k it loses (527/559 against 550/598). Since session 15's "lpt_grid" it
#   is ahead at 1k only (366/372 against 365/365) and behind at 2k (450/443 against 467/482).
# - d128, the first group's diagonal 64 keys wide (TileConfig.first_group_diagonal) where the
#   call's diagonal is block-aligned (`diagonal_fits`; dense calls): "short_diag" up to 1k,
#   "diag" (the default kernel with it) up to 8k. Session 22, two processes, against the same
#   kernels without it, 1k/2k/4k/8k/16k: "short_diag" 390/392 against "short" 382/385 at 1k;
#   "diag" 488/475, 570/562, 611/610 against 466/450, 556/553, 602/597 at 2k/4k/8k (+1.5 to
#   +5.6%), and 626/615 against 638/637 at 16k, where it loses (docs/perf-log.md, "the first
#   warp group's diagonal"). A step whose narrowing the call cannot take is passed over.
# Without a mask, d128:
# - 128-key blocks ("n128") up to 1k: 469 against 446 for the default's 176 at 1k (six blocks
#   per tile row, the last 82% padding). docs/perf-log.md "P converted through asm", run 2.
#   Since session 14 with the row maximum as a tree ("n128_tree"): 485 against 470 at 1k (run
#   4), and 602/639 against 589/620 at 4k/16k, where the 176-key default stays (589-595/645-653).
# - 128-key blocks with the first block in ping-pong turn, from 1k to 4k, measured even in
#   four runs of session 12 (+1.2% at 2k, +0.9% at 4k on average, single runs −1.8% to +4.9%):
#   not adopted.
SHORT_CALLS = {
    ("causal", 64): (("short_wg2_diag", 1024), ("short_wg2", 1024)),
    ("causal", 128): (("short_diag", 1024), ("short", 1024), ("diag", 8192)),
    ("none", 128): (("n128_tree", 1024),),
}
# Forward calls without a mask and with at most this many query rows (as the kernel sees them:
# GQA-packed, fa4_jax/pack_gqa.py) run the "decode" tuning, compiled at every head dim.
DECODE_ROWS = 64


def call_tuning(kind: str, mask: str, head_dim: int, seqlen_q: int, seqlen_k: int,
                tuning: str = "default", ragged: bool = False) -> str:
    """The tuning a call runs: "decode" for a forward of at most DECODE_ROWS query rows without
    a mask, the short tuning of a short forward's mask and head dim (SHORT_CALLS) whose
    narrowing the call can take, the tail tuning of a dense one without a mask whose last key
    block it holds (TAIL_CALLS), else `tuning`."""
    if kind != "fwd" or tuning != "default":
        return tuning
    if mask == "none" and seqlen_q <= DECODE_ROWS:
        return "decode"
    for short_tuning, longest in SHORT_CALLS.get((mask, head_dim), ()):
        if (max(seqlen_q, seqlen_k) <= longest and
                narrowing_mismatch(short_tuning, mask, head_dim, seqlen_q, seqlen_k, ragged) is None):
            return short_tuning
    if mask == "none":
        for width in TAIL_WIDTHS:
            if narrowing_mismatch(f"tail{width}", mask, head_dim, seqlen_q, seqlen_k, ragged) is None:
                return f"tail{width}"
    return tuning


def tail_fits(tail_keys: int, head_dim: int, seqlen_k: int) -> bool:
    """Whether a dense call of seqlen_k keys has more than one key block and at most tail_keys
    keys in its last, at the tile_n that TAIL_CALLS gives for head_dim."""
    tile_n = TAIL_CALLS.get(head_dim)
    if tile_n is None or seqlen_k <= tile_n:
        return False
    return seqlen_k - (seqlen_k - 1) // tile_n * tile_n <= tail_keys


def diagonal_fits(seqlen_q: int, seqlen_k: int) -> bool:
    """Whether a causal call's diagonal runs along 128 x 128 blocks: seqlen_k − seqlen_q is a
    multiple of 128, so each tile's highest key block holds its first warp group's visible keys
    in its first 64 (TileConfig.first_group_diagonal)."""
    return (seqlen_k - seqlen_q) % 128 == 0


def narrowing_mismatch(tuning: str, mask: str, head_dim: int, seqlen_q: int, seqlen_k: int,
                       ragged: bool) -> str | None:
    """Why a forward call may not run `tuning`, one whose kernel computes only part of a key
    block: the first tail_keys keys of the last (without a mask), or the first group's first 64
    of the diagonal (causal); None if it may (or the tuning narrows nothing at this mask)."""
    settings = TUNINGS[tuning]
    if settings.get("first_group_diagonal") and mask == "causal":
        if ragged:
            return (f"tuning {tuning!r} narrows the diagonal block, which a ragged batch's entries "
                    "do not share")
        if not diagonal_fits(seqlen_q, seqlen_k):
            return (f"tuning {tuning!r} narrows the diagonal block and needs seqlen_k − seqlen_q a "
                    f"multiple of 128; seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
    tail_keys = settings.get("tail_keys", 0)
    if not tail_keys or mask != "none":
        return None
    if ragged:
        return f"tuning {tuning!r} narrows the last key block, which a ragged batch's entries do not share"
    if not tail_fits(tail_keys, head_dim, seqlen_k):
        return (f"tuning {tuning!r} computes {tail_keys} keys of the last key block and needs two or "
                f"more blocks; seqlen_k={seqlen_k} at head dim {head_dim} does not fit")
    return None


# Deterministic backward calls at these head dims, with at most this many keys, give every
# query block's dQ two fp32 accumulators (kernels/bwd_workspace.py BWD_MAX_DQ_COPIES): each add
# then waits for the add two turns back in its own copy instead of the one just before it. There
# a 64 x 64 step is shorter than an add's round trip through L2 and the semaphore, so one
# accumulator paced the chain at the round trip. Measured against one copy (docs/perf-log.md,
# "two dQ accumulators"), deterministic forward+backward at 1k/4k/16k: d192 +15/21/0%, causal
# +9/10/0%; d256 +10/16/0%, causal +3/7/-5%. 8192 keys (a chain of 128 key blocks, all
# resident at once on 132 SMs) is where the gain is assumed to end; 8k was not measured.
DET_DQ_COPIES_MAX_KEYS = {192: 8192, 256: 8192}


def dq_copies(head_dim: int, seqlen_k: int, tuning: str, deterministic: bool) -> int:
    """The dQ accumulators (the workspace's leading dim) of a backward call."""
    if not deterministic or tuning == "det_one_copy":
        return 1
    return 2 if seqlen_k <= DET_DQ_COPIES_MAX_KEYS.get(head_dim, 0) else 1


@dataclasses.dataclass(frozen=True)
class Variant:
    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    softcap: bool
    kind: str = "fwd"
    tuning: str = "default"

    def __post_init__(self):
        if (self.arch not in ARCHES or self.dtype not in DTYPES or self.mask not in MASKS
                or self.kind not in KINDS or self.tuning not in TUNINGS):
            raise ValueError(f"not a valid variant: {self!r}")

    @property
    def name(self) -> str:
        """A C identifier: the export name, function prefix and dispatch key of this variant."""
        arch = self.arch.replace("_", "")
        mask = "" if self.mask == "none" else f"_{self.mask}"
        softcap = "_softcap" if self.softcap else ""
        tuning = "" if self.tuning == "default" else f"_t{self.tuning}"
        return (f"{self.kind}_{arch}_{self.dtype}_d{self.head_dim}_dv{self.head_dim_v}"
                f"{mask}{softcap}{tuning}")

    @property
    def tuning_kwargs(self) -> dict:
        return dict(TUNINGS[self.tuning])

    def to_json(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


MENU: tuple[Variant, ...] = tuple(
    Variant("sm_90a", dtype, d, dv, mask, softcap, kind)
    for kind in KINDS
    for dtype, (d, dv), mask, softcap in itertools.product(
        DTYPES, HEAD_DIMS[kind], MASKS, (False, True))
) + tuple(
    Variant("sm_90a", "bf16", d, dict(HEAD_DIMS[kind])[d], mask, False, kind, tuning)
    for kind, d, tunings in ABLATIONS for tuning in tunings for mask in ("none", "causal")
) + tuple(
    Variant("sm_90a", dtype, d, d, mask, softcap, "fwd", short_tuning)
    for (mask, d), steps in SHORT_CALLS.items() for short_tuning, _ in steps
    for dtype, softcap in itertools.product(DTYPES, (False, True))
) + tuple(
    Variant("sm_90a", dtype, d, d, "none", softcap, "fwd", f"tail{width}")
    for d in TAIL_CALLS for width in TAIL_WIDTHS
    for dtype, softcap in itertools.product(DTYPES, (False, True))
) + tuple(
    Variant("sm_90a", dtype, d, dv, "none", softcap, "fwd", "decode")
    for dtype, (d, dv), softcap in itertools.product(DTYPES, HEAD_DIMS["fwd"], (False, True))
)


def mask_kind(causal: bool, window_left: int | None, window_right: int | None) -> str:
    """A window bound on either side makes the call "local" (causal folds into its right bound)."""
    if window_left is not None or window_right is not None:
        return "local"
    return "causal" if causal else "none"


def select(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window_left: int | None,
           window_right: int | None, softcap: bool, arch: str = "sm_90a", kind: str = "fwd",
           tuning: str = "default") -> Variant:
    """The variant that serves a call; it may be absent from MENU (callers check membership)."""
    return Variant(arch, dtype, head_dim, head_dim_v, mask_kind(causal, window_left, window_right),
                   bool(softcap), kind, tuning)
