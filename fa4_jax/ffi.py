"""Loads the built kernel library and exposes the FFI custom calls (contract; the build fills it in).

Contract used by `vjp.py` and `api.py`:

- `is_available() -> bool`: the library is built, loads, and its targets are registered for CUDA.
- `unsupported_reason(q, k, v, params) -> str | None`: None when a compiled variant serves this
  call on the current default device, else a sentence saying why not (names the missing variant).
- `forward(q, k, v, params) -> (out, lse)`: the `fa4_fwd` custom call.
"""
from __future__ import annotations


def is_available() -> bool:
    return False


def unsupported_reason(q, k, v, params) -> str | None:
    return "the fa4_jax kernel library is not built"


def forward(q, k, v, params):
    raise RuntimeError("the fa4_jax kernel library is not built")
