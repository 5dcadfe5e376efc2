"""CPU tier: the parent's side of the probes (fa4_jax.runtime.probe.runner) against a stand-in probe
process (tests/fake_child.py) that passes, fails, hangs, faults or crashes on command: each
variant gets its verdict, a hang or a fault costs only the child, which is replaced for the
variants left, and the child sees exactly the caller's GPU on the CPU-only JAX."""
import json
import time

import pytest

from fa4_jax.runtime.probe import runner
from tests.probe_stand_ins import FAKE_CHILD


@pytest.fixture
def log(tmp_path, monkeypatch):
    """The fake child's starts, read back as a list of {"job", "env"}."""
    path = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_CHILD_LOG", str(path))
    return lambda: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run(names, timeout=30.0, command=FAKE_CHILD):
    events = []
    device, verdicts = runner.run(runner.Target("/no/library.so", 0), names, timeout, command=command,
                                  on_start=lambda name: events.append(("start", name)),
                                  on_verdict=lambda v: events.append((v.verdict, v.variant)))
    return device, verdicts, events


def test_every_variant_gets_its_verdict_in_order_from_one_child(log):
    names = ["v_a", "v_wrong_b", "v_load-error_c", "v_inconclusive_d"]
    device, verdicts, events = _run(names)
    assert [verdicts[n].verdict for n in names] == ["pass", "wrong", "load-error", "inconclusive"]
    assert events == [e for n, kind in zip(names, ["pass", "wrong", "load-error", "inconclusive"])
                      for e in (("start", n), (kind, n))]
    assert device["name"] == "NVIDIA B200" and len(log()) == 1


def test_a_hang_is_killed_after_the_timeout_and_a_new_child_takes_the_rest(log):
    start = time.monotonic()
    _, verdicts, _ = _run(["v_a", "v_hang_b", "v_c"], timeout=1.5)
    assert time.monotonic() - start < 20
    assert {n: v.verdict for n, v in verdicts.items()} == {"v_a": "pass", "v_hang_b": "hang", "v_c": "pass"}
    assert "1.5 s" in verdicts["v_hang_b"].reason and "FA4_JAX_PROBE_TIMEOUT" in verdicts["v_hang_b"].reason
    assert [start["job"]["variants"] for start in log()] == [["v_a", "v_hang_b", "v_c"], ["v_c"]]


@pytest.mark.parametrize("how, reason", [("fault", "fake fault"), ("crash", "signal 11")])
def test_a_fault_or_a_crash_costs_the_child_only(log, how, reason):
    _, verdicts, _ = _run(["v_a", f"v_{how}_b", "v_c", f"v_{how}_d", "v_e"])
    assert {n: v.verdict for n, v in verdicts.items()} == {
        "v_a": "pass", f"v_{how}_b": "fault", "v_c": "pass", f"v_{how}_d": "fault", "v_e": "pass"}
    assert reason in verdicts[f"v_{how}_b"].reason
    assert len(log()) == 3


def test_a_child_that_stops_answering_outside_a_variant_leaves_the_rest_inconclusive(log, monkeypatch):
    monkeypatch.setattr(runner, "SETUP_SECONDS", 1.5)
    _, verdicts, _ = _run(["v_a", "v_stall_b", "v_c"])
    assert {n: v.verdict for n, v in verdicts.items()} == {"v_a": "pass", "v_stall_b": "inconclusive",
                                                           "v_c": "inconclusive"}
    assert "did not answer" in verdicts["v_c"].reason and len(log()) == 1


def test_a_child_that_cannot_start_leaves_everything_inconclusive():
    _, verdicts, _ = _run(["v_a", "v_b"], command=["/bin/false"])
    assert all(v.verdict == "inconclusive" and "exit status 1" in v.reason for v in verdicts.values())


@pytest.mark.parametrize("visible, hardware_id, child", [
    (None, 0, "0"), (None, 3, "3"), ("", 1, "1"), ("2,5,7", 1, "5"), ("GPU-aa, GPU-bb", 1, "GPU-bb"),
    ("MIG-1/2/3", 0, "MIG-1/2/3")])
def test_the_child_sees_the_callers_gpu_alone(visible, hardware_id, child):
    assert runner.child_visible_devices(visible, hardware_id) == child


def test_a_hardware_id_outside_the_callers_devices_is_refused():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        runner.child_visible_devices("2,5", 2)


def test_the_child_runs_jax_on_the_cpu_pinned_to_the_gpu(log, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    runner.run(runner.Target("/no/library.so", 1, "4,6"), ["v_a"], 30.0, command=FAKE_CHILD)
    assert log()[0]["env"] == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "6"}
    assert log()[0]["job"] == {"library": "/no/library.so", "device": 0, "variants": ["v_a"]}


@pytest.mark.parametrize("value, seconds", [(None, 20.0), ("", 20.0), ("7.5", 7.5)])
def test_the_timeout_comes_from_the_environment(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("FA4_JAX_PROBE_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("FA4_JAX_PROBE_TIMEOUT", value)
    assert runner.timeout_seconds() == seconds


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_timeout_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("FA4_JAX_PROBE_TIMEOUT", value)
    with pytest.raises(ValueError, match="FA4_JAX_PROBE_TIMEOUT"):
        runner.timeout_seconds()


def test_the_real_probe_process_without_a_gpu_judges_nothing():
    # `python -m fa4_jax.runtime.probe` itself, on the built library: it checks its Fa4Args mirror,
    # finds no GPU to open, and says so for every variant, inconclusive (retried, not kept).
    from fa4_jax.aot import build
    from fa4_jax.runtime.probe import device

    if not build.LIBRARY.exists():
        pytest.fail(f"{build.LIBRARY} is not built: run `python -m fa4_jax.aot.build`")
    if device.open_library(str(build.LIBRARY)).Fa4CudaDriverVersion() > 0:
        pytest.skip("a CUDA driver is installed: the probe would run (the GPU tier's)")
    names = ["fwd_sm90a_bf16_d64_dv64", "fwd_sm100f_bf16_d64_dv64"]
    opened, verdicts = runner.run(runner.Target(str(build.LIBRARY), 0), names, 30.0)
    assert "error" in opened and list(verdicts) == names
    assert all(v.verdict == "inconclusive" and "could not open the GPU" in v.reason for v in verdicts.values())
