"""CPU tier: the attention benchmark's harness (benchmarks/bench_attention.py) on the reference,
including DeepSeek's d192/dv128 shape, which the JAX peers take with v zero-padded."""
import json

import jax
import numpy as np
import pytest

from benchmarks import bench_attention
from fa4_jax.fallbacks import reference


def test_dry_run_times_d192_with_value_head_dim_128(tmp_path):
    argv = ["--dry-run", "--modes", "fwd,fwd_bwd", "--head-dims", "64,192", "--seqlens", "128",
            "--causal", "no", "--peers", "fa4_jax,xla", "--out", str(tmp_path)]
    assert bench_attention.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {(r["head_dim"], r["head_dim_v"]) for r in rows} == {(64, 64), (192, 128)}
    for row in rows:
        assert row["status"] == "ok" and row["tflops"] > 0, row
        # Q·Kᵀ at d plus P·V at dv, per (batch, head, query, key); 3.5 forwards with the backward.
        forward = 2 * row["batch"] * row["heads"] * 128 * 128 * (row["head_dim"] + row["head_dim_v"])
        factor = bench_attention.FWD_BWD_FLOP_FACTOR if row["mode"] == "fwd_bwd" else 1
        assert row["flops"] == forward * factor


def test_the_matmul_ceiling_is_recorded_beside_anchors(tmp_path):
    argv = ["--dry-run", "--modes", "fwd", "--head-dims", "64", "--seqlens", "128", "--causal", "no",
            "--peers", "xla", "--ceiling-size", "96", "--out", str(tmp_path)]
    assert bench_attention.main(argv) == 0
    ceiling = json.loads((tmp_path / "results.json").read_text())["meta"]["matmul_ceiling"]
    assert ceiling["size"] == 96 and ceiling["anchors_tflops"] == 732.0
    assert ceiling["tflops"] == pytest.approx(2 * 96**3 / (ceiling["ms"] * 1e-3) / 1e12)
    argv[argv.index("96")] = "0"
    assert bench_attention.main(argv) == 0
    assert "matmul_ceiling" not in json.loads((tmp_path / "results.json").read_text())["meta"]


