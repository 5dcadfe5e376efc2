"""The custom call targets of the kernel library: the names programs call, and the library's
handler each name binds to. The one place these names are written: the run time registers and
calls them (fa4_jax.runtime.ffi), the tests check the built library and the serialized programs
against them. Plain Python, no JAX: the build-run contract.

Each kind (forward, backward) has one handler (ffi/forward.cc, ffi/backward.cc). Its operands are
the kind's fixed ones (`fixed_operands`: q, k, v, ..., seq_used_q, seq_used_k), then optional ones
(`OPTIONAL_OPERANDS`): none; the segment ids and their span tables (fa4_jax.runtime.segments);
or those and a boolean mask's bits (fa4_jax.runtime.mask_bits). The handler's instantiate stage,
which loads the kernels a call site may run before XLA can capture execute into a CUDA graph,
sees the call's attributes but not its operands: so a call of the current target also says how
many optional operands it passes, in its `optional_operands` attribute.

A name a release used stays registered: a program that `jax.export` serialized then still names
it. Such a legacy name binds a handler pair that fixes the optional operands its calls passed
(that name's calls carry no `optional_operands`), so they run as they did. A change of a target's
operands or attributes takes a new name, and the old one joins `legacy`.
"""
from __future__ import annotations

import dataclasses

# The optional operands a call may pass, by count: none; the segment ids and their span tables;
# those and the mask's bits.
SEGMENT_OPERANDS = 4
MASK_OPERANDS = 5
OPTIONAL_OPERANDS = (0, SEGMENT_OPERANDS, MASK_OPERANDS)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    # The library's handler pair for it: `{handler}Instantiate` and `{handler}Execute`.
    handler: str
    # The optional operands of every call of a legacy name (its handler fixes the count); None:
    # each call names its own in the `optional_operands` attribute.
    optional_operands: int | None = None


@dataclasses.dataclass(frozen=True)
class KindTargets:
    """One kind's targets."""

    current: Target  # what the run time's calls name
    # The development library's name for the current handler (benchmarks/ablations.py): that
    # library also takes a `tuning` attribute, and a name of its own lets both libraries register
    # in one process. Its programs are not exported, so its earlier names are not kept.
    development: Target
    legacy: tuple[Target, ...]  # names of earlier releases, still registered
    fixed_operands: int  # the operands every call passes before the optional ones

    def shipping(self) -> tuple[Target, ...]:
        """The names the shipping library registers: the current one and every legacy one."""
        return (self.current, *self.legacy)


TARGETS = {
    "fwd": KindTargets(
        current=Target("fa4_jax_fwd_v3", "Fa4Fwd"),
        development=Target("fa4_jax_dev_fwd_v3", "Fa4Fwd"),
        legacy=(Target("fa4_jax_fwd_v2", "Fa4FwdLengths", 0),
                Target("fa4_jax_fwd_segments_v1", "Fa4FwdSegments", SEGMENT_OPERANDS),
                Target("fa4_jax_fwd_masked_v1", "Fa4FwdMasked", MASK_OPERANDS)),
        fixed_operands=5,
    ),
    "bwd": KindTargets(
        current=Target("fa4_jax_bwd_v3", "Fa4Bwd"),
        development=Target("fa4_jax_dev_bwd_v3", "Fa4Bwd"),
        legacy=(Target("fa4_jax_bwd_v2", "Fa4BwdLengths", 0),
                Target("fa4_jax_bwd_segments_v1", "Fa4BwdSegments", SEGMENT_OPERANDS),
                Target("fa4_jax_bwd_masked_v1", "Fa4BwdMasked", MASK_OPERANDS)),
        fixed_operands=9,
    ),
}


def registered(development: bool = False) -> tuple[Target, ...]:
    """Every target a library registers: the shipping one's current and legacy names, or the
    development library's names."""
    if development:
        return tuple(kind.development for kind in TARGETS.values())
    return tuple(target for kind in TARGETS.values() for target in kind.shipping())
