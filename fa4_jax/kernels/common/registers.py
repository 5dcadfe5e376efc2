"""setmaxnreg budgets against the register pool of the CTA that runs them.

A warp-specialised kernel launches with one register count for every thread and then moves
registers between its warp groups with `setmaxnreg` (USETMAXREG.TRY_ALLOC / DEALLOC.CTAPOOL):
a decrease gives registers back to the CTA's pool, an increase takes them from it and waits
until the pool can serve it. The pool is what the launch allocated, launch registers × threads,
not the SM's register file: budgets that sum to more leave the last increase waiting forever,
and every role behind it at its next barrier (shown on an H100: a 384-thread sm_90a kernel
launched at 168 registers with budgets 256 / 208 / 48 never finished; with 256 / 200 / 48 it
finished at once, tests/gpu/test_register_pool_gpu.py). FA3 and CUTLASS's three-warp-group
kernels sum to 3 × 168 = 504 per thread slot.

Pure Python: the kernels check their tables against it when built, the tests against the
compiled kernels' own launch registers.
"""
from __future__ import annotations

# An SM's 32-bit registers, which one CTA per SM may take whole at launch.
REGISTERS_PER_SM = 64 * 1024
THREADS_PER_WARP_GROUP = 128
# setmaxnreg's range, in steps of 8.
MIN_BUDGET, MAX_BUDGET = 24, 256


def launch_registers(threads: int) -> int:
    """Registers per thread a one-CTA-per-SM launch of `threads` gets (ptxas's count, in its
    steps of 8, at most 255 per thread)."""
    return min(REGISTERS_PER_SM // threads, 255) // 8 * 8


def pool_violation(budgets: tuple[int, ...], launch: int) -> str | None:
    """Why per-warp-group setmaxnreg `budgets` cannot all be granted in a CTA of those warp
    groups launched at `launch` registers per thread, or None when they can."""
    bad = [b for b in budgets if b % 8 or not MIN_BUDGET <= b <= MAX_BUDGET]
    if bad:
        return f"setmaxnreg budgets {bad} are not multiples of 8 in [{MIN_BUDGET}, {MAX_BUDGET}]"
    threads = THREADS_PER_WARP_GROUP * len(budgets)
    asked, pool = sum(budgets) * THREADS_PER_WARP_GROUP, launch * threads
    if asked > pool:
        return (f"setmaxnreg budgets {'/'.join(map(str, budgets))} per warp group ask {asked} registers of the "
                f"CTA's pool of {pool} ({launch} at launch x {threads} threads): the last increase would "
                "wait forever")
    return None
