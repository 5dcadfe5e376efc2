"""CPU tier: the first-use gate (fa4_jax.runtime.gate) on a fake Blackwell GPU.

The device reports sm_100f, its forward kernel is a stand-in that returns NaN (so a call it
served shows), and the probe process is tests/fake_child.py, told per variant to pass, fail,
hang, fault or crash. What runs is the dispatch's real decision, the public API's fallback
around it, the real parent side of the probes, the verdicts kept on disk and the lock: a variant
that failed but still served a call (a poisoned result), a probe that ran twice, a verdict that
was not kept (or an inconclusive one that was) fails here.
"""
import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.runtime import device, dispatch, ffi, verdict_store, gate
from fa4_jax.tools import verdicts
from fa4_jax.aot import build
from fa4_jax.ops.bodies import _reference_fp32
from fa4_jax.runtime.operands import KernelOperands
from fa4_jax.kernels.sm100 import menu as sm100
from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.runtime.probe import runner
from fa4_jax.runtime.probe.protocol import Verdict
from tests.probe_stand_ins import FAKE_CHILD

D64, D64_CAUSAL = "fwd_sm100f_bf16_d64_dv64", "fwd_sm100f_bf16_d64_dv64_causal"
D128, D128_PAIR = "fwd_sm100f_bf16_d128_dv128", "fwd_sm100f_bf16_d128_dv128_tcta_pair"


@pytest.fixture
def blackwell(monkeypatch, tmp_path):
    """A fake B200 with a poisoned forward kernel; returns a namespace: library, plan (name ->
    what the fake probe does), starts() (the probe processes' jobs), marked (variants marked
    verified in the library), identity."""
    library_file = tmp_path / "libfa4_jax.so"
    library_file.write_bytes(b"a library")
    (tmp_path / "manifest.json").write_text(json.dumps(build.manifest(build.shipping_menu([sm100.ARCH]))))
    library = ffi.Library(
        path=str(library_file), compiled=frozenset(v.name for v in sm100.MENU),
        routes=tuple((sm100.ARCH, r) for r in sm100.ROUTES),
        dq_copies_max_keys={}, tuning_targets=False, head_dims={sm100.ARCH: frozenset(sm100.HEAD_DIMS)},
        unverified_arches=frozenset({sm100.ARCH}))
    state = types.SimpleNamespace(library=library, plan={}, marked=[])
    log = tmp_path / "starts.jsonl"
    state.starts = lambda: [json.loads(line)["job"]["variants"] for line in log.read_text().splitlines()] \
        if log.exists() else []

    def poisoned_kernel(library, q, k, v, lengths, attrs, tuning=None, segments=None):
        out = jnp.full(q.shape[:-1] + v.shape[-1:], jnp.nan, q.dtype)
        return out, jnp.full((q.shape[0], q.shape[2], q.shape[1]), jnp.nan, jnp.float32)

    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B200", local_hardware_id=0,
                                compute_capability="10.0")
    monkeypatch.setattr(device, "device_arch", lambda: (sm100.ARCH, None))
    monkeypatch.setattr(device, "sm_count", lambda: 148)
    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: library)
    monkeypatch.setattr(ffi, "forward_call", poisoned_kernel)
    monkeypatch.setattr(ffi, "mark_verified", lambda library, name: state.marked.append(name))
    monkeypatch.setattr(ffi, "cuda_driver_version", lambda library: 12080)
    monkeypatch.setattr(runner, "default_gpu", lambda: gpu)
    monkeypatch.setattr(runner, "probe_command", lambda: FAKE_CHILD)
    monkeypatch.setattr(gate.notices, "progress", lambda message: None)
    monkeypatch.setenv("FAKE_CHILD_LOG", str(log))
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FA4_JAX_PROBE_TIMEOUT", "3")
    for variable in ("FA4_JAX_TRUST_UNVERIFIED", "FA4_JAX_DISABLE_ARCHES", "FA4_JAX_UNVERIFIED_ARCHES"):
        monkeypatch.delenv(variable, raising=False)
    state.set_plan = lambda plan: (state.plan.update(plan), monkeypatch.setenv("FAKE_CHILD_PLAN", json.dumps(state.plan)))
    gate.forget()
    state.identity = gate.library_identity(library)
    # Traces of the same shapes from earlier tests would hold another stand-in kernel.
    jax.clear_caches()
    yield state
    gate.forget()


def _inputs(seed=0, shape=(1, 96, 2, 64)):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys)


def _params(q, k, v, **options):
    from fa4_jax.api.attention import attention_params

    return attention_params(q, k, v, implementation="reference", **options)


