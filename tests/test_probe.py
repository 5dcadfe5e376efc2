"""CPU tier: the first-use probes (fa4_jax.runtime.probe) without a GPU.

- which problems each shipped variant is checked on: routed to it by the handler's rule and
  fa4_jax.abi.routing's alike, never to a sibling, the ragged probe wherever the routes allow one;
- the numpy reference against fa4_jax.fallbacks.reference (values, low-precision error, gradients);
- the launch against what fa4_jax.runtime.ffi gives XLA, operand for operand;
- the judge, with stand-in kernels computed from the launch alone: a correct one passes, each
  flawed one fails;
- the C++ side: Fa4Args' ctypes mirror, and the handler's gate (refusal, Fa4MarkVerified).
"""
import ctypes
import dataclasses
import itertools
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fa4_jax.runtime import ffi
from fa4_jax.abi import routing, targets
from fa4_jax.aot import build, menu
from fa4_jax.core.params import AttentionParams
from fa4_jax.runtime.probe import calls, cases, device, judge, problems, reference
from fa4_jax.fallbacks.reference import attention_reference
from tests.probe_stand_ins import StandInDevice

_COMPILED = frozenset(v.name for v in menu.MENU)
_SERVES = problems.routing_rule(menu.routes(), _COMPILED)
_SETTINGS = judge.Settings(132, menu.dq_copies_max_keys(), {})


def _variant(name):
    return next(v for v in menu.MENU if v.name == name)


def _routes(arch):
    return [route for route_arch, route in menu.routes() if route_arch == arch]


@pytest.fixture(scope="module")
def library():
    if not build.LIBRARY.exists():
        pytest.fail(f"{build.LIBRARY} is not built: run `python -m fa4_jax.aot.build`")
    return device.open_library(str(build.LIBRARY))


# Which problems.

@pytest.mark.parametrize("arch", menu.ARCHES)
def test_every_shipped_variant_is_probed_on_problems_routed_to_it_alone(arch):
    for v in (v for v in menu.MENU if v.arch == arch):
        chosen = problems.for_variant(v, _SERVES)
        assert chosen, f"no probe problem routes to {v.name}"
        for problem in chosen:
            assert routing.choose(problem.call(v), _routes(arch), _COMPILED) == v, (v.name, problem)


def test_the_library_routes_the_probes_as_fa4_jax_routing_does(library):
    # The child counts a problem only where both rules agree; they must, for every problem.
    for v in menu.MENU:
        for problem in problems.for_variant(v, _SERVES):
            assert device.handler_choice(library, problem.call(v)) == v.name, (v.name, problem)


def _ragged_calls_reach(v) -> bool:
    """Whether some ragged call routes to v (a grid of lengths around every route's bounds)."""
    lengths = (1, 48, 64, 65, 128, 256, 257, 300, 600, 1024, 1025, 1100, 1206, 4096, 8193)
    return any(routing.choose(routing.Call(v.kind, v.arch, v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap,
                                           sq, sk, ragged=True), _routes(v.arch), _COMPILED) == v
               for sq, sk in itertools.product(lengths, lengths))


@pytest.mark.parametrize("arch", menu.ARCHES)
def test_every_forward_variant_that_ragged_calls_reach_gets_the_ragged_probe(arch):
    reached = 0
    for v in (v for v in menu.MENU if v.arch == arch and v.kind == "fwd" and not v.segments):
        ragged = [p for p in problems.for_variant(v, _SERVES) if p.lengths is not None]
        assert bool(ragged) == _ragged_calls_reach(v), v.name
        reached += bool(ragged)
        for p in ragged:  # NaN padding in a key block, an entry without keys, one without rows
            assert (0 < p.lengths[1][1] < p.seqlen_k) and any(k == 0 for _, k in p.lengths) \
                and any(q == 0 for q, _ in p.lengths)
    assert reached


