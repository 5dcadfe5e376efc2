"""CPU tier: the shipping menu (the union of the arch folders'), variant names, and the routing
rules that send a call to a tuned variant (fa4_jax.abi.routing; the handler's copy is checked against
this one in test_build.py)."""
import itertools
import re

import pytest

from fa4_jax.abi import routing
from fa4_jax.aot import menu
from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.abi.routing import Call, Route, Variant

COMPILED = {v.name for v in menu.MENU}


def choose(kind="fwd", mask="none", head_dim=128, seqlen_q=4096, seqlen_k=4096, softcap=False,
           ragged=False, top_left=False, dtype="bf16"):
    head_dim_v = dict(sm90.HEAD_DIMS)[head_dim]
    call = Call(kind, "sm_90a", dtype, head_dim, head_dim_v, mask, softcap, seqlen_q, seqlen_k, ragged,
                top_left)
    return routing.choose(call, sm90.ROUTES, COMPILED).tuning


def test_menu_covers_the_axes_once():
    defaults = [v for v in sm90.MENU if v.tuning == "default"]
    for kind, segments in itertools.product(routing.KINDS, (False, True)):
        # dtypes x head dims x masks x softcap, with segment ids and without
        head_dims = sm90.HEAD_DIMS if kind == "fwd" else sm90.BACKWARD_HEAD_DIMS
        assert sum(v.kind == kind and v.segments == segments and not v.mask_array
                   for v in defaults) == 2 * len(head_dims) * 3 * 2
        # A mask array's kernels: dtypes x head dims, its rules folded into the bits.
        mask_arrays = {(v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap)
                       for v in defaults if v.kind == kind and v.mask_array}
        assert mask_arrays == {(dtype, d, dv, "none", False)
                               for dtype, (d, dv) in itertools.product(routing.DTYPES, head_dims)}
    # Segment ids' kernels run the default tuning only (the routes that narrow a tile's first
    # blocks assume the causal mask's own); a mask array's tuned kernels narrow none.
    assert all(v.tuning == "default" for v in menu.MENU if v.segments and not v.mask_array)
    for r in sm90.ROUTES:
        assert not r.mask_array or not (r.diagonal_block or r.tail_tile_n), r
    assert len(COMPILED) == len(menu.MENU)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.name) for v in menu.MENU)
    assert {v.arch for v in menu.MENU} == {"sm_90a", "sm_100f"}
    assert menu.ARCHES == ("sm_90a", "sm_100f")


def test_every_shipped_variant_is_reachable():
    # The menu holds only what a public call can reach: the defaults, and each route's tuning.
    routed = {(r.kind, r.mask, r.head_dim, r.tuning, r.mask_array) for r in sm90.ROUTES}
    for v in sm90.MENU:
        assert v.tuning == "default" or (v.kind, v.mask, v.head_dim, v.tuning, v.mask_array) in routed, v.name
        assert v.tuning in sm90.TUNINGS
    # And each route's variants exist at both dtypes (and the softcap settings it takes).
    for r, dtype in itertools.product(sm90.ROUTES, routing.DTYPES):
        for softcap in ((False, True) if r.softcap is None else (r.softcap,)):
            v = Variant("sm_90a", dtype, r.head_dim, dict(sm90.HEAD_DIMS)[r.head_dim], r.mask, softcap,
                        r.kind, r.tuning, segments=r.mask_array, mask_array=r.mask_array)
            assert v.name in COMPILED


def test_every_backward_variant_has_a_forward_twin():
    backward = {(v.arch, v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap, v.segments)
                for v in menu.MENU if v.kind == "bwd"}
    forward = {(v.arch, v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap, v.segments)
               for v in menu.MENU if v.kind == "fwd"}
    assert backward <= forward
    # A forward-only head dim's backward runs on a wider compiled pair.
    for d, dv in set(sm90.HEAD_DIMS) - set(sm90.BACKWARD_HEAD_DIMS):
        assert routing.serving_head_dims(d, dv, sm90.BACKWARD_HEAD_DIMS) is not None


