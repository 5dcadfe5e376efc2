"""GPU tier: `fa4_jax.dot_product_attention` on the kernels against `jax.nn.dot_product_attention`
with per-entry lengths: jax's top-left masks, padded rows and keyless rows, forward and gradients,
under docs/design.md's numerics rule (jax's XLA path in f32 at full matmul precision as the
oracle, the same path in bf16 as the low-precision reference)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule

pytestmark = pytest.mark.gpu

# (is_causal, local_window_size): jax's masks, aligned top-left.
MASKS = {"none": (False, None), "causal": (True, None), "window": (False, (40, 24)),
         "causal_window": (True, (64, 0))}
# (batch, T, S, N, K)
SHAPES = {"q_shorter_gqa": (4, 200, 333, 8, 2), "q_longer": (4, 333, 200, 4, 4)}


def _lengths(next_key, kind, batch, seqlen):
    """int32 [batch]: random in [0, seqlen], or the ends (0, full, 1, full - 1)."""
    if kind == "ends":
        return jnp.asarray([0, seqlen, 1, seqlen - 1][:batch], jnp.int32)
    return jax.random.randint(next_key(), (batch,), 0, seqlen + 1).astype(jnp.int32)


@pytest.mark.parametrize("lengths", ["random", "ends"])
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_drop_in_with_lengths_matches_jax_on_the_kernels(next_key, shape, mask, lengths):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    is_causal, window = mask
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    seq_lengths = dict(query_seq_lengths=_lengths(next_key, lengths, batch, seqlen_q),
                       key_value_seq_lengths=_lengths(next_key, lengths, batch, seqlen_k))
    static = dict(is_causal=is_causal, local_window_size=window)

    def out_and_grads(attention, q, k, v):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
        return jax.jit(lambda q, k, v: (attention(q, k, v), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    got = out_and_grads(functools.partial(fa4_jax.dot_product_attention, implementation="cute",
                                          **static, **seq_lengths), q, k, v)
    xla = functools.partial(jax.nn.dot_product_attention, implementation="xla", **static, **seq_lengths)
    with jax.default_matmul_precision("highest"):
        ref = out_and_grads(xla, *(x.astype(jnp.float32) for x in (q, k, v)))
    lowp = out_and_grads(xla, q, k, v)
    # An entry with no keys, or rows a window leaves keyless, take the mean of the values: their
    # share of dv is added to the kernel's dv in bf16, one rounding more than jax makes.
    for name, result, want, want_lowp in zip(("out", "dq", "dk", "dv"), got, ref, lowp):
        assert_close_by_rule(result, want, want_lowp, name=name, factor=3 if name == "dv" else 2)
    # Padded query rows are zero in jax's output; the kernels never write them otherwise.
    valid_rows = np.arange(seqlen_q)[None, :] < np.asarray(seq_lengths["query_seq_lengths"])[:, None]
    assert np.all(np.asarray(got[0], np.float32)[~valid_rows] == np.asarray(lowp[0], np.float32)[~valid_rows])
