"""CPU tier: the GQA decode benchmark's harness (benchmarks/bench_decode.py) on the reference."""
import json

from benchmarks import bench_decode


def test_dry_run_times_every_case_and_peer(tmp_path):
    peers = "fa4_jax,fa4_jax_fulltile,fa4_jax_nosplit,fa4_jax_unpacked,fa4_jax_ragged,xla"
    assert bench_decode.main(["--dry-run", "--peers", peers, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["results"]
    assert len(rows) == len(bench_decode.CASES["dry_run"]) * 6
    for row in rows:
        assert row["status"] == "ok" and row["us"] > 0 and row["kv_gb_s"] > 0, row


def test_kv_bytes_count_k_and_v_once():
    case = bench_decode.DecodeCase(batch=2, seqlen_k=100, heads_q=8, heads_kv=2, head_dim=64)
    assert case.kv_bytes == 2 * (2 * 100 * 2 * 64) * 2