def test_name():
    assert Variant("sm_90a", "bf16", 128, 128, "causal", True).name == "fwd_sm90a_bf16_d128_dv128_causal_softcap"
    assert Variant("sm_100f", "fp16", 64, 64, "none", False).name == "fwd_sm100f_fp16_d64_dv64"
    assert Variant("sm_90a", "bf16", 192, 128, "local", False, "bwd").name == "bwd_sm90a_bf16_d192_dv128_local"
    assert Variant("sm_90a", "bf16", 128, 128, "none", False, "fwd", "tail48").name == \
        "fwd_sm90a_bf16_d128_dv128_ttail48"
    assert Variant("sm_90a", "fp16", 64, 64, "causal", True, "bwd", segments=True).name == \
        "bwd_sm90a_fp16_d64_dv64_causal_softcap_segments"


def test_mask_kind():
    assert routing.mask_kind(False, None, None) == "none"
    assert routing.mask_kind(True, None, None) == "causal"
    assert routing.mask_kind(False, 3, None) == "local"
    assert routing.mask_kind(False, None, 0) == "local"
    assert routing.mask_kind(True, 8, None) == "local"  # causal folds into the window's right bound


@pytest.mark.parametrize("bad", [dict(arch="gfx90a"), dict(dtype="fp8"), dict(kind="dgrad"),
                                 dict(mask="sliding"), dict(tuning="not an identifier")])
def test_bad_variant_is_refused(bad):
    fields = dict(arch="sm_90a", dtype="bf16", head_dim=64, head_dim_v=64, mask="none", softcap=False,
                  kind="fwd", tuning="default") | bad
    with pytest.raises(ValueError):
        Variant(**fields)


def test_unregistered_arch_or_tuning_is_refused():
    with pytest.raises(ValueError, match="no registered arch"):
        menu.arch_menu("sm_80")
    with pytest.raises(ValueError, match="ships no tuning"):
        menu.tuning_kwargs(Variant("sm_90a", "bf16", 128, 128, "none", False, "fwd", "tau0"))
    with pytest.raises(ValueError, match="no bwd kernel"):
        menu.kernel_class(Variant("sm_100f", "bf16", 128, 128, "none", False, "bwd"))


@pytest.mark.parametrize("head_dim", [d for d, _ in sm90.HEAD_DIMS])
def test_decode_sized_forwards_take_the_decode_tuning(head_dim):
    assert choose(head_dim=head_dim, seqlen_q=64, seqlen_k=50_000) == "decode"
    assert choose(head_dim=head_dim, seqlen_q=1, seqlen_k=1, ragged=True, softcap=True) == "decode"
    # More rows, a mask or the backward: not decode (49_984 keys fill d128's 176-key blocks,
    # so the tail rule leaves them alone too).
    assert choose(head_dim=head_dim, seqlen_q=65, seqlen_k=49_984) == "default"
    assert choose(head_dim=head_dim, mask="local", seqlen_q=1, seqlen_k=100) == "default"
    assert choose("bwd", head_dim=head_dim, seqlen_q=1, seqlen_k=100) == "default"


