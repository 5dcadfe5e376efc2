"""Partitioning of the attention ops over a device mesh: batch and heads, never a collective.

Attention is independent across batch entries and across kv-head groups, so when q, k and v
are sharded on those dimensions each device can run the single-device op (`bodies.py`: the
kernels' custom call, or the reference) on its own block. The ops here say so to the
compiler with `jax.experimental.custom_partitioning`:

- a Shardy sharding rule (Shardy is JAX's default partitioner) in einsum-like notation, which
  propagates batch/head shardings through the op (q -> out, lse; out -> q, and so on) and keeps
  the sequence and head_dim dimensions out of propagation;
- a partition callback that picks the per-device layout from the operands' shardings: batch
  and heads keep their mesh axes; every other sharded dimension is gathered, with a
  `ReshardWarning` that names the operand, dimension and mesh axes (sequence sharding needs
  context parallelism: `fa4_jax.ring_attention` inside `shard_map`).

The call's `KernelOperands` (a ragged batch's lengths, segment ids and their span tables, a
mask's bits) are operands of the op, one op per set of them, sharded with the batch: each device
gets those of its own batch entries (whole along the sequence, like q and k).

Grouped-query attention: query head i reads kv head i // groups, so the query heads factor as
(kv_heads, groups), kv_heads major. Sharding heads over n devices gives each device
heads_kv / n kv heads and their query heads; heads_kv must be a multiple of n (else a
ValueError at compile time).

The forward and backward ops share one rule and one callback, and the same rules run whatever
the backend, so the CPU tests exercise exactly the partitioning the GPU uses. On one device,
and inside a `shard_map` body where every mesh axis is manual, the op is the plain
single-device body. Under `jax.vmap`, mapped axes become extra leading batch dimensions, which
each device folds into one locally (so a sharded mapped axis or batch costs no gather).
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax.core.params import AttentionParams
from fa4_jax.ops import bodies
from fa4_jax.runtime.operands import KernelOperands


class ReshardWarning(UserWarning):
    """An input of attention is sharded on a dimension the op cannot keep, and is gathered.

    Turn it into an error with `warnings.simplefilter("error", fa4_jax.ReshardWarning)`.
    """


def attention_forward(q, k, v, params: AttentionParams, operands: KernelOperands = KernelOperands()):
    """(out, lse) = attention of q, k, v, partitioned over batch and heads.

    Shapes as `vjp.attention_op`: q [batch, seqlen_q, heads_q, head_dim], k [batch, seqlen_k,
    heads_kv, head_dim], v [batch, seqlen_k, heads_kv, head_dim_v] -> out [batch, seqlen_q,
    heads_q, head_dim_v], lse [batch, heads_q, seqlen_q] float32. operands: the call's
    `KernelOperands`, all partitioned with the batch.
    """
    _check_not_partially_manual()
    present = operands.present()
    return _vmappable(_forward_op(present), params)(q, k, v, *(getattr(operands, n) for n in present))


def attention_backward(q, k, v, out, lse, d_out, d_lse, params: AttentionParams,
                       operands: KernelOperands = KernelOperands()):
    """(dq, dk, dv) of attention, partitioned like the forward; shapes as `bodies.backward`.

    d_lse None (lse not differentiated) selects ops without a d_lse operand.
    """
    _check_not_partially_manual()
    arrays = (q, k, v, out, lse, d_out) + (() if d_lse is None else (d_lse,))
    present = operands.present()
    op = _backward_op(d_lse is not None, present)
    return _vmappable(op, params)(*arrays, *(getattr(operands, n) for n in present))


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
# Under jax.vmap an array has several leading batch dimensions: roles b0, b1, ...
# The valid lengths of a ragged batch are one number per batch entry: layout "b"; segment ids
# one per query row or key.
_QUERY, _KEY, _VALUE, _OUT, _LSE, _LENGTHS = "bsHd", "bthd", "bthe", "bsHe", "bHs", "b"
_QUERY_IDS, _KEY_IDS = "bs", "bt"
# Segment ids' span tables: per query (m) or key (n) chunk, four fields (f); a mask's bits: per
# query row, words (w) of 32 keys.
_ROW_SPANS, _KEY_SPANS, _MASK_BITS = "bmf", "bnf", "bsw"
_DIMENSION_NAMES = {
    "b": "batch", "s": "seq", "t": "seq", "H": "heads", "h": "heads", "d": "head_dim",
    "e": "head_dim", "m": "chunks", "n": "chunks", "f": "fields", "w": "mask words",
}
# Dimensions a device needs whole (sequence parallelism is ring_attention's job).
_REPLICATED_ROLES = "stdemnfw"


def _roles(layout, batch_dims):
    """The role of each dimension of an array of `layout` with `batch_dims` batch dims."""
    return tuple(f"b{i}" for i in range(batch_dims)) + tuple(layout[1:])


class _OpLayout:
    """Names and layouts of one op's operands and results, and its Shardy rule."""

    def __init__(self, operands, results):
        self.operand_names = tuple(name for name, _ in operands)
        self.operand_layouts = tuple(layout for _, layout in operands)
        self.result_layouts = tuple(layout for _, layout in results)

    def sharding_rule(self, groups, batch_dims):
        """The einsum-like Shardy rule and its keyword arguments, for `groups` query heads
        per kv head and `batch_dims` leading batch dimensions."""
        heads_q = "(h g)" if groups > 1 else "h"

        def spell(layout):
            roles = _roles(layout, batch_dims)
            return " ".join(heads_q if role == "H" else role for role in roles)

        rule = (
            ", ".join(map(spell, self.operand_layouts))
            + " -> "
            + ", ".join(map(spell, self.result_layouts))
        )
        # custom_partitioning wants the special factors in the order the rule introduces them.
        first_use = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
        need_replication = sorted(set(_REPLICATED_ROLES) & set(first_use), key=first_use.index)
        options = {"need_replication_factors": tuple(need_replication)}
        if groups > 1:
            options["g"] = groups
        return rule, options


