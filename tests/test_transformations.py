"""attention under jax.vmap, jax.checkpoint, jit caching and a jax.export round trip."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fa4_jax
from tests.multi_device import cpu_mesh

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(next_key, leading=(2,), seqlen=16, heads_q=4, heads_kv=2, head_dim=8):
    q = jax.random.normal(next_key(), (*leading, seqlen, heads_q, head_dim), jnp.float32)
    k = jax.random.normal(next_key(), (*leading, seqlen, heads_kv, head_dim), jnp.float32)
    v = jax.random.normal(next_key(), (*leading, seqlen, heads_kv, head_dim), jnp.float32)
    return q, k, v


def _causal(q, k, v):
    return fa4_jax.attention(q, k, v, causal=True, return_lse=True)


def _per_slice(fn, *arrays):
    """fn applied to each leading slice, stacked: what vmap must equal."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *(fn(*xs) for xs in zip(*arrays)))


def _assert_trees_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_vmap_folds_mapped_axes_into_batch(next_key):
    q, k, v = _qkv(next_key, leading=(3, 2))
    _assert_trees_close(jax.vmap(_causal)(q, k, v), _per_slice(_causal, q, k, v))
    # Nested vmaps and a mapped axis that is not leading.
    nested = jax.vmap(jax.vmap(_causal), in_axes=1, out_axes=1)(q[None], k[None], v[None])
    _assert_trees_close(nested, jax.tree.map(lambda x: x[None], _per_slice(_causal, q, k, v)))
    # Only the queries mapped: k and v are shared by every slice.
    _assert_trees_close(
        jax.vmap(_causal, in_axes=(0, None, None))(q, k[0], v[0]),
        _per_slice(lambda q: _causal(q, k[0], v[0]), q),
    )


def test_grad_of_vmap_and_vmap_of_grad(next_key):
    q, k, v = _qkv(next_key, leading=(3, 2))

    def loss(q, k, v):
        out, lse = _causal(q, k, v)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    per_slice_grads = _per_slice(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    grad_of_vmap = jax.grad(lambda *a: jnp.sum(jax.vmap(loss)(*a)), argnums=(0, 1, 2))
    _assert_trees_close(jax.jit(grad_of_vmap)(q, k, v), per_slice_grads)
    _assert_trees_close(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v), per_slice_grads)


def test_checkpoint_gives_the_same_gradients(next_key):
    q, k, v = _qkv(next_key)

    def loss(q, k, v):
        out, lse = _causal(q, k, v)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    rematerialised = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
    _assert_trees_close(
        jax.jit(jax.grad(rematerialised, argnums=(0, 1, 2)))(q, k, v),
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v),
    )


def test_jit_retraces_only_when_static_arguments_change(next_key):
    traced_with = []

    def attend(q, k, v, causal, softmax_scale):
        traced_with.append((causal, softmax_scale))
        return fa4_jax.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

    jitted = jax.jit(attend, static_argnames=("causal", "softmax_scale"))
    q, k, v = _qkv(next_key)
    new_q, new_k, new_v = _qkv(next_key)
    jitted(q, k, v, causal=True, softmax_scale=None)
    jitted(new_q, new_k, new_v, causal=True, softmax_scale=None)
    assert traced_with == [(True, None)]
    jitted(q, k, v, causal=False, softmax_scale=None)
    jitted(q, k, v, causal=False, softmax_scale=0.5)
    jitted(new_q, new_k, new_v, causal=False, softmax_scale=0.5)
    assert traced_with == [(True, None), (False, None), (False, 0.5)]


# Runs in a fresh interpreter: nothing of the exporting process (traced functions, registered
# callbacks) is there, only what `import fa4_jax` sets up.
_DESERIALIZE_AND_CHECK = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import fa4_jax  # registers the kernels' FFI targets where they exist
    from jax import export
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    folder = sys.argv[1]
    def load(name):
        return export.deserialize(bytearray(open(f"{folder}/{name}.bin", "rb").read()))
    data = np.load(f"{folder}/data.npz")
    q, k, v = data["q"], data["k"], data["v"]

    single = load("single_device")
    out, lse = single.call(q, k, v)
    grads = jax.grad(lambda *a: single.call(*a)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        np.testing.assert_allclose(got, data[name], rtol=1e-6, atol=1e-6, err_msg=name)

    ring = load("ring")
    mesh = jax.make_mesh((ring.nr_devices,), ("seq",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:ring.nr_devices])
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v))
    np.testing.assert_allclose(jax.jit(ring.call)(q, k, v), data["ring_out"],
                               rtol=1e-6, atol=1e-6, err_msg="ring_out")
    print("round trip ok")
""")


def test_export_round_trip_in_a_fresh_process(next_key, tmp_path):
    """Single-device attention with its VJP, and a multi-device ring inside shard_map.

    (Auto-partitioned multi-device attention cannot be serialized: custom_partitioning is a
    host callback. shard_map bodies lower without it; see docs/multi_gpu.md.)
    """
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    from jax import export

    q, k, v = _qkv(next_key, leading=(1,), seqlen=32)
    single = jax.jit(_causal)
    exported = export.export(single)(q, k, v)
    (tmp_path / "single_device.bin").write_bytes(exported.serialize(vjp_order=1))
    out, lse = single(q, k, v)
    grads = jax.grad(lambda *a: _causal(*a)[0].sum(), argnums=(0, 1, 2))(q, k, v)

    mesh = cpu_mesh((4,), ("seq",))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: fa4_jax.ring_attention(q, k, v, mesh_axis="seq"),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"),
    ))
    (tmp_path / "ring.bin").write_bytes(export.export(ring)(q, k, v).serialize())
    np.savez(tmp_path / "data.npz", q=q, k=k, v=v, out=out, lse=lse, dq=grads[0],
             dk=grads[1], dv=grads[2], ring_out=ring(q, k, v))

    # The child inherits XLA_FLAGS (8 fake devices) from tests/conftest.py.
    environment = dict(os.environ, PYTHONPATH=REPOSITORY)
    child = subprocess.run(
        [sys.executable, "-c", _DESERIALIZE_AND_CHECK, str(tmp_path)],
        capture_output=True, text=True, env=environment, timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "round trip ok" in child.stdout
