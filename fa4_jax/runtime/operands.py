"""The arrays the kernels read beside q, k and v, derived once per call from its `Visibility`.

A call passes each entry's lengths (a ragged batch), segment ids with their span tables
(fa4_jax/abi/segment_layout.py, `fa4_jax.runtime.segments`), or a boolean mask's bits with span
tables of the same layout (`fa4_jax.runtime.mask_bits`, which folds the call's rules, lengths and
ids into the bits). They are computed once, before the op, and are operands of both passes (the
backward's residuals), partitioned with the batch (fa4_jax/ops/sharding.py).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from fa4_jax.core.params import AttentionParams
from fa4_jax.core.visibility import Visibility
from fa4_jax.runtime import mask_bits, segments


class KernelOperands(NamedTuple):
    """int32 arrays, each None when the call has none (a pytree: None fields are no leaves).

    query_lengths, key_lengths: [batch], a ragged batch's valid lengths, in [0, seqlen].
    query_segment_ids, kv_segment_ids: [batch, seqlen_q], [batch, seqlen_k]; all 0 with a mask.
    row_spans, key_spans: [batch, ceil(seqlen / 64), 4], the span tables of the ids or the mask.
    mask_bits: [batch, seqlen_q, ceil(seqlen_k / 32)], a mask packed 32 keys to a word.
    The kernels' custom calls take them in this order.
    """

    query_lengths: object = None
    key_lengths: object = None
    query_segment_ids: object = None
    kv_segment_ids: object = None
    row_spans: object = None
    key_spans: object = None
    mask_bits: object = None

    @property
    def ragged(self) -> bool:
        return self.query_lengths is not None

    @property
    def segments(self) -> bool:
        """The call runs the segments kernels (span tables given: of ids or of a mask)."""
        return self.row_spans is not None

    @property
    def mask_array(self) -> bool:
        """The call runs the mask_array kernels (a mask's bits given)."""
        return self.mask_bits is not None

    @property
    def seq_lengths(self) -> tuple | None:
        """(query_lengths, key_lengths), or None for a dense batch."""
        return (self.query_lengths, self.key_lengths) if self.ragged else None

    @property
    def span_operands(self) -> tuple:
        """The ids, their tables and the bits that are given, in call order."""
        return tuple(x for x in self[2:] if x is not None)

    def present(self) -> tuple[str, ...]:
        """The names of the given arrays: the op's operands after q, k and v."""
        return tuple(name for name, x in zip(self._fields, self) if x is not None)

    @classmethod
    def of_present(cls, names, arrays) -> KernelOperands:
        return cls(**dict(zip(names, arrays)))


@dataclasses.dataclass(frozen=True)
class OperandKinds:
    """Which of the optional operands a call passes: lengths (a ragged batch), span tables
    (segment ids, or a mask: the segments kernels), a mask's bits (the mask_array kernels) — what
    picks the kernels, known before the arrays are made."""

    ragged: bool = False
    segments: bool = False
    mask_array: bool = False

    @classmethod
    def of(cls, operands: KernelOperands) -> OperandKinds:
        return cls(operands.ragged, operands.segments, operands.mask_array)


def kernel_view(visibility: Visibility, params: AttentionParams) -> tuple[AttentionParams, OperandKinds]:
    """The call as the kernels see it: its params (a mask's call folds the rules into the bits,
    so its params lose them) and the kinds of operands `kernel_operands` makes for it. The plan,
    `explain` and the call itself all take the kernels' view from here."""
    kinds = OperandKinds(visibility.ragged, visibility.segmented or visibility.masked, visibility.masked)
    return (params.rules_folded() if visibility.masked else params), kinds


def kernel_operands(visibility: Visibility, params: AttentionParams, batch: int, seqlen_q: int,
                    seqlen_k: int) -> tuple[AttentionParams, KernelOperands]:
    """(the params as the kernels see them, the operands) of a call whose arrays `visibility`
    holds: both lengths when ragged, clamped to the sequences (`fa4_jax.api.validation`); a mask
    shared by every head (one with a head axis runs each head as an entry of its own, before
    this)."""
    kernel_params, _ = kernel_view(visibility, params)
    lengths = (visibility.query_lengths, visibility.key_lengths) if visibility.ragged else None
    operands = KernelOperands(*(lengths or (None, None)))
    if visibility.masked:
        mask = visibility.mask[:, 0]
        if visibility.segmented:
            ids = visibility.query_segment_ids[:, :, None] == visibility.kv_segment_ids[:, None, :]
            mask = mask & ids
        tables = mask_bits.operands(mask, params, lengths, seqlen_q, seqlen_k, batch)
        return kernel_params, operands._replace(**dict(zip(KernelOperands._fields[2:], tables)))
    if visibility.segmented:
        tables = segments.operands((visibility.query_segment_ids, visibility.kv_segment_ids), lengths)
        return params, operands._replace(**dict(zip(KernelOperands._fields[2:6], tables)))
    return params, operands
