"""GPU tier: the partitioned attention op reaches the kernels' FFI custom call."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fa4_jax
from fa4_jax.abi import targets
from fa4_jax.runtime import dispatch

FORWARD_TARGET = targets.TARGETS["fwd"].current.name
BACKWARD_TARGET = targets.TARGETS["bwd"].current.name


def _require_kernels(q):
    if not dispatch.available():
        pytest.skip("kernels unavailable: the library or a GPU of its arch is missing")


def _batch_sharded_attention(devices):
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
    sharding = NamedSharding(mesh, P("data"))
    return jax.jit(
        lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="cute"),
        in_shardings=(sharding,) * 3,
    )


@pytest.mark.gpu
def test_partitioned_op_lowers_to_the_forward_custom_call_on_one_device():
    q = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
    _require_kernels(q)
    lowered = _batch_sharded_attention(jax.devices("gpu")[:1]).lower(q, q, q)
    assert FORWARD_TARGET in lowered.as_text()
    assert FORWARD_TARGET in lowered.compile().as_text()


@pytest.mark.gpu
def test_batch_sharded_op_runs_the_custom_call_per_device_without_collectives():
    devices = jax.devices("gpu")
    if len(devices) < 2:
        pytest.skip("needs 2 GPUs")
    q = jnp.zeros((2 * len(devices), 256, 4, 128), jnp.bfloat16)
    _require_kernels(q)
    compiled = _batch_sharded_attention(devices).lower(q, q, q).compile().as_text()
    assert FORWARD_TARGET in compiled
    assert "all-gather" not in compiled and "all-to-all" not in compiled


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradient_lowers_to_the_backward_custom_call_with_its_mode(deterministic):
    q = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
    _require_kernels(q)
    loss = lambda q: fa4_jax.attention(q, q, q, causal=True, deterministic=deterministic,
                                       implementation="cute").astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert FORWARD_TARGET in text and BACKWARD_TARGET in text
    assert f"deterministic = {str(deterministic).lower()}" in text
