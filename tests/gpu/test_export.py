"""GPU tier: a `jax.export` artifact serialized from an earlier library still deserializes and
runs on this one (the custom calls' ABI: versioned targets whose attributes describe the problem,
the handler routing by shape; scripts/make_export_artifact.py made it)."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.fallbacks.reference import attention_reference
from tests.numerics import assert_close_by_rule, reference_pair
from tests.scripts import load_script

pytestmark = pytest.mark.gpu
ARTIFACT = Path(__file__).resolve().parents[1] / "data" / "attention_v2.jaxexport"


def test_the_serialized_artifact_runs_on_this_library(next_key):
    from fa4_jax.runtime import dispatch

    if not dispatch.available():
        pytest.skip("needs the built library and a GPU of its arch")
    exported = jax.export.deserialize(bytearray(ARTIFACT.read_bytes()))
    specs = load_script("make_export_artifact").argument_specs()
    arrays = [jax.random.normal(next_key(), s.shape, s.dtype) for s in specs]
    results = exported.call(*arrays)
    options = (dict(causal=True), dict(window_left=64, window_right=16, softcap=20.0))
    for i, opts in enumerate(options):
        q, k, v = arrays[3 * i:3 * i + 3]
        out, dq, dk, dv = results[4 * i:4 * i + 4]
        factor = 3 if "softcap" in opts else 2
        (ref, _), (lowp, _) = reference_pair(q, k, v, **opts)
        assert_close_by_rule(out, ref, lowp, factor=factor, name=f"call {i} out")

        def grads(compute_dtype, opts=opts):
            def loss(q, k, v):
                out = attention_reference(q, k, v, compute_dtype=compute_dtype, **opts)[0]
                return jnp.sum(out.astype(jnp.float32) ** 2)
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

        for name, got, want, want_lowp in zip(("dq", "dk", "dv"), (dq, dk, dv), grads(jnp.float32),
                                              grads(q.dtype)):
            assert np.isfinite(np.asarray(got, np.float32)).all(), name
            assert_close_by_rule(got, want, want_lowp, factor=factor, name=f"call {i} {name}")
