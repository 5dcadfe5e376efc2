"""CPU tier: the padded-head-dim benchmark's harness (benchmarks/bench_head_dims.py) on the reference."""
import json

from benchmarks import bench_head_dims


def test_dry_run_times_the_padded_and_the_served_call(tmp_path):
    assert bench_head_dims.main(["--dry-run", "--peers", "fa4_jax,fa4_jax_served",
                                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "head_dims.json").read_text())["results"]
    assert len(rows) == 2 * 2 * 2  # modes x causal x peers
    for row in rows:
        assert row["status"] == "ok" and row["tflops"] > 0, row
    assert {row["timed_head_dim"] for row in rows} == {24, 32}


def test_flops_count_the_true_head_dim():
    case = bench_head_dims.Case("fwd", 88, 1024, True, 2, 3)
    assert bench_head_dims.served_head_dim(case) == 96
    assert case.flops == 4 * 2 * 3 * 1024 ** 2 * 88 / 2
