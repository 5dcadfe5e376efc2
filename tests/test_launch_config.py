"""CPU tier: what each compiled variant's exported host launcher asks CUDA for (grid, block,
dynamic shared memory, cluster), read without a GPU by scripts/launch_config.py: every Blackwell
forward of the shipping menu, and a sample of Hopper's, as the build cache holds them.

A cubin does not record how it is launched. A CTA pair's kernel (plan.TileConfig.cta_pair)
issues 2-CTA MMAs, loads and commits that need its two CTAs launched as one cluster; only the
launcher says whether they are, and no GPU has run these kernels (the sm100 menu's VERIFIED).
tests/test_sm100_sass.py checks the pair's instructions; this checks its launch.
"""
import functools

import pytest

# The expected grids come from the kernels' own schedulers, which import the DSL.
pytest.importorskip("cutlass")

from fa4_jax.aot import build  # noqa: E402
from fa4_jax.aot import compile as compile_worker  # noqa: E402
from fa4_jax.aot import menu, toolchain  # noqa: E402
from fa4_jax.kernels.sm90 import hardware as sm90_hardware  # noqa: E402
from fa4_jax.kernels.sm100 import fwd, hardware, plan  # noqa: E402
from fa4_jax.kernels.sm100 import menu as sm100  # noqa: E402
from tests.scripts import load_script  # noqa: E402

launch_config = load_script("launch_config")

# Hopper's launchers come from the same export path: a forward of each tile order ("linear",
# "lpt_grid", persistent "lpt") and a backward (three launches) show they launch no cluster.
SM90_SAMPLE = tuple({v.name: v for v in menu.MENU}[name] for name in (
    "fwd_sm90a_bf16_d128_dv128", "fwd_sm90a_fp16_d64_dv64_causal", "fwd_sm90a_bf16_d128_dv128_causal_tshort",
    "bwd_sm90a_bf16_d128_dv128"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> launch_config.Record of every checked variant the build cache holds: one harness
    for all of them (one compile and one link, not one per variant)."""
    try:
        toolchain.cxx()
    except toolchain.ToolchainError as e:
        pytest.skip(f"cannot link the exported launchers: {e}")
    variants = (*sm100.MENU, *SM90_SAMPLE)
    found = build.entries(build.Menu(variants))
    cached = {v: found[v.name] for v in variants if (found[v.name] / f"{v.name}.o").is_file()}
    if not cached:
        pytest.skip("the build cache holds none of these variants: run python -m fa4_jax.aot.build")
    return launch_config.Harness(tmp_path_factory.mktemp("launch")).run(cached)


def record_of(records, variant):
    if variant.name not in records:
        pytest.skip(f"the build cache has no entry for {variant.name}: run python -m fa4_jax.aot.build")
    record = records[variant.name]
    assert record.loaded == 0
    assert [call.returned for call in record.calls] == [0] * len(launch_config.SHAPES)
    # Every launch is of a kernel the launcher took from its own library.
    assert all(launch.kernel != "?" for launch in record.launches)
    return record


def config_of(variant):
    return plan.tile_config(variant.head_dim, variant.head_dim_v, sm100.TUNINGS[variant.tuning])


@functools.cache
def kernel_of(variant):
    """The variant's kernel object, constructed (not compiled) as the build constructs it."""
    return compile_worker.construct_kernel(variant, menu.kernel_class(variant), menu.tuning_kwargs(variant))


def expected_grid(variant, shape):
    """The grid the kernel's scheduler computes for a call of shape (b, sq, sk, h, hk), on
    Python ints."""
    b, sq, sk, h, hk = shape
    return tuple(kernel_of(variant).scheduler.grid(sq, sk, h, hk, b))


def storage_bytes(variant) -> int:
    """fwd.py's SharedStorage laid out as cute.struct lays out a struct: each field at its
    alignment, the whole a multiple of the strictest. Its fields: a full and an empty mbarrier
    per stage of every plan pipeline, the TMEM handshake (8 + 4 bytes), the row statistics, then
    at 1024 bytes Q's stages and the K/V ring (the two parts of plan.TileConfig.smem_bytes)."""
    config = config_of(variant)
    q = 2 * config.q_stages * plan.ROWS_PER_STAGE * variant.head_dim
    fields = [  # (bytes, alignment)
        (8 * 2 * sum(pipe.stages for pipe in plan.pipelines(config)), 8), (8, 8), (4, 4),
        (4 * config.q_stages * fwd.NUM_STATS * plan.ROWS_PER_STAGE, 4),
        (q, 1024), (config.smem_bytes(variant.head_dim, variant.head_dim_v) - q, 1024)]
    offset = 0
    for size, align in fields:
        offset = -(-offset // align) * align + size
    return -(-offset // 1024) * 1024


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_a_pair_launches_as_a_cluster_of_two(records, variant):
    record = record_of(records, variant)
    config = config_of(variant)
    for call in record.calls:
        [launch] = call.launches
        if config.cta_pair:
            assert launch.cluster == (2, 1, 1)
            assert launch.grid[0] % 2 == 0 and launch.grid[1:] == (1, 1)
        else:
            assert launch.cluster in (None, (1, 1, 1))
        assert launch.block == (plan.warp_roles(config).num_threads, 1, 1)
        assert launch.grid == expected_grid(variant, call.shape)


@pytest.mark.parametrize("variant", sm100.MENU, ids=lambda v: v.name)
def test_dynamic_shared_memory_is_the_storage_the_plan_lays_out(records, variant):
    record = record_of(records, variant)
    config = config_of(variant)
    [smem] = {launch.smem for launch in record.launches}
    assert smem == storage_bytes(variant)
    # The plan's own claim (fwd.py refuses a config that breaks it): barriers, statistics and
    # padding fit in SMEM_MARGIN on top of Q and the K/V ring, and the whole in the hardware's.
    bulk = config.smem_bytes(variant.head_dim, variant.head_dim_v)
    assert bulk < smem <= bulk + plan.SMEM_MARGIN <= hardware.SMEM_BYTES
    # The launch fits under the limit load() set on the kernel
    # (cudaFuncAttributeMaxDynamicSharedMemorySize, 8), or the GPU would refuse it.
    limits = [c["value"] for c in record.runtime
              if c["call"] == "cudaKernelSetAttributeForDevice" and c["attr"] == 8]
    assert limits and smem <= min(limits)


@pytest.mark.parametrize("variant", SM90_SAMPLE, ids=lambda v: v.name)
def test_hopper_launches_no_cluster(records, variant):
    record = record_of(records, variant)
    launches = {}  # kernel -> its launches
    for launch in record.launches:
        launches.setdefault(launch.kernel, []).append(launch)
        assert launch.cluster in (None, (1, 1, 1))
        assert launch.smem <= sm90_hardware.SMEM_BYTES
    assert len(launches) == (3 if variant.kind == "bwd" else 1)  # bwd: preprocess, main, postprocess
    for same_kernel in launches.values():
        assert len({(launch.block, launch.smem) for launch in same_kernel}) == 1
    if variant.kind == "fwd":
        for call in record.calls:
            assert call.launches[0].block == (kernel_of(variant).num_threads, 1, 1)
            assert call.launches[0].grid == expected_grid(variant, call.shape)
