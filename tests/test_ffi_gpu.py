"""GPU tier: the forward and backward custom calls end to end (library -> handler -> routed
variant -> kernel), and what their handlers refuse."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.abi import targets
from fa4_jax.runtime import dispatch, ffi
from fa4_jax.core.params import AttentionParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not dispatch.available(), reason="needs the built library and an sm_90 GPU"),
]
FWD_TARGET = targets.TARGETS["fwd"].current.name
BWD_TARGET = targets.TARGETS["bwd"].current.name


def _naive(q, k, v, p: AttentionParams):
    """fp32 attention with the mask semantics of AttentionParams (bottom-right aligned)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * p.softmax_scale
    if p.softcap is not None:
        s = p.softcap * jnp.tanh(s / p.softcap)
    sq, sk = q.shape[1], k.shape[1]
    i = jnp.arange(sq)[:, None] + (0 if p.top_left else sk - sq)
    j = jnp.arange(sk)[None, :]
    visible = jnp.ones((sq, sk), bool)
    if p.causal:
        visible &= j <= i
    if p.window_left is not None:
        visible &= j >= i - p.window_left
    if p.window_right is not None:
        visible &= j <= i + p.window_right
    s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    w = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v), lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_left": 5, "window_right": 0},
                                  {"window_left": 7}, {"causal": True, "window_left": 3}])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("top_left", [False, True])
def test_forward_matches_naive(dtype, d, mask, softcap, top_left):
    b, sq, sk, h, hk = 2, 77, 93, 4, 2
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, sq, h, d), dtype)
    k = jax.random.normal(keys[1], (b, sk, hk, d), dtype)
    v = jax.random.normal(keys[2], (b, sk, hk, d), dtype)
    p = AttentionParams(softmax_scale=1 / math.sqrt(d), softcap=softcap, top_left=top_left, **mask)
    assert dispatch.unsupported_reason(q, k, v, p) is None
    out, lse = jax.jit(lambda q, k, v: dispatch.forward(q, k, v, p))(q, k, v)
    ref_out, ref_lse = _naive(q, k, v, p)
    assert out.shape == (b, sq, h, d) and out.dtype == dtype and lse.shape == (b, h, sq)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_a_head_dim_no_kernel_serves_is_named():
    # Every multiple of 8 up to 256 runs on a compiled pair (zero-padded where it has none of its
    # own); past the widest compiled one the reason names the call's dims.
    q = jnp.ones((1, 8, 2, 264), jnp.bfloat16)
    params = AttentionParams(softmax_scale=0.1)
    for kind in ("fwd", "bwd"):
        reason = dispatch.unsupported_reason(q, q, q, params, kind)
        assert reason is not None and f"no {kind} kernel" in reason and "head dim 264" in reason


def _forward_of(q, target=FWD_TARGET):
    return jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                     jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))


def test_handler_rejects_bad_shapes():
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    k = jnp.ones((1, 8, 3, 64), jnp.bfloat16)  # 2 heads of q do not group over 3 of k
    with pytest.raises(Exception, match="multiple of heads"):
        jax.block_until_ready(_forward_of(q)(q, k, k, *ffi.seq_used(None), **_ATTRS))


def test_handler_refuses_a_tuning_attribute():
    # The shipping library's attributes describe the problem only; a tuning is the development
    # library's (benchmarks/ablations.py).
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="unexpected attribute tuning"):
        jax.block_until_ready(_forward_of(q)(q, q, q, *ffi.seq_used(None), **_ATTRS, tuning="default"))


def test_handler_refuses_an_attribute_it_does_not_read():
    # A misspelt attribute would otherwise change nothing, silently.
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="unexpected attribute window_lft"):
        jax.block_until_ready(_forward_of(q)(q, q, q, *ffi.seq_used(None), **_ATTRS,
                                             window_lft=np.int32(3)))


def test_handler_names_an_optional_operand_count_it_does_not_take():
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    wrong = {**_ATTRS, "optional_operands": np.int32(3)}
    with pytest.raises(Exception, match="optional_operands must be 0, 4 .* or 5 .*; got 3"):
        jax.block_until_ready(_forward_of(q)(q, q, q, *ffi.seq_used(None), **wrong))


