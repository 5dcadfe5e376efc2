"""The first-use gate: kernels that no GPU of their arch has run before users do are checked on
this GPU before a call uses them, in a child process, and never used if they fail.

An arch menu whose VERIFIED is False (kernels/sm100/menu.py: Blackwell's, compiled and statically
checked, never executed) puts its arch into the library's manifest. When the dispatch would run
one of its variants (`failure_reason`), that variant and every other not yet judged variant of
its problem class (its tunings, which one call site reaches through the routes) are probed in a
child process pinned to this process's default GPU (fa4_jax.runtime.probe: small calls at kernel level
against a numpy reference, a timeout per variant). A hang, a fault or a wrong answer costs the
child, never this process: the variant gets a verdict, and a call it would have served falls
back to cuDNN or the reference with a `FallbackWarning` saying why. A variant that passes is
marked verified in the library (`ffi.mark_verified`): the C++ handler refuses unverified variants
of those archs (ffi/gate.h), so a `jax.export`ed program runs only checked kernels.

Verdicts are kept per library (its bytes), GPU name and driver version (fa4_jax.runtime.verdict_store,
in FA4_JAX_CACHE_DIR): pass, wrong, hang, fault and load-error; an inconclusive probe (no device,
out of memory, exclusive compute mode) is not kept: that process falls back, the next one tries
again. One process per node probes at a time; others wait for it and read its verdicts. As soon as
JAX has started its GPU backend in a process that imported fa4_jax, the kept passes are marked
verified (`push_when_ready`), before any program runs.

    FA4_JAX_TRUST_UNVERIFIED=1        no check: the dispatch and the handler run the kernels
    FA4_JAX_DISABLE_ARCHES=sm_100f    never run these archs' kernels (comma-separated): the
                                      dispatch falls back, the handler refuses
    FA4_JAX_UNVERIFIED_ARCHES=sm_90a  also gate these archs (how the GPU tier tests the gate on
                                      a Hopper GPU)
    FA4_JAX_PROBE_TIMEOUT=20          seconds each variant's probe may take
    FA4_JAX_CACHE_DIR=DIR             where verdicts are kept (default ~/.cache/fa4_jax)

`python -m fa4_jax verdicts` shows, forgets and checks them (show | forget | check [REGEX]).

`python -m fa4_jax selftest` runs the same probes over every variant and reports on the kernels.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import threading

from fa4_jax.runtime import ffi, verdict_store
from fa4_jax.core import notices
from fa4_jax.abi import routing
from fa4_jax.runtime.probe import cases, runner
from fa4_jax.runtime.probe.protocol import Verdict

# (library path, variant name) -> this process's verdict (inconclusive ones included).
_verdicts: dict[tuple[str, str], Verdict] = {}
_lock = threading.Lock()


def _listed(variable: str) -> frozenset[str]:
    return frozenset(a.strip() for a in os.environ.get(variable, "").split(",") if a.strip())


def unverified_arches(library) -> frozenset[str]:
    """The archs whose kernels are gated: those the library's manifest marks unverified (an arch
    menu's VERIFIED = False), and FA4_JAX_UNVERIFIED_ARCHES."""
    return frozenset(library.unverified_arches) | _listed("FA4_JAX_UNVERIFIED_ARCHES")


def trusted() -> bool:
    return os.environ.get("FA4_JAX_TRUST_UNVERIFIED", "") not in ("", "0")


def failure_reason(variant: routing.Variant, library) -> str | None:
    """None when `variant` (of `library`, an `fa4_jax.runtime.ffi.Library`) may serve calls on this
    process's default GPU; else why not. A gated variant serves calls only when every variant of
    its problem class passed its first-use check: which tuning a call runs is picked by its
    final shapes (after GQA packing and split-KV, ragged or not), which the call's first
    decision does not see. Probes the class first if it has no verdicts for this library, GPU
    and driver yet; other threads and processes wait for that."""
    if variant.arch in _listed("FA4_JAX_DISABLE_ARCHES"):
        return (f"{variant.name} is switched off: its arch {variant.arch} is listed in "
                f"FA4_JAX_DISABLE_ARCHES (remove it from that variable to run it)")
    if variant.arch not in unverified_arches(library) or trusted():
        return None
    failed = [verdict for verdict in _class_verdicts(variant, library) if not verdict.passed]
    if not failed:
        return None
    return (f"{variant.name} has not run on {variant.arch} hardware before, and its problem class "
            f"failed its first-use check: " + "; ".join(
                f"{v.variant} {v.verdict}"
                + (" (not kept: the next process checks it again)" if v.verdict == "inconclusive" else "")
                + f": {v.reason}" for v in failed))


