"""An exhaustive search of a warp-specialised kernel's barrier protocol, as recorded from the
kernel's own role methods (kernels/common/recording.py), for the ways mbarriers go wrong.

Every interleaving of the roles' events is explored, and of the asynchronous arrivals as the
hardware may deliver them: a TMA load's bytes land at any time after its issue, in any order
across barriers and in issue order on one barrier; a tcgen05.commit's arrival lands when the
MMAs before it are done, so a role's commits land in the order it issued them (per landing CTA
in a pair: the multicast reaches each CTA's barrier on its own). It raises `ProtocolError` on

- a deadlock: nothing can move and something is left to do;
- a wait that passes on the wrong phase: mbarrier waits test the phase's parity only, so a
  role whose use count ran ahead or behind passes a wait meant for another round;
- an arrival that lands in another phase than the one it is meant for (a producer that
  overruns its consumers, or the reverse);
- a release of a stage whose data has not arrived (`Pipeline.releases_filled`: the consumer
  gives back a buffer a load may still be writing).

A CTA pair's roles run in both CTAs (those in `leader_only` in the first alone), and each
arrival lands on the barrier the plan's pipeline says (`full_at` / `empty_at`: the arriving
CTA's own, the leader's, or both).
"""
from __future__ import annotations

import dataclasses

LEADER = 0


class ProtocolError(AssertionError):
    pass


@dataclasses.dataclass(frozen=True)
class Barriers:
    """What the search needs of the kernel's pipelines (its plan's table): per pipeline, the
    roles whose arrival completes a phase of each side, where a pair's arrivals land, and
    whether an empty arrival gives back data its full phase delivered."""

    producers: dict  # pipe -> roles
    consumers: dict  # pipe -> roles
    full_at: dict  # pipe -> "own" | "leader" | "both"
    empty_at: dict
    releases_filled: frozenset

    @classmethod
    def of(cls, pipelines) -> "Barriers":
        return cls({p.name: p.producer for p in pipelines}, {p.name: p.consumers for p in pipelines},
                   {p.name: p.full_at for p in pipelines}, {p.name: p.empty_at for p in pipelines},
                   frozenset(p.name for p in pipelines if p.releases_filled))


def _landings(at: str, cta: int, ctas: int) -> tuple[int, ...]:
    if ctas == 1:
        return (0,)
    return {"own": (cta,), "leader": (LEADER,), "both": tuple(range(ctas))}[at]


def _placed(events: dict, barriers: Barriers, ctas: int, leader_only) -> dict:
    """(role, cta) -> events with each barrier named "pipe@cta": waits on the waiter's own,
    arrivals where they land (one event per landing CTA)."""
    out = {}
    for cta in range(ctas):
        for role, role_events in events.items():
            if cta != LEADER and role in leader_only:
                continue
            placed = out[(role, cta)] = []
            for event in role_events:
                if event[0] == "do":
                    continue
                kind, pipe, side = event[:3]
                if kind == "wait":
                    placed.append((kind, f"{pipe}@{cta}", *event[2:]))
                elif kind == "arrive":
                    at = (barriers.full_at if side == "full" else barriers.empty_at)[pipe]
                    placed.extend((kind, f"{pipe}@{owner}", *event[2:]) for owner in _landings(at, cta, ctas))
    return out


def _arrivals_per_phase(barriers: Barriers, ctas: int, leader_only) -> dict:
    """("pipe@cta", side) -> the arrivals (one per role, per CTA the role runs in) that
    complete a phase of that barrier."""
    out = {}
    for pipe in barriers.producers:
        for side, roles in (("full", barriers.producers[pipe]), ("empty", barriers.consumers[pipe])):
            at = (barriers.full_at if side == "full" else barriers.empty_at)[pipe]
            for owner in range(ctas):
                out[(f"{pipe}@{owner}", side)] = sum(
                    1 for cta in range(ctas) for role in roles
                    if (cta == LEADER or role not in leader_only) and owner in _landings(at, cta, ctas))
    return out


def _filled_by(barriers: Barriers, ctas: int) -> dict:
    """"pipe@cta" -> the barrier whose full phases say that CTA's buffers have landed."""
    return {f"{pipe}@{cta}": f"{pipe}@{_landings(barriers.full_at[pipe], cta, ctas)[0]}"
            for pipe in barriers.producers for cta in range(ctas)}


