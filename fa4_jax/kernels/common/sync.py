"""How a warp-specialised kernel's roles synchronise, in one place: every mbarrier wait and
arrival, tcgen05 commit and TMA issue a role makes goes through `Sync`, and every piece of work
between two of them through a method marked `action`; the role methods themselves, and the
steps they call, are marked `protocol`.

So the kernel's code is its protocol: `kernels/common/recording.py` runs the same role methods in
plain Python with a recording `Sync` (the actions stubbed and logged), and
`kernels/common/protocol_model.py` searches what they issued. A second, hand-written description
of the protocol could disagree with the kernel and be proven instead of it.

`Sync` names a pipeline by its plan name ("KV", "S0", ...) and a use of one of its stages by a
CUTLASS `PipelineState`, the way the roles already count their uses.
"""
from __future__ import annotations

import dataclasses

import cutlass.cute as cute
from cutlass import Int32

# What a marker says of a function: its body is recorded, or it is work the recorder stubs.
PROTOCOL = "protocol"
ACTION = "action"


def protocol(fn):
    """Marks a role method, or a step of one, whose body the recorder runs: it may only
    synchronise through `Sync`, count with pipeline states, branch and loop on the tile's block
    counts and the kernel's static settings, and call other protocol steps and actions."""
    fn.fa4_sync_kind = PROTOCOL
    return fn


def action(fn):
    """Marks work between synchronisations (GEMMs, TMEM and shared-memory traffic, fences,
    arithmetic): run by the kernel, stubbed and logged by the recorder, so it must neither wait
    nor arrive on an mbarrier."""
    fn.fa4_sync_kind = ACTION
    return fn


@dataclasses.dataclass(frozen=True)
class Sync:
    """The kernel's pipelines (CUTLASS pipeline objects by plan name), as the roles use them.
    Frozen: the DSL carries a mutable object through every dynamic loop that calls it."""

    pipes: dict
    # Per TMA pipeline, the bytes its stages' full barriers expect unless a load says other.
    default_tx_bytes: dict

    def acquire(self, name: str, state, tx_bytes=None):
        """The producer waits until the stage of this use is free (a TMA producer also tells
        the stage's full barrier how many bytes its loads will bring, when it differs from the
        pipeline's usual count)."""
        if tx_bytes is None or tx_bytes == self.default_tx_bytes.get(name):
            self.pipes[name].producer_acquire(state)
        else:
            self.pipes[name].producer_acquire(state, expected_tx=tx_bytes)

    def wait(self, name: str, state):
        """A consumer waits until the stage of this use is full."""
        self.pipes[name].consumer_wait(state)

    def wait_empty(self, name: str, state):
        """A wait on the stage's empty barrier by a role that is not its producer (the producer
        reading what the consumers handed back in it), counted by a consumer state."""
        self.pipes[name].sync_object_empty.wait(state.index, state.phase)

    def release(self, name: str, state):
        """A consumer hands the stage of this use back (a tcgen05.commit from the MMA warp, an
        arrival of each thread from the others)."""
        self.pipes[name].consumer_release(state)

    def commit(self, name: str, state):
        """The producer says the stage of this use is full (a tcgen05.commit from the MMA warp,
        an arrival of each thread from the others)."""
        self.pipes[name].producer_commit(state)

    def tma_load(self, name: str, state, atom, src, dst):
        """A TMA load into the stage of this use, completing on its full barrier."""
        cute.copy(atom, src, dst, tma_bar_ptr=self.pipes[name].producer_get_barrier(state))

    @cute.jit
    def release_after_bulk_store(self, name: str, state, stores_after: int, thread: Int32):
        """One thread (thread 0 of the role's rows) hands the stage of this use back once the
        bulk stores it issued from that stage's buffer have read it, `stores_after` younger
        groups still allowed in flight; a plain arrival on this CTA's own empty barrier."""
        if thread == 0:
            cute.arch.cp_async_bulk_wait_group(stores_after, read=True)
            cute.arch.mbarrier_arrive(self.pipes[name].sync_object_empty.get_barrier(state.index))

    def tail(self, name: str, state):
        """The producer, before it leaves, waits for every stage to be handed back, so that no
        arrival lands on a barrier of a CTA that has left."""
        self.pipes[name].producer_tail(state)