def _reason(state, name=D64, **options):
    q, k, v = _inputs(shape=(1, 96, 2, int(name.split("_d")[1].split("_")[0])))
    return dispatch.unsupported_reason(q, k, v, _params(q, k, v, **options), "fwd")


def test_blackwell_is_unverified_and_hopper_is_not(monkeypatch, blackwell):
    # The shipping library's manifest says so (what ffi.load reads at run time).
    assert build.manifest(build.shipping_menu())["unverified_arches"] == [sm100.ARCH]
    assert gate.unverified_arches(blackwell.library) == {sm100.ARCH}
    monkeypatch.setenv("FA4_JAX_UNVERIFIED_ARCHES", "sm_90a, sm_120a")
    assert gate.unverified_arches(blackwell.library) == {sm100.ARCH, sm90.ARCH, "sm_120a"}


def test_a_class_that_passes_serves_calls_is_probed_once_and_marked_verified(blackwell):
    q, k, v = _inputs()
    for causal in (False, True, False):
        out = fa4_jax.attention(q, k, v, causal=causal, implementation="cute")
        assert np.isnan(np.asarray(out, np.float32)).all()  # the (poisoned) kernel ran: the gate let it
    assert blackwell.starts() == [[D64], [D64_CAUSAL]] and blackwell.marked == [D64, D64_CAUSAL]
    # Every tuning of a class in one probe process, as one call site may reach any of them.
    assert _reason(blackwell, D128) is None and blackwell.starts()[-1] == [D128, D128_PAIR]
    kept = verdict_store.load(blackwell.identity)
    assert sorted(kept) == sorted([D64, D64_CAUSAL, D128, D128_PAIR]) and all(v.passed for v in kept.values())


@pytest.mark.parametrize("does", ["wrong", "hang", "fault", "crash", "load-error"])
def test_a_variant_that_fails_never_serves_a_call(blackwell, does):
    blackwell.set_plan({D64: does})
    q, k, v = _inputs(1)
    with pytest.warns(fa4_jax.FallbackWarning, match="first-use check"):
        out = fa4_jax.attention(q, k, v)
    reference, _ = _reference_fp32(q, k, v, _params(q, k, v), KernelOperands())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), atol=2e-2)
    with pytest.raises(ValueError, match="first-use check"):
        fa4_jax.attention(q, k, v, implementation="cute")
    verdict = verdict_store.load(blackwell.identity)[D64].verdict
    assert verdict == ("fault" if does == "crash" else does) and blackwell.marked == []
    assert blackwell.starts() == [[D64]]  # once, kept: never again for this library, GPU and driver
    gate.forget()
    assert "first-use check" in _reason(blackwell) and len(blackwell.starts()) == 1


def test_a_failing_tuning_keeps_its_whole_class_off_the_kernels(blackwell):
    # Which tuning a call runs is decided by its final shapes (GQA packing, split-KV, ragged),
    # after the dispatch's decision: so a class serves calls only when all of its tunings passed.
    blackwell.set_plan({D128_PAIR: "wrong"})
    reason = _reason(blackwell, D128)
    assert D128_PAIR in reason and "wrong" in reason
    assert blackwell.marked == [D128]  # the handler may still run the default (an exported program)


def test_an_inconclusive_probe_falls_back_and_is_not_kept(blackwell):
    blackwell.set_plan({D64: "inconclusive"})
    assert "not kept" in _reason(blackwell) and verdict_store.load(blackwell.identity) == {}
    assert "not kept" in _reason(blackwell) and len(blackwell.starts()) == 1  # this process: fallback
    gate.forget()  # the next process tries again
    blackwell.set_plan({D64: "pass"})
    assert _reason(blackwell) is None and len(blackwell.starts()) == 2


def test_a_probe_that_opened_another_gpu_judges_nothing(blackwell, monkeypatch):
    monkeypatch.setenv("FAKE_CHILD_GPU", "NVIDIA B300")
    reason = _reason(blackwell)
    assert "NVIDIA B300" in reason and verdict_store.load(blackwell.identity) == {} and blackwell.marked == []


def test_kept_verdicts_are_per_library_gpu_and_driver(blackwell, monkeypatch):
    blackwell.set_plan({D64: "wrong"})
    assert _reason(blackwell) is not None
    gate.forget()
    monkeypatch.setattr(ffi, "cuda_driver_version", lambda library: 12090)  # a new driver: checked anew
    blackwell.set_plan({D64: "pass"})
    assert _reason(blackwell) is None and len(blackwell.starts()) == 2