def search(events: dict, barriers: Barriers, ctas: int = 1, leader_only=()) -> int:
    """Explores every interleaving of `events` (role -> recorded events of one CTA; a pair's
    both CTAs run them) and of their asynchronous arrivals; raises ProtocolError on the first
    violation. Returns the number of states visited."""
    placed = _placed(events, barriers, ctas, leader_only)
    arrivals = _arrivals_per_phase(barriers, ctas, leader_only)
    filled_by = _filled_by(barriers, ctas)
    roles = sorted(placed, key=str)
    slots: dict = {}

    def slot(name, side, stage):
        return slots.setdefault((name, side, stage), len(slots))

    # Per role, its events as (kind, slot, parity or round, phases, delivery, needed, filled
    # slot, event): kind 0 wait, 1 arrive now, 2 arrive later. A later arrival is queued by
    # `delivery`: ("tma", slot) or ("commit", issuing role, landing CTA).
    steps = []
    for r, role in enumerate(roles):
        role_steps = []
        for event in placed[role]:
            kind, name, side, stage = event[:4]
            b = slot(name, side, stage)
            if kind == "wait":
                role_steps.append((0, b, event[4], event[5], None, 0, -1, (role, event)))
                continue
            rnd, how = event[4], event[5]
            filled = -1
            if side == "empty" and name.split("@")[0] in barriers.releases_filled:
                filled = slot(filled_by[name], "full", stage)
            delivery = None if how == "sync" else ("tma", b) if how == "tma" else ("commit", r, name.split("@")[1])
            role_steps.append((1 if delivery is None else 2, b, rnd, None, delivery, arrivals[(name, side)],
                               filled, (role, event)))
        steps.append(role_steps)
    queue_ids: dict = {}
    for role_steps in steps:
        for step in role_steps:
            if step[0] == 2:
                queue_ids.setdefault(step[4], len(queue_ids))

    def deliver(phases, counts, step):
        _, b, rnd, _, _, need, filled, event = step
        if need == 0:
            raise ProtocolError(f"{event}: arrives on a barrier no phase of which counts it")
        if filled >= 0 and phases[filled] <= rnd:
            raise ProtocolError(f"{event}: releases round {rnd} before its data has arrived")
        if phases[b] != rnd:
            raise ProtocolError(f"{event}: arrives while the barrier is in phase {phases[b]}")
        count = counts[b] + 1
        if count == need:
            phases, count = phases[:b] + (phases[b] + 1,) + phases[b + 1:], 0
        return phases, counts[:b] + (count,) + counts[b + 1:]

    zeros = (0,) * len(slots)
    start = ((0,) * len(roles), ((),) * len(queue_ids), zeros, zeros)
    seen = {start}
    frontier = [start]
    while frontier:
        pcs, queues, phases, counts = frontier.pop()
        successors = []
        for q, queue in enumerate(queues):
            if queue:  # the oldest arrival of this queue lands
                r, i = queue[0]
                successors.append((pcs, queues[:q] + (queue[1:],) + queues[q + 1:],
                                   *deliver(phases, counts, steps[r][i])))
        for r, role_steps in enumerate(steps):
            if pcs[r] == len(role_steps):
                continue
            step = role_steps[pcs[r]]
            kind, b, parity, expected, delivery, _, _, event = step
            new_pcs = pcs[:r] + (pcs[r] + 1,) + pcs[r + 1:]
            if kind == 0:
                if phases[b] % 2 == parity:
                    continue  # the parity wait blocks
                if phases[b] != expected:
                    raise ProtocolError(f"{event}: the wait passes with the barrier in phase {phases[b]}")
                successors.append((new_pcs, queues, phases, counts))
            elif kind == 2:
                q = queue_ids[delivery]
                successors.append((new_pcs, queues[:q] + (queues[q] + ((r, pcs[r]),),) + queues[q + 1:],
                                   phases, counts))
            else:
                successors.append((new_pcs, queues, *deliver(phases, counts, step)))
        if not successors and (any(queues) or any(pc < len(s) for pc, s in zip(pcs, steps))):
            stuck = {str(role): steps[r][pcs[r]][-1][1] for r, role in enumerate(roles) if pcs[r] < len(steps[r])}
            raise ProtocolError(f"deadlock: {stuck}")
        for state in successors:
            if state not in seen:
                seen.add(state)
                frontier.append(state)
    return len(seen)
