"""The shipping menu: the union of the registered arch folders' menus.

Each arch folder's menu.py (fa4_jax/kernels/<arch>/menu.py) owns its kernels, tunings, routes
and variants; this module only registers the folders. Adding an architecture is one folder and
one line in ARCH_MENUS (docs/build.md).
"""
from __future__ import annotations

from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.kernels.sm100 import menu as sm100
from fa4_jax.abi.routing import Variant

ARCH_MENUS = (sm90, sm100)
ARCHES = tuple(arch_menu.ARCH for arch_menu in ARCH_MENUS)
MENU: tuple[Variant, ...] = tuple(v for arch_menu in ARCH_MENUS for v in arch_menu.MENU)


def arch_menu(arch: str):
    for candidate in ARCH_MENUS:
        if candidate.ARCH == arch:
            return candidate
    raise ValueError(f"no registered arch {arch!r}; known: {ARCHES}")


def kernel_class(variant: Variant) -> str:
    """"module:Class" of the kernel that compiles `variant`."""
    kernels = arch_menu(variant.arch).KERNELS
    if variant.kind not in kernels:
        raise ValueError(f"variant {variant.name}: {variant.arch} has no {variant.kind} kernel")
    return kernels[variant.kind]


def tuning_kwargs(variant: Variant) -> dict:
    """The shipped tuning's kernel settings (the arch menu's TUNINGS)."""
    tunings = arch_menu(variant.arch).TUNINGS
    if variant.tuning not in tunings:
        raise ValueError(f"variant {variant.name}: {variant.arch} ships no tuning {variant.tuning!r}")
    return dict(tunings[variant.tuning])


def routes():
    """Every registered arch's routes, in order: (arch, Route) pairs."""
    return tuple((arch_menu.ARCH, route) for arch_menu in ARCH_MENUS for route in arch_menu.ROUTES)


def unverified_arches() -> tuple[str, ...]:
    """The archs whose kernels no GPU of the arch has run (their menu's VERIFIED is False)."""
    return tuple(arch_menu.ARCH for arch_menu in ARCH_MENUS if not arch_menu.VERIFIED)


def dq_copies_max_keys() -> dict[str, dict[int, int]]:
    return {arch_menu.ARCH: dict(arch_menu.DQ_COPIES_MAX_KEYS) for arch_menu in ARCH_MENUS}
