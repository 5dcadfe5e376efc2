"""CPU tier: the variant menu and the selection rule the C++ handler mirrors."""
import dataclasses
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
    assert bounds == sorted(set(bounds)), "steps go from the shortest bound up"
    shortest = 0
    for tuning, longest in steps:
        assert tuning != "default"
        # Both ends of the step's range, either length the longer one (past the decode rows).
        low = max(shortest + 1, variants.DECODE_ROWS + 1)
        assert variants.call_tuning("fwd", mask, head_dim, longest, longest) == tuning
        assert variants.call_tuning("fwd", mask, head_dim, low, variants.DECODE_ROWS + 1) == tuning
        assert variants.call_tuning("fwd", mask, head_dim, variants.DECODE_ROWS + 1, low) == tuning
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
        shortest = longest
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
    # More rows, a mask, the backward, or an explicit tuning: unchanged.
    assert variants.call_tuning("fwd", "none", head_dim, rows + 1, 50_000) == "default"
    assert variants.call_tuning("fwd", "local", head_dim, 1, 100) == "default"
    assert variants.call_tuning("bwd", "none", head_dim, 1, 100) == "default"
    assert variants.call_tuning("fwd", "none", head_dim, 1, 100, "lpt") == "lpt"
    for dtype in variants.DTYPES:
        for softcap in (False, True):
            v = select(dtype, head_dim, head_dim_v, False, None, None, softcap, tuning="decode")
            assert v in MENU