def test_short_causal_calls():
    # d64: the diagonal kernel where the diagonal runs along the blocks (dense, no softcap), the
    # plain short kernel otherwise, up to 1k; the default beyond.
    assert choose(mask="causal", head_dim=64, seqlen_q=1024, seqlen_k=1024) == "short_wg2_diag"
    assert choose(mask="causal", head_dim=64, seqlen_q=896, seqlen_k=1024) == "short_wg2_diag"
    assert choose(mask="causal", head_dim=64, seqlen_q=1000, seqlen_k=1001) == "short_wg2"
    assert choose(mask="causal", head_dim=64, seqlen_q=1024, seqlen_k=1024, ragged=True) == "short_wg2"
    assert choose(mask="causal", head_dim=64, seqlen_q=1024, seqlen_k=1024, softcap=True) == "short_wg2"
    assert choose(mask="causal", head_dim=64, seqlen_q=1025, seqlen_k=1025) == "default"
    # d128: short (diagonal or not) up to 1k, the diagonal default kernel up to 8k.
    assert choose(mask="causal", seqlen_q=1024, seqlen_k=1024) == "short_diag"
    assert choose(mask="causal", seqlen_q=1000, seqlen_k=1001) == "short"
    assert choose(mask="causal", seqlen_q=8192, seqlen_k=8192) == "diag"
    assert choose(mask="causal", seqlen_q=4000, seqlen_k=4001) == "default"
    assert choose(mask="causal", seqlen_q=8193, seqlen_k=8193) == "default"
    assert choose(mask="causal", seqlen_q=4096, seqlen_k=4096, softcap=True) == "default"
    # Top-left alignment puts the diagonal at offset 0: block-aligned whatever the lengths.
    assert choose(mask="causal", seqlen_q=1000, seqlen_k=1001, top_left=True) == "short_diag"
    assert choose(mask="causal", seqlen_q=3000, seqlen_k=4001, top_left=True) == "diag"
    # ... but query rows past the keys' last block see whole blocks that are not their diagonal.
    assert choose(mask="causal", seqlen_q=4096, seqlen_k=1000, top_left=True) == "default"
    assert choose(mask="causal", seqlen_q=1024, seqlen_k=1000, top_left=True) == "short_diag"
    assert choose(mask="causal", seqlen_q=1025, seqlen_k=1024, top_left=True) == "default"
    # Other head dims and masks keep the default.
    assert choose(mask="causal", head_dim=256, seqlen_q=512, seqlen_k=512) == "default"
    assert choose(mask="local", seqlen_q=512, seqlen_k=512) == "default"
    assert choose("bwd", mask="causal", seqlen_q=512, seqlen_k=512) == "default"


def test_dense_d128_forwards_take_the_narrowest_tail_that_holds_their_last_block():
    tile_n = 176
    # The benchmark grid's lengths: 2k leaves 112 keys in the last block, 4k 48, 8k 96, 16k 16.
    assert [choose(seqlen_k=s) for s in (2048, 4096, 8192, 16384)] == ["tail128", "tail48", "tail96", "tail48"]
    previous = 0
    for width in (48, 96, 128):
        for tail in (previous + 1, width):
            assert choose(seqlen_k=7 * tile_n + tail) == f"tail{width}"
        previous = width
    # A last block wider than every width, a full one, or a single block: the default.
    for seqlen_k in (7 * tile_n + 129, 8 * tile_n, tile_n):
        assert choose(seqlen_k=seqlen_k) == "default"
    assert choose(seqlen_q=1024, seqlen_k=1024) == "n128_tree"  # the short rule comes first
    assert choose(seqlen_k=4096, ragged=True) == "default"
    assert choose(head_dim=64, seqlen_k=4000) == "default"


def test_a_route_whose_variant_is_not_compiled_is_passed_over():
    call = Call("fwd", "sm_90a", "bf16", 128, 128, "none", False, 4096, 4096)  # 48 keys in the last block
    assert routing.choose(call, sm90.ROUTES, COMPILED - {call.variant("tail48").name}).tuning == "tail96"
    tails = {call.variant(f"tail{keys}").name for keys in (48, 96, 128)}
    assert routing.choose(call, sm90.ROUTES, COMPILED - tails).tuning == "default"


def test_route_conditions():
    call = Call("fwd", "sm_90a", "bf16", 128, 128, "causal", False, 1000, 1128)
    assert Route("x", "causal", 128, max_len=1128, diagonal_block=128).fits(call)
    assert not Route("x", "causal", 128, max_len=1127).fits(call)
    assert not Route("x", "causal", 128, diagonal_block=256).fits(call)
    assert not Route("x", "causal", 128, max_rows=999).fits(call)
    assert Route("x", "causal", 128, min_rows=1000).fits(call)
    assert not Route("x", "causal", 128, min_rows=1001).fits(call)
    assert not Route("x", "causal", 128, softcap=True).fits(call)
    assert not Route("x", "none", 128).fits(call)
    assert not Route("x", "causal", 64).fits(call)
    assert not Route("x", "causal", 128, kind="bwd").fits(call)
    assert not Route("x", "causal", 128, mask_array=True).fits(call)
    masked = Call("fwd", "sm_90a", "bf16", 128, 128, "causal", False, 1000, 1128, segments=True, mask_array=True)
    assert Route("x", "causal", 128, mask_array=True).fits(masked) and not Route("x", "causal", 128).fits(masked)


