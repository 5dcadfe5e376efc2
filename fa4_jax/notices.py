"""Saying which backend ran and why, once per process and reason."""
from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("fa4_jax")
_SAID: set[str] = set()


class FallbackWarning(UserWarning):
    """A call runs on cuDNN or the pure-JAX reference instead of fa4_jax's kernels.

    Silence it with `warnings.simplefilter("ignore", fa4_jax.FallbackWarning)`, or ask for a
    backend with `implementation=` (then nothing is said, and "cute" raises instead).
    """


def fallback(backend: str, reason: str) -> None:
    """Warns, once per process for each (backend, reason), that a call runs on `backend`."""
    message = f"fa4_jax: running on {backend}: {reason}"
    if message in _SAID:
        return
    _SAID.add(message)
    logger.info(message)
    warnings.warn(message, FallbackWarning, stacklevel=4)
