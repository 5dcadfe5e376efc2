"""GPU tier: the first-use check against kernels that do what a never-run kernel may do on first
contact with hardware: hang (setmaxnreg budgets over the CTA's register pool), trap, store
through a bad address, answer wrong, or fail to load. tests/gpu/faults/build.py builds them,
marked unverified, into build/faults/ (built on a machine with the DSL, carried here).

Each scenario runs in processes of its own, as a user's would (the library a process loads is
fixed at import): for every bad variant the user's call gets a FallbackWarning within the
probe's timeout and the fallback's right answer, and afterwards the process still runs GPU work
(a jnp op, and fa4_jax's call on the good variant, which passed its check); a second process
reads the verdicts and probes nothing; an exported program that names a bad variant gets the
handler's error, one that names the good variant runs.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fa4_jax.runtime import device, dispatch
from tests.gpu.faults.build import FAULTS, OUT

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_processes]

TIMEOUT = 8  # FA4_JAX_PROBE_TIMEOUT: seconds a probe of one variant may run
# Each fault's problem class (bf16 d128) as a call's options.
OPTIONS = {
    "fwd_sm90a_bf16_d128_dv128": {},
    "fwd_sm90a_bf16_d128_dv128_causal": {"causal": True},
    "fwd_sm90a_bf16_d128_dv128_local": {"window_size": (64, 16)},
    "fwd_sm90a_bf16_d128_dv128_softcap": {"softcap": 20.0},
    "fwd_sm90a_bf16_d128_dv128_causal_softcap": {"causal": True, "softcap": 20.0},
    "fwd_sm90a_bf16_d128_dv128_local_softcap": {"window_size": (64, 16), "softcap": 20.0},
}
GOOD = "fwd_sm90a_bf16_d128_dv128"

USER = textwrap.dedent('''
    import json, os, sys, time, warnings
    import jax, jax.numpy as jnp
    import fa4_jax
    from fa4_jax.runtime import ffi, gate
    from fa4_jax.core import numerics
    from tests.numerics import reference_pair

    def reference_options(opts):
        """The call's options as the reference takes them (a window as its two bounds)."""
        opts = dict(opts)
        if "window_size" in opts:
            opts["window_left"], opts["window_right"] = opts.pop("window_size")
        return opts

    def close(out, ref, lowp, factor=2):
        comparison = numerics.compare(out, ref, lowp, factor)
        return {"passed": comparison.passed, "text": comparison.describe("out")}

    options = json.loads(sys.argv[1])
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 300, 4, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 333, 2, 128), jnp.bfloat16) for key in keys[1:])
    report = {"library": ffi.load().path, "calls": {}}
    for name, opts in options.items():
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **opts))(q, k, v).block_until_ready()
        (ref, _), (lowp, _) = reference_pair(q, k, v, **reference_options(opts))
        warned = [str(w.message) for w in caught if issubclass(w.category, fa4_jax.FallbackWarning)]
        verdict = gate.results().get(name)
        report["calls"][name] = {"seconds": time.monotonic() - start, "warnings": warned,
                                 "verdict": verdict and verdict.verdict, "reason": verdict and verdict.reason,
                                 "close": close(out, ref, lowp, 3 if "softcap" in opts else 2)}
    report["jnp"] = float((jnp.arange(1000, dtype=jnp.float32) * 2).sum())
    out = fa4_jax.attention(q, k, v, implementation="cute")
    (ref, _), (lowp, _) = reference_pair(q, k, v)
    report["good_after"] = close(out, ref, lowp)
    print("REPORT " + json.dumps(report))
''')

EXPORT = textwrap.dedent('''
    import os, sys
    import jax, jax.numpy as jnp
    import fa4_jax

    causal = sys.argv[2] == "causal"
    spec = jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 333, 2, 128), jnp.bfloat16)
    os.environ["FA4_JAX_TRUST_UNVERIFIED"] = "1"  # so the program holds the kernel's custom call
    exported = jax.export.export(jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal)),
                                 disabled_checks=fa4_jax.export_disabled_checks())(spec, kv, kv)
    open(sys.argv[1], "wb").write(exported.serialize())