def test_the_dense_probes_cover_tiles_decode_and_many_where_routes_allow():
    for name in ("fwd_sm90a_bf16_d64_dv64_causal", "fwd_sm90a_fp16_d256_dv256_local_softcap"):
        assert [p.kind for p in problems.for_variant(_variant(name), _SERVES)] == ["tiles", "decode", "many", "ragged"]
    # The tuned variants get the shapes of their routes.
    tail = problems.for_variant(_variant("fwd_sm90a_bf16_d128_dv128_ttail48"), _SERVES)
    assert [(p.kind, p.seqlen_k) for p in tail] == [("tiles", 1100), ("many", 40)][:len(tail)]
    pair = problems.for_variant(_variant("fwd_sm100f_bf16_d128_dv128_tcta_pair"), _SERVES)
    assert {p.kind for p in pair} == {"tiles", "many"}  # dense calls over 256 rows only


def test_backward_variants_run_deterministic_mode_and_d_lse_present_and_absent():
    for name in ("bwd_sm90a_bf16_d128_dv128_local_softcap", "bwd_sm90a_fp16_d64_dv64_causal_segments",
                 "bwd_sm90a_bf16_d256_dv256_boolmask"):
        chosen = problems.for_variant(_variant(name), _SERVES)
        assert chosen[1] == dataclasses.replace(chosen[0], deterministic=True)
        if "segments" not in name and "boolmask" not in name:
            assert chosen[0].d_lse and not chosen[-1].d_lse


# The reference.

_CASES = {  # (seqlen_q, seqlen_k, heads_q, heads_kv, params options, lengths, extra)
    "plain": (37, 53, 2, 1, {}, None, None),
    "causal_gqa_ragged": (37, 53, 4, 2, {"causal": True}, ((37, 53), (20, 30), (9, 0)), None),
    "window_top_left": (40, 33, 2, 2, {"window_left": 5, "window_right": 3, "top_left": True}, None, None),
    "softcap_causal_ragged": (33, 47, 2, 1, {"softcap": 2.0, "causal": True}, ((30, 40), (0, 5), (33, 47)), None),
    "segments": (37, 53, 2, 1, {"causal": True}, None, "segments"),
}


def _arrays(case, dtype, seed=0):
    seqlen_q, seqlen_k, h, hk, options, lengths, extra = _CASES[case]
    rng = np.random.default_rng(seed)
    b, d, dv = (len(lengths) if lengths else 2), 16, 24
    q, k, v, d_out = (rng.standard_normal(shape, np.float32).astype(dtype) for shape in (
        (b, seqlen_q, h, d), (b, seqlen_k, hk, d), (b, seqlen_k, hk, dv), (b, seqlen_q, h, dv)))
    d_lse = rng.standard_normal((b, h, seqlen_q), np.float32)
    q_len, kv_len = (np.array(side) for side in zip(*lengths)) if lengths else (np.full(b, seqlen_q),
                                                                                  np.full(b, seqlen_k))
    ids = None
    if extra:
        ids = (rng.integers(0, 3, (b, seqlen_q)).astype(np.int32), rng.integers(0, 3, (b, seqlen_k)).astype(np.int32))
    inputs = reference.Inputs(q, k, v, d_out, d_lse, q_len, kv_len,
                              None if ids is None else ids[0][:, :, None] == ids[1][:, None, :])
    params = AttentionParams(softmax_scale=0.7 / math.sqrt(d), **options)
    jax_options = dict(softmax_scale=params.softmax_scale, causal=params.causal, window_left=params.window_left,
                       window_right=params.window_right, softcap=params.softcap, top_left=params.top_left,
                       query_seq_lengths=q_len if lengths else None, key_value_seq_lengths=kv_len if lengths else None,
                       query_segment_ids=None if ids is None else ids[0], kv_segment_ids=None if ids is None else ids[1])
    return inputs, params, jax_options


