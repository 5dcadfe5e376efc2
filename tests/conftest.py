"""Shared pytest setup: the `gpu` marker, and fresh PRNG keys for every test.

Each test gets a seed drawn at random (so repeated runs explore new inputs) unless
FA4_JAX_TEST_SEED is set; a failing test's report shows the seed to replay it.
"""
import os
import secrets

# The CPU tier is dominated by XLA compiling many small programs; LLVM's optimisation of the
# generated code costs more than it saves there. Must be set before jax starts a backend.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with -m gpu")


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
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
