"""The Blackwell forward's plan (kernels/sm100/plan.py), checked without a GPU: the warp-role
tables against the CTA's register pool, the TMEM map against tensor memory, shared memory
against Q and the ring. (The barrier protocol, as the kernel issues it: test_sm100_protocol.py.)"""
import dataclasses

import pytest

from fa4_jax.kernels.common import registers
from fa4_jax.kernels.sm100 import hardware, plan
from fa4_jax.kernels.sm100.plan import Role

TABLES = {"two stages": plan.TWO_STAGE_ROLES, "one stage": plan.ONE_STAGE_ROLES}


@pytest.mark.parametrize("roles", TABLES.values(), ids=TABLES.keys())
def test_the_warp_roles_fit_the_ctas_register_pool(roles):
    roles.check()
    budgets = roles.budgets()
    # setmaxnreg draws on the pool the launch allocated, launch registers x threads.
    assert sum(budgets) * plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP <= roles.launch_registers * roles.num_threads
    # One softmax warp group per stage, the correction's, and the MMA/load/idle warps'.
    assert roles.num_threads == (len(roles.softmax) + 2) * plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP
    assert len(budgets) == roles.num_threads // (plan.WARPS_PER_GROUP * plan.THREADS_PER_WARP)


def test_budgets_over_the_pool_are_refused():
    # The d256 table as first shipped: 256/208/48 over 384 threads launched at 168 registers
    # asks 65,536 of a 64,512-register pool (its second increase would wait forever), though
    # it fits the SM's register file.
    hung = plan.WarpRoles(tuple(dataclasses.replace(r, registers=208) if r.role == Role.CORRECTION else r
                                for r in plan.ONE_STAGE_ROLES.table))
    assert hung.launch_registers == 168 and sum(hung.budgets()) * 128 == registers.REGISTERS_PER_SM
    with pytest.raises(ValueError, match="pool of 64512"):
        hung.check()
    assert registers.pool_violation((256, 200, 48), 168) is None
    assert "wait forever" in registers.pool_violation((256, 208, 48), 168)
    # Budgets setmaxnreg cannot take at all.
    assert "multiples of 8" in registers.pool_violation((192, 192, 84, 48), 128)
    assert registers.pool_violation((264, 48, 48), 168) is not None


def test_each_config_gets_the_table_of_its_stages():
    for config in (*plan.TILE_CONFIGS.values(), *plan.PAIR_TILE_CONFIGS.values()):
        assert len(plan.warp_roles(config).softmax) == config.q_stages


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
