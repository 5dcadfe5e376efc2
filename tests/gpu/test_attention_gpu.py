"""GPU tier: the CuTe forward kernel against the reference under docs/design.md's numerics rule.

Run with `pytest -m gpu`. A variant the built library does not serve is skipped with the
library's own reason, so a green run never overstates coverage.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import LOCAL_AND_SOFTCAP, mask_options, qkv
from tests.numerics import (
    assert_close_by_rule,
    naive_attention_fp64,
    reference_grad_pair,
    reference_pair,
    visible_mask,
)

pytestmark = pytest.mark.gpu

_UNSERVED = "implementation='cute' cannot serve this call"


def _reference_options(**options):
    return dict(mask_options(**options), softcap=options.get("softcap"))


def _cute(q, k, v, **options):
    """The kernel's (out, lse), or a skip naming why the library cannot serve this variant."""
    try:
        return fa4_jax.attention(q, k, v, return_lse=True, implementation="cute", **options)
    except ValueError as error:
        if _UNSERVED in str(error):
            pytest.skip(str(error))
        raise


def _check_forward(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                   head_dim_v=None, **options):
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, head_dim_v)
    out, lse = _cute(q, k, v, **options)
    # One jit for both oracles: eager dispatch compiles each primitive per new shape.
    (ref, ref_lse), (lowp, lowp_lse) = jax.jit(
        lambda q, k, v: reference_pair(q, k, v, **_reference_options(**options)))(q, k, v)
    factor = 3 if options.get("softcap") else 2
    assert_close_by_rule(out, ref, lowp, factor=factor, name="out")
    assert_close_by_rule(lse, ref_lse, lowp_lse, factor=factor, name="lse")
    # Nothing left unwritten: every entry is finite; rows seeing no key are exactly 0 / -inf.
    assert np.isfinite(np.asarray(out, np.float32)).all()
    visible = visible_mask(seqlen_q, seqlen_k, **mask_options(**options)).any(axis=1)
    assert np.all(np.asarray(out, np.float32)[:, ~visible] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, ~visible]))
    assert np.isfinite(np.asarray(lse)[:, :, visible]).all()
    # Fresh inputs give fresh outputs (no stale buffer served twice).
    other_out, _ = _cute(*(2 * x for x in qkv(next_key, batch, seqlen_q, seqlen_k, heads_q,
                                                  heads_kv, head_dim, dtype, head_dim_v)), **options)
    if visible.any():
        assert not np.array_equal(np.asarray(out), np.asarray(other_out))


def _routed(q, k, v, **options):
    """The tuning of the variant the handler runs for this call (fa4_jax.abi.routing's rule)."""
    from fa4_jax.runtime import dispatch
    from fa4_jax.api.attention import attention_params

    params = attention_params(q, k, v, implementation="cute", **options)
    return dispatch.forward_plan(q, k, v, params, pack_gqa=False, split_kv=1).variant.tuning


# (mask, head dim, seqlen_q, seqlen_k, the tuning the call routes to): each routed variant at
# the ends of its range (kernels/sm90/menu.py ROUTES), and the default just past them.
ROUTED_CALLS = [
    ("causal", 64, 1024, 1024, "short_wg2_diag"),
    ("causal", 64, 1000, 1001, "short_wg2"),
    ("causal", 64, 1025, 1025, "default"),
    ("causal", 128, 896, 1024, "short_diag"),
    ("causal", 128, 999, 1000, "short"),
    ("causal", 128, 2048, 2048, "diag"),
    ("causal", 128, 8064, 8192, "diag"),
    ("causal", 128, 3000, 3001, "default"),
    ("none", 128, 1000, 1000, "n128_tree"),
    ("none", 64, 64, 3000, "decode"),
]


@pytest.mark.parametrize("mask,head_dim,seqlen_q,seqlen_k,want", ROUTED_CALLS,
                         ids=[f"{m}-d{d}-{sq}x{sk}-{t}" for m, d, sq, sk, t in ROUTED_CALLS])
def test_routed_calls_run_their_variant(next_key, mask, head_dim, seqlen_q, seqlen_k, want):
    q, k, v = qkv(next_key, 1, seqlen_q, seqlen_k, 2, 2, head_dim, jnp.bfloat16)
    causal = mask == "causal"
    assert _routed(q, k, v, causal=causal) == want
    _check_forward(next_key, 1, seqlen_q, seqlen_k, 2, 2, head_dim, jnp.bfloat16, causal=causal)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,seqlen,want", [(128, 1024, "short_diag"), (128, 2048, "diag"),
                                                  (64, 1024, "short_wg2_diag")])
