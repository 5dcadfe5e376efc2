"""CPU tier: scripts/upstream_peer/build.py's generated FFI handler fills each exported kernel's
tensor structs with the row-major [b, s, h, d] / [b, h, sq] layouts XLA hands it."""
from benchmarks.bench_attention import UPSTREAM_HEAD_DIMS
from tests.scripts import load_script


def test_each_kernel_case_passes_row_major_shapes_and_strides():
    build = load_script("upstream_peer/build")
    case = build._case("upstream_fwd_d128_causal", 128, True)
    assert "if (d == 128 && causal == true)" in case
    # q/o over seqlen_q, k/v over seqlen_k; strides in elements, outermost first, last mode 1.
    assert "mQ{q, {b, sq, h, d}, {int64_t(sq) * h * d, int64_t(h) * d, d}}" in case
    assert "mK{k, {b, sk, h, d}, {int64_t(sk) * h * d, int64_t(h) * d, d}}" in case
    assert "mV{v, {b, sk, h, d}, {int64_t(sk) * h * d, int64_t(h) * d, d}}" in case
    assert "mO{o, {b, sq, h, d}, {int64_t(sq) * h * d, int64_t(h) * d, d}}" in case
    assert "mLSE{lse, {b, h, sq}, {int64_t(h) * sq, sq}}" in case
    assert "cute_dsl_upstream_fwd_d128_causal_wrapper(&g_upstream_fwd_d128_causal," in case
    assert build.HEAD_DIMS == UPSTREAM_HEAD_DIMS  # the benchmark's column skips the others
