"""CPU tier: the kernels' constructors refuse tunings they cannot compile correctly, and resolve
the per-head-dim settings as the tile tables say.

Builds the kernel objects only (no compile); needs the DSL, so it skips where cutlass is absent.
"""
import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402

from fa4_jax.kernels.sm90 import hardware, menu as sm90  # noqa: E402
from fa4_jax.kernels.sm90.bwd import Barrier as BwdBarrier  # noqa: E402
from fa4_jax.kernels.sm90.bwd import FlashAttentionBackwardSm90  # noqa: E402
from fa4_jax.kernels.sm90.fwd import Barrier as FwdBarrier  # noqa: E402
from fa4_jax.kernels.sm90.fwd import TILE_CONFIGS, FlashAttentionForwardSm90  # noqa: E402


def _kernel(mask="causal", head_dim=128, **tuning):
    return FlashAttentionForwardSm90(cutlass.BFloat16, head_dim, head_dim, mask, False, **tuning)


@pytest.mark.parametrize("tuning", [
    dict(mma_warp_groups=1),  # ping-pong needs a second warp group
    dict(mma_warp_groups=4),  # no register budget for four
    dict(tile_n=100),  # not a multiple of P·V's k16 steps
    dict(tile_n=256, kv_stages=3),  # more shared memory than a CTA has
    dict(exp2_poly_share=1.5),
    dict(no_such_knob=1),
])
def test_bad_tunings_are_refused(tuning):
    with pytest.raises((ValueError, TypeError)):
        _kernel(**tuning)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d128_pingpong_is_off_under_a_mask_only(mask):
    assert _kernel(mask).pingpong is (mask == "none")
    assert _kernel(mask, pingpong=True).pingpong


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d256_takes_pingpong_under_a_mask_only(mask):
    assert _kernel(mask, head_dim=256).pingpong is (mask == "causal")


@pytest.mark.parametrize("mask, width", [("none", 176), ("causal", 128), ("local", 128)])
def test_d128_key_blocks_are_narrower_under_a_mask(mask, width):
    assert _kernel(mask).tile_n == width
    # The knob sets both widths, so an ablation row means the same block at every mask.
    assert _kernel(mask, tile_n=192).tile_n == 192


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d64_padded_warp_groups_skip_their_gemms(mask):
    assert _kernel(mask, head_dim=64).config.skip_padded_groups
    assert not _kernel(mask, head_dim=64, skip_padded_groups=False).config.skip_padded_groups
    assert not _kernel(mask).config.skip_padded_groups  # d128: unmeasured, off
    with pytest.raises(ValueError, match="skip_padded_groups"):
        FlashAttentionForwardSm90(cutlass.BFloat16, 64, 64, "none", False, tail_keys=48)


def test_tile_shapes_fit_the_hardware():
    for (d, dv), config in TILE_CONFIGS.items():
        for masked in (False, True):
            resolved = config.for_mask(masked)
            assert resolved.smem_bytes(d, dv) + 1024 <= hardware.SMEM_BYTES, (d, dv, masked)
    # The register budgets against the CTA's pool: tests/test_register_pool.py.


def test_named_barriers_fit_the_hardware():
    forward = [int(b) for b in FwdBarrier] + [FwdBarrier.PINGPONG + g for g in range(3)]
    backward = [int(b) for b in BwdBarrier]
    for ids in (forward, backward):
        assert 0 not in ids and max(ids) < hardware.NAMED_BARRIERS


def test_tail_routes_agree_with_the_tile_table():
    # The menu's tail routes carry d128's unmasked tile_n for the run-time rule.
    for route in (r for r in sm90.ROUTES if r.tail_tile_n):
        kernel = _kernel("none", route.head_dim)
        assert kernel.tile_n == route.tail_tile_n
        tuned = _kernel("none", route.head_dim, **sm90.TUNINGS[route.tuning])
        assert tuned.tail_keys == route.tail_keys
        # Under a mask the tail block keeps the full width.
        assert _kernel("causal", route.head_dim, **sm90.TUNINGS[route.tuning]).tail_keys == 0


