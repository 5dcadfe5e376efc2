"""Blackwell's (sm_100a) part of the shipping menu: registered, with no kernel yet.

The folder takes the same contract as kernels/sm90/ (docs/build.md, "Adding an architecture"):
KERNELS, HEAD_DIMS, TUNINGS, ROUTES, DQ_COPIES_MAX_KEYS and MENU. Until its kernels land, a
Blackwell GPU runs calls on cuDNN or the reference (fa4_jax.dispatch).
"""
from __future__ import annotations

from fa4_jax.routing import Route, Variant

ARCH = "sm_100a"
KERNELS: dict[str, str] = {}
HEAD_DIMS: tuple[tuple[int, int], ...] = ()
TUNINGS: dict[str, dict] = {"default": {}}
ROUTES: tuple[Route, ...] = ()
DQ_COPIES_MAX_KEYS: dict[int, int] = {}
MENU: tuple[Variant, ...] = ()
