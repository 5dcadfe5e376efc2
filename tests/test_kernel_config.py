"""CPU tier: the forward kernel's constructor refuses tunings it cannot compile correctly.

Builds the kernel objects only (no compile); needs the DSL, so it skips where cutlass is absent.
"""
import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402

from fa4_jax.kernels.sm90.fwd import FlashAttentionForwardSm90  # noqa: E402


def _kernel(mask="causal", **tuning):
    return FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, mask, False, **tuning)


@pytest.mark.parametrize("tuning", [
    dict(overlap_tiles=True),  # one CTA per tile: no next tile to overlap with
    dict(overlap_tiles=True, scheduler="lpt"),  # O staged in Q's buffer: the next Q cannot land
    dict(mma_warp_groups=1),  # ping-pong needs a second warp group
    dict(tile_n=100),
    dict(no_such_knob=1),
])
def test_bad_tunings_are_refused(tuning):
    with pytest.raises((ValueError, TypeError)):
        _kernel(**tuning)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d128_pingpong_is_off_under_a_mask_only(mask):
    assert _kernel(mask).pingpong is (mask == "none")
    assert _kernel(mask, pingpong=True).pingpong
    assert _kernel(mask, scheduler="lpt", separate_o=True, overlap_tiles=True, tile_n=128).config.overlap_tiles


@pytest.mark.parametrize("mask, width", [("none", 176), ("causal", 128), ("local", 128)])
def test_d128_key_blocks_are_narrower_under_a_mask(mask, width):
    assert _kernel(mask).tile_n == width
    # The knob sets both widths, so an ablation row means the same block at every mask.
    assert _kernel(mask, tile_n=192).tile_n == 192
