"""CPU tier: the test setup's reading of `-m`, which decides the GPU tier's XLA flags."""
import pytest

from tests.conftest import _selects_gpu_tier


@pytest.mark.parametrize("markexpr, gpu_tier", [
    ("gpu", True),
    ("gpu and not gpu_processes", True),  # the GPU tier's shards (scripts/device_check.sh)
    ("gpu and gpu_processes", True),  # the tests that start GPU processes, run apart
    ("(gpu)", True),
    ("", False),
    ("not gpu", False),
    ("not gpu and not slow", False),
    ("gpu_processes_only", False),
])
def test_the_gpu_tier_is_told_by_its_terms(markexpr, gpu_tier):
    assert _selects_gpu_tier(markexpr) is gpu_tier
