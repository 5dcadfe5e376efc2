"""The shipping library as the run time sees it on an H200, for CPU tests of routing and calls."""
from __future__ import annotations

import functools

from fa4_jax.runtime import device, ffi
from fa4_jax.aot import menu
from fa4_jax.kernels.sm90 import menu as sm90


@functools.cache
def _segments_backward_tile_m() -> dict:
    """The manifest's query tile of each segments backward variant (constructs the kernels: the
    DSL is needed)."""
    from fa4_jax.aot import build

    return build.segments_backward_tile_m(build.Menu(menu.MENU))


def use_h200_menu(monkeypatch) -> ffi.Library:
    """`ffi.load` returns the shipping menu's library (every variant, Hopper's routes and dQ
    rule, the segments and mask_array variants) and the default device is an sm_90a with 132 SMs;
    no kernel runs (the custom calls are the caller's to replace). Returns the Library."""
    library = ffi.Library(path="(menu)", compiled=frozenset(v.name for v in menu.MENU),
                          routes=tuple((sm90.ARCH, route) for route in sm90.ROUTES),
                          dq_copies_max_keys={sm90.ARCH: dict(sm90.DQ_COPIES_MAX_KEYS)},
                          tuning_targets=False, head_dims={sm90.ARCH: frozenset(sm90.HEAD_DIMS)},
                          segments_backward_tile_m=_segments_backward_tile_m())
    monkeypatch.setattr(ffi, "load", lambda *args, **kwargs: library)
    monkeypatch.setattr(device, "device_arch", lambda: (sm90.ARCH, None))
    monkeypatch.setattr(device, "sm_count", lambda: 132)
    return library
