"""CPU tier: how `dispatch.forward` shapes a kernel call (split-KV, then GQA packing) and undoes
it, and the workspaces `dispatch.backward` asks for.

The kernel call itself (`ffi.forward_call`) is replaced by the fp32 reference, which records the
shapes it receives; everything around it is the code the GPU runs. So a wrong order of the two
transforms, a lost length, or a merge that mixes up entries fails here against the reference of
the original call, and the recorded shapes pin which calls are split and packed.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.api.attention import attention_params
from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.ops.bodies import _reference_backward
from fa4_jax.ops.bodies import _reference_fp32
from fa4_jax.runtime import device, dispatch, ffi
from fa4_jax.runtime.operands import KernelOperands

def _operands(lengths):
    """The operands of a call with these (q_len, kv_len), or none."""
    return KernelOperands() if lengths is None else KernelOperands(*lengths)


def _reference(q, k, v, params, lengths):
    return _reference_fp32(q, k, v, params, _operands(lengths))


_LIBRARY = ffi.Library(path="(none)", compiled=frozenset(), routes=(),
                       dq_copies_max_keys={"sm_90a": dict(sm90.DQ_COPIES_MAX_KEYS)},
                       tuning_targets=False)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def fake_kernel(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        ragged = lengths[0].shape[0] > 0
        calls.append((q.shape, k.shape, attrs["causal"], ragged))
        params = dataclasses.replace(_PARAMS[0], causal=attrs["causal"])
        return _reference(q, k, v, params, lengths if ragged else None)

    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: _MENU_LIBRARY)
    monkeypatch.setattr(ffi, "forward_call", fake_kernel)
    monkeypatch.setattr(dispatch, "_require", lambda *args: None)
    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    monkeypatch.setattr(device, "sm_count", lambda: 132)
    return calls


_PARAMS = []


def _params(*args, **kwargs):
    params = attention_params(*args, **kwargs)
    _PARAMS[:] = [params]
    return params


@pytest.mark.parametrize("ragged", [False, True])
def test_decode_is_split_then_packed_and_merged_back(next_key, kernel_calls, ragged):
    batch, seqlen_k, heads_q, heads_kv, d = 2, 4096, 8, 2, 16
    q = jax.random.normal(next_key(), (batch, 1, heads_q, d), jnp.float32)
    k, v = (jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, d), jnp.float32)
            for _ in range(2))
    params = _params(q, k, v, causal=True, implementation="reference")
    lengths = None
    if ragged:
        lengths = (jnp.asarray([1, 1], jnp.int32), jnp.asarray([1500, 3000], jnp.int32))
    out, lse = dispatch.forward(q, k, v, params, _operands(lengths))
    want_out, want_lse = _reference(q, k, v, params, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    # 4 tiles want 66 splits; 4096 keys allow 4 of 1024: one kernel call over 8 entries, each
    # with the 4 query heads of a KV head as rows, the mask dropped (one row sees every key).
    assert kernel_calls == [((batch * 4, heads_q // heads_kv, heads_kv, d),
                             (batch * 4, seqlen_k // 4, heads_kv, d), False, ragged)]


def test_long_calls_go_to_the_kernel_unchanged(next_key, kernel_calls):
    q, k, v = (jax.random.normal(next_key(), (1, 300, 4, 16), jnp.float32) for _ in range(3))
    params = _params(q, k[:, :, :2], v[:, :, :2], causal=True, implementation="reference")
    out, _ = dispatch.forward(q, k[:, :, :2], v[:, :, :2], params)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(
        q, k[:, :, :2], v[:, :, :2], params, None)[0]), rtol=1e-6)
    assert kernel_calls == [((1, 300, 4, 16), (1, 300, 2, 16), True, False)]


def test_explicit_settings_turn_both_off(next_key, kernel_calls):
    q = jax.random.normal(next_key(), (2, 1, 8, 16), jnp.float32)
    k, v = (jax.random.normal(next_key(), (2, 4096, 2, 16), jnp.float32) for _ in range(2))
    params = _params(q, k, v, implementation="reference")
    dispatch.forward(q, k, v, params, split_kv=1, pack_gqa=False)
    assert kernel_calls == [((2, 1, 8, 16), (2, 4096, 2, 16), False, False)]


def test_top_left_decode_is_neither_split_nor_packed(next_key, kernel_calls):
    # One top-left causal query row sees only the first key: no chunk of keys or packed head
    # row may drop the mask.
    q = jax.random.normal(next_key(), (2, 1, 8, 16), jnp.float32)
    k, v = (jax.random.normal(next_key(), (2, 4096, 2, 16), jnp.float32) for _ in range(2))
    params = dataclasses.replace(_params(q, k, v, causal=True, implementation="reference"), top_left=True)
    _PARAMS[:] = [params]
    out, lse = dispatch.forward(q, k, v, params)
    assert kernel_calls == [((2, 1, 8, 16), (2, 4096, 2, 16), True, False)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(v[:, :1].repeat(4, axis=2)), rtol=1e-6)


@pytest.mark.parametrize("head_dim,head_dim_v,seqlen_k,deterministic,copies", [
    (128, 128, 300, True, 1),
    (256, 256, 300, False, 1),
    (256, 256, 300, True, 2),
    (192, 128, 8192, True, 2),
    (192, 128, 8193, True, 1),
])
def test_backward_workspaces_hold_the_dq_copies_of_the_call(monkeypatch, head_dim, head_dim_v,
                                                            seqlen_k, deterministic, copies):
    # Deterministic d192/d256 calls of up to 8k keys get two dQ accumulators and two semaphore
    # sets; the handler reads the count off dq_accum, so these shapes are the whole of the choice.
    results = []

    def fake_ffi_call(target, result_types):
        results.extend(result_types)
        return lambda *operands, **attrs: tuple(jnp.zeros(r.shape, r.dtype) for r in result_types)

    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    monkeypatch.setattr(dispatch, "_require", lambda *args: None)
    monkeypatch.setattr(device, "device_arch", lambda: ("sm_90a", None))
    b, s, h = 2, 300, 4
    q = jnp.zeros((b, s, h, head_dim), jnp.bfloat16)
    k = jnp.zeros((b, seqlen_k, h, head_dim), jnp.bfloat16)
    v = jnp.zeros((b, seqlen_k, h, head_dim_v), jnp.bfloat16)
    out = jnp.zeros((b, s, h, head_dim_v), jnp.bfloat16)
    lse = jnp.zeros((b, h, s), jnp.float32)
    params = attention_params(q, k, v, deterministic=deterministic, implementation="reference")
    dispatch.backward(q, k, v, out, lse, out, lse, params, library=_MENU_LIBRARY)
    dq_accum, dpsum, _, semaphore = (r.shape for r in results[3:])
    assert dq_accum == (copies, b, h, 384, head_dim)
    assert dpsum == (b, h, 384)
    assert semaphore == (copies, b, h, 384 // 64)


# ------------------------------------------------- head dims served zero-padded by wider kernels

_MENU_LIBRARY = dataclasses.replace(
    _LIBRARY, compiled=frozenset(v.name for v in sm90.MENU),
    head_dims={sm90.ARCH: frozenset(sm90.HEAD_DIMS)})


def _as_attributed(params, attrs):
    """params with the softmax scale the kernel call was given."""
    return dataclasses.replace(params, softmax_scale=float(attrs["softmax_scale"]))


@pytest.mark.parametrize("head_dims,served,served_backward", [
    ((8, 8), (32, 32), (32, 32)), ((40, 40), (64, 64), (64, 64)), ((64, 32), (64, 64), (64, 64)),
    ((72, 72), (80, 80), (96, 96)), ((80, 80), (80, 80), (96, 96)),
    ((128, 64), (128, 128), (128, 128)), ((136, 72), (160, 160), (160, 160)),
    ((168, 128), (192, 128), (192, 128)), ((192, 192), (256, 256), (256, 256)),
    ((248, 8), (256, 256), (256, 256)), ((96, 96), (96, 96), (96, 96)),
])
def test_every_head_dim_runs_on_the_narrowest_wider_kernel(next_key, monkeypatch, head_dims, served,
                                                           served_backward):
    # The fake kernels take only compiled head dims and check that the padding they see is zero,
    # then compute the fp32 reference: a wrong slice, a padded column that is not zero, or a
    # softmax scale taken from the padded dim fails against the call's own reference.
    head_dim, head_dim_v = head_dims
    seen = []

    def padding_is_zero(x, width):
        assert not np.asarray(x[..., width:], np.float32).any()

    def fake_forward(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        seen.append(("fwd", q.shape[-1], v.shape[-1]))
        for x, width in ((q, head_dim), (k, head_dim), (v, head_dim_v)):
            padding_is_zero(x, width)
        return _reference(q, k, v, _as_attributed(params, attrs), None)

    def fake_backward(library, q, k, v, out, lse, d_out, d_lse, lengths, attrs, deterministic,
                      dq_copies, tuning=None, segments=None):
        seen.append(("bwd", q.shape[-1], v.shape[-1]))
        for x, width in ((q, head_dim), (k, head_dim), (v, head_dim_v), (out, head_dim_v),
                         (d_out, head_dim_v)):
            padding_is_zero(x, width)
        return _reference_backward(q, k, v, out, lse, d_out, d_lse, _as_attributed(params, attrs),
                                   KernelOperands())

    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    monkeypatch.setattr(device, "sm_count", lambda: 132)
    monkeypatch.setattr(ffi, "forward_call", fake_forward)
    monkeypatch.setattr(ffi, "backward_call", fake_backward)
    q, k = (jax.random.normal(next_key(), (2, 96, 4, head_dim), jnp.bfloat16) for _ in range(2))
    v = jax.random.normal(next_key(), (2, 96, 4, head_dim_v), jnp.bfloat16)
    params = attention_params(q, k, v, causal=True, implementation="reference")
    assert dispatch.unsupported_reason(q, k, v, params, "bwd", _MENU_LIBRARY) is None
    out, lse = dispatch.forward(q, k, v, params, library=_MENU_LIBRARY)
    want_out, want_lse = _reference(q, k, v, params, None)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    d_out = jax.random.normal(next_key(), out.shape, jnp.bfloat16)
    grads = dispatch.backward(q, k, v, out, lse, d_out, None, params, library=_MENU_LIBRARY)
    want = _reference_backward(q, k, v, out, lse, d_out, None, params, KernelOperands())
    for got, expected, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                                   rtol=2e-2, atol=2e-2)
    assert seen == [("fwd", *served), ("bwd", *served_backward)]
    assert dispatch.backward_variant(q, k, v, params, library=_MENU_LIBRARY).head_dim == served_backward[0]


def test_no_wider_kernel_says_which_dims_are_missing(monkeypatch):
    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    library = dataclasses.replace(_MENU_LIBRARY, head_dims={sm90.ARCH: frozenset({(64, 64), (128, 128)})})
    q = jax.ShapeDtypeStruct((1, 64, 2, 136), jnp.bfloat16)
    params = attention_params(q, q, q, implementation="reference")
    reason = dispatch.unsupported_reason(q, q, q, params, "fwd", library)
    assert "head dim 136" in reason and "or wider" in reason
    assert dispatch.unsupported_reason(q, q, q, params, "fwd", _MENU_LIBRARY) is None


def test_ragged_operands_reach_the_kernels_as_they_are(monkeypatch, next_key):
    # The kernels make a ragged entry's padding harmless themselves (the forward's epilogue and
    # V zeroing, the backward's shared-memory zeroing of Q, dO, K and V): the dispatch hands q,
    # k, v and d_out over unchanged, NaN padding and all (each zeroing pass read and wrote a
    # whole operand).
    seen = {}
    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    monkeypatch.setattr(dispatch, "_require", lambda *args, **kwargs: None)
    monkeypatch.setattr(ffi, "forward_call", lambda library, q, k, v, lengths, *rest, **kw:
                        seen.update(fwd=(q, k, v, lengths)) or (q, None))
    monkeypatch.setattr(ffi, "backward_call", lambda library, q, k, v, out, lse, d_out, d_lse, lengths, *rest, **kw:
                        seen.update(bwd=(q, k, v, d_out, lengths)) or (q, k, v))
    q, k, v, d_out = (jax.random.normal(next_key(), (2, 8, 1, 32), jnp.bfloat16) for _ in range(4))
    lengths = (jnp.asarray([8, 5], jnp.int32), jnp.asarray([3, 8], jnp.int32))
    q, d_out = (x.at[1, 5:].set(jnp.nan) for x in (q, d_out))
    k, v = (x.at[0, 3:].set(jnp.nan) for x in (k, v))
    params = attention_params(q, k, v, implementation="reference")
    library = _MENU_LIBRARY
    dispatch.forward(q, k, v, params, KernelOperands(*lengths), library=library, pack_gqa=False, split_kv=1)
    dispatch.backward(q, k, v, q, None, d_out, None, params, KernelOperands(*lengths), library=library, copies=1)
    for got, want in zip(seen["fwd"][:3] + seen["bwd"][:4], (q, k, v, q, k, v, d_out)):
        assert got is want
    for got in (seen["fwd"][3], seen["bwd"][4]):
        np.testing.assert_array_equal(np.asarray(got[0]), [8, 5])
        np.testing.assert_array_equal(np.asarray(got[1]), [3, 8])
