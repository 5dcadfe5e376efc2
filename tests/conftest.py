"""Shared pytest setup: the `gpu` marker, and fresh PRNG keys for every test.

Each test gets a seed drawn at random (so repeated runs explore new inputs) unless
FA4_JAX_TEST_SEED is set; a failing test's report shows the seed to replay it.
"""
import os
import re
import secrets


def _add_xla_flag(flag):
    """Appends flag to XLA_FLAGS unless the user already set that option."""
    name = flag.split("=")[0]
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


# Sharding and ring-attention tests run on 8 fake CPU devices. XLA reads the flag when jax
# starts its CPU backend, which happens after pytest imports this file (no test module touches
# a device at import time), so the whole suite runs in one process with 8 devices; tests that
# do not shard simply run on the first.
_add_xla_flag("--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with -m gpu")
    if _selects_gpu_tier(config.option.markexpr):
        # Every GPU test jits new shapes; XLA's autotuning of the oracles' dot fusions (timing
        # Triton and cuBLAS candidates on the GPU) made a test cost ~30 s with 8 processes
        # sharing the device, against ~2.6 s without it. The oracles' speed does not matter.
        _add_xla_flag("--xla_gpu_autotune_level=0")
    else:
        # The CPU tier is dominated by XLA compiling many small programs; LLVM's optimisation
        # of the generated code costs more than it saves there (~2x faster suite). Still in
        # time: backends start at the first device query, after configuration.
        _add_xla_flag("--xla_backend_optimization_level=0")
        _add_xla_flag("--xla_llvm_disable_expensive_passes=true")


def _selects_gpu_tier(markexpr):
    """Whether a -m expression selects tests marked gpu: `gpu` is one of its terms, not negated.
    By words, not substrings: "gpu and not gpu_processes" (the GPU tier's shards) contains
    "not gpu", which once sent the shards to the CPU tier's flags with autotuning on (~40 s a
    test instead of ~4)."""
    tokens = re.findall(r"\w+|[()]", markexpr)
    return any(token == "gpu" and (i == 0 or tokens[i - 1] != "not") for i, token in enumerate(tokens))


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_addoption(parser):
    parser.addoption(
        "--shard", default=None, metavar="K/N",
        help="run only every N-th collected test, starting at the K-th (0-based): splits the GPU "
             "tier over N processes that compile in parallel (scripts/device_check.sh)")


def _keep_shard(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        index, count = (int(x) for x in spec.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard must be K/N with 0 <= K < N, got {spec!r}") from None
    kept = [item for i, item in enumerate(items) if i % count == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (jax sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(record_property):
    value = int(os.environ.get("FA4_JAX_TEST_SEED", secrets.randbits(31)))
    record_property("seed", value)
    print(f"FA4_JAX_TEST_SEED={value}")
    return value


@pytest.fixture
def next_key(seed):
    """A function returning a new PRNG key on each call, derived from this test's seed."""
    key = jax.random.key(seed)

    def draw():
        nonlocal key
        key, fresh = jax.random.split(key)
        return fresh

    return draw