_FORWARD_LAYOUT = _OpLayout(
    operands=(("query", _QUERY), ("key", _KEY), ("value", _VALUE)),
    results=(("out", _OUT), ("lse", _LSE)),
)
_BACKWARD_OPERANDS = (
    ("query", _QUERY), ("key", _KEY), ("value", _VALUE), ("out", _OUT), ("lse", _LSE),
    ("d_out", _OUT),
)
_D_LSE_OPERAND = (("d_lse", _LSE),)
_GRADIENTS = (("dq", _QUERY), ("dk", _KEY), ("dv", _VALUE))
# The layout of each of the call's optional operands (`KernelOperands`' fields).
_OPERAND_LAYOUTS = {
    "query_lengths": _LENGTHS, "key_lengths": _LENGTHS, "query_segment_ids": _QUERY_IDS,
    "kv_segment_ids": _KEY_IDS, "row_spans": _ROW_SPANS, "key_spans": _KEY_SPANS,
    "mask_bits": _MASK_BITS,
}
# What the operands a device receives are called in a ReshardWarning.
_OPERAND_NAMES = {"query_lengths": "query_seq_lengths", "key_lengths": "key_value_seq_lengths"}


def _aux_layout(present: tuple[str, ...]) -> tuple:
    return tuple((_OPERAND_NAMES.get(name, name), _OPERAND_LAYOUTS[name]) for name in present)


def _forward_layout(present: tuple[str, ...]) -> _OpLayout:
    return _OpLayout(
        operands=(*zip(_FORWARD_LAYOUT.operand_names, _FORWARD_LAYOUT.operand_layouts),
                  *_aux_layout(present)),
        results=(("out", _OUT), ("lse", _LSE)),
    )


def _backward_layout(with_d_lse: bool, present: tuple[str, ...]) -> _OpLayout:
    """The backward op's layout: with a d_lse operand, or none (lse not differentiated)."""
    return _OpLayout(_BACKWARD_OPERANDS + (_D_LSE_OPERAND if with_d_lse else ()) + _aux_layout(present),
                     _GRADIENTS)


def _sharding_rule(layout, params, mesh, operand_types, result_types):
    del params, mesh, result_types
    query_shape, key_shape = operand_types[0].shape, operand_types[1].shape
    return layout.sharding_rule(
        groups=query_shape[-2] // key_shape[-2], batch_dims=len(query_shape) - 3
    )


def _partition(layout, body, params, mesh, operand_shapes, result_shapes):
    """custom_partitioning's callback: the per-device body and the layouts it runs on."""
    del result_shapes
    batch_dims = len(operand_shapes[0].shape) - 3
    operand_specs = [_spec_of(shape) for shape in operand_shapes]
    axes = _axes_by_role(
        mesh, operand_specs[0], operand_specs[1], batch_dims,
        heads_kv=operand_shapes[1].shape[-2],
    )

    def spec_for(layout):
        return PartitionSpec(*(axes.get(role) or None for role in _roles(layout, batch_dims)))

    wanted = [spec_for(operand_layout) for operand_layout in layout.operand_layouts]
    _warn_about_gathers(layout, batch_dims, operand_specs, wanted)
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


