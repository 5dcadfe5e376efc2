"""CPU tier: benchmarks/timing_protocol.py (the two timers side by side) runs end to end on the
reference backend, and its isolated timer takes the dispatch time off each call."""
import time

import jax.numpy as jnp

from benchmarks import timing_protocol


def test_isolated_timer_subtracts_the_dispatch_time():
    def step(x):
        time.sleep(0.02)
        return x

    inputs = [(jnp.zeros((4,)),)]
    def isolated(overhead_s):
        return timing_protocol.isolated_ms(step, inputs, samples=3, gap_s=0.0, flush_elems=16,
                                           overhead_s=overhead_s)

    whole, less = isolated(0.0), isolated(0.01)
    assert whole >= 20.0
    assert 5.0 <= whole - less <= 15.0  # the 10 ms taken off, within the sleeps' jitter


def test_dry_run_prints_both_timings(capsys):
    assert timing_protocol.main(["--dry-run", "--peers", "fa4_jax", "--head-dims", "64",
                                 "--seqlens", "128"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "fa4_jax" in line)
    loop_ms, _, alone_ms, _, ratio = (float(x) for x in row.split()[-5:])
    assert loop_ms > 0 and alone_ms > 0
    assert abs(ratio - loop_ms / alone_ms) < 0.01
