"""Saying which backend ran and why, once per process and reason."""
from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger("fa4_jax")
_SAID: set[str] = set()
# A warning names the first frame outside the package: the caller's line.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class FallbackWarning(UserWarning):
    """A call runs on cuDNN or the pure-JAX reference instead of fa4_jax's kernels.

    Silence it with `warnings.simplefilter("ignore", fa4_jax.FallbackWarning)`, or ask for a
    backend with `implementation=` (then nothing is said, and "cute" raises instead).
    """


def shape_class(query, value, params) -> str:
    """What a warning is said once for: dtype, head dims, mask and softcap ("bfloat16 d128 causal")."""
    head_dims = f"d{query.shape[-1]}" + ("" if value.shape[-1] == query.shape[-1] else f"/dv{value.shape[-1]}")
    mask = "causal" if params.causal and params.window_left is None else (
        "window" if params.window_left is not None or params.window_right is not None else "no mask")
    return " ".join([str(query.dtype), head_dims, mask] + (["softcap"] if params.softcap else []))


def fallback(backend: str, reason: str, shape: str) -> None:
    """Warns, once per process for each (shape class, backend, reason), that calls of that
    shape class run on `backend`."""
    message = f"fa4_jax: {shape} calls run on {backend}: {reason}"
    if message in _SAID:
        return
    _SAID.add(message)
    logger.info(message)
    warnings.warn(message, FallbackWarning, skip_file_prefixes=(_PACKAGE,))


def progress(message: str) -> None:
    """Says, once, what fa4_jax is doing that takes time (a first-use check): through the
    "fa4_jax" logger where logging shows warnings, else on stderr."""
    if logger.isEnabledFor(logging.WARNING) and logger.hasHandlers():
        logger.warning(message)
    else:
        print(message, file=sys.stderr, flush=True)