def test_padded_value_gives_the_narrow_output():
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(0), 3), [(2, 33, 3, 192), (2, 33, 3, 192), (2, 33, 3, 128)]))
    padded = bench_attention.with_value_padded(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    out = padded(q, k, v)
    want, _ = reference.attention_reference(q, k, v, causal=True)
    assert out.shape == (2, 33, 3, 128)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


def _dry_run_rows(tmp_path, *args) -> list[dict]:
    """The result rows of a dry run over both modes at d64, s = 128, no mask, with `args`."""
    argv = ["--dry-run", "--modes", "fwd,fwd_bwd", "--head-dims", "64", "--seqlens", "128",
            "--causal", "no", *args, "--out", str(tmp_path)]
    assert bench_attention.main(argv) == 0
    return json.loads((tmp_path / "results.json").read_text())["results"]


def test_tuning_rows_without_a_kernel_are_skipped_with_the_reason(tmp_path):
    # Ablation variants exist at some head dims only; a row the library cannot serve is a skip
    # that says why (here: no GPU), not a failure.
    rows = _dry_run_rows(tmp_path, "--peers", "xla", "--fa4-tunings", "lpt",
                         "--fa4-bwd-tunings", "dq_writer1")
    tuned = [r for r in rows if r["peer"] != "xla"]
    assert {r["peer"] for r in tuned} == {"fa4_jax:lpt", "fa4_jax_bwd:dq_writer1",
                                          "fa4_jax_bwd_det:dq_writer1"}
    for row in tuned:
        assert row["status"] == "skipped" and row["note"], row


def test_upstream_rows_say_why_they_are_skipped(tmp_path, monkeypatch):
    # FA4 upstream's exported forward and backward are an optional column: without its library
    # (or at a head dim it was not exported for) the row is a skip naming what is missing, not a
    # failure, forward and forward+backward alike.
    monkeypatch.delenv(bench_attention.UPSTREAM_LIB_ENV, raising=False)
    rows = _dry_run_rows(tmp_path, "--peers", "upstream")
    assert {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for row in rows:
        assert row["status"] == "skipped" and bench_attention.UPSTREAM_LIB_ENV in row["note"], row
    missing = tmp_path / "missing.so"
    monkeypatch.setenv(bench_attention.UPSTREAM_LIB_ENV, str(missing))
    settings = bench_attention.settings_from(bench_attention.parse_args(["--dry-run"]))
    for mode in bench_attention.MODES:
        for head_dim, reason in ((64, str(missing)), (192, "head dims")):
            case = bench_attention.Case(mode, head_dim, 128, False, 4, 4)
            try:
                bench_attention.upstream_candidates(case, settings)
            except bench_attention.Skip as skip:
                assert reason in str(skip), (mode, head_dim, skip)
            else:
                raise AssertionError(f"{mode} d{head_dim} without the library must be skipped")


def test_the_ablation_menu_is_apart_from_the_shipping_menu():
    # The development library's variants are all the ablation tunings' (plus each ablated
    # problem class's default, the like-for-like baseline), none of them in the wheel's library.
    from benchmarks import ablations
    from fa4_jax.aot import menu

    shipped = {v.name for v in menu.MENU}
    tuned = [v for v in ablations.MENU if v.tuning not in ("default",) + tuple(menu.arch_menu("sm_90a").TUNINGS)]
    assert tuned and not {v.name for v in tuned} & shipped
    assert {v.tuning for v in ablations.MENU} <= set(ablations.TUNINGS)
    assert ablations.ablation_menu().tuning_targets


def test_narrowed_ablations_refuse_calls_they_would_cut_short():
    from benchmarks import ablations
    from fa4_jax.abi.routing import Call

    tail = Call("fwd", "sm_90a", "bf16", 128, 128, "none", False, 300, 4200)  # 152 keys in the last block
    assert "seqlen_k=4200" in ablations.narrowing_mismatch("tail48", tail)
    assert ablations.narrowing_mismatch("tail128", Call("fwd", "sm_90a", "bf16", 128, 128, "none", False,
                                                        300, 4176)) is None  # 128 keys in the last
    diagonal = Call("fwd", "sm_90a", "bf16", 96, 96, "causal", False, 1000, 1064)
    assert "128-key blocks" in ablations.narrowing_mismatch("diag", diagonal)
    assert ablations.narrowing_mismatch("diag", Call("fwd", "sm_90a", "bf16", 96, 96, "causal", False,
                                                     1000, 1128)) is None
    assert ablations.narrowing_mismatch("lpt", diagonal) is None


def test_each_peer_keeps_its_colour_in_panels_it_is_absent_from(tmp_path, monkeypatch):
    # A peer without causal rows (Pallas MGPU's backward) must not hand its colour to the next
    # peer in the causal panels: the legend is gathered from all panels, one entry per label.
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    peers = ["fa4_jax", "mgpu", "upstream"]
    results = [{"mode": "fwd_bwd", "head_dim": 64, "causal": causal, "seqlen": seqlen, "peer": peer,
                "status": "ok", "tflops": 100.0 + seqlen / 64}
               for causal in (False, True) for seqlen in (1024, 4096) for peer in peers
               if not (causal and peer == "mgpu")]
    settings = bench_attention.Settings(**{
        **{f.name: None for f in bench_attention.dataclasses.fields(bench_attention.Settings)},
        "tokens": 16384, "hidden": 2048, "dtype": "bf16"})
    bench_attention.plot(results, peers, settings, str(tmp_path))
    (figure,) = figures
    colours = {}
    for ax in figure.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert len(colours) >= 3 and all(len(c) == 1 for c in colours.values()), colours
