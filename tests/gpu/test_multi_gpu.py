"""GPU tier, several GPUs of one host: the kernels under batch/head sharding and in the ring.

Issue #7's test list: batch- and head-sharded attention, forward and backward, equal to the
unsharded kernel's result; ring (context-parallel) attention against the reference, causal and
not; deterministic mode bitwise stable across runs. Every test skips with fewer than 2 GPUs
(scripts/multi_gpu_check.sh runs them on a multi-GPU machine). The CPU tier checks the same
rules on 8 fake CPU devices through the reference backend (tests/test_sharding.py,
tests/test_ring_attention.py); here the kernels run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fa4_jax
from fa4_jax import ffi
from fa4_jax.api import attention_params
from tests.gpu.cases import qkv
from tests.numerics import assert_close_by_rule, dense_attention

pytestmark = pytest.mark.gpu


def _gpus():
    devices = jax.devices("gpu") if jax.default_backend() == "gpu" else []
    if len(devices) < 2:
        pytest.skip(f"needs 2 or more GPUs, jax sees {len(devices)}")
    return devices


def _require_kernels(q, k, v, **options):
    params = attention_params(q, k, v, implementation="cute", **options)
    reason = ffi.unsupported_reason(q, k, v, params, "bwd")
    if reason is not None:
        pytest.skip(f"no backward kernel: {reason}")


def _forward_and_grads(attend):
    def step(q, k, v, d_out):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(d_out))

    return step


# (batch, heads_q, heads_kv) per sharded dimension; the sharded one is a multiple of 2 · GPUs.
SHARDINGS = {"batch": ("data", None), "heads": (None, "heads")}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", SHARDINGS.keys())
def test_sharded_attention_equals_the_unsharded_kernel(next_key, dim, causal):
    devices = _gpus()
    n = len(devices)
    batch, heads_q, heads_kv = (2 * n, 4, 2) if dim == "batch" else (2, 4 * n, 2 * n)
    q, k, v = qkv(next_key, batch, 1000, 1000, heads_q, heads_kv, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    _require_kernels(q, k, v, causal=causal)
    # Deterministic mode: the sharded and the unsharded call then run the same kernels in the
    # same order on each device's rows, so they must agree bitwise.
    attend = lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, deterministic=True,  # noqa: E731
                                               implementation="cute")
    unsharded = jax.jit(_forward_and_grads(attend))(q, k, v, d_out)

    axis = "data" if dim == "batch" else "heads"
    mesh = jax.make_mesh((n,), (axis,), devices=devices)
    batch_axis, head_axis = SHARDINGS[dim]
    spec = NamedSharding(mesh, P(batch_axis, None, head_axis, None))
    sharded_step = jax.jit(_forward_and_grads(attend), in_shardings=(spec,) * 4,
                           out_shardings=(spec,) * 4)
    compiled = sharded_step.lower(q, k, v, d_out).compile().as_text()
    assert "all-gather" not in compiled and "all-to-all" not in compiled
    sharded = sharded_step(q, k, v, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), sharded, unsharded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _ring(mesh, n, causal, deterministic):
    per_device = jax.shard_map(
        lambda q, k, v: fa4_jax.ring_attention(q, k, v, mesh_axis="seq", causal=causal,
                                               deterministic=deterministic, implementation="cute"),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))

    def attend(q, k, v):
        to_layout = lambda x: fa4_jax.to_zigzag_layout(x, n)  # noqa: E731
        return fa4_jax.from_zigzag_layout(per_device(*map(to_layout, (q, k, v))), n)

    return attend


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_matches_the_reference(next_key, causal):
    devices = _gpus()
    n = len(devices)
    seqlen = 512 * n
    q, k, v = qkv(next_key, 1, seqlen, seqlen, 4, 2, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    _require_kernels(q, k, v, causal=causal)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    got = jax.jit(_forward_and_grads(_ring(mesh, n, causal, False)))(q, k, v, d_out)

    def oracle(compute_dtype):
        def attend(q, k, v):
            out, _ = dense_attention(q, k, v, causal=causal, compute_dtype=compute_dtype)
            return out.astype(q.dtype)
        return jax.jit(_forward_and_grads(attend))(q, k, v, d_out)

    ref, lowp = oracle(jnp.float32), oracle(jnp.bfloat16)
    for name, a, want, want_lowp in zip(("out", "dq", "dk", "dv"), got, ref, lowp):
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name}: non-finite entries"
        # Factor 3: each hop's partial O comes out of the kernel in bf16 before the fp32 merge,
        # one rounding more than a single call.
        assert_close_by_rule(a, want, want_lowp, factor=3, name=f"ring {name}")


def test_deterministic_ring_is_bitwise_stable(next_key):
    devices = _gpus()
    n = len(devices)
    q, k, v = qkv(next_key, 1, 512 * n, 512 * n, 8, 2, 128, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    _require_kernels(q, k, v, causal=True, deterministic=True)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    step = jax.jit(_forward_and_grads(_ring(mesh, n, True, True)))
    first = [np.asarray(x) for x in step(q, k, v, d_out)]
    for _ in range(4):
        for name, want, again in zip(("out", "dq", "dk", "dv"), first, step(q, k, v, d_out)):
            np.testing.assert_array_equal(np.asarray(again), want, err_msg=name)
