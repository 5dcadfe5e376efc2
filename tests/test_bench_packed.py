"""CPU tier: the packed-documents benchmark's harness (benchmarks/bench_packed.py) on the reference."""
import json

from benchmarks import bench_packed


def test_dry_run_times_every_peer_and_skips_cudnn(tmp_path):
    assert bench_packed.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "packed.json").read_text())["results"]
    timed = {(row["mode"], row["peer"]) for row in rows if row["status"] == "ok"}
    for peer in ("fa4_jax_segments", "fa4_jax_varlen", "fa4_jax_varlen_apart", "fa4_jax_mask",
                 "fa4_jax_dense_equal"):
        assert {("fwd", peer), ("fwd_bwd", peer)} <= timed
    assert ("fwd", "span_tables") in timed and ("fwd_bwd", "span_tables") not in timed
    assert ("fwd_bwd", "fa4_jax_segments_det") in timed and ("fwd", "fa4_jax_segments_det") not in timed
    assert all(row["status"] == "skipped" for row in rows if row["peer"].startswith("cudnn"))
    assert {"cudnn_mask", "cudnn_dense_equal", "cudnn_dense_docs"} <= {row["peer"] for row in rows}
    # Equal documents are also timed as a dense batch of them, at the same useful work.
    batched = [row for row in rows if row["peer"] == "fa4_jax_dense_docs"]
    assert {row["case"] for row in batched} == {"equal 40"} and len(batched) == 2
    segments = next(row for row in rows if row["peer"] == "fa4_jax_segments" and row["case"] == "equal 40")
    assert batched[0]["useful_tflop"] == segments["useful_tflop"]


def test_useful_work_counts_each_documents_causal_pairs():
    case = bench_packed.PackedCase("t", 1, 16, 2, 8, ((3, 5, 8),))
    assert case.useful_pairs == 6 + 15 + 36
    assert case.flops("fwd") == 4 * 2 * 8 * 57 and case.flops("fwd_bwd") == 3.5 * case.flops("fwd")
    assert case.equal_documents() is None
    assert bench_packed.PackedCase("t", 2, 12, 2, 8, ((4, 4, 4),) * 2).equal_documents() == 4
    assert bench_packed.PackedCase("t", 1, 13, 2, 8, ((4, 4, 4),)).equal_documents() is None
    q_ids, kv_ids = case.segment_ids()
    assert q_ids.tolist() == [[0] * 3 + [1] * 5 + [2] * 8] and kv_ids.tolist() == q_ids.tolist()
