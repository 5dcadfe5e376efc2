"""Meshes of the 8 fake CPU devices that tests/conftest.py asks XLA for."""
from __future__ import annotations

import math

import jax
import pytest
from jax.sharding import AxisType

DEVICE_COUNT = 8


def cpu_mesh(axis_sizes, axis_names, axis_type=AxisType.Auto):
    """A mesh over the first prod(axis_sizes) devices; fails (never skips) when they are missing."""
    needed = math.prod(axis_sizes)
    if jax.device_count() < needed:
        pytest.fail(
            f"this test needs {needed} devices, jax has {jax.device_count()}: the CPU backend "
            f"started before tests/conftest.py set --xla_force_host_platform_device_count; "
            f"run the tests through pytest from the repository root"
        )
    return jax.make_mesh(
        axis_sizes,
        axis_names,
        axis_types=(axis_type,) * len(axis_names),
        devices=jax.devices()[:needed],
    )


def collectives_in(hlo_text):
    """The cross-device collectives a compiled HLO module contains, by op name."""
    ops = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
    return sorted(op for op in ops if op in hlo_text)
