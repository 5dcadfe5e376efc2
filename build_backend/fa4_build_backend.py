"""PEP 517 backend: setuptools, with the AOT kernel build (fa4_jax.aot.build) run first.

Both `pip install .` (build_wheel) and `pip install -e .` (build_editable) build the library into
fa4_jax/_lib/ before setuptools packages it; the per-variant cache outside the tree
(FA4_JAX_CACHE_DIR, default ~/.cache/fa4_jax) makes a rebuild quick.
"""
from __future__ import annotations

import os
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every hook we do not override

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aot_build() -> None:
    sys.path.insert(0, _ROOT)  # the source tree's fa4_jax, not an installed one
    try:
        from fa4_jax.aot import build
    finally:
        sys.path.remove(_ROOT)
    if build.main([]) != 0:
        raise SystemExit("fa4_jax: the AOT kernel build failed (see above)")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _aot_build()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _aot_build()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
