"""The Blackwell forward's plan (kernels/sm100/plan.py), checked without a GPU: the warp-role
table against the register file, the TMEM map against tensor memory, and the barrier protocol
every role follows, searched exhaustively for deadlock and for waits or arrivals that land in
the wrong phase of an mbarrier."""
import collections
import dataclasses

import pytest

from fa4_jax.kernels.sm100 import hardware, plan
from fa4_jax.kernels.sm100.plan import Q_STAGES, Role


def test_the_warp_roles_fill_the_register_file_and_whole_warp_groups():
    plan.check_budgets()
    per_group = collections.defaultdict(set)
    for assignment in plan.ROLES:
        for warp in assignment.warps:
            per_group[warp // plan.WARPS_PER_GROUP].add(assignment.registers)
    budgets = [per_group[g].pop() for g in sorted(per_group)]
    assert sum(b * plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP for b in budgets) == hardware.REGISTERS_PER_SM
    assert plan.NUM_THREADS == 512


def test_a_register_table_over_the_file_is_refused(monkeypatch):
    greedy = tuple(dataclasses.replace(r, registers=200) if r.role == Role.CORRECTION else r for r in plan.ROLES)
    monkeypatch.setattr(plan, "ROLES", greedy)
    with pytest.raises(ValueError, match="setmaxnreg"):
        plan.check_budgets()


def test_softmax_and_correction_warps_cover_the_128_tmem_lanes():
    # Warp w reads TMEM lanes 32·(w % 4) .. +31: a role's warps must hit each quarter once.
    for name in (*plan.SOFTMAX_ROLES, Role.CORRECTION):
        quarters = sorted(w % plan.WARPS_PER_GROUP for w in plan.role(name).warps)
        assert quarters == [0, 1, 2, 3], name


@pytest.mark.parametrize("dims", sorted(plan.TILE_CONFIGS))
def test_the_tmem_map_fits_and_p_lies_in_the_second_half_of_its_s(dims):
    config = plan.TILE_CONFIGS[dims]
    tmem = plan.TmemMap(config.tile_n, dims[1])
    assert tmem.alloc_columns <= hardware.TMEM_COLUMNS
    assert tmem.used_columns <= tmem.alloc_columns
    regions = tmem.regions()
    for stage in range(Q_STAGES):
        s_lo, s_hi = regions[f"S{stage}"]
        p_lo, p_hi = regions[f"P{stage}"]
        # P (16-bit, two per column) is half as wide and ends where S ends.
        assert (p_lo, p_hi) == (s_lo + config.tile_n // 2, s_hi)
    disjoint = [v for k, v in regions.items() if not k.startswith("P")]
    covered = set()
    for lo, hi in disjoint:
        cols = set(range(lo, hi))
        assert not cols & covered, regions
        covered |= cols


@pytest.mark.parametrize("dims", sorted(plan.TILE_CONFIGS))
def test_shared_memory_holds_q_and_the_ring(dims):
    config = plan.TILE_CONFIGS[dims]
    assert config.smem_bytes(*dims) + plan.SMEM_MARGIN <= hardware.SMEM_BYTES


# --- The protocol model ----------------------------------------------------------------------

class ProtocolError(AssertionError):
    pass


def explore(config, tiles, events=None, arrivals=None):
    """Every interleaving of the roles' barrier events (plan.role_events) and of the async
    arrivals (TMA, tcgen05.commit: delivered later, in issue order per issuing role). Raises
    ProtocolError on a deadlock, a wait that passes on the wrong phase (mbarrier parity waits
    only see the phase's parity), an arrival that lands in another phase than the one it is
    meant for, or a release of a round whose data has not arrived (`Pipeline.releases_filled`:
    a consumer must not give back a buffer a load is still writing). Returns the number of
    states visited."""
    events = events or plan.role_events(config, tiles)
    arrivals = arrivals or plan.expected_arrivals(config)
    releases_filled = {pipe.name for pipe in plan.pipelines(config) if pipe.releases_filled}
    roles = sorted(events, key=lambda r: r.value)
    start = (tuple(0 for _ in roles), tuple(() for _ in roles), ())
    seen = {start}
    frontier = [start]

    def barrier(barriers, key):
        return dict(barriers).get(key, (0, 0))

    def deliver(barriers, event):
        _, pipe, side, stage, rnd = event[:5]
        key = (pipe, side, stage)
        if side == "empty" and pipe in releases_filled and barrier(barriers, (pipe, "full", stage))[0] <= rnd:
            raise ProtocolError(f"{event}: releases round {rnd} before its data has arrived")
        phase, count = barrier(barriers, key)
        if phase != rnd:
            raise ProtocolError(f"{event}: arrives while {key} is in phase {phase}")
        count += 1
        if count == arrivals[(pipe, side)]:
            phase, count = phase + 1, 0
        return tuple(sorted({**dict(barriers), key: (phase, count)}.items()))

    while frontier:
        pcs, queues, barriers = frontier.pop()
        successors = []
        for r, role in enumerate(roles):
            if queues[r]:  # the oldest async arrival of this role lands
                new_queues = queues[:r] + (queues[r][1:],) + queues[r + 1:]
                successors.append((pcs, new_queues, deliver(barriers, queues[r][0])))
            if pcs[r] == len(events[role]):
                continue
            event = events[role][pcs[r]]
            new_pcs = pcs[:r] + (pcs[r] + 1,) + pcs[r + 1:]
            kind, pipe, side, stage, rnd = event[:5]
            if kind == "wait":
                phase, _ = barrier(barriers, (pipe, side, stage))
                if phase % 2 == rnd % 2:
                    continue  # the parity wait blocks
                if phase != rnd + 1:
                    raise ProtocolError(f"{role}: {event} passes with the barrier in phase {phase}")
                successors.append((new_pcs, queues, barriers))
            elif event[-1] == "async":
                new_queues = queues[:r] + (queues[r] + (event,),) + queues[r + 1:]
                successors.append((new_pcs, new_queues, barriers))
            else:
                successors.append((new_pcs, queues, deliver(barriers, event)))
        done = all(pcs[r] == len(events[role]) for r, role in enumerate(roles)) and not any(queues)
        if not successors and not done:
            stuck = {role.value: events[role][pcs[r]] for r, role in enumerate(roles)
                     if pcs[r] < len(events[role])}
            raise ProtocolError(f"deadlock: {stuck}")
        for state in successors:
            if state not in seen:
                seen.add(state)
                frontier.append(state)
    return len(seen)


@pytest.mark.parametrize("kv_stages", [2, 4, 5, 6])
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_the_protocol_has_no_deadlock_and_no_phase_aliasing(kv_stages, n_blocks):
    config = plan.TileConfig(kv_stages=kv_stages)
    assert explore(config, (n_blocks,)) > 100


# A persistent CTA's tiles in a row: the pipelines run on from one tile into the next, Q's
# buffers come back only once the previous tile's O stores have read them, and a tile without
# keys (0) takes Q's handshake alone.
@pytest.mark.parametrize("kv_stages", [2, 4])
@pytest.mark.parametrize("tiles", [(1, 1), (2, 1), (1, 2), (0, 1), (1, 0), (0, 0), (2, 0, 1), (1, 1, 1)])
def test_consecutive_tiles_have_no_deadlock_and_no_phase_aliasing(kv_stages, tiles):
    config = plan.TileConfig(kv_stages=kv_stages)
    assert explore(config, tiles) > 20


def test_every_shipped_ring_depth_is_covered_by_the_search():
    assert {c.kv_stages for c in plan.TILE_CONFIGS.values()} <= {2, 4, 5, 6}


def _without(events, role, predicate):
    return {**events, role: [e for e in events[role] if not predicate(e)]}


def test_the_search_finds_a_missing_arrival():
    # Without the correction's first release of O_0 the MMA warp waits forever.
    config = plan.TileConfig(kv_stages=2)
    events = plan.role_events(config, (2,))
    broken = _without(events, Role.CORRECTION, lambda e: e[:5] == ("arrive", "S0", "empty", 0, 0))
    with pytest.raises(ProtocolError, match="deadlock"):
        explore(config, (2,), broken)


def test_the_search_finds_a_phase_overrun():
    # A softmax that no longer waits for the correction to read its previous row scale can
    # publish two scales into one phase of STATS0.
    config = plan.TileConfig(kv_stages=2)
    events = plan.role_events(config, (3,))
    broken = _without(events, Role.SOFTMAX0, lambda e: e[:3] == ("wait", "STATS0", "empty"))
    with pytest.raises(ProtocolError):
        explore(config, (3,), broken)


def test_the_search_finds_a_ring_too_shallow_for_its_order():
    # A one-stage K/V ring cannot hold K_j and V_j together: the MMA warp waits for K_j while
    # V_j's load waits for K_j's release.
    config = plan.TileConfig(kv_stages=1)
    with pytest.raises(ProtocolError, match="deadlock"):
        explore(config, (2,))


def test_the_search_finds_a_q_buffer_never_given_back():
    # Without the correction's release of Q_1 after the first tile's store, the second tile's
    # Q_1 never loads.
    config = plan.TileConfig(kv_stages=2)
    events = plan.role_events(config, (1, 1))
    broken = _without(events, Role.CORRECTION, lambda e: e[:5] == ("arrive", "Q", "empty", 1, 0))
    with pytest.raises(ProtocolError, match="deadlock"):
        explore(config, (1, 1), broken)


def test_the_search_finds_zeros_staged_before_q_lands():
    # A keyless tile whose correction no longer waits for Q to land stages its zeros and gives
    # Q back while the load may still be writing it.
    config = plan.TileConfig(kv_stages=2)
    events = plan.role_events(config, (0, 1))
    broken = _without(events, Role.CORRECTION, lambda e: e[:4] == ("wait", "Q", "full", 0) or
                      e[:4] == ("wait", "Q", "full", 1))
    with pytest.raises(ProtocolError, match="before its data has arrived"):
        explore(config, (0, 1), broken)


def test_the_prediction_model_counts_each_unit_per_stage_and_block():
    from benchmarks import sm100_prediction as model

    c = model.cycles(128, 128, loop_instructions=558, mufu_ex2=129)
    # 2·128·128·256 FLOPs at 8192 per clock; 128 rows × 129 exponentials at 16 per clock;
    # 4 warps × 558 instructions over 4 sub-partitions; Q, K, V tiles of 32 KB at 128 B/clock.
    assert (c["tensor"], c["mufu"], c["issue"], c["smem"]) == (1024, 1032, 558, 768)
    assert model.tflops(c) == pytest.approx(2.25e15 * 1024 / 1032 / 1e12, rel=1e-6)
    # FA4's 1613 TF/s d128 against its own loop's bound: ~0.72.
    assert 0.6 < model.upstream_efficiency() < 0.8
