"""CPU tier: `python -m fa4_jax selftest` runs the first-use probes over every variant of the GPU's
arch (or those matching) in a child process and reports on the kernels; without a GPU it says
there is nothing to check. The probe process is tests/fake_child.py, told per variant what to do;
which problems each variant runs, and the judge, are tests/test_probe.py's."""
import io
import json
import types

import pytest

from fa4_jax.runtime import device, dispatch, ffi, gate
from fa4_jax.tools import selftest
from fa4_jax.aot import menu
from fa4_jax.runtime.probe import runner
from tests.probe_stand_ins import FAKE_CHILD

D160 = r"^(fwd|bwd)_sm90a_(bf16|fp16)_d160_dv160(_causal)?$"


def test_without_a_gpu_there_is_nothing_to_check():
    out = io.StringIO()
    report = selftest.run(out=out)
    assert report["status"] == "nothing to check" and "not a CUDA GPU" in out.getvalue()
    assert selftest.main([]) == 2


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    """A fake H200 whose probes the fake child runs; returns set_plan(name -> what it does)."""
    library = ffi.Library(path=str(tmp_path / "libfa4_jax.so"), compiled=frozenset(v.name for v in menu.MENU),
                          routes=(), dq_copies_max_keys={},
                          tuning_targets=False, unverified_arches=frozenset({"sm_100f"}))
    monkeypatch.setattr(device, "device_arch", lambda: ("sm_90a", None))
    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: library)
    monkeypatch.setattr(ffi, "manifest_variants", lambda path: {v.name: v for v in menu.MENU})
    monkeypatch.setattr(runner, "default_gpu", lambda: types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA H200", local_hardware_id=0))
    monkeypatch.setattr(runner, "probe_command", lambda: FAKE_CHILD)
    monkeypatch.setenv("FA4_JAX_PROBE_TIMEOUT", "2")
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path / "cache"))
    gate.forget()
    return lambda plan: monkeypatch.setenv("FAKE_CHILD_PLAN", json.dumps(plan))


def test_every_matching_variant_is_probed_and_reported_as_it_goes(hopper, tmp_path):
    hopper({"fwd_sm90a_fp16_d160_dv160_causal": "wrong", "bwd_sm90a_bf16_d160_dv160": "hang"})
    out, path = io.StringIO(), tmp_path / "report.json"
    report = selftest.run(only=D160, out=out, json_path=str(path))
    names = [v["variant"] for v in report["variants"]]
    assert sorted(names) == sorted(v.name for v in menu.MENU if v.arch == "sm_90a" and "_d160_dv160" in v.name
                                   and not (v.segments or v.softcap) and v.tuning == "default" and v.mask != "local")
    # A problem class's forward and backward side by side (they share the probes' references).
    assert [name[:3] for name in names] == ["fwd", "bwd"] * 4
    assert all(a[3:] == b[3:] for a, b in zip(names[::2], names[1::2]))
    verdicts = {v["variant"]: v["verdict"] for v in report["variants"]}
    assert verdicts.pop("fwd_sm90a_fp16_d160_dv160_causal") == "wrong" and verdicts.pop(
        "bwd_sm90a_bf16_d160_dv160") == "hang" and set(verdicts.values()) == {"pass"}
    text = out.getvalue()
    first = names[0]
    assert text.index(f"[1/8] {first} ...") < text.index(f"PASS         {first} ") < text.index(f"[2/8] {names[1]}")
    assert "HANG" in text and "FAIL" in text and "6 pass, 1 wrong, 1 hang of 8 variants" in text
    assert report["status"] == "fail" and json.loads(path.read_text()) == report
    # It reports on the kernels themselves: no first-use gate, nothing kept.
    assert gate.results() == {} and not (tmp_path / "cache" / "verdicts.json").exists()


@pytest.mark.parametrize("plan, status, code", [({}, "pass", 0), ({"bwd_sm90a_fp16_d160_dv160": "fault"}, "fail", 1),
                                                ({"fwd_sm90a_bf16_d160_dv160": "inconclusive"}, "inconclusive", 2)])
def test_the_exit_status_says_pass_fail_or_nothing_checked(hopper, plan, status, code, capsys):
    hopper(plan)
    assert selftest.main(["--only", D160]) == code
    assert f"of 8 variants" in capsys.readouterr().out


def test_a_pattern_that_matches_nothing_is_nothing_to_check(hopper):
    report = selftest.run(only="^no such variant$", out=io.StringIO())
    assert report["status"] == "nothing to check" and "matches" in report["reason"]
