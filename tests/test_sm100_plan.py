"""The Blackwell forward's plan (kernels/sm100/plan.py), checked without a GPU: the warp-role
table against the register file, the TMEM map against tensor memory, and the barrier protocol
every role follows, searched exhaustively for deadlock and for waits or arrivals that land in
the wrong phase of an mbarrier."""
import collections
import dataclasses

import pytest

from fa4_jax.kernels.sm100 import hardware, plan
from fa4_jax.kernels.sm100.plan import Role

TABLES = {"two stages": plan.TWO_STAGE_ROLES, "one stage": plan.ONE_STAGE_ROLES}


@pytest.mark.parametrize("roles", TABLES.values(), ids=TABLES.keys())
def test_the_warp_roles_fill_the_register_file_and_whole_warp_groups(roles):
    roles.check()
    per_group = collections.defaultdict(set)
    for assignment in roles.table:
        for warp in assignment.warps:
            per_group[warp // plan.WARPS_PER_GROUP].add(assignment.registers)
    budgets = [per_group[g].pop() for g in sorted(per_group)]
    assert sum(b * plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP for b in budgets) == hardware.REGISTERS_PER_SM
    # One softmax warp group per stage, the correction's, and the MMA/load/idle warps'.
    assert roles.num_threads == (len(roles.softmax) + 2) * plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP


def test_each_config_gets_the_table_of_its_stages():
    for config in (*plan.TILE_CONFIGS.values(), *plan.PAIR_TILE_CONFIGS.values()):
        assert len(plan.warp_roles(config).softmax) == config.q_stages


def test_a_register_table_over_the_file_is_refused():
    greedy = plan.WarpRoles(tuple(dataclasses.replace(r, registers=200) if r.role == Role.CORRECTION else r
                                  for r in plan.TWO_STAGE_ROLES.table))
    with pytest.raises(ValueError, match="setmaxnreg"):
        greedy.check()


@pytest.mark.parametrize("roles", TABLES.values(), ids=TABLES.keys())
def test_softmax_and_correction_warps_cover_the_128_tmem_lanes(roles):
    # Warp w reads TMEM lanes 32·(w % 4) .. +31: a role's warps must hit each quarter once.
    for name in (*roles.softmax, Role.CORRECTION):
        quarters = sorted(w % plan.WARPS_PER_GROUP for w in roles.role(name).warps)
        assert quarters == [0, 1, 2, 3], name


@pytest.mark.parametrize("dims", sorted(plan.TILE_CONFIGS))
def test_the_tmem_map_fits_and_p_lies_in_the_second_half_of_its_s(dims):
    config = plan.TILE_CONFIGS[dims]
    tmem = plan.TmemMap(config.tile_n, dims[1], config.q_stages)
    assert tmem.alloc_columns <= hardware.TMEM_COLUMNS
    assert tmem.used_columns <= tmem.alloc_columns
    regions = tmem.regions()
    assert sum(name.startswith("O") for name in regions) == config.q_stages
    for buffer in range(plan.S_BUFFERS):
        s_lo, s_hi = regions[f"S{buffer}"]
        p_lo, p_hi = regions[f"P{buffer}"]
        # P (16-bit, two per column) is half as wide and ends where S ends.
        assert (p_lo, p_hi) == (s_lo + config.tile_n // 2, s_hi)
    disjoint = [v for k, v in regions.items() if not k.startswith("P")]
    covered = set()
    for lo, hi in disjoint:
        cols = set(range(lo, hi))
        assert not cols & covered, regions
        covered |= cols


@pytest.mark.parametrize("dims, pair", [(d, False) for d in sorted(plan.TILE_CONFIGS)]
                         + [(d, True) for d in sorted(plan.PAIR_TILE_CONFIGS)])
def test_shared_memory_holds_q_and_the_ring(dims, pair):
    config = plan.tile_config(*dims, {"cta_pair": True} if pair else {})
    assert config.smem_bytes(*dims) + plan.SMEM_MARGIN <= hardware.SMEM_BYTES
    # A pair's CTA holds half of each K/V block: its stage is half the single CTA's.
    if pair:
        single = dataclasses.replace(config, cta_pair=False)
        half_ring = config.kv_stages * config.tile_n * max(dims)  # bytes: 2-byte elements, halved
        assert single.smem_bytes(*dims) - config.smem_bytes(*dims) == half_ring


# --- The protocol model ----------------------------------------------------------------------

class ProtocolError(AssertionError):
    pass


def explore(config, tiles, events=None, arrivals=None, filled_by=None):
    """Every interleaving of the roles' barrier events (plan.role_events) and of the async
    arrivals (TMA, tcgen05.commit: delivered later, in issue order per issuing role). Raises
    ProtocolError on a deadlock, a wait that passes on the wrong phase (mbarrier parity waits
    only see the phase's parity), an arrival that lands in another phase than the one it is
    meant for, or a release of a round whose data has not arrived (`Pipeline.releases_filled`:
    a consumer must not give back a buffer a load is still writing; `filled_by` names, per
    pipeline, the barrier whose full phases say so). Returns the number of states visited."""
    events = events or plan.role_events(config, tiles)
    arrivals = arrivals or plan.expected_arrivals(config)
    releases_filled = {pipe.name for pipe in plan.pipelines(config) if pipe.releases_filled}
    filled_by = filled_by or {}
    roles = sorted(events, key=str)
    # A state: each role's next event, each role's arrivals in flight, and each barrier's phase
    # and arrival count, barriers numbered in `slots`.
    slots = {}

    def slot(pipe, side, stage):
        return slots.setdefault((pipe, side, stage), len(slots))

    steps = []
    for role in roles:
        role_steps = []
        for event in events[role]:
            kind, pipe, side, stage, rnd = event[:5]
            filled = -1
            if kind == "arrive" and side == "empty" and pipe.split("@")[0] in releases_filled:
                filled = slot(filled_by.get(pipe, pipe), "full", stage)
            role_steps.append((kind == "wait", slot(pipe, side, stage), rnd, event[-1] == "async",
                               arrivals.get((pipe, side), 0), filled, event))
        steps.append(role_steps)

    def deliver(phases, counts, step):
        _, b, rnd, _, need, filled, event = step
        if filled >= 0 and phases[filled] <= rnd:
            raise ProtocolError(f"{event}: releases round {rnd} before its data has arrived")
        if phases[b] != rnd:
            raise ProtocolError(f"{event}: arrives while barrier {b} is in phase {phases[b]}")
        count = counts[b] + 1
        if count == need:
            phases, count = phases[:b] + (phases[b] + 1,) + phases[b + 1:], 0
        return phases, counts[:b] + (count,) + counts[b + 1:]

    zeros = (0,) * len(slots)
    start = ((0,) * len(roles), ((),) * len(roles), zeros, zeros)
    seen = {start}
    frontier = [start]
    while frontier:
        pcs, queues, phases, counts = frontier.pop()
        successors = []
        for r, role_steps in enumerate(steps):
            if queues[r]:  # the oldest async arrival of this role lands
                new_queues = queues[:r] + (queues[r][1:],) + queues[r + 1:]
                successors.append((pcs, new_queues, *deliver(phases, counts, role_steps[queues[r][0]])))
            if pcs[r] == len(role_steps):
                continue
            step = role_steps[pcs[r]]
            is_wait, b, rnd, is_async, _, _, event = step
            new_pcs = pcs[:r] + (pcs[r] + 1,) + pcs[r + 1:]
            if is_wait:
                if phases[b] % 2 == rnd % 2:
                    continue  # the parity wait blocks
                if phases[b] != rnd + 1:
                    raise ProtocolError(f"{roles[r]}: {event} passes with the barrier in phase {phases[b]}")
                successors.append((new_pcs, queues, phases, counts))
            elif is_async:
                new_queues = queues[:r] + (queues[r] + (pcs[r],),) + queues[r + 1:]
                successors.append((new_pcs, new_queues, phases, counts))
            else:
                successors.append((new_pcs, queues, *deliver(phases, counts, step)))
        if not successors and (any(queues) or any(pc < len(s) for pc, s in zip(pcs, steps))):
            stuck = {str(role): steps[r][pcs[r]][-1] for r, role in enumerate(roles) if pcs[r] < len(steps[r])}
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


# One stage (d256): S double-buffered, issued two blocks ahead, O's rescale after PV0. Runs of
# up to four blocks, so that each S buffer is reused and the ring wraps.
@pytest.mark.parametrize("kv_stages", [2, 3, 4])
@pytest.mark.parametrize("tiles", [(1,), (2,), (3,), (4,), (1, 1), (3, 1), (1, 2), (0, 1), (2, 0, 1)])
def test_one_stage_has_no_deadlock_and_no_phase_aliasing(kv_stages, tiles):
    config = plan.TileConfig(kv_stages=kv_stages, q_stages=1)
    assert explore(config, tiles) > 100


def unread_overwrites(mma_events):
    """The MMA warp's S GEMMs issued before it waited, earlier in its own order, for the release
    of the previous use of the same S buffer (whose P the P·V issued after that wait read)."""
    waited, out = set(), []
    for kind, pipe, side, stage, rnd, *_ in mma_events:
        if not pipe.startswith("S"):
            continue
        if kind == "wait" and side == "empty":
            waited.add((pipe, stage, rnd))
        elif kind == "arrive" and side == "full" and rnd > 0 and (pipe, stage, rnd - 1) not in waited:
            out.append((pipe, stage, rnd))
    return out


@pytest.mark.parametrize("q_stages", [2, 1])
def test_an_s_gemm_never_overwrites_a_p_that_p_v_has_not_read(q_stages):
    # An S GEMM waits for nothing itself (the model sees no hazard there): the order must.
    config = plan.TileConfig(kv_stages=2, q_stages=q_stages)
    events = plan.role_events(config, (3, 1, 2))[Role.MMA]
    assert not unread_overwrites(events)
    # Without the waits for P, every S GEMM after a buffer's first use overwrites unread P.
    assert unread_overwrites([e for e in events if e[:3] != ("wait", "S0", "empty")])


def test_every_shipped_ring_depth_is_covered_by_the_search():
    assert {c.kv_stages for c in plan.TILE_CONFIGS.values() if c.q_stages == 2} <= {2, 4, 5, 6}
    assert {c.kv_stages for c in plan.TILE_CONFIGS.values() if c.q_stages == 1} <= {2, 3, 4}


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
    # A CTA pair's SM reads its Q rows and half of K and V: 32 + 16 + 16 KB.
    assert model.cycles(128, 128, 558, 129, ctas=2)["smem"] == 512
    # K and V loaded per stage and block: a d128 block serves two stages, a d256 block one
    # (twice the bytes per FLOP), halved again on a pair.
    assert model.cycles(128, 128, 558, 129)["kv_bytes"] == 32768
    assert model.cycles(256, 256, 437, 129)["kv_bytes"] == 131072
    assert model.cycles(256, 256, 437, 129, ctas=2)["kv_bytes"] == 65536


# --- The CTA pair ------------------------------------------------------------------------------

def explore_pair(config, tiles, events=None):
    return explore(config, tiles, events or plan.pair_role_events(config, tiles),
                   plan.pair_expected_arrivals(config), plan.pair_filled_by(config))


# Nine roles make a pair's state space large (1.7 million states for two one-block tiles): one
# tile at each shipped depth, and the ring's wrap and the next tile's Q at the shallowest.
@pytest.mark.parametrize("kv_stages, tiles, q_stages", [
    (2, (1,), 2), (5, (1,), 2), (6, (1,), 2), (2, (2,), 2), (2, (1, 1), 2),
    # d256's pair: each S buffer used twice in three blocks, and a second tile.
    (4, (1,), 1), (2, (3,), 1), (4, (2,), 1), (2, (1, 1), 1)])
def test_a_cta_pair_has_no_deadlock_and_no_phase_aliasing(kv_stages, tiles, q_stages):
    # Both CTAs' loads complete on the leader's K/V and Q barriers, the leader's commits land
    # on both CTAs' barriers, and both CTAs' softmax and correction hand S back to the leader.
    config = plan.TileConfig(kv_stages=kv_stages, cta_pair=True, q_stages=q_stages)
    assert explore_pair(config, tiles) > 100


def test_every_shipped_pair_ring_depth_is_covered_by_the_search():
    assert {c.kv_stages for c in plan.PAIR_TILE_CONFIGS.values() if c.q_stages == 2} <= {2, 5, 6}
    assert {c.kv_stages for c in plan.PAIR_TILE_CONFIGS.values() if c.q_stages == 1} <= {2, 4}
    assert all(c.cta_pair for c in plan.PAIR_TILE_CONFIGS.values())


def test_a_pair_counts_both_ctas_on_the_leaders_barriers():
    arrivals = plan.pair_expected_arrivals(plan.TileConfig(cta_pair=True))
    # Both CTAs' TMA loads on the leader's; the non-leader's full barrier of them unused.
    assert arrivals[("KV@0", "full")] == arrivals[("Q@0", "full")] == 2
    assert arrivals[("KV@1", "full")] == arrivals[("Q@1", "full")] == 0
    # One multicast commit per phase on each CTA's K/V empty and S full barriers.
    assert arrivals[("KV@0", "empty")] == arrivals[("KV@1", "empty")] == 1
    assert arrivals[("S0@1", "full")] == 1
    # Softmax 0 and the correction of both CTAs give S_0 back to the leader.
    assert (arrivals[("S0@0", "empty")], arrivals[("S0@1", "empty")]) == (4, 0)


def test_the_search_finds_a_commit_that_misses_the_partner():
    # K/V's release committed to the leader's barrier alone: the partner's load warp waits
    # forever for its ring to empty.
    config = plan.TileConfig(kv_stages=2, cta_pair=True)
    events = plan.pair_role_events(config, (3,))
    broken = _without(events, (Role.MMA, 0), lambda e: e[:3] == ("arrive", "KV@1", "empty"))
    with pytest.raises(ProtocolError, match="deadlock"):
        explore_pair(config, (3,), broken)


def test_the_search_finds_a_partner_release_on_its_own_barrier():
    # The partner's softmax arriving on its own S_0 empty barrier instead of the leader's: the
    # leader's MMA warp waits forever for S_0 back.
    config = plan.TileConfig(kv_stages=2, cta_pair=True)
    events = plan.pair_role_events(config, (2,))
    misdirected = [e[:1] + ("S0@1",) + e[2:] if e[:3] == ("arrive", "S0@0", "empty") else e
                   for e in events[(Role.SOFTMAX0, 1)]]
    with pytest.raises(ProtocolError):
        explore_pair(config, (2,), {**events, (Role.SOFTMAX0, 1): misdirected})


def test_a_pair_refuses_tiles_without_keys():
    with pytest.raises(ValueError, match="key blocks"):
        plan.pair_role_events(plan.TileConfig(cta_pair=True), (1, 0))