def test_trusting_the_arch_skips_the_probe(blackwell, monkeypatch):
    blackwell.set_plan({D64: "wrong"})
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "1")
    q, k, v = _inputs(2)
    out = fa4_jax.attention(q, k, v, implementation="cute")
    assert np.isnan(np.asarray(out, np.float32)).all() and blackwell.starts() == []


def test_the_kill_switch_turns_an_arch_off_whatever_else_says(blackwell, monkeypatch):
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "1")
    monkeypatch.setenv("FA4_JAX_DISABLE_ARCHES", "sm_90a,sm_100f")
    assert "FA4_JAX_DISABLE_ARCHES" in _reason(blackwell)
    hopper = next(v for v in sm90.MENU if v.tuning == "default")
    assert "FA4_JAX_DISABLE_ARCHES" in gate.failure_reason(hopper, blackwell.library)
    assert blackwell.starts() == []


def test_head_dims_run_padded_are_checked_as_the_kernel_that_serves_them(blackwell):
    q, k, v = _inputs(4, shape=(1, 64, 2, 80))
    assert dispatch.unsupported_reason(q, k, v, _params(q, k, v), "fwd") is None
    assert blackwell.starts() == [["fwd_sm100f_bf16_d96_dv96"]]


def test_the_hopper_kernels_are_not_gated(blackwell):
    hopper = next(v for v in sm90.MENU if v.tuning == "default")
    assert gate.failure_reason(hopper, blackwell.library) is None and blackwell.starts() == []


_HOLD_THE_LOCK = """
import sys, time
from fa4_jax.runtime import verdict_store
from fa4_jax.runtime.probe.protocol import Verdict
identity = verdict_store.Identity(*sys.argv[1:4])
with verdict_store.probing_lock():
    print("holding", flush=True)
    time.sleep(2)
    verdict_store.record(identity, Verdict(sys.argv[4], "pass", None, 0.5))
"""


def test_another_process_probing_is_waited_for_and_its_verdicts_read(blackwell):
    identity = blackwell.identity
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, identity.library, identity.gpu, identity.driver,
                               D64], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    assert _reason(blackwell) is None  # waited, then read the other process's pass
    assert holder.wait() == 0 and blackwell.starts() == [] and blackwell.marked == [D64]


def test_kept_passes_are_marked_verified_once_jax_has_started(blackwell, monkeypatch):
    verdict_store.record(blackwell.identity, Verdict(D64, "pass"))
    verdict_store.record(blackwell.identity, Verdict(D64_CAUSAL, "wrong", "off"))
    started = {"backends": False}
    monkeypatch.setattr(gate, "_backends_started", lambda: started["backends"])
    gate.push_when_ready(blackwell.library)
    jax.monitoring.record_event_duration_secs("/fa4_jax/test", 0.0)
    assert blackwell.marked == []  # never starts JAX's backends itself
    started["backends"] = True
    jax.monitoring.record_event_duration_secs("/fa4_jax/test", 0.0)  # e.g. a compile, before it runs
    jax.monitoring.record_event_duration_secs("/fa4_jax/test", 0.0)
    assert blackwell.marked == [D64]
    gate.forget()  # a new process, whose JAX has started already: at once
    gate.push_when_ready(blackwell.library)
    assert blackwell.marked == [D64, D64]


def test_the_command_shows_forgets_and_checks(blackwell, capsys):
    blackwell.set_plan({D64_CAUSAL: "wrong"})
    assert verdicts.main(["check", r"^fwd_sm100f_bf16_d64_dv64(_causal)?$"]) == 1
    out = capsys.readouterr().out
    assert f"PASS         {D64}" in out and f"FAIL         {D64_CAUSAL}" in out
    assert verdicts.main(["check", r"^fwd_sm100f_bf16_d64_dv64(_causal)?$"]) == 2  # judged already
    assert verdicts.main(["show"]) == 0 and D64_CAUSAL in capsys.readouterr().out
    assert verdicts.main(["forget"]) == 0 and "forgot 2" in capsys.readouterr().out
    assert verdict_store.load(blackwell.identity) == {}


def test_a_probe_that_cannot_even_start_falls_back_and_keeps_nothing(blackwell, monkeypatch):
    monkeypatch.setattr(runner, "probe_command", lambda: ["/nonexistent/python"])
    reason = _reason(blackwell)
    assert "could not run" in reason and "not kept" in reason
    assert verdict_store.load(blackwell.identity) == {} and blackwell.marked == []
