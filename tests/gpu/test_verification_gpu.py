"""GPU tier: the first-use check of an unverified arch's kernels (fa4_jax.verification), run for
real on the Hopper kernels by marking sm_90a unverified, inside a jit trace as users hit it.

On a Blackwell GPU the same code checks the sm100 kernels; here it proves that the check runs
the kernel on concrete arrays during an outer trace, that a passing variant then serves the
call, and that a failing one does not (its calls still answer correctly, through the fallback).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import dispatch, selftest, verification
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule, reference_pair

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper_unverified(monkeypatch, tmp_path):
    arch, reason = dispatch.device_arch()
    if reason is not None or arch != "sm_90a":
        pytest.skip(reason or f"needs a Hopper GPU, not {arch}")
    monkeypatch.setenv("FA4_JAX_UNVERIFIED_ARCHES", "sm_90a")
    monkeypatch.delenv("FA4_JAX_TRUST_UNVERIFIED", raising=False)
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path))
    verification.forget()
    yield
    verification.forget()


def _call_and_reference(next_key, **options):
    q, k, v = qkv(next_key, 2, 333, 517, 4, 2, 128, jnp.bfloat16)
    out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
    (ref, _), (lowp, _) = jax.jit(lambda q, k, v: reference_pair(q, k, v, **options))(q, k, v)
    return out, ref, lowp


def test_a_correct_kernel_passes_its_check_inside_a_trace_and_serves_the_call(next_key, hopper_unverified):
    out, ref, lowp = _call_and_reference(next_key, causal=True)
    assert_close_by_rule(out, ref, lowp, name="out")
    checked = verification.results()
    # The variant the router picks for the call (a tuned one, at these lengths) was checked.
    assert any(name.startswith("fwd_sm90a_bf16_d128_dv128_causal") for name in checked), checked
    assert all(reason is None for reason in checked.values()), checked
    plan = fa4_jax.explain(jax.ShapeDtypeStruct((2, 333, 4, 128), jnp.bfloat16),
                           jax.ShapeDtypeStruct((2, 517, 2, 128), jnp.bfloat16),
                           jax.ShapeDtypeStruct((2, 517, 2, 128), jnp.bfloat16), causal=True)
    assert plan.backend == "cute"


def test_a_kernel_that_fails_its_check_is_not_used(next_key, hopper_unverified, monkeypatch):
    # The check's comparison says every kernel result is wrong.
    monkeypatch.setattr(selftest, "_bound_by_rule", lambda *args: (1.0, 0.0))
    with pytest.warns(fa4_jax.FallbackWarning, match="first-use check"):
        out, ref, lowp = _call_and_reference(next_key)
    assert_close_by_rule(out, ref, lowp, name="out (fallback)")
    failed = {name: reason for name, reason in verification.results().items()
              if name.startswith("fwd_sm90a_bf16_d128_dv128")}
    assert failed and all("error" in reason for reason in failed.values()), failed
    with pytest.raises(ValueError, match="first-use check"):
        q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
        fa4_jax.attention(q, q, q, implementation="cute")
    np.testing.assert_array_equal(np.isfinite(np.asarray(out, np.float32)), True)
