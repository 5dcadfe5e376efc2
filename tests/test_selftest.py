"""CPU tier: `python -m fa4_jax.selftest`'s probes reach every shipped variant, its rule can
fail, and without a GPU it says there is nothing to check."""
import io

import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import dispatch, ffi, selftest
from fa4_jax.aot import menu
from tests.h200_menu import use_h200_menu


def test_without_a_gpu_there_is_nothing_to_check():
    out = io.StringIO()
    report = selftest.run(out=out)
    assert report["status"] == "nothing to check" and "not a CUDA GPU" in out.getvalue()
    assert selftest.main([]) == 2


def test_the_probes_reach_every_shipped_variant(monkeypatch):
    # The router and the menu as on an H200; the checks themselves replaced by a record of the
    # call, so this is the probe selection alone.
    use_h200_menu(monkeypatch)

    def fake_check(problem, dtype, d, dv, options, seqlen_q, seqlen_k, seed, implementation="cute"):
        import fa4_jax

        q = np.zeros((1, seqlen_q, selftest.HEADS_Q, d), dtype)
        k = np.zeros((1, seqlen_k, selftest.HEADS_KV, d), dtype)
        v = np.zeros((1, seqlen_k, selftest.HEADS_KV, dv), dtype)
        explanation = fa4_jax.explain(q, k, v, implementation="cute", **options)
        return selftest.Check(problem, seqlen_q, seqlen_k, explanation.forward_variant,
                              explanation.backward_variant, {"out": (0.0, 1.0)}, 0.0)

    monkeypatch.setattr(selftest, "_check_call", fake_check)
    report = selftest.run(out=io.StringIO())
    assert report["status"] == "pass" and report["unreached"] == []
    # Each check reaches something new: no call is made twice for one variant pair.
    assert len(report["checks"]) < len(menu.MENU)
    only = selftest.run(only=r"_d160_", out=io.StringIO())
    assert {c["forward_variant"] for c in only["checks"]} <= {v.name for v in menu.MENU if "_d160_" in v.name}


def test_the_rule_fails_a_wrong_answer_and_passes_one_rounding_step():
    ref = np.linspace(-4.0, 4.0, 101)
    lowp = ref + 1e-4
    assert selftest._bound_by_rule(ref + 0.01, ref, lowp, 2, jnp.bfloat16)[0] <= \
        selftest._bound_by_rule(ref + 0.01, ref, lowp, 2, jnp.bfloat16)[1]  # within a bf16 step at 4
    error, bound = selftest._bound_by_rule(ref + 0.1, ref, lowp, 2, jnp.bfloat16)
    assert error > bound
    error, bound = selftest._bound_by_rule(np.where(ref > 0, np.nan, ref), ref, lowp, 2, jnp.bfloat16)
    assert error > bound


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (64, 16), "softcap": 20.0}],
                         ids=["none", "causal", "window_softcap"])
def test_a_check_compares_the_call_with_the_dense_oracle(options):
    # The whole comparison path, with the reference standing in for the kernels: it passes,
    # and a corrupted result fails.
    check = selftest._check_call("bf16 d32", jnp.bfloat16, 32, 32, options, 40, 70, seed=0,
                                 implementation="reference")
    assert check.passed and set(check.errors) == {"out", "lse", "dq", "dk", "dv"}, check.line()
    assert check.forward_variant is None and "PASS" in check.line()
    wrong = dict(check.errors, dv=(1.0, check.errors["dv"][1]))
    assert not selftest.Check(**{**check.__dict__, "errors": wrong}).passed


def test_the_segment_probe_compares_with_the_same_documents(monkeypatch):
    # The segment probe's oracle masks with the probe's ids: with the reference standing in for
    # the kernels it passes, and against an oracle that drops the ids it fails.
    from fa4_jax import reference

    q_ids, kv_ids = selftest._segment_ids()
    assert (q_ids >= 0).sum() == 180 and (kv_ids >= 0).sum() == 290
    options = {"causal": True, "query_segment_ids": q_ids, "kv_segment_ids": kv_ids}
    (seqlen_q, seqlen_k), _ = selftest.SEGMENT_PROBE

    def check():
        return selftest._check_call("bf16 d32 causal segments", jnp.bfloat16, 32, 32, options, seqlen_q,
                                    seqlen_k, seed=0, implementation="reference")

    assert check().passed, check().line()
    dense = reference.dense_attention
    monkeypatch.setattr(reference, "dense_attention", lambda *args, query_segment_ids=None,
                        kv_segment_ids=None, **kwargs: dense(*args, **kwargs))
    assert not check().passed


def test_on_an_unverified_arch_it_reports_on_the_kernels_themselves(monkeypatch, tmp_path):
    # A Blackwell device whose (stand-in) forward kernel returns NaN: the selftest must run it
    # and say FAIL, not let the first-use check route its calls to the reference and say PASS.
    # The arch has no backward kernels, so the gradients come from the reference.
    from fa4_jax import verification
    from fa4_jax.kernels.sm100 import menu as sm100

    library = ffi.Library(path="(menu)", fwd_target="f", bwd_target="b",
                          compiled=frozenset(v.name for v in sm100.MENU), routes=(), dq_copies_max_keys={},
                          tuning_targets=False, head_dims={sm100.ARCH: frozenset(sm100.HEAD_DIMS)},
                          unverified_arches=frozenset({sm100.ARCH}))

    def poisoned_kernel(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        out = jnp.full(q.shape[:-1] + v.shape[-1:], jnp.nan, q.dtype)
        return out, jnp.full((q.shape[0], q.shape[2], q.shape[1]), jnp.nan, jnp.float32)

    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: library)
    monkeypatch.setattr(ffi, "forward_call", poisoned_kernel)
    monkeypatch.setattr(dispatch, "device_arch", lambda: (sm100.ARCH, None))
    monkeypatch.setattr(dispatch, "sm_count", lambda: 148)
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path))
    verification.forget()
    out = io.StringIO()
    report = selftest.run(only=r"fwd_sm100f_bf16_d64_dv64$", out=out)
    assert report["status"] == "fail", out.getvalue()
    assert report["checks"] and all(not c["passed"] for c in report["checks"])
    assert all(c["backward_variant"] is None for c in report["checks"])
    assert verification.results() == {}  # no first-use check ran
