"""CPU tier: kernels of an unverified arch (Blackwell's) are checked on first use and never
serve a call after failing (fa4_jax.verification).

The GPU side is replaced: the device reports sm_100f, the kernel call is a stand-in, and the
check's verdict is set by the test. What runs is the dispatch's real decision and the public
API's fallback around it, so a variant that failed its check but still served a call (a
poisoned result), or a check that ran twice, fails here.
"""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import dispatch, ffi, verification
from fa4_jax.backends import _reference_fp32
from fa4_jax.kernels.sm100 import menu as sm100
from fa4_jax.kernels.sm90 import menu as sm90

_REAL_CHECK = verification._check
_LIBRARY = ffi.Library(
    path="(none)", fwd_target="fa4_jax_fwd_v2", bwd_target="fa4_jax_bwd_v2",
    compiled=frozenset(v.name for v in sm100.MENU), routes=(), dq_copies_max_keys={},
    tuning_targets=False, head_dims={sm100.ARCH: frozenset(sm100.HEAD_DIMS)},
    unverified_arches=frozenset({sm100.ARCH}))


@pytest.fixture
def blackwell(monkeypatch, tmp_path):
    """A fake sm_100f device whose forward kernel returns NaN (so a call it served shows), and
    a first-use check whose verdict the test sets; returns the variants checked, in order."""
    checked = []
    verdict = {"reason": None}

    def fake_check(variant):
        checked.append(variant.name)
        return verdict["reason"]

    def poisoned_kernel(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        out = jnp.full(q.shape[:-1] + v.shape[-1:], jnp.nan, q.dtype)
        return out, jnp.full((q.shape[0], q.shape[2], q.shape[1]), jnp.nan, jnp.float32)

    monkeypatch.setattr(dispatch, "device_arch", lambda: (sm100.ARCH, None))
    monkeypatch.setattr(dispatch, "sm_count", lambda: 148)
    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: _LIBRARY)
    monkeypatch.setattr(ffi, "forward_call", poisoned_kernel)
    monkeypatch.setattr(verification, "_check", fake_check)
    monkeypatch.delenv("FA4_JAX_TRUST_UNVERIFIED", raising=False)
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path))
    verification.forget()
    # Traces of the same shapes from earlier tests would hold another stand-in kernel.
    jax.clear_caches()
    yield checked, verdict
    verification.forget()


def _inputs(seed=0, shape=(1, 96, 2, 64)):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys)


def test_blackwell_is_unverified_and_hopper_is_not(monkeypatch):
    from fa4_jax.aot import build

    monkeypatch.delenv("FA4_JAX_UNVERIFIED_ARCHES", raising=False)
    # The shipping library's manifest says so (what ffi.load reads at run time).
    assert build.manifest(build.shipping_menu())["unverified_arches"] == [sm100.ARCH]
    assert verification.unverified_arches(_LIBRARY) == {sm100.ARCH}
    monkeypatch.setenv("FA4_JAX_UNVERIFIED_ARCHES", "sm_90a, sm_120a")
    assert verification.unverified_arches(_LIBRARY) == {sm100.ARCH, sm90.ARCH, "sm_120a"}


def test_a_variant_that_passes_serves_calls_and_is_checked_once(blackwell):
    checked, _ = blackwell
    q, k, v = _inputs()
    for causal in (False, True, False):
        out = fa4_jax.attention(q, k, v, causal=causal, implementation="cute")
        # The (poisoned) kernel ran: the check let it.
        assert np.isnan(np.asarray(out, np.float32)).all()
    assert checked == ["fwd_sm100f_bf16_d64_dv64", "fwd_sm100f_bf16_d64_dv64_causal"]


def test_a_variant_that_fails_never_serves_a_call(blackwell):
    checked, verdict = blackwell
    verdict["reason"] = "FAIL out 0.5 > 0.01"
    q, k, v = _inputs(1)
    with pytest.warns(fa4_jax.FallbackWarning, match="first-use check"):
        out = fa4_jax.attention(q, k, v)
    reference, _ = _reference_fp32(q, k, v, _params(q, k, v), None)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), atol=2e-2)
    with pytest.raises(ValueError, match="first-use check"):
        fa4_jax.attention(q, k, v, implementation="cute")
    assert checked == ["fwd_sm100f_bf16_d64_dv64"]


def test_trusting_the_arch_skips_the_check(blackwell, monkeypatch):
    checked, verdict = blackwell
    verdict["reason"] = "would fail"
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "1")
    q, k, v = _inputs(2)
    out = fa4_jax.attention(q, k, v, implementation="cute")
    assert np.isnan(np.asarray(out, np.float32)).all() and checked == []