def test_causal_calls_run_their_narrowed_diagonal_variant(next_key, head_dim, seqlen, want, dtype, softcap):
    # Every dtype and softcap setting of the diagonal routes, routed and against the reference
    # (softcap calls take the full-diagonal kernels); GQA, and 128 fewer queries than keys.
    q, k, v = qkv(next_key, 2, seqlen - 128, seqlen, 4, 2, head_dim, dtype)
    expected = want if softcap is None else {"short_diag": "short", "diag": "default",
                                             "short_wg2_diag": "short_wg2"}[want]
    assert _routed(q, k, v, causal=True, softcap=softcap) == expected
    _check_forward(next_key, 2, seqlen - 128, seqlen, 4, 2, head_dim, dtype, causal=True, softcap=softcap)


def _tail_cases():
    """(width, keys in the last block) at both ends of each tail width's range."""
    widths = (48, 96, 128)
    narrower = (0,) + widths[:-1]
    return [(width, tail) for low, width in zip(narrower, widths) for tail in (low + 1, width)]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("width,tail", _tail_cases())
def test_dense_calls_run_their_narrowed_tail_variant(next_key, width, tail, dtype, softcap):
    # Dense d128 calls without a mask compute their last key block only as wide as the tail
    # variant's width: pin the choice, then the numerics at both ends of the width's range (the
    # keys past the tail must not leak in; none of the tail may drop).
    seqlen_q, seqlen_k = 300, 7 * 176 + tail
    q, k, v = qkv(next_key, 2, seqlen_q, seqlen_k, 4, 2, 128, dtype)
    assert _routed(q, k, v, softcap=softcap) == f"tail{width}"
    _check_forward(next_key, 2, seqlen_q, seqlen_k, 4, 2, 128, dtype, softcap=softcap)


# The first warp group's diagonal block 64 keys wide (TileConfig.first_group_diagonal) on
# block-aligned diagonals: equal lengths; 128 more keys than queries, odd lengths; 128 fewer
# (the first rows see no key, whole tiles have no block); tiles of one key block; GQA and MQA.
DIAGONAL_SHAPES = {
    "equal": (2, 1024, 1024, 8, 2),
    "more_keys_odd": (2, 1000, 1128, 4, 4),
    "fewer_keys": (3, 300, 172, 4, 1),
    "one_block": (4, 129, 129, 4, 4),
    "longer": (1, 2000, 2128, 4, 2),
}


