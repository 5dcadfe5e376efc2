"""Partitioning of the attention ops over a device mesh: batch and heads, never a collective.

Attention is independent across batch entries and across kv-head groups, so when q, k and v
are sharded on those dimensions each device can run the single-device op (`backends.py`: the
kernels' `fa4_fwd` custom call, or the reference) on its own block. The ops here say so to the
compiler with `jax.experimental.custom_partitioning`:

- a Shardy sharding rule (Shardy is JAX's default partitioner) in einsum-like notation, which
  propagates batch/head shardings through the op (q -> out, lse; out -> q, and so on) and keeps
  the sequence and head_dim dimensions out of propagation;
- a partition callback that picks the per-device layout from the operands' shardings: batch
  and heads keep their mesh axes; every other sharded dimension is gathered, with a
  `ReshardWarning` that names the operand, dimension and mesh axes (sequence sharding needs
  context parallelism: `fa4_jax.ring_attention` inside `shard_map`).

Grouped-query attention: query head i reads kv head i // groups, so the query heads factor as
(kv_heads, groups), kv_heads major. Sharding heads over n devices gives each device
heads_kv / n kv heads and their query heads; heads_kv must be a multiple of n (else a
ValueError at compile time).

The forward and backward ops share one rule and one callback, and the same rules run whatever
the backend, so the CPU tests exercise exactly the partitioning the GPU uses. On one device,
and inside a `shard_map` body where every mesh axis is manual, the op is the plain
single-device body. Under `jax.vmap`, mapped axes fold into the batch dimension.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax import backends
from fa4_jax.params import AttentionParams


class ReshardWarning(UserWarning):
    """An input of attention is sharded on a dimension the op cannot keep, and is gathered.

    Turn it into an error with `warnings.simplefilter("error", fa4_jax.ReshardWarning)`.
    """


def attention_forward(q, k, v, params: AttentionParams):
    """(out, lse) = attention of q, k, v, partitioned over batch and heads.

    Shapes as `vjp.attention_op`: q [batch, seqlen_q, heads_q, head_dim], k [batch, seqlen_k,
    heads_kv, head_dim], v [batch, seqlen_k, heads_kv, head_dim_v] -> out [batch, seqlen_q,
    heads_q, head_dim_v], lse [batch, heads_q, seqlen_q] float32.
    """
    _check_not_partially_manual()
    return _vmappable(_FORWARD, params)(q, k, v)


def attention_backward(q, k, v, out, lse, d_out, d_lse, params: AttentionParams):
    """(dq, dk, dv) of attention, partitioned like the forward; shapes as `backends.backward`."""
    _check_not_partially_manual()
    return _vmappable(_BACKWARD, params)(q, k, v, out, lse, d_out, d_lse)


def _check_not_partially_manual():
    """Rejects a shard_map body that leaves some mesh axes to the compiler.

    There custom_partitioning would have to partition over the remaining axes, which JAX
    does not support (it fails inside XLA's partitioner); the alternative, inlining the op,
    would let XLA replicate the kernel's operands (an all-gather) without a word.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    if manual and manual != set(mesh.axis_names):
        automatic = tuple(axis for axis in mesh.axis_names if axis not in manual)
        raise NotImplementedError(
            f"fa4_jax attention inside a shard_map that leaves mesh axes {automatic} to the "
            f"compiler is not supported; make every mesh axis manual (shard_map's default "
            f"axis_names) and shard batch or heads over {automatic} through in_specs"
        )


# Each array's dimensions, by role: b batch, s query rows, t key rows, H query heads, h kv
# heads, d head_dim of q/k, e head_dim of v. H is (h g) in the Shardy rule (see the docstring).
_QUERY, _KEY, _VALUE, _OUT, _LSE = "bsHd", "bthd", "bthe", "bsHe", "bHs"
_DIMENSION_NAMES = {
    "b": "batch", "s": "seq", "t": "seq", "H": "heads", "h": "heads", "d": "head_dim",
    "e": "head_dim",
}
# Dimensions a device needs whole (sequence parallelism is ring_attention's job).
_REPLICATED_ROLES = "stde"


class _OpLayout:
    """Names and layouts of one op's operands and results, and its Shardy rule."""

    def __init__(self, operands, results):
        self.operand_names = tuple(name for name, _ in operands)
        self.operand_layouts = tuple(layout for _, layout in operands)
        self.result_layouts = tuple(layout for _, layout in results)

    def sharding_rule(self, groups):
        """The einsum-like Shardy rule and its keyword arguments, for `groups` q heads per kv head."""
        heads_q = "(h g)" if groups > 1 else "h"

        def spell(layout):
            return " ".join(heads_q if role == "H" else role for role in layout)

        rule = (
            ", ".join(map(spell, self.operand_layouts))
            + " -> "
            + ", ".join(map(spell, self.result_layouts))
        )
        # custom_partitioning wants the special factors in the order the rule introduces them.
        first_use = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
        need_replication = sorted(set(_REPLICATED_ROLES), key=first_use.index)
        options = {"need_replication_factors": tuple(need_replication)}
        if groups > 1:
            options["g"] = groups
        return rule, options


_FORWARD_LAYOUT = _OpLayout(
    operands=(("query", _QUERY), ("key", _KEY), ("value", _VALUE)),
    results=(("out", _OUT), ("lse", _LSE)),
)
_BACKWARD_LAYOUT = _OpLayout(
    operands=(
        ("query", _QUERY), ("key", _KEY), ("value", _VALUE), ("out", _OUT), ("lse", _LSE),
        ("d_out", _OUT), ("d_lse", _LSE),
    ),
    results=(("dq", _QUERY), ("dk", _KEY), ("dv", _VALUE)),
)


def _sharding_rule(layout, params, mesh, operand_types, result_types):
    del params, mesh, result_types
    heads_q, heads_kv = operand_types[0].shape[2], operand_types[1].shape[2]
    return layout.sharding_rule(heads_q // heads_kv)


def _partition(layout, body, params, mesh, operand_shapes, result_shapes):
    """custom_partitioning's callback: the per-device body and the layouts it runs on."""
    del result_shapes
    operand_specs = [_spec_of(shape) for shape in operand_shapes]
    batch_axes, head_axes = _batch_and_head_axes(
        mesh, operand_specs[0], operand_specs[1], heads_kv=operand_shapes[1].shape[2]
    )

    def spec_for(role_layout):
        axes = {"b": batch_axes, "H": head_axes, "h": head_axes}
        return PartitionSpec(*(axes.get(role) or None for role in role_layout))

    wanted = [spec_for(role_layout) for role_layout in layout.operand_layouts]
    _warn_about_gathers(layout, operand_specs, wanted)
    operand_shardings = tuple(NamedSharding(mesh, spec) for spec in wanted)
    result_shardings = tuple(NamedSharding(mesh, spec_for(r)) for r in layout.result_layouts)

    def per_device(*arrays):
        return tuple(body(*arrays, params))

    return mesh, per_device, result_shardings, operand_shardings


def _spec_of(shape):
    """The operand's PartitionSpec as one tuple of mesh axis names per dimension."""
    sharding = shape.sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
    elif sharding.is_fully_replicated:
        spec = (None,) * len(shape.shape)
    else:
        raise NotImplementedError(
            f"fa4_jax attention partitions NamedSharding inputs (a mesh and a PartitionSpec); "
            f"got {sharding}"
        )
    return tuple(() if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
                 for axes in spec)


def _batch_and_head_axes(mesh, query_spec, key_spec, *, heads_kv):
    """Mesh axes of the batch and head dimensions every operand will use.

    The query's choice wins (it is the largest operand); the key's fills a dimension the query
    leaves unsharded. An axis used for batch is not reused for heads.
    """
    batch_axes = query_spec[0] or key_spec[0]
    head_axes = query_spec[2] or key_spec[2]
    head_axes = tuple(axis for axis in head_axes if axis not in batch_axes)
    ways = math.prod(mesh.shape[axis] for axis in head_axes)
    if heads_kv % ways:
        raise ValueError(
            f"fa4_jax attention: heads are sharded {ways} ways over mesh axes {head_axes}, but "
            f"key/value have {heads_kv} heads, not a multiple of {ways}; each device must hold "
            f"whole kv heads with their query heads. Shard heads over fewer devices, or repeat "
            f"the kv heads (jnp.repeat(key, r, axis=2), same for value) to a multiple of {ways}"
        )
    return batch_axes, head_axes


def _warn_about_gathers(layout, operand_specs, wanted_specs):
    gathers = []
    for name, role_layout, spec, wanted in zip(
        layout.operand_names, layout.operand_layouts, operand_specs, wanted_specs
    ):
        for role, axes, kept in zip(role_layout, spec, wanted):
            dropped = tuple(axis for axis in axes if axis not in (kept or ()))
            if dropped:
                gathers.append(f"{name} {_DIMENSION_NAMES[role]} over {dropped}")
    if gathers:
        warnings.warn(
            "fa4_jax attention keeps only batch and head shardings; these inputs are gathered "
            "before the op (an all-gather each): " + "; ".join(gathers) + ". For sequence "
            "(context) parallelism use fa4_jax.ring_attention inside shard_map.",
            ReshardWarning,
            stacklevel=2,
        )


def _custom_partitioned(body, layout):
    op = custom_partitioning(body, static_argnums=(len(layout.operand_layouts),))
    op.def_partition(
        partition=functools.partial(_partition, layout, body),
        sharding_rule=functools.partial(_sharding_rule, layout),
    )
    return op


_FORWARD = _custom_partitioned(backends.forward, _FORWARD_LAYOUT)
_BACKWARD = _custom_partitioned(backends.backward, _BACKWARD_LAYOUT)


@functools.cache
def _vmappable(op, params):
    """op(*arrays, params) as a function of the arrays whose `jax.vmap` folds into batch.

    custom_partitioning has no batching rule of its own. Every operand and result of the
    attention ops has batch as its leading dimension, so a mapped axis (moved to the front by
    vmap) merges with it: [n, batch, ...] -> [n * batch, ...].
    """

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return tuple(op(*arrays, params))

    @call.def_vmap
    def fold_mapped_axis_into_batch(axis_size, in_batched, *arrays):
        arrays = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(arrays, in_batched)
        ]
        results = call(*(x.reshape(-1, *x.shape[2:]) for x in arrays))
        results = tuple(r.reshape(axis_size, -1, *r.shape[1:]) for r in results)
        return results, (True,) * len(results)

    return call
