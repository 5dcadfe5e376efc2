"""Attention over disjoint key sets, merged by their logsumexp: the one formula that split-KV's
chunks (split_kv.py) and ring attention's hops (api/ring.py) combine their partial
results with.

For parts i of the same query rows, out = Σ exp(lse_i − lse) · out_i and lse = log Σ exp(lse_i),
the exponents shifted by the largest lse so none overflows. A row that no part saw (every lse_i
−inf) gets out 0 and lse −inf, with no 0/0 and no log 0.
"""
from __future__ import annotations


def merge_by_lse(outs, lses):
    """outs [b, n, rows, heads, dv] (any float dtype) and lses [b, n, heads, rows]: n partial
    attentions of the same rows. Returns out [b, rows, heads, dv] float32 and lse
    [b, heads, rows] float32."""
    import jax.numpy as jnp  # here, as in ffi.py and split_kv.py: the import needs no JAX

    lse_max = jnp.max(lses, axis=1)
    shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lses - shift[:, None])
    total = jnp.sum(weights, axis=1)
    seen = total > 0.0
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, shift + jnp.log(safe_total), -jnp.inf)
    # [b, n, heads, rows] -> [b, n, rows, heads, 1], onto outs
    by_row = jnp.swapaxes(weights / safe_total[:, None], 2, 3)[..., None]
    return jnp.sum(by_row * outs.astype(jnp.float32), axis=1), lse