@pytest.mark.parametrize("shape", DIAGONAL_SHAPES.values(), ids=DIAGONAL_SHAPES.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_first_groups_narrowed_diagonal(next_key, head_dim, shape):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    short = max(seqlen_q, seqlen_k) <= 1024
    want = {64: "short_wg2_diag" if short else "default", 128: "short_diag" if short else "diag"}
    assert _routed(q, k, v, causal=True) == want[head_dim]
    _check_forward(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16,
                   causal=True)


# Top-left masks (the drop-in's rule, jax.nn.dot_product_attention's): the diagonal at offset
# 0 whatever the lengths, on the kernels, forward and backward through the drop-in.
TOP_LEFT_SHAPES = {
    "q_shorter": (2, 300, 1000, 4, 2),
    "q_longer": (2, 1000, 300, 4, 2),
    "diag_routed": (1, 2000, 3000, 4, 4),
    "q_past_keys": (1, 1200, 500, 2, 2),
}


@pytest.mark.parametrize("window", [None, (64, 0), (50, 20)], ids=["causal", "causal_window", "window"])
@pytest.mark.parametrize("shape", TOP_LEFT_SHAPES.values(), ids=TOP_LEFT_SHAPES.keys())
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_top_left_masks_on_the_kernels(next_key, shape, window, dtype):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, 128, dtype)
    kwargs = dict(is_causal=window is None or window[1] == 0, local_window_size=window)
    out = fa4_jax.dot_product_attention(q, k, v, implementation="cute", **kwargs)
    # The f32 oracle at full precision: jax's default f32 matmul on a GPU is TF32, whose 10-bit
    # mantissa is fp16's, which would make the rule's bound noise for fp16.
    with jax.default_matmul_precision("highest"):
        ref = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                           implementation="xla", **kwargs)
    lowp = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    assert_close_by_rule(out, ref, lowp, name="out")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_head_dims_dtypes(next_key, head_dim, dtype, causal):
    _check_forward(next_key, 2, 1000, 1000, 4, 4, head_dim, dtype, causal=causal)


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(100, 30)),
                                     dict(softcap=5.0, causal=True)],
                         ids=["none", "causal", "window", "softcap_causal"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_v_differs(next_key, dtype, options):
    # DeepSeek's shape: q and k at 192, v and out at 128; odd lengths and GQA on top.
    _check_forward(next_key, 2, 1000, 1031, 4, 2, 192, dtype, head_dim_v=128, **options)


LENGTHS = [(1, 1), (17, 17), (113, 113), (4097, 4097), (17, 1000), (1000, 17), (113, 4097),
           (4097, 113)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_odd_and_unequal_lengths(next_key, seqlen_q, seqlen_k, causal):
    _check_forward(next_key, 1, seqlen_q, seqlen_k, 4, 2, 128, jnp.bfloat16, causal=causal)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_and_mqa(next_key, heads_q, heads_kv, dtype):
    _check_forward(next_key, 2, 513, 513, heads_q, heads_kv, 128, dtype, causal=True)


def test_fully_masked_rows(next_key):
    # causal with seqlen_q > seqlen_k: the first 200 rows see no key.
    _check_forward(next_key, 2, 300, 100, 4, 2, 128, jnp.bfloat16, causal=True)


@pytest.mark.parametrize("options", LOCAL_AND_SOFTCAP.values(), ids=LOCAL_AND_SOFTCAP.keys())
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_windows_and_softcap(next_key, head_dim, options):
    _check_forward(next_key, 1, 777, 1031, 4, 2, head_dim, jnp.bfloat16, **options)


def test_jit_matches_eager(next_key):
    q, k, v = qkv(next_key, 1, 300, 300, 4, 2, 128, jnp.bfloat16)
    eager = _cute(q, k, v, causal=True)
    jitted = jax.jit(lambda q, k, v: _cute(q, k, v, causal=True))(q, k, v)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_over_an_extra_axis(next_key):
    q, k, v = qkv(next_key, 1, 200, 200, 4, 2, 128, jnp.bfloat16)
    stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
    out, _ = jax.jit(jax.vmap(lambda q, k, v: _cute(q, k, v, causal=True)))(*stacked)
    (ref, _), (lowp, _) = reference_pair(-q, -k, -v, causal=True)
    assert_close_by_rule(out[1], ref, lowp, name="vmapped out")


def test_grad_of_jit_on_the_kernel_path(next_key):
    q, k, v = qkv(next_key, 1, 257, 257, 4, 2, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)

    def loss(q, k, v):
        out, _ = _cute(q, k, v, causal=True)
        return (out.astype(jnp.float32) * d_out.astype(jnp.float32)).sum()

    grads = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(q, k, v)
    ref, lowp = reference_grad_pair(q, k, v, d_out, causal=True)
    for name, grad, want, want_lowp in zip(("dq", "dk", "dv"), grads, ref, lowp):
        assert_close_by_rule(grad, want, want_lowp, name=name)


def test_reference_on_gpu_keeps_fp32_precision(next_key):
    # The oracle itself: fp32 matmuls must not drop to TF32 on the GPU.
    q, k, v = qkv(next_key, 1, 256, 256, 2, 2, 64, jnp.float32)
    out, lse = fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="reference")
    want_out, want_lse = naive_attention_fp64(q, k, v, softmax_scale=1 / math.sqrt(64), causal=True)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)


# Masked calls run the LPT order with its grid in the order's shape ("lpt_grid"). When an L2
# section holds fewer (batch, head) pairs than the call has and does not divide them, the last
# section is partial: part of its grid has no tile and must exit without writing. A 32 MiB
# section keeps 4 KV heads of 32k keys at d64, of 16k at d128, of 8k at d256: 6 heads make
# sections of 4 and 2. (d64's ping-pong turn is handed out once per CTA, tile or not.)
@pytest.mark.parametrize("head_dim,seqlen_k", [(64, 32768), (128, 16384), (256, 8192)])
@pytest.mark.parametrize("window_size", [(None, None), (512, None)], ids=["causal", "window"])
def test_partial_last_l2_section(next_key, head_dim, seqlen_k, window_size):
    _check_forward(next_key, 1, 300, seqlen_k, 6, 6, head_dim, jnp.bfloat16, causal=True,
                   window_size=window_size)


# Shapes that stress a scheduler: several tiles per persistent CTA (b·h·m_blocks >> 132),
# causal with more queries than keys (tiles with no key block at all), odd lengths, GQA.
SCHEDULER_SHAPES = {
    "many_tiles": (4, 1100, 1100, 16, 4),
    "sq_gt_sk": (2, 700, 300, 8, 2),
    "odd_mqa": (3, 333, 777, 8, 1),
}


@pytest.mark.parametrize("shape", SCHEDULER_SHAPES.values(), ids=SCHEDULER_SHAPES.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_short_persistent_kernels_on_many_tiles(next_key, head_dim, shape):
    # The short causal routes' persistent kernels walk several tiles per CTA.
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    _check_forward(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16, causal=True)