def _jax_reference(inputs, jax_options, compute_dtype):
    """(out, lse) and (dq, dk, dv) of fa4_jax.fallbacks.reference at compute_dtype, with lse differentiated."""
    source = jnp.float32 if compute_dtype == jnp.float32 else compute_dtype
    qkv = tuple(jnp.asarray(x.astype(np.float32)).astype(source) for x in (inputs.q, inputs.k, inputs.v))

    def attend(q, k, v):
        return attention_reference(q, k, v, compute_dtype=compute_dtype, chunk_size=16, **jax_options)

    (out, lse), vjp = jax.vjp(attend, *qkv)
    grads = vjp((jnp.asarray(inputs.d_out.astype(np.float32)).astype(out.dtype), jnp.asarray(inputs.d_lse)))
    return (out, lse), grads


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", _CASES)
def test_the_numpy_reference_is_fa4_jax_reference(case, dtype):
    inputs, params, jax_options = _arrays(case, dtype)
    exact, lowp = reference.forward(inputs, params), reference.forward(inputs, params, dtype)
    results = exact.results() + reference.gradients(exact, inputs, params)
    lowp_results = lowp.results() + reference.gradients(lowp, inputs, params)
    (out, lse), grads = _jax_reference(inputs, jax_options, jnp.float32)
    (low_out, low_lse), low_grads = _jax_reference(inputs, jax_options, jnp.dtype(dtype))
    for name, ours, ours_low, theirs, theirs_low in zip(("out", "lse", "dq", "dk", "dv"), results, lowp_results,
                                                        (out, lse, *grads), (low_out, low_lse, *low_grads)):
        theirs, theirs_low = np.asarray(theirs, np.float64), np.asarray(theirs_low, np.float64)
        np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs), err_msg=name)
        finite = np.isfinite(ours)
        scale = np.abs(ours[finite]).max()
        # Exact against JAX's float32: float32's rounding only.
        np.testing.assert_allclose(ours[finite], theirs[finite], atol=2e-5 * scale, rtol=0, err_msg=name)
        # The twin's rounding error is JAX's, within a factor (the order of the roundings differs).
        ours_error = np.abs(ours_low[finite] - ours[finite]).max()
        theirs_error = np.abs(theirs_low[finite] - ours[finite]).max()
        assert theirs_error / 3 <= ours_error <= 3 * theirs_error + 1e-6, (name, ours_error, theirs_error)
        assert ours_error > 0 or name == "lse" and theirs_error == 0, name


def test_rows_and_keys_past_an_entrys_length_and_keyless_rows_are_zero_with_lse_minus_inf():
    inputs, params, _ = _arrays("causal_gqa_ragged", ml_dtypes.bfloat16)
    nan_padded = dataclasses.replace(inputs, k=inputs.k.copy(), v=inputs.v.copy())
    nan_padded.k[2], nan_padded.v[2] = np.nan, np.nan  # entry 2 has no keys
    fwd = reference.forward(nan_padded, params)
    out, lse = fwd.results()
    dq, dk, dv = reference.gradients(fwd, nan_padded, params)
    assert (out[1, 20:] == 0).all() and np.isneginf(lse[1, :, 20:]).all()
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all() and (dq[2] == 0).all()
    assert (dk[1, 30:] == 0).all() and (dv[1, 30:] == 0).all() and np.isfinite(dk).all()


# The launch.

def _ffi_launch(monkeypatch, kind, case, deterministic=False, copies=1):
    """What fa4_jax.runtime.ffi.forward_call / backward_call give XLA for `case`: (target, operand
    shapes and dtypes, result shapes and dtypes, attributes)."""
    captured = {}

    def ffi_call(target, results):
        def call(*operands, **attributes):
            captured.update(target=target, operands=[(x.shape, np.dtype(x.dtype)) for x in operands],
                            results=[(tuple(r.shape), np.dtype(r.dtype)) for r in results], attributes=attributes)
            return [jnp.zeros(r.shape, r.dtype) for r in results]
        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", ffi_call)
    library = ffi.Library(path="(menu)", compiled=_COMPILED, routes=(), dq_copies_max_keys={},
                          tuning_targets=False)
    x = case.inputs
    lengths = ffi.seq_used(None if case.problem.lengths is None else (jnp.asarray(x.q_len), jnp.asarray(x.kv_len)))
    attrs = ffi.attributes(case.params)
    segments = None if case.operands is None else tuple(jnp.asarray(o) for o in case.operands)
    q, k, v = (jnp.asarray(a.astype(np.float32)).astype(a.dtype) for a in (x.q, x.k, x.v))
    if kind == "fwd":
        ffi.forward_call(library, q, k, v, lengths, attrs, segments=segments)
    else:
        d_lse = None if x.d_lse is None else jnp.asarray(x.d_lse)
        out = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
        lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
        ffi.backward_call(library, q, k, v, out, lse, out, d_lse, lengths, attrs, deterministic, copies,
                          segments=segments)
    return captured


_FWD_OPERANDS = ("q", "k", "v", "seq_used_q", "seq_used_k", "q_segment_ids", "kv_segment_ids", "row_spans",
                 "key_spans", "mask_bits")
