"""CPU tier: the variant menu and the selection rule the C++ handler mirrors."""
import dataclasses
import itertools
import re

import pytest

from fa4_jax.aot import variants
from fa4_jax.aot.variants import MENU, Variant, select


def test_menu_covers_the_axes_once():
    users = [v for v in MENU if v.tuning == "default"]
    for kind in variants.KINDS:
        # dtypes x head dims x masks x softcap
        assert sum(v.kind == kind for v in users) == 2 * len(variants.HEAD_DIMS[kind]) * 3 * 2
    assert len({v.name for v in MENU}) == len(MENU)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.name) for v in MENU)
    assert {v.arch for v in MENU} == {"sm_90a"}
    tunings = {v.tuning for v in MENU} - {"default"}
    assert tunings and tunings <= set(variants.TUNINGS)


def test_every_backward_variant_has_a_forward_twin():
    # (Backward ablation tunings are backward-only.)
    backward = {dataclasses.replace(v, kind="fwd") for v in MENU if v.kind == "bwd" and v.tuning == "default"}
    assert backward <= {v for v in MENU if v.kind == "fwd"}
    # The head dims users train with most have backward kernels.
    assert {(64, 64), (128, 128)} <= set(variants.HEAD_DIMS["bwd"])


def test_name():
    v = Variant("sm_90a", "bf16", 128, 128, "causal", True)
    assert v.name == "fwd_sm90a_bf16_d128_dv128_causal_softcap"
    assert Variant("sm_100a", "fp16", 64, 64, "none", False).name == "fwd_sm100a_fp16_d64_dv64"
    assert Variant("sm_90a", "bf16", 192, 128, "local", False, "bwd").name == \
        "bwd_sm90a_bf16_d192_dv128_local"


def test_select_mask_rule():
    def mask(causal, wl, wr):
        return select("bf16", 64, 64, causal, wl, wr, False).mask

    assert mask(False, None, None) == "none"
    assert mask(True, None, None) == "causal"
    assert mask(False, 3, None) == "local"
    assert mask(False, None, 0) == "local"
    assert mask(True, 8, None) == "local"  # causal folds into the window's right bound


def test_select_finds_menu_entries():
    v = select("fp16", 256, 256, False, None, None, True)
    assert v in MENU and v.softcap and v.arch == "sm_90a" and v.kind == "fwd"
    assert select("fp16", 256, 256, False, None, None, True, kind="bwd") in MENU
    v = select("bf16", 192, 128, True, None, None, False)
    assert v in MENU and v.name == "fwd_sm90a_bf16_d192_dv128_causal"
    assert select("bf16", 96, 96, False, None, None, False) in MENU
    assert select("bf16", 192, 192, False, None, None, False) not in MENU
    assert select("bf16", 160, 160, False, None, None, False) not in MENU
    assert select("bf16", 128, 128, True, None, None, False, tuning="lpt") in MENU


def test_bad_variant_is_refused():
    with pytest.raises(ValueError):
        Variant("sm_80", "bf16", 64, 64, "none", False)
    with pytest.raises(ValueError):
        Variant("sm_90a", "fp8", 64, 64, "none", False)
    with pytest.raises(ValueError):
        Variant("sm_90a", "bf16", 64, 64, "none", False, "dgrad")
    with pytest.raises(ValueError):
        Variant("sm_90a", "bf16", 64, 64, "none", False, "fwd", "no_such_tuning")
    assert variants.ARCHES == ("sm_90a", "sm_100a")


@pytest.mark.parametrize("mask,head_dim", sorted(variants.SHORT_CALLS))
def test_short_forwards_take_the_short_tuning(mask, head_dim):
    steps = variants.SHORT_CALLS[(mask, head_dim)]
    bounds = [longest for _, longest in steps]
    assert bounds == sorted(bounds), "steps go from the shortest bound up"
    def rule(seqlen_q, seqlen_k, **kwargs):
        return variants.call_tuning("fwd", mask, head_dim, seqlen_q, seqlen_k, **kwargs)

    for tuning, longest in steps:
        assert tuning != "default"
        shortest = max((b for b in bounds if b < longest), default=0)
        low = max(shortest + 1, variants.DECODE_ROWS + 1)
        if variants.TUNINGS[tuning].get("first_group_diagonal"):
            # Both ends of the step's range on block-aligned diagonals; a ragged call passes it over.
            assert rule(longest, longest) == tuning and rule(low, low) == tuning
            assert rule(low + 128, low) == tuning
            assert rule(longest, longest, ragged=True) != tuning
            assert rule(longest, longest - 1) != tuning
        else:
            # Both ends of the step's range, either length the longer one (past the decode rows);
            # ragged, so that no narrowing step of the same bound takes the call first.
            assert rule(longest, longest, ragged=True) == tuning
            assert rule(low, variants.DECODE_ROWS + 1, ragged=True) == tuning
            assert rule(variants.DECODE_ROWS + 1, low, ragged=True) == tuning
        # Another mask, the backward, or an explicit tuning: unchanged.
        for other in set(variants.MASKS) - {m for m, d in variants.SHORT_CALLS if d == head_dim}:
            assert variants.call_tuning("fwd", other, head_dim, longest, longest) == "default"
        assert variants.call_tuning("bwd", mask, head_dim, longest, longest) == "default"
        assert variants.call_tuning("fwd", mask, head_dim, longest, longest, "linear") == "linear"
        # Every dtype and softcap setting of the rule's calls is compiled.
        for dtype in variants.DTYPES:
            for softcap in (False, True):
                v = select(dtype, head_dim, head_dim, mask == "causal", None, None, softcap, tuning=tuning)
                assert v in MENU
    shortest = bounds[-1]
    # Longer than the last step on either side: the default.
    assert variants.call_tuning("fwd", mask, head_dim, shortest + 1, shortest) == "default"
    assert variants.call_tuning("fwd", mask, head_dim, shortest, shortest + 1) == "default"


