"""CPU tier: every Blackwell forward variant of the shipping menu, as compiled (the build cache's
cubins), holds what the plan (kernels/sm100/plan.py) says it must, and nothing it must not.

No Blackwell GPU has run these kernels; these checks read what ptxas made of them: the tcgen05
instruction families (both MMA forms, TMEM loads and stores, allocation paired with release),
the launch facts and the TMEM allocation against the plan's tables, local memory, and the
exponentials of each softmax loop against the tile width.
"""
import concurrent.futures
import os
from pathlib import Path

import pytest

from fa4_jax.aot import build
from fa4_jax.kernels.common import registers
from fa4_jax.kernels.sm100 import hardware, menu as sm100, plan
from fa4_jax.kernels.sm100.plan import Barrier, Role
from tests.scripts import load_script

sass_facts = load_script("sass_facts")


def config_of(variant):
    """The configuration a variant was built with (the kernel's own rule, plan.tile_config)."""
    return plan.tile_config(variant.head_dim, variant.head_dim_v, sm100.TUNINGS[variant.tuning])


@pytest.fixture(scope="module")
def all_facts():
    found = build.cubins(sm100.MENU)
    missing = sorted(name for name, cubins in found.items() if len(cubins) != 1)
    if missing:
        pytest.fail(f"no single cached cubin for {missing}: run python -m fa4_jax.aot.build")
    # cuobjdump per cubin (~1 s each) on every core.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        facts = pool.map(lambda cubins: sass_facts.facts(str(cubins[0])), found.values())
        return dict(zip(found, facts))


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_tcgen05_families(all_facts, variant):
    facts = all_facts[variant.name]
    fam = facts.families
    config = config_of(variant)
    k_steps_qk, k_steps_pv = variant.head_dim // 16, config.tile_n // 16
    # S = Q·Kᵀ from shared memory (SS) and O += P·V with P from TMEM (TS), one MMA per k16 step
    # per stage: S in the first blocks' and the loop's copies (with one stage, the first two
    # blocks' and the loop's), P·V in the loop's and, with two stages, the last block's.
    stages = config.q_stages
    assert facts.mma_forms["ss"] >= (1 + config.s_lookahead) * stages * k_steps_qk
    assert facts.mma_forms["ts"] >= (2 if stages == 2 else 1) * stages * k_steps_pv
    assert facts.mma_forms["ss"] + facts.mma_forms["ts"] == fam["utchmma"]
    assert fam["ldtm"] > 0 and fam["sttm"] > 0 and fam["utcbar"] > 0
    # TMEM is allocated (with the retry of a failed allocation) and released once.
    assert fam["tmem_alloc"] >= 1 and fam["tmem_dealloc"] == 1
    # A CTA pair: every MMA, TMEM allocation and K/V or Q load of the pair's kind, every commit
    # multicast to both CTAs' barriers, and the CTAs wait for each other (cluster barriers, at
    # the barriers' initialisation and before leaving). A single CTA: none of them.
    pair = config.cta_pair
    assert fam["utchmma_2cta"] == (fam["utchmma"] if pair else 0)
    assert fam["utcbar_multicast"] == (fam["utcbar"] if pair else 0)
    assert fam["tmem_alloc_2cta"] == (fam["tmem_alloc"] if pair else 0)
    assert fam["tma_load_2cta"] == (fam["tma_load"] if pair else 0)
    assert fam["cluster_wait"] == (2 if pair else 0)
    # O leaves through shared memory, one TMA store per stage; the plain global stores are
    # LSE's, a 32-bit store per stage and epilogue, and a tile without keys's zero rows of O
    # (which no buffer is free to stage), in 16-byte stores.
    assert fam["tma_store"] >= stages and fam["tma_load"] > 0
    assert fam["global_store"] <= 2 * stages + stages * variant.head_dim_v * 2 // 16


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_launch_facts_match_the_plan(all_facts, variant):
    facts = all_facts[variant.name]
    roles = plan.warp_roles(config_of(variant))
    assert facts.launch["threads"] == [roles.num_threads, 1, 1]
    assert facts.launch["registers"] == roles.launch_registers
    # The setmaxnreg budgets fit the pool ptxas's launch registers give the CTA.
    assert registers.pool_violation(roles.budgets(), facts.launch["registers"]) is None
    assert facts.launch["num_barriers"] <= hardware.NAMED_BARRIERS
    assert facts.launch["num_barriers"] == max(Barrier) + 1
    # setmaxnreg: the roles under the launch's count give registers up, those above take them
    # (a decrease to a count above the current one is not allowed), at the table's budgets.
    budgets = {(("TRY_ALLOC" if roles.role(r).registers > roles.launch_registers else "DEALLOC"),
                roles.role(r).registers) for r in (*roles.softmax, Role.CORRECTION, Role.MMA)}
    assert set(facts.setmaxnreg) == budgets
    assert facts.named_barriers == [(int(Barrier.TMEM), roles.threads(*roles.tmem_users)),
                                    (int(Barrier.O_STORE), roles.threads(Role.CORRECTION))]


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_tmem_allocation_is_the_plans(all_facts, variant):
    # The columns the compiled kernel asks tcgen05.alloc for (its first try and the retry)
    # are the TMEM map's allocation for this variant's tile: the map's regions fit in what the
    # hardware hands out.
    config = config_of(variant)
    planned = plan.TmemMap(config.tile_n, variant.head_dim_v, config.q_stages).alloc_columns
    columns = all_facts[variant.name].tmem_alloc_columns
    assert columns and set(columns) == {planned}
    assert planned <= hardware.TMEM_COLUMNS


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_no_local_memory_in_any_loop(all_facts, variant):
    facts = all_facts[variant.name]
    for loop in facts.loop_families:
        assert loop["local_load"] == loop["local_store"] == 0, (variant.name, loop)
    # Outside the loops ptxas keeps at most a few values in local memory across the warps'
    # register drops (docs/blackwell.md, "Static comparison"); the persistent kernels, which
    # derive each tile inside their loops, none.
    local = facts.families["local_load"] + facts.families["local_store"]
    assert local <= (0 if plan.scheduler_kind(variant.mask) == "lpt" else 16)


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_each_softmax_loop_runs_one_exponential_per_key_and_one_row_scale(all_facts, variant):
    config = config_of(variant)
    facts = all_facts[variant.name]
    softmax_loops = [loop for loop in sass_facts.innermost(facts.loop_families) if loop["mufu_ex2"]]
    # Each softmax warp group's unmasked loop, and masked loops per mask kind (inside each
    # group's loop over its tiles).
    expected_loops = {"none": 1, "causal": 2, "local": 3}[variant.mask] * config.q_stages
    assert len(softmax_loops) == expected_loops
    # Columns go in pairs: the scaling is one FFMA2 per pair, and a pair on the polynomial is
    # three FFMA2 (Horner) and one FMUL2 (times 2^floor) instead of two MUFU.EX2.
    poly_pairs = sum(plan_uses_poly(config, pair) for pair in range(config.tile_n // 2))
    for loop in softmax_loops:
        assert loop["mufu_ex2"] == config.tile_n - 2 * poly_pairs + 1, loop
        assert loop["ffma2"] == config.tile_n // 2 + 3 * poly_pairs, loop
        assert loop["fmul2"] == poly_pairs, loop
        assert loop["ldtm"] == config.tile_n // 32 and loop["sttm"] == config.tile_n // 32
        if variant.softcap:
            assert loop["mufu_tanh"] == config.tile_n


@pytest.mark.parametrize("variant", [v for v in sm100.MENU if plan.scheduler_kind(v.mask) == "lpt"],
                         ids=lambda v: v.name)
def test_every_role_walks_the_ctas_tiles(all_facts, variant):
    # Persistent CTAs (the scheduler's "lpt", without a mask): each role's work on a tile sits
    # inside a loop over the CTA's tiles. One tile per CTA (the masked kernels' "lpt_grid", where
    # the loop runs at most once and compiles to none), the softmax loops, O's TMA stores and the
    # first block's S GEMMs lie outside every loop but the key blocks'.
    loops = all_facts[variant.name].loop_families
    inner = sass_facts.innermost(loops)
    outer = [loop for loop in loops if loop not in inner]
    softmax_loops = [loop for loop in inner if loop["mufu_ex2"]]
    assert softmax_loops and all(any(sass_facts.encloses(o, loop) for o in outer) for loop in softmax_loops)
    assert max(loop["tma_store"] for loop in outer) >= config_of(variant).q_stages  # the correction's
    # The MMA warp's first S GEMMs of a tile: in a tile loop, outside its key-block loops.
    assert max(loop["utchmma"] - sum(i["utchmma"] for i in inner if sass_facts.encloses(loop, i))
               for loop in outer) > 0


def plan_uses_poly(config, column):
    from fa4_jax.kernels.common.exp2 import uses_poly

    return uses_poly(config.exp2_poly_share, column)


def test_the_docs_static_table_is_what_this_build_compiles(all_facts):
    # docs/blackwell.md's fa4_jax rows (scripts/upstream_peer/sm100_static.py) must be the
    # current cubins': a kernel change that moves them must come with the table's update.
    static = load_script("upstream_peer/sm100_static")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "blackwell.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in docs.splitlines() if line.startswith("| fwd_sm100f_")}
    assert rows, "docs/blackwell.md has no fa4_jax rows in its static table"
    keys = None
    for name, line in rows.items():
        row = static.row(name, all_facts[name])
        keys = keys or list(row)
        assert line == "| " + " | ".join("" if row[k] is None else str(row[k]) for k in keys) + " |", name