def _axes_by_role(mesh, query_spec, key_spec, batch_dims, *, heads_kv):
    """Mesh axes of each batch dimension ("b0", ...) and of the heads ("H", "h").

    The query's choice wins (it is the largest operand); the key's fills a dimension the query
    leaves unsharded. No mesh axis serves two dimensions.
    """
    head_dim_index = batch_dims + 1  # [batch..., seq, heads, head_dim]
    dimensions = [(f"b{i}", i) for i in range(batch_dims)] + [("H", head_dim_index)]
    axes, used = {}, set()
    for role, index in dimensions:
        chosen = query_spec[index] or key_spec[index]
        axes[role] = tuple(axis for axis in chosen if axis not in used)
        used.update(axes[role])
    axes["h"] = head_axes = axes["H"]
    ways = math.prod(mesh.shape[axis] for axis in head_axes)
    if heads_kv % ways:
        raise ValueError(
            f"fa4_jax attention: heads are sharded {ways} ways over mesh axes {head_axes}, but "
            f"key/value have {heads_kv} heads, not a multiple of {ways}; each device must hold "
            f"whole kv heads with their query heads. Shard heads over fewer devices, or repeat "
            f"the kv heads (jnp.repeat(key, r, axis=2), same for value) to a multiple of {ways}"
        )
    return axes


def _warn_about_gathers(layout, batch_dims, operand_specs, wanted_specs):
    gathers = []
    for name, operand_layout, spec, wanted in zip(
        layout.operand_names, layout.operand_layouts, operand_specs, wanted_specs
    ):
        roles = _roles(operand_layout, batch_dims)
        for role, axes, kept in zip(roles, spec, wanted):
            kept = (kept,) if isinstance(kept, str) else kept or ()
            dropped = tuple(axis for axis in axes if axis not in kept)
            if dropped:
                gathers.append(f"{name} {_DIMENSION_NAMES[role[0]]} over {dropped}")
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


def _on_folded_batch(body, arrays, params):
    """`body` (one batch dimension) on arrays with any number of leading batch dimensions.

    They fold into one on each device (a local reshape), and unfold in the results; folding
    before the partitioned op instead would merge a sharded dimension with an unsharded one,
    which XLA can only do by gathering.
    """
    batch_shape = arrays[0].shape[: arrays[0].ndim - 3]
    if len(batch_shape) == 1:
        return tuple(body(*arrays, params))
    results = body(*(None if x is None else x.reshape(-1, *x.shape[len(batch_shape):])
                     for x in arrays), params)
    return tuple(r.reshape(*batch_shape, *r.shape[1:]) for r in results)


def _op_name(kind: str, present: tuple[str, ...]) -> str:
    operands = KernelOperands.of_present(present, (True,) * len(present))
    filtered = ["masked"] if operands.mask_array else ["segmented"] if operands.segments else []
    return "_".join([kind] + ["ragged"] * operands.ragged + filtered + ["on_device"])


@functools.cache
def _forward_op(present: tuple[str, ...]):
    """The partitioned forward op of a call passing the `present` optional operands."""
    def body(q, k, v, *aux_and_params):
        *aux, params = aux_and_params
        return bodies.forward(q, k, v, params, KernelOperands.of_present(present, aux))

    def forward_on_device(q, k, v, *aux_and_params):
        *aux, params = aux_and_params
        return _on_folded_batch(body, (q, k, v, *aux), params)

    forward_on_device.__name__ = _op_name("forward", present)
    return _custom_partitioned(forward_on_device, _forward_layout(present))


@functools.cache
def _backward_op(with_d_lse: bool, present: tuple[str, ...]):
    """The partitioned backward op; the op without a d_lse operand passes the backend None
    there (lse not differentiated)."""
    def body(q, k, v, out, lse, d_out, d_lse, *aux_and_params):
        *aux, params = aux_and_params
        return bodies.backward(q, k, v, out, lse, d_out, d_lse, params,
                               KernelOperands.of_present(present, aux))

    def backward_on_device(*arrays_and_params):
        *arrays, params = arrays_and_params
        if not with_d_lse:
            arrays.insert(6, None)
        return _on_folded_batch(body, tuple(arrays), params)

    backward_on_device.__name__ = _op_name("backward" if with_d_lse else "backward_without_d_lse", present)
    return _custom_partitioned(backward_on_device, _backward_layout(with_d_lse, present))


@functools.cache
def _vmappable(op, params):
    """op(*arrays, params) as a function of the arrays that `jax.vmap` can map.

    custom_partitioning has no batching rule of its own. Every operand and result of the
    attention ops has batch dimensions first, so a mapped axis (moved to the front by vmap)
    is one more of them; the partitioned op folds them on each device.
    """

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return tuple(op(*arrays, params))

    @call.def_vmap
    def map_as_a_batch_dimension(axis_size, in_batched, *arrays):
        arrays = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(arrays, in_batched)
        ]
        results = call(*arrays)
        return results, (True,) * len(results)

    return call