def test_menu_lists_each_variant_once():
    assert len({v.name for v in MENU}) == len(MENU)


def test_other_head_dims_keep_the_default_order():
    assert variants.call_tuning("fwd", "causal", 256, 512, 512) == "default"
    assert variants.call_tuning("fwd", "causal", 96, 512, 512) == "default"


@pytest.mark.parametrize("head_dim,head_dim_v", variants.HEAD_DIMS["fwd"])
def test_decode_sized_forwards_take_the_decode_tuning(head_dim, head_dim_v):
    rows = variants.DECODE_ROWS
    assert variants.call_tuning("fwd", "none", head_dim, rows, 50_000) == "decode"
    assert variants.call_tuning("fwd", "none", head_dim, 1, 1) == "decode"
    # More rows, a mask, the backward, or an explicit tuning: unchanged (49_984 keys fill
    # d128's 176-key blocks, so the tail rule leaves them alone too).
    assert variants.call_tuning("fwd", "none", head_dim, rows + 1, 49_984) == "default"
    assert variants.call_tuning("fwd", "local", head_dim, 1, 100) == "default"
    assert variants.call_tuning("bwd", "none", head_dim, 1, 100) == "default"
    assert variants.call_tuning("fwd", "none", head_dim, 1, 100, "lpt") == "lpt"
    for dtype in variants.DTYPES:
        for softcap in (False, True):
            v = select(dtype, head_dim, head_dim_v, False, None, None, softcap, tuning="decode")
            assert v in MENU


def test_dense_d128_forwards_take_the_narrowest_tail_that_holds_their_last_block():
    tile_n = variants.TAIL_CALLS[128]
    assert tile_n not in variants.TAIL_WIDTHS and list(variants.TAIL_WIDTHS) == sorted(variants.TAIL_WIDTHS)
    rule = lambda seqlen_k, **kw: variants.call_tuning("fwd", "none", 128, 4096, seqlen_k, **kw)  # noqa: E731
    # The benchmark grid's lengths: 2k leaves 112 keys in the last block, 4k 48, 8k 96, 16k 16.
    assert [rule(s) for s in (2048, 4096, 8192, 16384)] == ["tail128", "tail48", "tail96", "tail48"]
    previous = 0
    for width in variants.TAIL_WIDTHS:
        for tail in (previous + 1, width):
            seqlen_k = 7 * tile_n + tail
            assert rule(seqlen_k) == f"tail{width}"
            assert variants.narrowing_mismatch(f"tail{width}", "none", 128, 4096, seqlen_k, False) is None
        previous = width
    # A last block wider than every width, a full one, or a single block: the default.
    for seqlen_k in (7 * tile_n + previous + 1, 8 * tile_n, tile_n, 100):
        assert rule(seqlen_k) == "default"
    # Ragged batches, masks, other head dims, the backward and explicit tunings: unchanged.
    assert rule(4096, ragged=True) == "default"
    assert rule(4096, tuning="tail_full") == "tail_full"
    assert variants.call_tuning("fwd", "causal", 128, 4096, 4096) == "diag"
    assert variants.call_tuning("fwd", "none", 64, 4096, 4000) == "default"
    assert variants.call_tuning("bwd", "none", 128, 4096, 4096) == "default"
    # Every dtype and softcap setting of the rule's calls is compiled.
    for width, dtype, softcap in itertools.product(variants.TAIL_WIDTHS, variants.DTYPES, (False, True)):
        assert select(dtype, 128, 128, False, None, None, softcap, tuning=f"tail{width}") in MENU


def test_a_tail_tuning_is_refused_where_it_would_drop_keys():
    mismatch = lambda tuning, mask, d, seqlen_k, ragged: variants.narrowing_mismatch(  # noqa: E731
        tuning, mask, d, 4096, seqlen_k, ragged)
    assert "ragged" in mismatch("tail48", "none", 128, 4096, True)
    assert "seqlen_k=4200" in mismatch("tail48", "none", 128, 4200, False)  # 152 keys in the last block
    assert "seqlen_k=100" in mismatch("tail128", "none", 128, 100, False)  # one block
    assert "head dim 64" in mismatch("tail48", "none", 64, 4096, False)
    # A mask keeps the full width, and other tunings narrow nothing.
    assert mismatch("tail48", "causal", 128, 4200, False) is None
    assert mismatch("default", "none", 128, 4200, True) is None


@pytest.mark.parametrize("tuning", ["diag", "short_wg2_diag", "short_diag"])
def test_a_diagonal_tuning_is_refused_where_the_diagonal_is_not_block_aligned(tuning):
    mismatch = variants.narrowing_mismatch
    for seqlen_q, seqlen_k in ((4096, 4096), (1000, 1128), (333, 77), (1, 129)):
        assert mismatch(tuning, "causal", 128, seqlen_q, seqlen_k, False) is None
    assert "seqlen_q=700, seqlen_k=300" in mismatch(tuning, "causal", 128, 700, 300, False)
    assert "seqlen_q=1000, seqlen_k=1001" in mismatch(tuning, "causal", 64, 1000, 1001, False)
    assert "ragged" in mismatch(tuning, "causal", 128, 4096, 4096, True)
    # Without a mask (an ablation row's other variant) nothing is narrowed.
    assert mismatch(tuning, "none", 128, 700, 300, False) is None
