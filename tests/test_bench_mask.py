"""CPU tier: the mask benchmark's harness (benchmarks/bench_mask.py) on the reference."""
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_mask


def test_dry_run_times_every_fa4_jax_peer(tmp_path):
    assert bench_mask.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "mask.json").read_text())["results"]
    timed = {(row["mode"], row["peer"]) for row in rows if row["status"] == "ok"}
    for peer in ("fa4_jax_is_causal", "fa4_jax_mask", "fa4_jax_padding_mask"):
        assert {("fwd", peer), ("fwd_bwd", peer)} <= timed
    assert ("fwd", "mask_operands") in timed and ("fwd_bwd", "mask_operands") not in timed


def test_the_mask_peer_computes_what_the_flag_peer_computes():
    # The two timed calls are one attention: a causal array is is_causal=True.
    peers = bench_mask.peers("reference")
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 96, 2, 32), jnp.float32) for i in range(3))
    mask = jnp.tril(jnp.ones((96, 96), bool))[None, None]
    np.testing.assert_allclose(peers["fa4_jax_mask"](q, k, v, mask, None),
                               peers["fa4_jax_is_causal"](q, k, v, mask, None), atol=1e-5, rtol=1e-5)
