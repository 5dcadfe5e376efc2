"""Partitioning of attention over 8 fake CPU devices: results, collectives, warnings, errors.

The reference backend runs under the same custom_partitioning rules as the kernels, so these
tests check exactly the partitioning a GPU run gets.
"""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fa4_jax
from tests.multi_device import collectives_in, cpu_mesh


def _inputs(next_key, batch=8, seqlen=32, heads_q=8, heads_kv=4, head_dim=16):
    """q, k, v and cotangents for out and lse, float32."""
    q = jax.random.normal(next_key(), (batch, seqlen, heads_q, head_dim), jnp.float32)
    k = jax.random.normal(next_key(), (batch, seqlen, heads_kv, head_dim), jnp.float32)
    v = jax.random.normal(next_key(), (batch, seqlen, heads_kv, head_dim), jnp.float32)
    d_out = jax.random.normal(next_key(), q.shape, jnp.float32)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, seqlen), jnp.float32)
    return q, k, v, d_out, d_lse


def _forward_and_vjp(attend):
    """(q, k, v, d_out, d_lse) -> (out, lse, dq, dk, dv): both cotangents reach the op, and
    no scalar loss adds a reduction across devices of its own."""

    def step(q, k, v, d_out, d_lse):
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    return step


def _causal_attention(q, k, v):
    return fa4_jax.attention(q, k, v, causal=True, return_lse=True)


def _assert_trees_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


# name: (mesh axis sizes, names, q spec, k/v spec, heads_kv). Each keeps every device busy on
# its own batch entries and/or kv-head groups, so no collective is needed.
NO_COLLECTIVE_SHARDINGS = {
    "batch": ((8,), ("data",), P("data"), P("data"), 4),
    "heads": ((4,), ("model",), P(None, None, "model"), P(None, None, "model"), 4),
    "batch_and_heads": ((2, 4), ("data", "model"), P("data", None, "model"),
                        P("data", None, "model"), 4),
    "gqa_heads": ((2,), ("model",), P(None, None, "model"), P(None, None, "model"), 2),
    # k/v arrive replicated: each device slices its kv heads locally (no communication).
    "gqa_heads_from_q_only": ((2, 2), ("data", "model"), P("data", None, "model"), P(), 2),
}


@pytest.mark.parametrize(
    "case", NO_COLLECTIVE_SHARDINGS.values(), ids=NO_COLLECTIVE_SHARDINGS.keys()
)
def test_batch_and_head_sharding_runs_locally_and_matches_unsharded(next_key, case):
    axis_sizes, axis_names, q_spec, kv_spec, heads_kv = case
    mesh = cpu_mesh(axis_sizes, axis_names)
    inputs = _inputs(next_key, heads_kv=heads_kv)
    step = _forward_and_vjp(_causal_attention)
    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    lse_sharding = NamedSharding(mesh, P(q_spec[0], *q_spec[2:3]))
    sharded_step = jax.jit(
        step, in_shardings=(q_sharding, kv_sharding, kv_sharding, q_sharding, lse_sharding)
    )

    with warnings.catch_warnings():
        warnings.simplefilter("error", fa4_jax.ReshardWarning)
        compiled = sharded_step.lower(*inputs).compile()
    assert collectives_in(compiled.as_text()) == []
    results = compiled(*inputs)

    _assert_trees_close(results, jax.jit(step)(*inputs))
    out, _, dq, _, _ = results
    # out and dq keep q's batch/head sharding.
    assert out.sharding.is_equivalent_to(q_sharding, out.ndim)
    assert dq.sharding.is_equivalent_to(q_sharding, dq.ndim)


# name: (mesh axis sizes, names, q spec, k/v spec, lengths spec)
RAGGED_SHARDINGS = {
    "batch": ((8,), ("data",), P("data"), P("data"), P("data")),
    # The lengths arrive replicated: each device slices its batch entries' lengths.
    "batch_and_heads": ((2, 4), ("data", "model"), P("data", None, "model"),
                        P("data", None, "model"), P()),
    "heads": ((4,), ("model",), P(None, None, "model"), P(None, None, "model"), P()),
}


