"""The probe problems: small calls, at kernel level, that a variant is checked on.

A problem is the call as the kernel receives it (after any GQA packing or split-KV: what the
handler's routing rule sees), with 2 query heads on 1 kv head (GQA). A variant is checked only on
problems that the handler routes to it: each kind of problem lists candidate shapes, and a
variant takes, per kind, the first candidate whose call the routing rule serves with it (checked
against both the library's rule and fa4_jax.abi.routing's; `for_variant`). A kind none of whose
candidates reaches the variant is one its routes do not allow (a CTA pair's dense-only route
never sees a ragged batch).

Forward and backward variants without segment ids get:

- tiles: an odd-length call over two CTA tiles and three key blocks, or the shape a tuned
  variant's route needs (the d128 tails' last key blocks, a diagonal along 128-key blocks, the
  Blackwell pairs' single-CTA siblings);
- decode: one query row over 777 keys (or 1777);
- many: a batch of many tiles, so that persistent CTAs compute several in a row, and, under a
  causal or window mask (bottom-right: more rows than keys), tiles without any key;
- ragged: a ragged batch whose padding holds NaN (K and V, and Q and dO: what reaches the kernels
  unzeroed), with an entry of no keys and one of no rows.

Segments variants get the segment probe (two documents of different lengths on each side, and
padding that matches nothing), mask-array variants the mask probe (those documents, and every
fifth key shown to every row). A backward variant also runs its first problem in deterministic
mode, and its tiles problem differentiates lse (d_lse present; absent elsewhere).

Pure Python: the CPU tests check the selection for every shipped variant.
"""
from __future__ import annotations

import dataclasses

from fa4_jax.abi import routing

HEADS_Q, HEADS_KV = 2, 1
# The softcap of softcap variants: small enough that tanh bends the scores of the probes.
SOFTCAP = 5.0
# The "local" mask kind's window (left, right).
WINDOW = (64, 16)
# The segment and mask probes' documents: (query rows, keys) of each, then padding.
DOCUMENTS = ((70, 150), (110, 140))

# Each kind's candidates, tried in order: (seqlen_q, seqlen_k), or (batch, seqlen_q, seqlen_k).
# tiles: two CTA tiles and three key blocks; then d128's tails of 44, 90 and 120 keys after
# 176-key blocks (sk 1100, 1146, 1176; 1206 ends in 150, the default), a diagonal along 128-key
# blocks short (256, 384) and long (300, 1324), and one Blackwell CTA's tile (<= 128 rows).
TILES = ((300, 333), (300, 1206), (300, 1100), (300, 1146), (300, 1176), (256, 384), (300, 1324),
         (120, 333))
# decode: then past the short causal routes (max_len 1024), for the defaults behind them.
DECODE = ((1, 777), (1, 1777))
# many: 300 tiles of 256 rows (75 entries of 2, 2 heads) over 148 SMs, two or more per CTA, and
# under a causal or window mask a whole first tile without a key (bottom-right with 40 keys, rows
# 0-263 see none through the window's right bound of 16); then past the short routes (1100 rows),
# and under the Blackwell pairs' min_rows (300 one-tile entries).
MANY = ((75, 320, 40), (16, 1100, 40), (150, 200, 40), (150, 120, 40))
RAGGED = ((300, 333), (48, 333), (300, 1206))
SEGMENTS = ((200, 333),)
# The mask probe, and a call past the short mask route (max_len 1024).
MASKED = ((200, 333), (1152, 1152))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call at kernel level. lengths: a ragged batch's (query rows, keys) per entry, or None
    (dense). d_lse: the backward differentiates lse too. deterministic: the backward's fixed
    order (the reference is the same)."""

    kind: str  # "tiles", "decode", "many", "ragged", "segments", "mask"
    batch: int
    seqlen_q: int
    seqlen_k: int
    lengths: tuple[tuple[int, int], ...] | None = None
    d_lse: bool = False
    deterministic: bool = False

    @property
    def name(self) -> str:
        shape = f"{self.kind} b={self.batch} sq={self.seqlen_q} sk={self.seqlen_k}"
        return shape + (" d_lse" if self.d_lse else "") + (" deterministic" if self.deterministic else "")

    @property
    def inputs_key(self) -> "Problem":
        """What the inputs and the reference depend on."""
        return dataclasses.replace(self, deterministic=False)

    def call(self, variant: routing.Variant) -> routing.Call:
        """The call the handler sees for this problem on `variant`'s problem class."""
        return routing.Call(variant.kind, variant.arch, variant.dtype, variant.head_dim, variant.head_dim_v,
                            variant.mask, variant.softcap, self.seqlen_q, self.seqlen_k,
                            ragged=self.lengths is not None, segments=variant.segments,
                            mask_array=variant.mask_array)


def ragged_lengths(seqlen_q: int, seqlen_k: int) -> tuple[tuple[int, int], ...]:
    """A ragged batch's entries in buffers of (seqlen_q, seqlen_k): the whole buffers, one that
    ends inside a key block, one with no keys and one with no rows."""
    return ((seqlen_q, seqlen_k), (seqlen_q // 2, seqlen_k * 3 // 5), (seqlen_q // 4, 0), (0, seqlen_k // 6))


def _candidates(variant: routing.Variant) -> list[list[Problem]]:
    """Per kind of problem, its candidates for `variant`, in order."""
    def dense(kind, shapes):
        return [Problem(kind, *((1,) + shape if len(shape) == 2 else shape)) for shape in shapes]

    if variant.mask_array:
        return [dense("mask", MASKED)]
    if variant.segments:
        return [dense("segments", SEGMENTS)]
    ragged = [Problem("ragged", 4, sq, sk, ragged_lengths(sq, sk)) for sq, sk in RAGGED]
    tiles = dense("tiles", TILES)
    if variant.kind == "bwd":
        tiles = [dataclasses.replace(p, d_lse=True) for p in tiles]
    return [tiles, dense("decode", DECODE), dense("many", MANY), ragged]


def for_variant(variant: routing.Variant, serves) -> tuple[Problem, ...]:
    """The problems `variant` is checked on. serves(call, variant) -> bool: whether the handler
    runs `variant` for `call` (a problem counts for the variant that runs it, never a sibling)."""
    chosen = []
    for candidates in _candidates(variant):
        first = next((p for p in candidates if serves(p.call(variant), variant)), None)
        if first is not None:
            chosen.append(first)
    if variant.kind == "bwd" and chosen:
        chosen.insert(1, dataclasses.replace(chosen[0], deterministic=True))
    return tuple(chosen)


def routing_rule(routes, compiled):
    """serves(call, variant) by fa4_jax.abi.routing's rule over (arch, Route) pairs and the compiled
    variant names (a library's manifest, or the menu)."""
    by_arch: dict = {}
    for arch, route in routes:
        by_arch.setdefault(arch, []).append(route)

    def serves(call: routing.Call, variant: routing.Variant) -> bool:
        return routing.choose(call, by_arch.get(call.arch, ()), compiled) == variant

    return serves
