"""ring_attention (context parallelism) on fake CPU devices against single-device attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fa4_jax
from tests.multi_device import cpu_mesh
from tests.numerics import assert_close_by_rule, reference_grad_pair, reference_pair

RING = 4  # devices on the sequence axis


def _inputs(next_key, dtype=jnp.float32, batch=2, seqlen=64, heads_q=4, heads_kv=2, head_dim=16):
    """q, k, v and cotangents for out and lse."""
    q = jax.random.normal(next_key(), (batch, seqlen, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, seqlen, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, seqlen, heads_kv, head_dim), dtype)
    d_out = jax.random.normal(next_key(), q.shape, dtype)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, seqlen), jnp.float32)
    return q, k, v, d_out, d_lse


def _ring_over_full_sequence(mesh, **options):
    """Full-sequence (out, lse) computed by ring_attention on the mesh's "seq" axis.

    The sequence goes in and out of the zig-zag layout around the shard_map, as a user's
    model would do once at its input and output.
    """

    def to_layout(x, seq_axis=1):
        return fa4_jax.to_zigzag_layout(x, RING, seq_axis=seq_axis)

    def from_layout(x, seq_axis=1):
        return fa4_jax.from_zigzag_layout(x, RING, seq_axis=seq_axis)

    per_device = jax.shard_map(
        lambda q, k, v: fa4_jax.ring_attention(
            q, k, v, mesh_axis="seq", return_lse=True, **options
        ),
        mesh=mesh,
        in_specs=P("data", "seq"),
        out_specs=(P("data", "seq"), P("data", None, "seq")),
    )

    def attend(q, k, v):
        out, lse = per_device(to_layout(q), to_layout(k), to_layout(v))
        return from_layout(out), from_layout(lse, seq_axis=2)

    return attend


def _forward_and_vjp(attend):
    def step(q, k, v, d_out, d_lse):
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((d_out, d_lse)))

    return step


CASES = {
    "causal_deterministic": dict(causal=True, deterministic=True),
    "full_softcap": dict(causal=False, softcap=3.0),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_ring_matches_single_device_attention_fwd_and_grads(next_key, options):
    mesh = cpu_mesh((2, RING), ("data", "seq"))
    inputs = _inputs(next_key)
    ring_step = jax.jit(_forward_and_vjp(_ring_over_full_sequence(mesh, **options)))
    expected = jax.jit(_forward_and_vjp(
        lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **options)
    ))(*inputs)

    results = ring_step(*inputs)
    for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), results, expected):
        np.testing.assert_allclose(actual, wanted, rtol=2e-5, atol=2e-5, err_msg=name)
    if options.get("deterministic"):
        again = ring_step(*inputs)
        for first, second in zip(results, again):
            np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_bfloat16_meets_the_numerics_rule(next_key, causal):
    """Partials merge in fp32 and dk, dv travel the ring in fp32: docs/design.md's bound holds."""
    mesh = cpu_mesh((1, RING), ("data", "seq"))
    q, k, v, d_out, _ = _inputs(next_key, dtype=jnp.bfloat16, batch=1, seqlen=128, head_dim=32)
    ring = _ring_over_full_sequence(mesh, causal=causal)

    def out_and_grads(q, k, v):
        (out, lse), pullback = jax.vjp(ring, q, k, v)
        return out, lse, pullback((d_out, jnp.zeros_like(lse)))

    out, lse, grads = jax.jit(out_and_grads)(q, k, v)
    (ref, ref_lse), (ref_lowp, ref_lowp_lse) = reference_pair(q, k, v, causal=causal)
    assert_close_by_rule(out, ref, ref_lowp, name="out")
    assert_close_by_rule(lse, ref_lse, ref_lowp_lse, name="lse")
    ref_grads, ref_lowp_grads = reference_grad_pair(q, k, v, d_out, causal=causal)
    for name, grad, ref_grad, ref_lowp_grad in zip(("dq", "dk", "dv"), grads, ref_grads,
                                                    ref_lowp_grads):
        assert_close_by_rule(grad, ref_grad, ref_lowp_grad, name=name)


def test_zigzag_layout_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i():
    sequence = jnp.arange(16)[None, :]  # 2n = 8 chunks of 2
    permuted = fa4_jax.to_zigzag_layout(sequence, 4)
    per_device = np.asarray(permuted).reshape(4, 4)  # contiguous sharding over 4 devices
    np.testing.assert_array_equal(per_device[1], [2, 3, 12, 13])  # chunks 1 and 6
    np.testing.assert_array_equal(fa4_jax.from_zigzag_layout(permuted, 4), sequence)
    lse_like = jnp.arange(2 * 3 * 16).reshape(2, 3, 16)
    round_trip = fa4_jax.from_zigzag_layout(
        fa4_jax.to_zigzag_layout(lse_like, 4, seq_axis=2), 4, seq_axis=2
    )
    np.testing.assert_array_equal(round_trip, lse_like)
    with pytest.raises(ValueError, match="divisible into 8 chunks"):
        fa4_jax.to_zigzag_layout(jnp.zeros((1, 12)), 4)


@pytest.mark.parametrize(
    "options, shapes, error, message",
    [
        (dict(window_size=(8, 0)), (8, 8), NotImplementedError, "sliding windows"),
        (dict(causal=True), (7, 7), ValueError, "one even length"),
        (dict(causal=True), (8, 4), ValueError, "one even length"),
    ],
    ids=["window", "odd_block", "unequal_blocks"],
)
def test_unsupported_ring_options_are_rejected(options, shapes, error, message):
    mesh = cpu_mesh((RING,), ("seq",))
    seqlen_q, seqlen_k = shapes
    q = jnp.zeros((1, RING * seqlen_q, 2, 8))
    kv = jnp.zeros((1, RING * seqlen_k, 2, 8))
    per_device = jax.shard_map(
        lambda q, k, v: fa4_jax.ring_attention(q, k, v, mesh_axis="seq", **options),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"),
    )
    with pytest.raises(error, match=message):
        jax.jit(per_device).trace(q, kv, kv)
