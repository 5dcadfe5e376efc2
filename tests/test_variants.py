"""CPU tier: the variant menu and the selection rule the C++ handler mirrors."""
import dataclasses
import re

import pytest

from fa4_jax.aot import variants
from fa4_jax.aot.variants import MENU, Variant, select


def test_menu_covers_the_axes_once():
    assert len(MENU) == 2 * len(variants.DTYPES) * len(variants.HEAD_DIMS) * 3 * 2
    assert len({v.name for v in MENU}) == len(MENU)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.name) for v in MENU)
    assert {v.arch for v in MENU} == {"sm_90a"}
    assert {v.tuning for v in MENU} == {"default"}


def test_every_forward_variant_has_a_backward_twin():
    # A call the forward kernel serves is differentiated by kernels too.
    forward = {dataclasses.replace(v, kind="bwd") for v in MENU if v.kind == "fwd"}
    assert forward == {v for v in MENU if v.kind == "bwd"}


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
    assert select("bf16", 96, 96, False, None, None, False) not in MENU


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