@pytest.mark.parametrize("case", RAGGED_SHARDINGS.values(), ids=RAGGED_SHARDINGS.keys())
def test_ragged_batch_sharding_runs_locally_and_matches_unsharded(next_key, case):
    """The lengths travel with the batch: each device attends its entries with their own."""
    axis_sizes, axis_names, q_spec, kv_spec, lengths_spec = case
    mesh = cpu_mesh(axis_sizes, axis_names)
    q, k, v, d_out, d_lse = _inputs(next_key)
    q_len = jax.random.randint(next_key(), (8,), 0, 33)
    kv_len = jax.random.randint(next_key(), (8,), 0, 33)

    def ragged_step(q, k, v, d_out, d_lse, q_len, kv_len):
        def attend(q, k, v):
            return fa4_jax.attention(q, k, v, causal=True, return_lse=True,
                                     query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

        return _forward_and_vjp(attend)(q, k, v, d_out, d_lse)

    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    lse_sharding = NamedSharding(mesh, P(q_spec[0], *q_spec[2:3]))
    lengths_sharding = NamedSharding(mesh, lengths_spec)
    sharded_step = jax.jit(ragged_step, in_shardings=(
        q_sharding, kv_sharding, kv_sharding, q_sharding, lse_sharding, lengths_sharding,
        lengths_sharding))
    inputs = (q, k, v, d_out, d_lse, q_len, kv_len)

    with warnings.catch_warnings():
        warnings.simplefilter("error", fa4_jax.ReshardWarning)
        compiled = sharded_step.lower(*inputs).compile()
    assert collectives_in(compiled.as_text()) == []
    results = compiled(*inputs)
    _assert_trees_close(results, jax.jit(ragged_step)(*inputs))
    assert results[0].sharding.is_equivalent_to(q_sharding, q.ndim)


def test_explicit_sharding_mesh(next_key):
    """jax.make_mesh's default (Explicit axes) partitions the same way as Auto axes."""
    mesh = cpu_mesh((2, 4), ("data", "model"), axis_type=AxisType.Explicit)
    q, k, v, _, _ = _inputs(next_key)
    sharding = NamedSharding(mesh, P("data", None, "model"))
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
    attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))
    assert collectives_in(attend.lower(q, k, v).compile().as_text()) == []
    out = attend(q, k, v)
    assert out.sharding.is_equivalent_to(sharding, out.ndim)
    np.testing.assert_allclose(out, fa4_jax.attention(*(np.asarray(x) for x in (q, k, v)),
                                                      causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spec, message",
    [(P(None, "data"), re.escape("query seq over ('data',)")),
     (P(None, None, None, "data"), re.escape("query head_dim over ('data',)"))],
    ids=["seq", "head_dim"],
)
def test_unsupported_sharding_is_gathered_with_a_warning(next_key, spec, message):
    mesh = cpu_mesh((4,), ("data",))
    q, k, v, _, _ = _inputs(next_key)
    sharding = NamedSharding(mesh, spec)
    attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True),
                     in_shardings=(sharding,) * 3)
    with pytest.warns(fa4_jax.ReshardWarning, match=message) as caught:
        compiled = attend.lower(q, k, v).compile()
    assert "ring_attention" in str(caught[0].message)
    assert "all-gather" in collectives_in(compiled.as_text())
    np.testing.assert_allclose(compiled(q, k, v), fa4_jax.attention(q, k, v, causal=True),
                               rtol=1e-5, atol=1e-5)


def test_kv_heads_must_be_a_multiple_of_the_head_sharding(next_key):
    mesh = cpu_mesh((4,), ("model",))
    q, k, v, _, _ = _inputs(next_key, heads_q=8, heads_kv=2)
    attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v),
                     in_shardings=(NamedSharding(mesh, P(None, None, "model")), None, None))
    with pytest.raises(Exception, match="key/value have 2 heads, not a multiple of 4"):
        attend.lower(q, k, v).compile()


def test_attention_inside_shard_map(next_key):
    """Every axis manual: the op is the single-device body on each shard, fwd and grads."""
    mesh = cpu_mesh((2, 4), ("data", "model"))
    inputs = _inputs(next_key)
    spec, lse_spec = P("data", None, "model"), P("data", "model")
    attend_per_shard = jax.shard_map(
        _causal_attention, mesh=mesh, in_specs=spec, out_specs=(spec, lse_spec)
    )
    step = jax.jit(_forward_and_vjp(attend_per_shard))
    assert collectives_in(step.lower(*inputs).compile().as_text()) == []
    _assert_trees_close(step(*inputs), jax.jit(_forward_and_vjp(_causal_attention))(*inputs))


def test_shard_map_with_automatic_axes_left_is_rejected(next_key):
    mesh = cpu_mesh((2, 4), ("data", "model"))
    q, k, v, _, _ = _inputs(next_key)
    spec = P(None, None, "model")
    attend_per_shard = jax.shard_map(
        lambda q, k, v: fa4_jax.attention(q, k, v),
        mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"model"},
    )
    with pytest.raises(NotImplementedError, match=re.escape("leaves mesh axes ('data',)")):
        jax.jit(attend_per_shard).trace(q, k, v)


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")], ids=["mapped_axis", "batch"])
def test_vmap_of_sharded_attention_needs_no_gather(next_key, spec):
    """A mapped axis is one more batch dimension of the partitioned op, sharded or not."""
    mesh = cpu_mesh((2,), ("data",))
    q, k, v, _, _ = _inputs(next_key)
    q, k, v = (x.reshape(2, 4, *x.shape[1:]) for x in (q, k, v))  # [mapped, batch, ...]
    sharding = NamedSharding(mesh, spec)
    attend = jax.jit(jax.vmap(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True)),
                     in_shardings=(sharding,) * 3)
    assert collectives_in(attend.lower(q, k, v).compile().as_text()) == []
    expected = fa4_jax.attention(*(x.reshape(8, *x.shape[2:]) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(attend(q, k, v), expected.reshape(q.shape), rtol=1e-5, atol=1e-5)
