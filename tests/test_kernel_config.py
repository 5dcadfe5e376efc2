"""CPU tier: the kernels' constructors refuse tunings they cannot compile correctly, and resolve
the per-head-dim settings as the tile tables say.

Builds the kernel objects only (no compile); needs the DSL, so it skips where cutlass is absent.
"""
import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402

from fa4_jax.kernels.sm90.bwd import FlashAttentionBackwardSm90  # noqa: E402
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


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d64_padded_warp_groups_skip_their_gemms(mask):
    # d64's default since session 16; the overlapped persistent order has no skip, so its
    # tunings turn it off rather than being refused (variants._OVERLAP).
    from fa4_jax.aot import variants

    def d64(tuning):
        kwargs = variants.TUNINGS[tuning]
        return FlashAttentionForwardSm90(cutlass.BFloat16, 64, 64, mask, False, **kwargs).config

    assert d64("default").skip_padded_groups
    assert not d64("no_skip_padded").skip_padded_groups
    assert d64("lpt_so_overlap").overlap_tiles and not d64("lpt_so_overlap").skip_padded_groups
    assert not _kernel(mask).config.skip_padded_groups  # d128: unmeasured, off
    with pytest.raises(ValueError, match="skip_padded_groups"):
        FlashAttentionForwardSm90(cutlass.BFloat16, 64, 64, mask, False, scheduler="lpt",
                                  separate_o=True, overlap_tiles=True, tile_n=128)


def test_tail_rule_agrees_with_the_tile_table():
    # variants.TAIL_CALLS carries each head dim's unmasked tile_n for the CPU-side rule.
    from fa4_jax.aot import variants

    for head_dim, tile_n in variants.TAIL_CALLS.items():
        kernel = FlashAttentionForwardSm90(cutlass.BFloat16, head_dim, head_dim, "none", False)
        assert kernel.tile_n == tile_n
        for width in variants.TAIL_WIDTHS:
            tuning = variants.TUNINGS[f"tail{width}"]
            assert FlashAttentionForwardSm90(cutlass.BFloat16, head_dim, head_dim, "none", False,
                                             **tuning).tail_keys == width
            # Under a mask the tail block keeps the full width.
            assert FlashAttentionForwardSm90(cutlass.BFloat16, head_dim, head_dim, "causal", False,
                                             **tuning).tail_keys == 0


@pytest.mark.parametrize("tuning", [dict(tail_keys=40), dict(tail_keys=176), dict(tail_keys=-16),
                                    dict(tail_keys=48, scheduler="lpt", separate_o=True,
                                         overlap_tiles=True, tile_n=128)])
def test_bad_tail_widths_are_refused(tuning):
    with pytest.raises(ValueError, match="tail_keys"):
        _kernel("none", **tuning)


def _backward(head_dim=64, mask="none", softcap=False, **tuning):
    return FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, head_dim, mask, softcap, **tuning)


@pytest.mark.parametrize("head_dim, tuning", [
    (128, dict(tile_m=96)),  # one or two 64-row WGMMA tiles per warp group only
    # d256 has one Q/dO stage: the next Q cannot load ahead.
    (256, dict(scores_ahead=True)),
    (64, dict(scores_ahead=True)),  # and d64's dq_during_dk: two overlaps of one hand-over
    (128, dict(det_free_sdq_on_read=False)),  # sdQ held to the add's completion: one writer only
    (256, dict(dq_writers=4)),  # the producer group has three warps besides the loader
    (128, dict(stages=3)),  # pds_stages 2 does not divide it
    (128, dict(row_stats_ahead=-1)),
    (128, dict(dv_after_ds_store=True, dv_during_ds=True)),  # dV is already issued earlier
    (256, dict(dv_after_ds_store=True)),  # d256's dV GEMM reads Pᵀ from shared memory
    (256, dict(do_release_early=True)),  # no hand-over under the dK GEMM to release before
    (64, dict(no_such_knob=1)),
])
def test_bad_backward_tunings_are_refused(head_dim, tuning):
    with pytest.raises((ValueError, TypeError)):
        _backward(head_dim, **tuning)


def test_d64_backward_tiles_are_128_rows_except_with_softcap():
    # 128-row tiles split the dQ GEMM by rows; softcap's fp32 pass would spill on them.
    plain, capped = _backward(64), _backward(64, softcap=True)
    assert (plain.tile_m, plain.dq_row_groups, plain.dq_cols) == (128, 2, 64)
    assert (capped.tile_m, capped.dq_row_groups, capped.dq_cols) == (64, 1, 32)
    assert not plain.config.dv_during_ds and capped.config.dv_during_ds


@pytest.mark.parametrize("head_dim", [96, 128])
def test_d96_d128_backward_issue_in_upstreams_order(head_dim):
    # dV after dSᵀ, dQ before dK with the hand-over under it, LSE/D read ahead (session 13); the
    # ablations that turn it back must still build.
    config = _backward(head_dim).config
    assert (config.dv_during_ds, config.dq_during_dk, config.scores_ahead) == (False, True, False)
    assert config.row_stats_ahead == 16
    # d128 reads LSE before the Sᵀ GEMM, as upstream does (session 16); the Sᵀ issued ahead
    # reads it later, and refuses the combination.
    assert config.lse_before_scores == (head_dim == 128)
    ahead = _backward(head_dim, scores_ahead=True, dq_during_dk=False, lse_before_scores=False)
    assert ahead.config.scores_ahead
    with pytest.raises(ValueError, match="scores_ahead and dq_during_dk"):
        _backward(head_dim, scores_ahead=True, lse_before_scores=False)
    with pytest.raises(ValueError, match="lse_before_scores"):
        _backward(head_dim, scores_ahead=True, dq_during_dk=False, lse_before_scores=True)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("softcap", [False, True])
def test_only_d64_claims_its_first_dq_add_by_default(head_dim, softcap):
    # Measured at d64 over three runs (session 20); at d256 it loses, at d128 it is mixed.
    from fa4_jax.aot import variants

    config = _backward(head_dim, softcap=softcap).config
    assert config.default_stores_first == (head_dim == 64)
    zeroed = _backward(head_dim, softcap=softcap, **variants.TUNINGS["dq_zeroed"]).config
    assert not zeroed.default_stores_first


@pytest.mark.parametrize("n", [1, 2, 3, 31, 32, 44, 88])
def test_tree_reduce_combines_every_value_in_log_depth(n):
    # The softmax's row maximum (softmax.py): every column must reach the result whatever the
    # row's width (odd widths carry their last value up a level), in ceil(log2 n) levels.
    from fa4_jax.kernels.common.softmax import tree_reduce

    leaves = [(float(v), 0) for v in range(n)]  # (value, depth)

    def combine(a, b):
        return (a[0] + b[0], max(a[1], b[1]) + 1)

    total, depth = tree_reduce(leaves, combine)
    assert total == sum(range(n))
    assert depth == (n - 1).bit_length()
