"""GPU tier: the first-use probes and gate (fa4_jax.runtime.probe, fa4_jax.runtime.gate) for real, on the
Hopper kernels, with sm_90a marked unverified (FA4_JAX_UNVERIFIED_ARCHES).

On a Blackwell GPU the same code checks the sm100 kernels; here it proves that the probe process
opens the caller's GPU, that real kernels pass their probes (the problems, operands, workspaces
and reference are right), that the gate probes a problem class inside a jit trace and then lets
the kernels serve it, that the handler refuses a variant nothing has checked (a `jax.export`ed
program) and runs it once checked, that a kept failure routes calls to the fallback, and that
`python -m fa4_jax selftest --only` passes.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from fa4_jax.runtime import device, dispatch, ffi, verdict_store, gate
from fa4_jax.abi import routing
from fa4_jax.api.attention import attention_params
from fa4_jax.runtime.probe import runner
from fa4_jax.runtime.probe.protocol import Verdict
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule, reference_pair

pytestmark = pytest.mark.gpu

# A few variants of each sort: a default, tunings by route, segments and mask arrays, backward.
PROBED = ("fwd_sm90a_bf16_d128_dv128", "fwd_sm90a_bf16_d128_dv128_tn128_tree", "fwd_sm90a_bf16_d128_dv128_tdecode",
          "fwd_sm90a_bf16_d128_dv128_ttail48", "fwd_sm90a_fp16_d64_dv64_causal_softcap_tshort_wg2",
          "fwd_sm90a_bf16_d64_dv64_local_segments", "fwd_sm90a_fp16_d96_dv96_boolmask",
          "bwd_sm90a_bf16_d128_dv128_causal", "bwd_sm90a_fp16_d64_dv64_local_softcap",
          "bwd_sm90a_bf16_d192_dv128_causal_segments", "bwd_sm90a_bf16_d64_dv64_boolmask")


@pytest.fixture
def hopper_unverified(monkeypatch, tmp_path):
    arch, reason = device.device_arch()
    if reason is not None or arch != "sm_90a":
        pytest.skip(reason or f"needs a Hopper GPU, not {arch}")
    monkeypatch.setenv("FA4_JAX_UNVERIFIED_ARCHES", "sm_90a")
    for variable in ("FA4_JAX_TRUST_UNVERIFIED", "FA4_JAX_DISABLE_ARCHES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path))
    gate.forget()
    yield ffi.load()
    gate.forget()


def test_real_variants_pass_their_probes_in_a_child_on_this_gpu(hopper_unverified):
    started = []
    gpu = runner.default_gpu()
    device, verdicts = runner.run(runner.Target.on(hopper_unverified.path, gpu), PROBED, on_start=started.append)
    assert device["name"] == gpu.device_kind and (device["major"], device["minor"]) == (9, 0), device
    assert started == list(PROBED)
    failed = {name: (v.verdict, v.reason) for name, v in verdicts.items() if not v.passed}
    assert not failed, failed
    for verdict in verdicts.values():
        worst = verdict.details["worst"]
        assert verdict.details["problems"] and worst["error"] <= worst["bound"], verdict


def _call_and_reference(next_key, **options):
    q, k, v = qkv(next_key, 2, 333, 517, 4, 2, 128, jnp.bfloat16)
    out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
    (ref, _), (lowp, _) = jax.jit(lambda q, k, v: reference_pair(q, k, v, **options))(q, k, v)
    return out, ref, lowp


def test_the_gate_probes_a_class_inside_a_trace_and_its_kernels_then_serve_it(next_key, hopper_unverified):
    out, ref, lowp = _call_and_reference(next_key, causal=True)
    assert_close_by_rule(out, ref, lowp, name="out")
    causal = [v.name for v in routing.class_variants(
        routing.Variant("sm_90a", "bf16", 128, 128, "causal", False), hopper_unverified.routes_for("sm_90a"),
        hopper_unverified.compiled)]
    assert len(causal) > 1  # its tunings, probed with it
    results = gate.results()
    assert all(results[name].passed for name in causal), {n: results.get(n) for n in causal}
    kept = verdict_store.load(gate.library_identity(hopper_unverified))
    assert all(kept[name].passed for name in causal)


def test_the_handler_refuses_an_unchecked_variant_and_runs_it_once_checked(next_key, hopper_unverified):
    # A program that reaches the custom call without the dispatch (as a jax.export'ed one does), of
    # a problem class no other test here checks.
    library = hopper_unverified
    q, k, v = qkv(next_key, 1, 200, 300, 4, 2, 96, jnp.float16)
    params = attention_params(q, k, v, window_size=(64, 16), softcap=5.0, implementation="reference")

    def kernel(q, k, v):
        return ffi.forward_call(library, q, k, v, ffi.seq_used(None), ffi.attributes(params))[0]

    exported = jax.export.export(jax.jit(kernel), disabled_checks=fa4_jax.export_disabled_checks())(q, k, v)
    program = jax.export.deserialize(exported.serialize())
    with pytest.raises(Exception, match="first-use check"):
        jax.block_until_ready(program.call(q, k, v))
    assert dispatch.unsupported_reason(q, k, v, params, "fwd") is None  # the gate: probed, passed, marked
    (ref, _), (lowp, _) = reference_pair(q, k, v, window_left=64, window_right=16, softcap=5.0)
    assert_close_by_rule(program.call(q, k, v), ref, lowp, factor=3, name="out")


def test_a_kept_failure_routes_the_class_to_the_fallback(next_key, hopper_unverified):
    library = hopper_unverified
    identity = gate.library_identity(library)
    for variant in routing.class_variants(routing.Variant("sm_90a", "bf16", 128, 128, "none", False),
                                          library.routes_for("sm_90a"), library.compiled):
        verdict_store.record(identity, Verdict(variant.name, "wrong", "told so by the test"))
    with pytest.warns(fa4_jax.FallbackWarning, match="first-use check"):
        out, ref, lowp = _call_and_reference(next_key)
    assert_close_by_rule(out, ref, lowp, name="out (fallback)")
    with pytest.raises(ValueError, match="told so by the test"):
        q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
        fa4_jax.attention(q, q, q, implementation="cute")


def test_the_selftest_passes_a_few_variants(hopper_unverified, tmp_path):
    pattern = "|".join(f"^{name}$" for name in PROBED[:4] + PROBED[7:8])
    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "fa4_jax", "selftest", "--only", pattern, "--json", str(report_path)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["status"] == "pass" and len(report["variants"]) == 5, report
    assert all(f"{name} ..." in proc.stdout for name in PROBED[:4])