def test_diagonal_routes_agree_with_the_kernels():
    for route in (r for r in sm90.ROUTES if r.diagonal_block):
        kernel = _kernel("causal", route.head_dim, **sm90.TUNINGS[route.tuning])
        assert kernel.diagonal_keys == 64 and kernel.tile_m == kernel.tile_n == route.diagonal_block
        # Softcap kernels keep the full diagonal, so the routes take no softcap.
        assert route.softcap is False
        softcapped = FlashAttentionForwardSm90(cutlass.BFloat16, route.head_dim, route.head_dim, "causal",
                                               True, **sm90.TUNINGS[route.tuning])
        assert softcapped.diagonal_keys == 0


@pytest.mark.parametrize("tuning", [dict(tail_keys=40), dict(tail_keys=176), dict(tail_keys=-16)])
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
    (256, dict(dq_writers=4)),  # the producer group has three warps besides the loader
    (128, dict(stages=3)),  # pds_stages 2 does not divide it
    (128, dict(row_stats_ahead=-1)),
    (64, dict(no_such_knob=1)),
    # Releasing Q and dO early needs dK's GEMM before dQ's, with dSᵀ from shared memory.
    (128, dict(release_early=True)),
    (192, dict(release_early=True, dq_during_dk=True, scores_ahead=False)),
])
def test_bad_backward_tunings_are_refused(head_dim, tuning):
    with pytest.raises((ValueError, TypeError)):
        _backward(head_dim, **tuning)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_only_d256_releases_q_and_do_before_its_dq_gemm(head_dim):
    # Releasing early needs dV, dK, then dQ issued in that order, with P and dSᵀ from shared
    # memory: d192's and d256's shape, where only d256 (one Q/dO stage) measured a gain.
    assert _backward(head_dim).config.release_early == (head_dim == 256)
    assert _backward(192, release_early=True).config.release_early


def test_d64_backward_tiles_are_128_rows_except_with_softcap():
    # 128-row tiles split the dQ GEMM by rows; softcap's fp32 pass would spill on them.
    plain, capped = _backward(64), _backward(64, softcap=True)
    assert (plain.tile_m, plain.dq_row_groups, plain.dq_cols) == (128, 2, 64)
    assert (capped.tile_m, capped.dq_row_groups, capped.dq_cols) == (64, 1, 32)
    assert not plain.config.dv_during_ds and capped.config.dv_during_ds


@pytest.mark.parametrize("head_dim", [96, 128])
def test_d96_d128_backward_issue_in_upstreams_order(head_dim):
    # dV after dSᵀ, dQ before dK with the hand-over under it, LSE/D read ahead; the settings
    # that turn it back must still build.
    config = _backward(head_dim).config
    assert (config.dv_during_ds, config.dq_during_dk, config.scores_ahead) == (False, True, False)
    assert config.row_stats_ahead == 16
    # d128 reads LSE before the Sᵀ GEMM, as upstream does; the Sᵀ issued ahead reads it later,
    # and refuses the combination.
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
    config = _backward(head_dim, softcap=softcap).config
    assert config.default_stores_first == (head_dim == 64)
    assert not _backward(head_dim, softcap=softcap, default_stores_first=False).config.default_stores_first


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


def _menus():
    from benchmarks import ablations
    from fa4_jax.aot import build

    for name, built in (("shipping", build.shipping_menu()), ("ablations", ablations.ablation_menu())):
        for variant in built.variants:
            yield pytest.param(built, variant, id=f"{name}:{variant.name}")


@pytest.mark.parametrize("built, variant", list(_menus()))
def test_every_menu_variant_constructs_its_kernel(built, variant):
    # A tuning its kernel refuses (an ablation's settings against a head dim's table, say) fails
    # here in seconds, not after a build's other variants have compiled.
    from fa4_jax.aot.compile import construct_kernel

    kernel = construct_kernel(variant, built.kernel_class(variant), built.tuning_kwargs(variant))
    assert kernel.head_dim == variant.head_dim
