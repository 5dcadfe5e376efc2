"""CPU tier: every warp-role table's setmaxnreg budgets fit the register pool of the CTA that
runs them (kernels/common/registers.py: the launch's registers x threads; an increase past it
waits forever), for Hopper's kernels as for Blackwell's (whose tables plan.WarpRoles.check holds
at construction, and tests/test_sm100_sass.py against every compiled sm100 variant): here
Hopper's tables, and a sample of its compiled forwards, whose launch registers ptxas chose."""
import pytest

pytest.importorskip("cutlass")  # the kernels' modules import the DSL

from fa4_jax.aot import build  # noqa: E402
from fa4_jax.aot import compile as compile_worker  # noqa: E402
from fa4_jax.aot import menu  # noqa: E402
from fa4_jax.kernels.common import registers  # noqa: E402
from fa4_jax.kernels.sm90 import bwd as sm90_bwd  # noqa: E402
from fa4_jax.kernels.sm90 import fwd as sm90_fwd  # noqa: E402
from tests.scripts import load_script  # noqa: E402

sass_facts = load_script("sass_facts")


def sm90_forward_budgets(mma_warp_groups: int) -> tuple[int, ...]:
    """The Hopper forward's budgets per warp group: the producer's, then each MMA group's."""
    return (sm90_fwd.ROLES.producer_registers,) + (sm90_fwd.MMA_REGISTERS[mma_warp_groups],) * mma_warp_groups


@pytest.mark.parametrize("mma_warp_groups", sorted(sm90_fwd.MMA_REGISTERS))
def test_the_hopper_forward_tables_fit_the_pool(mma_warp_groups):
    budgets = sm90_forward_budgets(mma_warp_groups)
    launch = registers.launch_registers(registers.THREADS_PER_WARP_GROUP * len(budgets))
    assert registers.pool_violation(budgets, launch) is None


def test_the_hopper_backward_table_fits_the_pool():
    roles = sm90_bwd.ROLES
    budgets = (roles.producer_registers,) + (roles.mma_registers,) * len(roles.mma_warp_groups)
    launch = registers.launch_registers(registers.THREADS_PER_WARP_GROUP * len(budgets))
    assert registers.pool_violation(budgets, launch) is None


# One compiled forward per MMA warp-group count (3: d64; 2: d128; 1: the decode tuning).
SAMPLE = ("fwd_sm90a_bf16_d64_dv64", "fwd_sm90a_bf16_d128_dv128", "fwd_sm90a_bf16_d128_dv128_tdecode")


@pytest.mark.parametrize("name", SAMPLE)
def test_compiled_hopper_forwards_fit_the_pool_ptxas_gave_them(name):
    variant = next(v for v in menu.MENU if v.name == name)
    cubins = build.cubins([variant])[name]
    if len(cubins) != 1:
        pytest.skip(f"no cached cubin for {name}: run python -m fa4_jax.aot.build")
    facts = sass_facts.facts(str(cubins[0]))
    kernel = compile_worker.construct_kernel(variant, menu.kernel_class(variant), menu.tuning_kwargs(variant))
    budgets = sm90_forward_budgets(len(kernel.mma_warp_groups))
    assert facts.launch["threads"] == [registers.THREADS_PER_WARP_GROUP * len(budgets), 1, 1]
    assert {count for _, count in facts.setmaxnreg} == set(budgets)
    assert registers.pool_violation(budgets, facts.launch["registers"]) is None
    # The check itself: a budget 8 registers over the pool's last slot is refused.
    over = budgets[:-1] + (budgets[-1] + facts.launch["registers"] * len(budgets) - sum(budgets) + 8,)
    assert registers.pool_violation(over, facts.launch["registers"]) is not None