''')

RUN_EXPORTED = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp
    import fa4_jax

    exported = jax.export.deserialize(open(sys.argv[1], "rb").read())
    q = jnp.ones((2, 300, 4, 128), jnp.bfloat16)
    k = jnp.ones((2, 333, 2, 128), jnp.bfloat16)
    try:
        exported.call(q, k, k).block_until_ready()
        print("RAN")
    except Exception as error:
        print("ERROR " + str(error).replace("\\n", " "))
''')


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    arch, reason = device.device_arch()
    if reason is not None or arch != "sm_90a":
        pytest.skip(reason or f"needs a Hopper GPU, not {arch}")
    if not OUT.exists():
        pytest.skip(f"no fault library at {OUT}: build it with python -m tests.gpu.faults.build")
    env = {k: v for k, v in os.environ.items()
           if k not in ("FA4_JAX_TRUST_UNVERIFIED", "FA4_JAX_DISABLE_ARCHES", "FA4_JAX_UNVERIFIED_ARCHES")}
    env.update(FA4_JAX_LIBRARY=str(OUT), FA4_JAX_CACHE_DIR=str(tmp_path_factory.mktemp("verdicts")),
               FA4_JAX_PROBE_TIMEOUT=str(TIMEOUT), PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return env


def run(env, script, *args, timeout=600):
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc


def user_process(env):
    proc = run(env, USER, json.dumps(OPTIONS))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):]), proc.stderr


@pytest.fixture(scope="module")
def first_process(environment):
    return user_process(environment)


@pytest.mark.parametrize("name", [n for n in FAULTS if FAULTS[n][1] != "pass"])
def test_a_bad_kernel_costs_a_warning_and_nothing_else(first_process, name):
    report, _ = first_process
    assert report["library"] == str(OUT)
    call = report["calls"][name]
    assert call["verdict"] == FAULTS[name][1], call
    assert any(name in message and "first-use check" in message for message in call["warnings"]), call
    # The fallback's answer, and within the probe's timeout (plus the process's own work).
    assert call["close"]["passed"], call
    assert call["seconds"] < TIMEOUT + 60, call


def test_the_process_runs_gpu_work_afterwards(first_process):
    report, _ = first_process
    assert report["jnp"] == 999000.0
    assert report["calls"][GOOD]["verdict"] == "pass" and not report["calls"][GOOD]["warnings"]
    assert report["good_after"]["passed"], report["good_after"]


def test_the_register_pool_rule_on_hardware(first_process):
    # The same Hopper forward: its MMA warp groups at 240 registers (24 + 240 + 240 per slot,
    # the pool of 168 x 384) finish with the right answer; at 248 the last increase never does.
    report, _ = first_process
    assert report["calls"][GOOD]["verdict"] == "pass"
    assert report["calls"]["fwd_sm90a_bf16_d128_dv128_causal"]["verdict"] == "hang"


def test_a_second_process_probes_nothing(environment, first_process):
    report, stderr = user_process(environment)
    for name, (_, expected) in FAULTS.items():
        assert report["calls"][name]["verdict"] == expected, report["calls"][name]
    assert "checking" not in stderr, stderr[-2000:]
    assert all(call["seconds"] < TIMEOUT for call in report["calls"].values()), report["calls"]


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_an_exported_program_runs_only_checked_kernels(environment, first_process, tmp_path, mask):
    artifact = tmp_path / f"{mask}.jaxexport"
    exported = run(environment, EXPORT, str(artifact), mask)
    assert exported.returncode == 0, exported.stderr[-3000:]
    ran = run(environment, RUN_EXPORTED, str(artifact))
    if mask == "none":
        assert "RAN" in ran.stdout, ran.stdout + ran.stderr[-3000:]
    else:
        assert "ERROR" in ran.stdout and "fwd_sm90a_bf16_d128_dv128_causal" in ran.stdout, ran.stdout
        assert "FA4_JAX_TRUST_UNVERIFIED" in ran.stdout
