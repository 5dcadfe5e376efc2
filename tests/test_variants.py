"""CPU tier: the variant menu and the selection rule the C++ handler mirrors."""
import re

import pytest

from fa4_jax.aot import variants
from fa4_jax.aot.variants import MENU, Variant, select


def test_menu_covers_the_axes_once():
    assert len(MENU) == 2 * 5 * 3 * 2  # dtypes x head dims x masks x softcap
    assert len({v.name for v in MENU}) == len(MENU)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.name) for v in MENU)
    assert {v.arch for v in MENU} == {"sm_90a"}


def test_name():
    v = Variant("sm_90a", "bf16", 128, 128, "causal", True)
    assert v.name == "fwd_sm90a_bf16_d128_dv128_causal_softcap"
    assert Variant("sm_100a", "fp16", 64, 64, "none", False).name == "fwd_sm100a_fp16_d64_dv64"


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
    assert v in MENU and v.softcap and v.arch == "sm_90a"
    v = select("bf16", 192, 128, True, None, None, False)
    assert v in MENU and v.name == "fwd_sm90a_bf16_d192_dv128_causal"
    assert select("bf16", 96, 96, False, None, None, False) in MENU
    assert select("bf16", 192, 192, False, None, None, False) not in MENU
    assert select("bf16", 160, 160, False, None, None, False) not in MENU


def test_bad_variant_is_refused():
    with pytest.raises(ValueError):
        Variant("sm_80", "bf16", 64, 64, "none", False)
    with pytest.raises(ValueError):
        Variant("sm_90a", "fp8", 64, 64, "none", False)
    assert variants.ARCHES == ("sm_90a", "sm_100a")