def test_a_check_that_raises_counts_as_a_failure(blackwell, monkeypatch):
    def broken(variant):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_INSTRUCTION")

    monkeypatch.setattr(verification, "_check", broken)
    q, k, v = _inputs(3)
    reason = dispatch.unsupported_reason(q, k, v, _params(q, k, v), "fwd")
    assert "ILLEGAL_INSTRUCTION" in reason and "first-use check" in reason


def test_head_dims_run_padded_are_checked_as_the_kernel_that_serves_them(blackwell):
    checked, _ = blackwell
    q, k, v = _inputs(4, shape=(1, 64, 2, 80))
    assert dispatch.unsupported_reason(q, k, v, _params(q, k, v), "fwd") is None
    assert checked == ["fwd_sm100f_bf16_d96_dv96"]


def _params(q, k, v):
    from fa4_jax.api import attention_params

    return attention_params(q, k, v, implementation="reference")


def test_the_hopper_kernels_are_not_checked(monkeypatch):
    monkeypatch.delenv("FA4_JAX_UNVERIFIED_ARCHES", raising=False)
    calls = []
    monkeypatch.setattr(verification, "_check", lambda variant: calls.append(variant) or "no")
    variant = dataclasses.replace(sm90.MENU[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verification.failure_reason(variant, _LIBRARY) is None and calls == []


def test_the_real_check_runs_inside_a_jit_trace_and_catches_a_wrong_kernel(blackwell, monkeypatch):
    # The check itself, not a stand-in: it runs on a thread of its own while the caller traces,
    # its probes reach the (poisoned) kernel through the dispatch, and their NaNs fail it.
    checked, _ = blackwell
    monkeypatch.setattr(verification, "_check", _REAL_CHECK)
    q, k, v = _inputs(5)
    with pytest.warns(fa4_jax.FallbackWarning, match="first-use check"):
        out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))(q, k, v)
    reference, _ = _reference_fp32(q, k, v, dataclasses.replace(_params(q, k, v), causal=True), None)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), atol=2e-2)
    reason = verification.results()["fwd_sm100f_bf16_d64_dv64_causal"]
    assert "out error inf" in reason and "sq=300 sk=333" in reason


def _stand_in_kernel(respect_key_lengths: bool):
    """A forward 'kernel' computed by the fp32 reference from the custom call's attributes: a
    correct one, or one that ignores the entries' key lengths (and so lets the NaN padding of
    the ragged probe's K and V into its rows, as a kernel that forgot to zero V's would)."""
    from fa4_jax.params import AttentionParams

    def kernel(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        window = tuple(None if w < 0 else int(w) for w in (attrs["window_left"], attrs["window_right"]))
        params = AttentionParams(softmax_scale=float(attrs["softmax_scale"]), causal=bool(attrs["causal"]),
                                 window_left=window[0], window_right=window[1],
                                 softcap=float(attrs["softcap"]) or None, top_left=bool(attrs["top_left"]))
        ragged = lengths[0].shape[0] > 0
        if ragged and not respect_key_lengths:
            lengths = (lengths[0], jnp.full_like(lengths[1], k.shape[1]))
        return _reference_fp32(q, k, v, params, lengths if ragged else None)

    return kernel


@pytest.mark.parametrize("respect_key_lengths", [True, False])
def test_the_ragged_probe_passes_a_correct_kernel_and_catches_one_that_reads_the_padding(
        blackwell, monkeypatch, respect_key_lengths):
    monkeypatch.setattr(verification, "_check", _REAL_CHECK)
    monkeypatch.setattr(ffi, "forward_call", _stand_in_kernel(respect_key_lengths))
    variant = next(v for v in sm100.MENU if v.name == "fwd_sm100f_bf16_d64_dv64_local")
    reason = verification.failure_reason(variant, _LIBRARY)
    if respect_key_lengths:
        assert reason is None
    else:
        assert reason is not None and "ragged entry 1" in reason and "sq=300" not in reason


def test_verdicts_are_kept_on_disk_for_the_same_library_gpu_and_driver(blackwell, monkeypatch):
    checked, verdict = blackwell
    verdict["reason"] = "FAIL out"
    variant = sm100.MENU[0]
    assert verification.failure_reason(variant, _LIBRARY) == "FAIL out"
    # A new process (the in-memory verdicts forgotten) reads the disk's and checks nothing.
    verification.forget()
    assert verification.failure_reason(variant, _LIBRARY) == "FAIL out" and len(checked) == 1
    # Another library build is checked anew.
    rebuilt = dataclasses.replace(_LIBRARY, path="(another build)")
    verification.forget()
    verdict["reason"] = None
    assert verification.failure_reason(variant, rebuilt) is None and len(checked) == 2
