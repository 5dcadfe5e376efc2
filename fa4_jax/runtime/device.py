"""Facts about the default device that decide what the kernels serve: its compute capability,
the arch name the variants use for it, and its multiprocessors."""
from __future__ import annotations

from fa4_jax.abi import routing


def compute_capability() -> str | None:
    """The default device's compute capability ("9.0"), or None when it is not a CUDA GPU."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    cc = getattr(device, "compute_capability", None)
    return None if device.platform != "gpu" or cc is None else str(cc)


def device_arch() -> tuple[str | None, str | None]:
    """(arch of the default device as the variants name it, None), or (None, why there is none)."""
    import jax

    cc = compute_capability()
    if cc is None:
        try:
            platform = jax.devices()[0].platform
        except RuntimeError as e:
            return None, f"no JAX device: {e}"
        return None, f"the default device is {platform}, not a CUDA GPU"
    major, minor = (int(x) for x in cc.split("."))
    return routing.arch_name(major, minor), None


def sm_count() -> int | None:
    """Multiprocessors of the default device, if JAX says."""
    import jax

    return getattr(jax.devices()[0], "core_count", None) or None