def _class_verdicts(variant: routing.Variant, library) -> list[Verdict]:
    """This process's verdicts of every variant of `variant`'s problem class: kept ones, or new
    ones from a probe of those without."""
    names = [v.name for v in routing.class_variants(variant, library.routes_for(variant.arch), library.compiled)]
    names = names or [variant.name]
    with _lock:
        if any((library.path, name) not in _verdicts for name in names):
            try:
                identity = library_identity(library)
                with verdict_store.probing_lock():
                    kept = verdict_store.load(identity)
                    _adopt(library, kept.values())
                    todo = [name for name in names if name not in kept]
                    if todo:
                        probe(library, identity, todo)
            except Exception as error:  # noqa: BLE001 - the call falls back; it must not fail
                _adopt(library, [Verdict(name, "inconclusive", f"the probe could not run: {type(error).__name__}: "
                                                               f"{error}")
                                 for name in names if (library.path, name) not in _verdicts])
        return [_verdicts[(library.path, name)] for name in names]


def _adopt(library, verdicts) -> None:
    """Takes `verdicts` as this process's, marking new passes verified in the library."""
    for verdict in verdicts:
        known = _verdicts.get((library.path, verdict.variant))
        _verdicts[(library.path, verdict.variant)] = verdict
        if verdict.passed and not (known is not None and known.passed):
            ffi.mark_verified(library, verdict.variant)


def probe(library, identity: verdict_store.Identity, names: list[str]) -> dict[str, Verdict]:
    """Probes `names` on the default GPU; keeps each verdict as it comes and takes it as this
    process's (a pass is marked verified at once)."""
    device = runner.default_gpu()
    timeout = runner.timeout_seconds()
    listed = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    notices.progress(
        f"fa4_jax: checking {len(names)} kernel(s) that have not run on {identity.gpu} hardware before "
        f"({listed}) against the reference, in a child process on that GPU: seconds if they pass, at "
        f"most {timeout:g} s each if they hang (FA4_JAX_PROBE_TIMEOUT); once per library, GPU and driver")
    opened = {}

    def on_verdict(verdict: Verdict) -> None:
        if opened.get("name") not in (None, identity.gpu):  # pinned to another GPU: no verdict
            verdict = Verdict(verdict.variant, "inconclusive",
                              f"the probe opened a {opened['name']}, not this process's {identity.gpu}")
        verdict_store.record(identity, verdict)
        _adopt(library, [verdict])

    _, verdicts = runner.run(runner.Target.on(library.path, device), names, timeout, on_verdict=on_verdict,
                             on_device=opened.update)
    return {name: _verdicts[(library.path, name)] for name in verdicts}


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _driver_version(library) -> str:
    """The NVIDIA driver's version (its kernel module's, when /proc says) and the CUDA version it
    supports."""
    cuda = f"cuda {ffi.cuda_driver_version(library)}"
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return cuda
    versions = [w for w in words if re.fullmatch(r"\d+\.\d+(\.\d+)?", w)]
    return f"{versions[0]}, {cuda}" if versions else cuda


def library_identity(library) -> verdict_store.Identity:
    """What this process's verdicts hold for; RuntimeError without a GPU (before reading the
    library's 60 MB)."""
    gpu = runner.default_gpu().device_kind
    stat = os.stat(library.path)
    return verdict_store.Identity(_file_digest(library.path, stat.st_size, stat.st_mtime_ns), gpu,
                                  _driver_version(library))


def push_kept(library) -> None:
    """Marks the kept passes of `library` on this process's default GPU and driver verified."""
    try:
        identity = library_identity(library)
    except (OSError, RuntimeError):
        return  # no library file, or no GPU: nothing the handler could run
    with _lock:
        _adopt(library, [v for v in verdict_store.load(identity).values() if v.passed])


def push_when_ready(library) -> None:
    """`push_kept` now if JAX's backends have started, else at the first JAX event after they
    have (a compile: before any program, an exported one included, runs). Never starts them: an
    import must not (a later jax.config or CUDA_VISIBLE_DEVICES would be ignored)."""
    if _backends_started():
        push_kept(library)
        return
    import jax.monitoring

    pushed = threading.Event()

    def on_event(event: str, duration: float, **kwargs) -> None:
        if not pushed.is_set() and _backends_started():
            pushed.set()
            push_kept(library)

    jax.monitoring.register_event_duration_secs_listener(on_event)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


def forget() -> None:
    """Drops this process's verdicts (tests); kept ones stay on disk."""
    with _lock:
        _verdicts.clear()


def results() -> dict[str, Verdict]:
    """variant name -> this process's verdict, for the variants judged so far."""
    with _lock:
        return {name: verdict for (_, name), verdict in _verdicts.items()}
