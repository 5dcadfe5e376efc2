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
    arrivals where they land (one event per landing CTA, the arriving CTA last)."""
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
                else:
                    at = (barriers.full_at if side == "full" else barriers.empty_at)[pipe]
                    placed.extend((kind, f"{pipe}@{owner}", *event[2:], cta) for owner in _landings(at, cta, ctas))
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


@dataclasses.dataclass(frozen=True)
class _Step:
    """One event of a role, resolved to barrier slots. kind: 0 a wait, 1 an arrival now, 2 an
    arrival later (queued on `queue`). A wait passes when the slot's phase parity differs from
    `value` and must find `phases` phases complete; an arrival is meant for phase `value`,
    `needed` arrivals complete one, and a release of data may only come once `filled` (a full
    barrier's slot, -1: none) has completed that phase."""

    kind: int
    slot: int
    value: int
    phases: int
    needed: int
    filled: int
    queue: object
    event: tuple

    def touches(self) -> tuple[int, int]:
        """(slots read, slots written) as bit sets: a wait reads its slot, an arrival writes
        its own (when it lands) and reads the one that says its data has arrived."""
        if self.kind == 0:
            return 1 << self.slot, 0
        return (1 << self.filled if self.filled >= 0 else 0), 1 << self.slot


def search(events: dict, barriers: Barriers, ctas: int = 1, leader_only=(), reduce: bool = True) -> int:
    """Explores every interleaving of `events` (role -> recorded events of one CTA; a pair's
    both CTAs run them) and of their asynchronous arrivals; raises ProtocolError on the first
    violation. Returns the number of states visited.

    `reduce`: explore from each state only a stubborn set of its moves (the roles and arrival
    queues whose next move could touch a barrier another's next moves touch, closed under that
    relation), which reaches every deadlock and every wait or arrival on a wrong phase that the
    full search reaches: a move left out touches no barrier the set's moves touch, so it stays
    possible, and means the same, after them. The state graph has no cycles (every move
    advances a role or lands an arrival), which the reduction needs."""
    placed = _placed(events, barriers, ctas, leader_only)
    arrivals = _arrivals_per_phase(barriers, ctas, leader_only)
    roles = sorted(placed, key=str)
    slots: dict = {}

    def slot(name, side, stage):
        return slots.setdefault((name, side, stage), len(slots))

    steps = []
    for r, role in enumerate(roles):
        role_steps = []
        for event in placed[role]:
            kind, name, side, stage = event[:4]
            b = slot(name, side, stage)
            if kind == "wait":
                role_steps.append(_Step(0, b, event[4], event[5], 0, -1, None, (role, event)))
                continue
            rnd, how, arriving_cta = event[4], event[5], event[6]
            pipe, landing = name.split("@")
            filled = -1
            if side == "empty" and pipe in barriers.releases_filled:
                # The arriving CTA's data: its own full barrier, or the leader's where its loads
                # complete there.
                landings = _landings(barriers.full_at[pipe], arriving_cta, ctas)
                owner = arriving_cta if arriving_cta in landings else landings[0]
                filled = slot(f"{pipe}@{owner}", "full", stage)
            queue = None if how == "sync" else ("tma", b) if how == "tma" else ("commit", r, landing)
            role_steps.append(_Step(1 if queue is None else 2, b, rnd, 0, arrivals[(name, side)], filled, queue,
                                    (role, event[:-1])))
        steps.append(role_steps)
    queue_ids: dict = {}
    for role_steps in steps:
        for step in role_steps:
            if step.kind == 2:
                queue_ids.setdefault(step.queue, len(queue_ids))
    # What each role may still touch from each point of its sequence on (bit sets of slots).
    suffix = []
    for role_steps in steps:
        reads, writes, rows = 0, 0, [(0, 0)]
        for step in reversed(role_steps):
            step_reads, step_writes = step.touches()
            reads, writes = reads | step_reads, writes | step_writes
            rows.append((reads, writes))
        suffix.append(rows[::-1])
    n_roles = len(steps)

    def deliver(phases, counts, step):
        b, rnd = step.slot, step.value
        if step.needed == 0:
            raise ProtocolError(f"{step.event}: arrives on a barrier no phase of which counts it")
        if step.filled >= 0 and phases[step.filled] <= rnd:
            raise ProtocolError(f"{step.event}: releases round {rnd} before its data has arrived")
        if phases[b] != rnd:
            raise ProtocolError(f"{step.event}: arrives while the barrier is in phase {phases[b]}")
        count = counts[b] + 1
        if count == step.needed:
            phases, count = phases[:b] + (phases[b] + 1,) + phases[b + 1:], 0
        return phases, counts[:b] + (count,) + counts[b + 1:]

    def moves(pcs, queues, phases):
        """Per process (roles, then queues), its next move as (step, enabled), or None."""
        out = []
        for r, role_steps in enumerate(steps):
            if pcs[r] == len(role_steps):
                out.append(None)
                continue
            step = role_steps[pcs[r]]
            out.append((step, step.kind != 0 or phases[step.slot] % 2 != step.value))
        for queue in queues:
            out.append((steps[queue[0][0]][queue[0][1]], True) if queue else None)
        return out

    def future(p, pcs, queues):
        """(reads, writes) process p may still make."""
        if p < n_roles:
            return suffix[p][pcs[p]]
        reads = writes = 0
        for r, i in queues[p - n_roles]:
            step_reads, step_writes = steps[r][i].touches()
            reads, writes = reads | step_reads, writes | step_writes
        return reads, writes

    def stubborn(next_moves, pcs, queues):
        """The enabled processes of the smallest stubborn set seeded by an enabled move."""
        best = None
        for seed, move in enumerate(next_moves):
            if move is None or not move[1]:
                continue
            chosen, work = {seed}, [seed]
            while work:
                p = work.pop()
                step, enabled = next_moves[p]
                if step.kind == 2 and p < n_roles:
                    continue  # queuing an arrival touches no barrier
                reads, writes = step.touches() if enabled else (0, 1 << step.slot)
                for o, other in enumerate(next_moves):
                    if other is None or o in chosen:
                        continue
                    other_reads, other_writes = future(o, pcs, queues)
                    if (enabled and (writes & (other_reads | other_writes) or reads & other_writes)) or \
                            (not enabled and writes & other_writes):
                        chosen.add(o)
                        work.append(o)
            live = [p for p in chosen if next_moves[p][1]]
            if best is None or len(live) < len(best):
                best = live
                if len(best) == 1:
                    break
        return best or []

    def touches(p, move):
        if move[0].kind == 2 and p < n_roles:
            return 0, 0  # queuing an arrival touches no barrier
        return move[0].touches()

    def independent(p, o, next_moves):
        p_reads, p_writes = touches(p, next_moves[p])
        o_reads, o_writes = touches(o, next_moves[o])
        return not (p_writes & (o_reads | o_writes) or p_reads & o_writes)

    def successor(state, p, step):
        pcs, queues, phases, counts = state
        if p >= n_roles:  # the oldest arrival of this queue lands
            q = p - n_roles
            return (pcs, queues[:q] + (queues[q][1:],) + queues[q + 1:], *deliver(phases, counts, step))
        new_pcs = pcs[:p] + (pcs[p] + 1,) + pcs[p + 1:]
        if step.kind == 0:
            if phases[step.slot] != step.phases:
                raise ProtocolError(f"{step.event}: the wait passes with the barrier in phase {phases[step.slot]}")
            return new_pcs, queues, phases, counts
        if step.kind == 2:
            q = queue_ids[step.queue]
            return new_pcs, queues[:q] + (queues[q] + ((p, pcs[p]),),) + queues[q + 1:], phases, counts
        return (new_pcs, queues, *deliver(phases, counts, step))

    # A depth-first search with sleep sets (a move whose interleavings with the moves explored
    # before it at this state were covered there, and which nothing since has touched, is not
    # taken again) and, per state, the sleep set it was explored with: a later visit with fewer
    # moves asleep takes the ones that were asleep before.
    zeros = (0,) * len(slots)
    start = ((0,) * n_roles, ((),) * len(queue_ids), zeros, zeros)
    explored: dict = {}
    stack = []

    def visit(state, sleep: frozenset):
        pcs, queues, phases, _ = state
        next_moves = moves(pcs, queues, phases)
        if state in explored:
            asleep_before = explored[state]
            if asleep_before <= sleep:
                return
            explored[state] = asleep_before & sleep
            todo = [p for p in asleep_before - sleep if next_moves[p] is not None and next_moves[p][1]]
        else:
            explored[state] = sleep
            enabled = [p for p, move in enumerate(next_moves) if move is not None and move[1]]
            if not enabled:
                if any(move is not None for move in next_moves):
                    stuck = {str(roles[r]): move[0].event[1] for r, move in enumerate(next_moves[:n_roles]) if move}
                    raise ProtocolError(f"deadlock: {stuck}")
                return
            todo = [p for p in (stubborn(next_moves, pcs, queues) if reduce else enabled) if p not in sleep]
        stack.append((state, next_moves, sleep, todo, []))

    visit(start, frozenset())
    while stack:
        state, next_moves, sleep, todo, done = stack[-1]
        if not todo:
            stack.pop()
            continue
        p = todo.pop()
        child_sleep = frozenset(z for z in (*sleep, *done) if independent(z, p, next_moves)) if reduce else frozenset()
        done.append(p)
        visit(successor(state, p, next_moves[p][0]), child_sleep)
    return len(explored)