_BWD_OPERANDS = ("q", "k", "v", "out", "d_out", "lse", "d_lse", "seq_used_q", "seq_used_k") + _FWD_OPERANDS[5:]
_BWD_RESULTS = ("dq", "dk", "dv", "dq_accum", "dpsum", "lse_log2", "semaphore")


@pytest.mark.parametrize("name", ["fwd_sm90a_bf16_d64_dv64_local_softcap", "bwd_sm90a_fp16_d192_dv128_causal",
                                  "fwd_sm90a_bf16_d128_dv128_causal_segments", "bwd_sm90a_bf16_d64_dv64_boolmask"])
def test_the_launch_passes_what_fa4_jax_ffi_gives_xla(monkeypatch, name):
    v = _variant(name)
    for problem in problems.for_variant(v, _SERVES):
        case = cases.case(cases.ProblemClass.of(v), problem)
        copies = calls.dq_copies(menu.dq_copies_max_keys(), v, problem)
        launch = judge.kernel_call(v, problem, _SETTINGS)
        xla = _ffi_launch(monkeypatch, v.kind, case, problem.deterministic, copies)
        names = _FWD_OPERANDS if v.kind == "fwd" else _BWD_OPERANDS
        ours = [(np.shape(launch.inputs[n]), np.dtype(launch.inputs[n].dtype)) for n in names[:len(xla["operands"])]]
        assert ours == [(tuple(s), d) for s, d in xla["operands"]], (name, problem)
        result_names = ("out", "lse") if v.kind == "fwd" else _BWD_RESULTS
        ours = [(tuple(shape), np.dtype(dtype)) for shape, dtype in
                ({**launch.results, **launch.workspaces}[n] for n in result_names)]
        assert ours == xla["results"], (name, problem)
        attributes = xla["attributes"]
        assert xla["target"] == targets.TARGETS[v.kind].current.name
        assert attributes["optional_operands"] == len(xla["operands"]) - targets.TARGETS[v.kind].fixed_operands
        assert launch.scalars["softmax_scale"] == pytest.approx(float(attributes["softmax_scale"]))
        assert launch.scalars["softcap"] == pytest.approx(float(attributes["softcap"]))
        assert launch.scalars["deterministic" if v.kind == "bwd" else "top_left"] == int(
            attributes["deterministic" if v.kind == "bwd" else "top_left"])


# The judge.

@pytest.mark.parametrize("name, flaws", [
    ("fwd_sm90a_bf16_d64_dv64_local_softcap", ["ignores lengths", "ignores softcap", "skips a row", "lse in log2",
                                               "slightly off"]),
    ("fwd_sm90a_fp16_d128_dv128_ttail96", ["skips a row", "slightly off"]),
    ("fwd_sm100f_bf16_d128_dv128", ["ignores lengths", "lse in log2"]),
    ("fwd_sm90a_bf16_d96_dv96_causal_segments", ["ignores segments"]),
    ("fwd_sm90a_fp16_d64_dv64_boolmask", ["skips a row"]),
    ("bwd_sm90a_bf16_d64_dv64_causal_softcap", ["ignores lengths", "ignores softcap", "slightly off"]),
    ("bwd_sm90a_fp16_d32_dv32_segments", ["ignores segments"]),
])
def test_the_judge_passes_a_correct_kernel_and_fails_each_flaw(name, flaws):
    v = _variant(name)
    chosen = problems.for_variant(v, _SERVES)
    stand_in = StandInDevice()
    verdict = judge.judge(v, chosen, stand_in, _SETTINGS)
    assert verdict.verdict == "pass", verdict.reason
    assert stand_in.loaded == [name] and len(stand_in.runs) == len(chosen)
    small = tuple(p for p in chosen if p.kind != "many")  # each flaw shows on these; cheaper
    for flaw in flaws:
        failed = judge.judge(v, small, StandInDevice(flaw), _SETTINGS)
        assert failed.verdict == "wrong" and failed.reason, (flaw, failed)


class _FailingDevice(StandInDevice):
    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def load(self, name):
        if self.stage == "load":
            raise device.CudaError("load", f"loading {name}", 200, "cudaErrorInvalidKernelImage", "bad image")

    def run(self, name, call):
        raise device.CudaError(self.stage, f"running {name}", 700, "cudaErrorIllegalAddress", "illegal address")