def test_handler_names_optional_operands_the_call_does_not_pass():
    # The attribute says segment ids and span tables; the call passes none.
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    segments = {**_ATTRS, "optional_operands": np.int32(targets.SEGMENT_OPERANDS)}
    with pytest.raises(Exception, match=r"0 operands after seq_used_k, expected optional_operands = 4 "
                                        r"\(q_segment_ids, kv_segment_ids, row_spans, key_spans\)"):
        jax.block_until_ready(_forward_of(q)(q, q, q, *ffi.seq_used(None), **segments))


def test_a_legacy_target_takes_the_calls_it_took():
    # An earlier release's name fixes its optional operands: its calls carry no count, and one
    # that does is refused as from a newer program.
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    legacy = next(t for t in targets.TARGETS["fwd"].legacy if t.optional_operands == 0)
    problem = {name: value for name, value in _ATTRS.items() if name != "optional_operands"}
    out, lse = _forward_of(q, legacy.name)(q, q, q, *ffi.seq_used(None), **problem)
    want, want_lse = _forward_of(q)(q, q, q, *ffi.seq_used(None), **_ATTRS)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(lse, want_lse)
    with pytest.raises(Exception, match="unexpected attribute optional_operands"):
        jax.block_until_ready(_forward_of(q, legacy.name)(q, q, q, *ffi.seq_used(None), **_ATTRS))


def test_handler_names_a_wrong_length_operand():
    q = jnp.ones((2, 8, 2, 64), jnp.bfloat16)
    call = _forward_of(q)
    full = jnp.full((2,), 8, jnp.int32)
    with pytest.raises(Exception, match=r"seq_used_k has shape \[3\], expected \[2\]"):
        jax.block_until_ready(call(q, q, q, full, jnp.full((3,), 8, jnp.int32), **_ATTRS))
    # Empty operands mean a dense batch only when both are empty.
    empty, _ = ffi.seq_used(None)
    with pytest.raises(Exception, match=r"seq_used_q has shape \[0\], expected \[2\]"):
        jax.block_until_ready(call(q, q, q, empty, full, **_ATTRS))


_ATTRS = dict(softmax_scale=np.float32(1), causal=False, window_left=np.int32(-1),
              window_right=np.int32(-1), softcap=np.float32(0), top_left=False,
              optional_operands=np.int32(0))


def _backward_workspace_call(dpsum_rows=128, copies=1, d_lse_batch=1):
    b, s, h, d = 1, 100, 2, 64
    q = jnp.ones((b, s, h, d), jnp.bfloat16)
    stats = jnp.zeros((b, h, s), jnp.float32)
    d_lse = jnp.zeros((d_lse_batch, h, s), jnp.float32)
    sq_pad = 128
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3 + [
        jax.ShapeDtypeStruct((copies, b, h, sq_pad, d), jnp.float32),
        jax.ShapeDtypeStruct((b, h, dpsum_rows), jnp.float32),
        jax.ShapeDtypeStruct((b, h, sq_pad), jnp.float32),
        jax.ShapeDtypeStruct((copies, b, h, sq_pad // 64), jnp.int32),
    ]
    call = jax.ffi.ffi_call(BWD_TARGET, results)
    return lambda: jax.block_until_ready(call(q, q, q, q, q, stats, d_lse, *ffi.seq_used(None),
                                              deterministic=True, **_ATTRS))


def test_backward_handler_rejects_a_wrong_workspace():
    with pytest.raises(Exception, match=r"dpsum has shape \[1, 2, 100\], expected \[1, 2, 128\]"):
        _backward_workspace_call(dpsum_rows=100)()  # dpsum must be padded to sq_pad


def test_backward_handler_takes_d_lse_whole_or_empty():
    _backward_workspace_call(d_lse_batch=0)()  # lse not differentiated
    with pytest.raises(Exception, match=r"d_lse has shape \[2, 2, 100\], expected \[1, 2, 100\]"):
        _backward_workspace_call(d_lse_batch=2)()


def test_backward_handler_rejects_more_dq_copies_than_the_kernels_take():
    with pytest.raises(Exception, match=r"dq_accum must be \[copies, b, h, sq_pad, d\] with 1 <= copies <= 2"):
        _backward_workspace_call(copies=3)()