def test_short_d128_calls_with_a_mask_array_take_the_persistent_short_kernel():
    def masked(seqlen, head_dim=128, softcap=False):
        call = Call("fwd", "sm_90a", "bf16", head_dim, head_dim, "none", softcap, seqlen, seqlen,
                    segments=True, mask_array=True)
        return routing.choose(call, sm90.ROUTES, COMPILED).tuning

    assert [masked(s) for s in (256, 1024, 1025)] == ["short", "short", "default"]
    assert masked(512, head_dim=64) == "default"
    # The same call without a mask array keeps its own route.
    assert choose(seqlen_q=512, seqlen_k=512) == "n128_tree"


def test_dq_copies():
    rule = sm90.DQ_COPIES_MAX_KEYS
    assert routing.dq_copies(rule, 256, 8192, True) == 2
    assert routing.dq_copies(rule, 256, 8193, True) == 1
    assert routing.dq_copies(rule, 256, 1024, False) == 1
    assert routing.dq_copies(rule, 128, 1024, True) == 1


def test_the_sm100_menu_is_every_forward_problem_class_once_and_unverified():
    from fa4_jax.kernels.sm100 import menu as sm100
    from fa4_jax.kernels.sm100 import plan

    assert sm100 in menu.ARCH_MENUS and sm100.ARCH == "sm_100f" and not sm100.VERIFIED
    assert sm90.VERIFIED
    assert set(sm100.KERNELS) == {"fwd"} and all(v.kind == "fwd" for v in sm100.MENU)
    defaults = [v for v in sm100.MENU if v.tuning == "default"]
    classes = {(v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap) for v in defaults}
    assert len(classes) == len(defaults) == 2 * len(sm100.HEAD_DIMS) * 3 * 2
    assert set(sm100.HEAD_DIMS) == set(plan.TILE_CONFIGS)
    # The tuned variants are the CTA pairs, one per unmasked class at the pair's head dims.
    pairs = {(v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap) for v in sm100.MENU if v.tuning != "default"}
    assert {v.tuning for v in sm100.MENU} == {"default", "cta_pair"}
    assert pairs == {c for c in classes if c[3] == "none" and c[1:3] in plan.PAIR_TILE_CONFIGS}
    # Every head dim up to 128 runs on a compiled pair (zero-padded where it has none).
    for d in range(8, 129, 8):
        assert routing.serving_head_dims(d, d, sm100.HEAD_DIMS) is not None


@pytest.mark.parametrize("mask, ragged, head_dim, rows, tuning", [
    ("none", False, 128, 4096, "cta_pair"), ("none", False, 192, 257, "cta_pair"),
    ("none", False, 128, 256, "default"), ("none", True, 128, 4096, "default"),
    ("causal", False, 128, 4096, "default"), ("local", False, 192, 4096, "default"),
    ("none", False, 64, 4096, "default"),
    # d256's single CTA holds one 128-row tile: more rows go to the pair, unless masked or ragged.
    ("none", False, 256, 129, "cta_pair"), ("none", False, 256, 128, "default"),
    ("causal", False, 256, 4096, "default"), ("none", True, 256, 4096, "default")])
def test_blackwell_pairs_serve_dense_unmasked_calls_at_their_head_dims(mask, ragged, head_dim, rows, tuning):
    # A pair cannot zero its partner's half of V's padding, nor wait for a keyless tile's Q:
    # ragged calls and masked ones (whose tiles may see no key) stay on single CTAs, and so do
    # calls that one CTA's tile holds (256 rows, 128 at d256).
    from fa4_jax.kernels.sm100 import menu as sm100

    dv = dict(sm100.HEAD_DIMS)[head_dim]
    call = routing.Call("fwd", "sm_100f", "bf16", head_dim, dv, mask, False, rows, 4096, ragged=ragged)
    compiled = {v.name for v in sm100.MENU}
    assert routing.choose(call, sm100.ROUTES, compiled).tuning == tuning


@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100f"), ((10, 3), "sm_100f"),
                                              ((12, 0), "sm_120a"), ((8, 0), "sm_80")])
def test_arch_names_put_blackwell_datacenter_gpus_in_one_family(capability, arch):
    assert routing.arch_name(*capability) == arch