@pytest.mark.parametrize("stage, verdict", [("load", "load-error"), ("launch", "fault"), ("sync", "fault"),
                                            ("memory", "inconclusive")])
def test_device_errors_become_verdicts(stage, verdict):
    v = _variant("fwd_sm90a_bf16_d64_dv64")
    judged = judge.judge(v, problems.for_variant(v, _SERVES), _FailingDevice(stage), _SETTINGS)
    assert judged.verdict == verdict and ("Invalid" in judged.reason or "Illegal" in judged.reason)


def test_a_variant_without_problems_is_inconclusive():
    assert judge.judge(_variant("fwd_sm90a_bf16_d64_dv64"), (), StandInDevice(), _SETTINGS).verdict == "inconclusive"


# The C++ side.

def test_the_fa4args_mirror_is_the_librarys_struct(library):
    theirs = json.loads(library.Fa4ArgsLayout().decode())
    assert theirs == device.layout() and theirs["size"] == ctypes.sizeof(device.Fa4Args)
    # It can fail: a mirror with two fields swapped is refused.
    swapped = list(device.Fa4Args._fields_)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert [f[0] for f in theirs["fields"]] != [name for name, _ in swapped]


@pytest.fixture
def gate(library, monkeypatch):
    for variable in ("FA4_JAX_UNVERIFIED_ARCHES", "FA4_JAX_TRUST_UNVERIFIED", "FA4_JAX_DISABLE_ARCHES"):
        monkeypatch.delenv(variable, raising=False)
    lib = ctypes.CDLL(str(build.LIBRARY))
    lib.Fa4VariantRefusal.restype = ctypes.c_char_p
    lib.Fa4VariantRefusal.argtypes = [ctypes.c_char_p]
    lib.Fa4MarkVerified.argtypes = [ctypes.c_char_p]
    return lambda name: lib.Fa4VariantRefusal(name.encode()).decode(), lambda name: lib.Fa4MarkVerified(name.encode())


def test_the_handler_refuses_an_unverified_variant_until_it_is_marked_verified(gate, monkeypatch):
    refusal, mark = gate
    blackwell, hopper = "fwd_sm100f_fp16_d96_dv96_local", "bwd_sm90a_fp16_d96_dv96_local_segments"
    assert "FA4_JAX_TRUST_UNVERIFIED" in refusal(blackwell) and "verdicts check" in refusal(blackwell)
    assert refusal(hopper) == ""
    monkeypatch.setenv("FA4_JAX_UNVERIFIED_ARCHES", "sm_120a, sm_90a")  # read at run time
    assert hopper in refusal(hopper)
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "0")
    assert refusal(hopper) != ""
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "1")
    assert refusal(hopper) == ""
    monkeypatch.delenv("FA4_JAX_TRUST_UNVERIFIED")
    assert mark(hopper) == 0 and refusal(hopper) == "" and refusal(hopper.replace("fp16", "bf16")) != ""
    assert mark("fwd_sm90a_bf16_d88_dv88") == 1 and refusal("fwd_sm90a_bf16_d88_dv88") == "unknown variant"


def test_the_kill_switch_refuses_an_arch_whatever_else_says(gate, monkeypatch):
    refusal, mark = gate
    hopper = "fwd_sm90a_bf16_d64_dv64"
    monkeypatch.setenv("FA4_JAX_TRUST_UNVERIFIED", "1")
    monkeypatch.setenv("FA4_JAX_DISABLE_ARCHES", "sm_100f,sm_90a")
    assert "FA4_JAX_DISABLE_ARCHES" in refusal(hopper) and "FA4_JAX_DISABLE_ARCHES" in refusal(
        "fwd_sm100f_bf16_d64_dv64")
    monkeypatch.setenv("FA4_JAX_DISABLE_ARCHES", "sm_90")  # a whole entry, not a prefix
    assert refusal(hopper) == ""


def test_the_generated_table_lists_the_unverified_archs():
    source = (build.ROOT / "build" / "aot" / "dispatch.cc").read_text()
    assert 'const char* const kFa4UnverifiedArches[] = {"sm_100f"};' in source
    assert "const int kFa4UnverifiedArchCount = 1;" in source
