"""CPU tier: scripts/upstream_peer/build.py's generated FFI handler fills each exported kernel's
tensor structs with the row-major [b, s, h, d] / [b, h, sq] layouts XLA hands it, and the
backward's workspaces with the shapes upstream allocates them in."""
from benchmarks.bench_attention import UPSTREAM_HEAD_DIMS
from tests.scripts import load_script

# export_bwd.py's NAME.json for d128 causal: upstream's _tile_size_bwd_sm90 (64 x 128 when causal).
TILE_D128_CAUSAL = {"tile_m": 64, "tile_n": 128, "accum_head_dim": 128}


def test_each_kernel_case_passes_row_major_shapes_and_strides():
    build = load_script("upstream_peer/build")
    case = build._fwd_case("upstream_fwd_d128_causal", 128, True)
    assert "if (d == 128 && causal == true)" in case
    # q/o over seqlen_q, k/v over seqlen_k; strides in elements, outermost first, last mode 1.
    assert "mQ{q, {b, sq, h, d}, {int64_t(sq) * h * d, int64_t(h) * d, d}}" in case
    assert "mK{k, {b, sk, h, d}, {int64_t(sk) * h * d, int64_t(h) * d, d}}" in case
    assert "mV{v, {b, sk, h, d}, {int64_t(sk) * h * d, int64_t(h) * d, d}}" in case
    assert "mO{o, {b, sq, h, d}, {int64_t(sq) * h * d, int64_t(h) * d, d}}" in case
    assert "mLSE{lse, {b, h, sq}, {int64_t(h) * sq, sq}}" in case
    assert "cute_dsl_upstream_fwd_d128_causal_wrapper(&g_upstream_fwd_d128_causal," in case
    assert build.HEAD_DIMS == UPSTREAM_HEAD_DIMS  # the benchmark's column skips the others


def test_each_backward_case_passes_row_major_shapes_strides_and_workspaces():
    build = load_script("upstream_peer/build")
    name = "upstream_bwd_d128_causal"
    case = build._bwd_case(name, 128, True, TILE_D128_CAUSAL)
    assert "if (d == 128 && causal == true)" in case
    for param, ptr, seq in [("mQ", "q", "sq"), ("mK", "k", "sk"), ("mV", "v", "sk"),
                            ("mO", "o", "sq"), ("mdO", "dout", "sq"), ("mdQ", "dq", "sq"),
                            ("mdK", "dk", "sk"), ("mdV", "dv", "sk")]:
        assert (f"{name}_Tensor_{param}_t {param}{{x.{ptr}, {{b, {seq}, h, d}}, "
                f"{{int64_t({seq}) * h * d, int64_t(h) * d, d}}}};") in case
    assert "mLSE{x.lse, {b, h, sq}, {int64_t(h) * sq, sq}}" in case
    # Upstream's workspaces over rows (seqlen_q rounded up to tile_m), dQ's at its head dim.
    assert "mdQaccum{x.dq_accum, {b, h, rows * 128}, {int64_t(h) * rows * 128, rows * 128}}" in case
    assert "mdPsum{x.dpsum, {b, h, rows}, {int64_t(h) * rows, rows}}" in case
    assert "mLSElog2{x.lse_log2, {b, h, rows}, {int64_t(h) * rows, rows}}" in case
    # The export's entry takes the tensors in export_bwd.py's order, then the scale and stream.
    call = " ".join(case[case.index(f"cute_dsl_{name}_wrapper("):].split())
    assert call.startswith(f"cute_dsl_{name}_wrapper(&g_{name}, &mQ, &mK, &mV, &mO, &mdO, &mLSE, "
                           "&mdQ, &mdK, &mdV, &mdQaccum, &mdPsum, &mLSElog2, scale, stream);")


def test_handler_says_each_backward_tile_and_keeps_the_forward_target():
    build = load_script("upstream_peer/build")
    source = build.handler_source(
        [("upstream_fwd_d128_causal", 128, True)],
        [("upstream_bwd_d128_causal", 128, True, TILE_D128_CAUSAL)])
    tile_m = source[source.index("int32_t UpstreamBwdTileM("):]
    assert "if (d == 128 && causal == true) return 64;" in tile_m[:tile_m.index("}")]
    accum = source[source.index("int32_t UpstreamBwdAccumHeadDim("):]
    assert "if (d == 128 && causal == true) return 128;" in accum[:accum.index("}")]
    for symbol in ("UpstreamFwdInstantiate", "UpstreamFwdExecute", "UpstreamBwdInstantiate",
                   "UpstreamBwdExecute"):
        assert f"XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol}," in source
    assert "@" not in source  # every placeholder filled
    assert "cudaMalloc" not in source  # XLA owns every buffer
