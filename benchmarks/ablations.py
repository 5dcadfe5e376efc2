"""The ablation menu: kernel settings timed beside the shipped ones, built into a development
library of their own (never the wheel's).

    python -m benchmarks.ablations build [--only REGEX] [--jobs N]

compiles `MENU` into build/ablations/libfa4_jax_ablations.so (the shipping build's cache serves
what it shares), whose FFI targets take a `tuning` attribute (the development names of
fa4_jax.abi.targets).
benchmarks/bench_attention.py's "fa4_jax:NAME" and "fa4_jax_bwd:NAME" rows call them through
`library()`; "default" names each ablated problem class's shipped kernel through the same path,
the like-for-like baseline.

Each tuning overrides a kernel's tile table (kernels/sm90/fwd.py and bwd.py TileConfig), as a
shipped tuning does; docs/perf-log.md records what each measured, under the section named. Only
settings the kernels still implement are here: the code of an ablation that lost, once its result
is in the log, is deleted from the kernels.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path

from fa4_jax.aot import build
from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.abi.routing import Variant

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "build" / "ablations" / "libfa4_jax_ablations.so"

_PERSISTENT = {"scheduler": "lpt", "separate_o": True, "tile_n": 128}
TUNINGS: dict[str, dict] = {
    **sm90.TUNINGS,
    # Forward (fwd.TileConfig and its SoftmaxConfig).
    "tau0": {"rescale_threshold": 0.0},  # rescale whenever the row max grows ("Forward v2")
    "nopingpong": {"pingpong": False},
    "pingpong": {"pingpong": True},  # d128 under a mask, where its default is off
    # A share of the exponentials on the FMA pipes ("Forward: the exp2 polynomial without
    # conversions, tree reductions, ...", "The forward's ablation table on today's build").
    "poly25": {"exp2_poly_share": 0.25},
    "poly12": {"exp2_poly_share": 0.125},
    "max_tree": {"max_tree": True},  # the row maximum as a tree on the default blocks
    # The P·V wait inside O's rescale branch, or before it ("The P·V wait pinned in O's
    # rescale branch").
    "pv_wait_pinned": {"pv_wait_in_branch": True},
    "pv_wait_hoisted": {"pv_wait_in_branch": False},
    "no_skip_padded": {"skip_padded_groups": False},
    # Tile orders (kernels/common/tile_scheduler.py): "Under a mask, the LPT order's grid in the
    # order's own shape".
    "lpt": {"scheduler": "lpt"},
    "lpt_grid": {"scheduler": "lpt_grid"},
    "linear": {"scheduler": "linear"},
    "lpt_so": _PERSISTENT,  # the short rule's kernel without its ping-pong setting
    "wg2": {"mma_warp_groups": 2, "tile_n": 128},  # d64 on 128-row tiles
    # Key block widths ("Forward: wider key blocks").
    **{f"n{n}": {"tile_n": n} for n in (80, 96, 112, 128, 160, 176, 192)},
    "n80_kv3": {"tile_n": 80, "kv_stages": 3},
    # The shipped kernels under names that escape the router: the full-width tail block, the
    # full-width diagonal.
    "tail_full": {},
    "diag_full": {},
    # Backward (bwd.TileConfig).
    "dq_writer1": {"dq_writers": 1},  # "Two dQ writers"
    "dq_writers3": {"dq_writers": 3},  # "Three dQ writers"
    "scores_ahead": {"scores_ahead": True, "dq_during_dk": False, "lse_before_scores": False},
    "scores_late": {"scores_ahead": False},
    "dq_after_dk": {"dq_during_dk": False},  # "The dQ hand-over during the dK GEMM"
    # d128's and d96's orders before upstream's ("d128 backward in FA4 upstream's GEMM order").
    "bwd_v11_order": {"dv_during_ds": True, "dq_during_dk": False, "row_stats_ahead": 0},
    "d96_v11_order": {"dv_during_ds": True, "dq_during_dk": False, "scores_ahead": True},
    "dv_during_ds": {"dv_during_ds": True},
    "stats_at_use": {"row_stats_ahead": 0},
    "stats_ahead": {"row_stats_ahead": 16},
    "m64": {"tile_m": 64, "dv_during_ds": True},  # d64 on 64-row tiles
    "lse_late": {"lse_before_scores": False},
    "lse_early": {"lse_before_scores": True},
    "stores_first": {"default_stores_first": True},
    "dq_zeroed": {"default_stores_first": False},
    "exp2_mufu": {"exp2_poly_share": 0.0},
    # The shipped backward with one dQ accumulator where the rule gives two (the benchmark
    # passes the copies: "Deterministic dQ: two accumulators at d192/d256").
    "det_one_copy": {},
    # Q's and dO's slots released as their last GEMM retires, or after the dQ GEMM ("The d256
    # backward: a CTA pair sharing dSᵀ, and Q/dO released early").
    "release_early": {"release_early": True},
    "release_late": {"release_early": False},
}
# (kind, head dim, tunings), bf16, masks none and causal.
ABLATIONS = (
    ("fwd", 128, ("tau0", "nopingpong", "pingpong", "poly25", "poly12", "lpt", "linear", "lpt_so",
                  "n176", "n192", "n160", "max_tree", "n128", "lpt_grid", "pv_wait_pinned",
                  "pv_wait_hoisted", "tail_full", "diag_full")),
    ("fwd", 64, ("wg2", "linear", "lpt", "lpt_so", "n96", "n128", "nopingpong", "max_tree",
                 "no_skip_padded", "pv_wait_pinned")),
    ("fwd", 96, ("diag", "pv_wait_hoisted")),
    ("fwd", 192, ("nopingpong", "n96", "n112", "n80_kv3", "pv_wait_hoisted", "pv_wait_pinned",
                  "max_tree", "linear")),
    ("fwd", 256, ("lpt", "linear", "n80", "max_tree", "pv_wait_pinned")),
    ("bwd", 64, ("m64", "dq_writer1", "stats_ahead", "dq_zeroed", "poly12", "dq_after_dk")),
    ("bwd", 96, ("d96_v11_order", "dq_writer1", "lse_early")),
    ("bwd", 128, ("scores_ahead", "stats_at_use", "dq_writer1", "bwd_v11_order", "dv_during_ds",
                  "lse_late", "stores_first", "exp2_mufu", "poly25", "dq_after_dk")),
    ("bwd", 192, ("scores_late", "dq_writer1", "det_one_copy", "dq_writers3", "release_early")),
    ("bwd", 256, ("dq_writer1", "det_one_copy", "dq_writers3", "lse_early", "stores_first",
                  "poly25", "release_late")),
)


def _variants():
    head_dim_v = dict(sm90.HEAD_DIMS)
    for kind, d, tunings in ABLATIONS:
        for tuning in ("default", *tunings):
            for mask in ("none", "causal"):
                yield Variant(sm90.ARCH, "bf16", d, head_dim_v[d], mask, False, kind, tuning)


MENU = tuple(dict.fromkeys(_variants()))


def narrowing_mismatch(tuning: str, call) -> str | None:
    """Why `call` (a fa4_jax.abi.routing.Call) may not run `tuning`, one whose kernel computes only
    part of a key block (the router's conditions for the shipped ones, kernels/sm90/menu.py),
    or None: the development library's targets run the tuning they are given, whatever the
    shapes."""
    from fa4_jax.abi import routing

    settings = TUNINGS[tuning]
    if settings.get("first_group_diagonal") and call.mask == "causal":
        if call.ragged or not routing.diagonal_on_blocks(call, 128):
            return (f"tuning {tuning!r} narrows the diagonal block, which needs a dense call whose "
                    f"diagonal runs along 128-key blocks; seqlen_q={call.seqlen_q}, seqlen_k={call.seqlen_k}")
    tail_keys = settings.get("tail_keys", 0)
    if tail_keys and call.mask == "none":
        tail = routing.Route(tuning, "none", call.head_dim, dense=True, tail_tile_n=176, tail_keys=tail_keys)
        if not tail.fits(call):
            return (f"tuning {tuning!r} computes {tail_keys} keys of the last 176-key block; "
                    f"seqlen_k={call.seqlen_k} does not fit")
    return None


def ablation_menu(only: str | None = None) -> build.Menu:
    variants = tuple(v for v in MENU if only is None or re.search(only, v.name))
    return build.Menu(variants, tuning_kwargs=lambda v: dict(TUNINGS[v.tuning]),
                      routes=(), dq_copies_max_keys={sm90.ARCH: dict(sm90.DQ_COPIES_MAX_KEYS)},
                      tuning_targets=True)


@functools.cache
def library():
    """The development library, loaded (build it first: `python -m benchmarks.ablations build`)."""
    from fa4_jax.runtime import ffi

    return ffi.load(str(os.environ.get("FA4_JAX_ABLATIONS_LIBRARY") or LIBRARY), tuning_targets=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ablations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "list"))
    parser.add_argument("--only", metavar="REGEX")
    parser.add_argument("--jobs", "-j", type=int, default=None)
    args = parser.parse_args(argv)
    menu = ablation_menu(args.only)
    if args.command == "list":
        for v in menu.variants:
            print(v.name)
        return 0
    try:
        build.build(menu, out=LIBRARY, jobs=args.jobs)
    except (build.BuildError, RuntimeError) as e:
        print(f"\nablation BUILD FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
