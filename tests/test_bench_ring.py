"""CPU tier: the ring-scaling benchmark's harness (benchmarks/bench_ring.py) on 8 fake devices."""
import json

from benchmarks import bench_ring


def test_dry_run_writes_a_row_per_case(tmp_path):
    argv = ["--dry-run", "--seqlens", "64", "--modes", "fwd,fwd_bwd", "--causal", "both",
            "--repeats", "1", "--out", str(tmp_path)]
    assert bench_ring.main(argv) == 0
    result = json.loads((tmp_path / "ring_results.json").read_text())
    assert result["devices"] == 8
    rows = result["rows"]
    assert {(r["mode"], r["causal"]) for r in rows} == {
        (m, c) for m in ("fwd", "fwd_bwd") for c in (False, True)}
    for row in rows:
        assert row["ring_ms"] > 0 and row["local_ms"] > 0 and row["single_ms"] > 0
        assert 0.0 <= row["communication_share"] <= 1.0
        assert row["single_seqlen"] == 64


def test_flops_follow_the_attention_shape():
    case = bench_ring.RingCase("fwd", 1024, False, heads=16, head_dim=128)
    assert case.flops() == 4 * 16 * 1024 * 1024 * 128
    causal = bench_ring.RingCase("fwd_bwd", 1024, True, heads=16, head_dim=128)
    assert causal.flops() == case.flops() / 2 * 3.5
    # local share of a causal ring: S/n rows against S/2 keys without a mask, same FLOPs / n
    assert case.flops(1024 // 8, 512, False) == causal.flops() / 3.5 / 8
