"""The first-use verdicts kept on disk: verdicts.json in FA4_JAX_CACHE_DIR (default
~/.cache/fa4_jax), per identity (the library's bytes, the GPU's name, the driver's version),
per variant, and verdicts.lock beside it, which one process per node holds while it probes.

    {"<library sha256>|<GPU name>|<driver>": {"<variant>": {"verdict": "pass", ...}, ...}, ...}

Only kept verdicts are written (fa4_jax.runtime.probe.protocol.KEPT: not inconclusive). Every write
replaces the whole file (a reader never sees half of one); a cache that cannot be written only
costs the next process its probes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
from pathlib import Path

from fa4_jax.runtime.probe.protocol import Verdict


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a verdict holds for."""

    library: str  # sha256 of the library file
    gpu: str  # the GPU's name, as CUDA reports it ("NVIDIA B200")
    driver: str

    @property
    def key(self) -> str:
        return f"{self.library}|{self.gpu}|{self.driver}"


def cache_dir() -> Path:
    return Path(os.environ.get("FA4_JAX_CACHE_DIR") or Path.home() / ".cache" / "fa4_jax")


def _path() -> Path:
    return cache_dir() / "verdicts.json"


def _read_all() -> dict:
    try:
        verdicts = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def load(identity: Identity) -> dict[str, Verdict]:
    """variant name -> its kept verdict for `identity`."""
    entries = _read_all().get(identity.key, {})
    verdicts = {}
    for name, entry in entries.items() if isinstance(entries, dict) else ():
        try:
            verdicts[name] = Verdict(variant=name, **entry)
        except (TypeError, ValueError):
            continue  # written by another version: probed again
    return verdicts


def _write_all(verdicts: dict) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(verdicts, f, indent=1)
        os.replace(f.name, path)
    except OSError:
        pass


def record(identity: Identity, verdict: Verdict) -> None:
    """Keeps `verdict` (a kept kind only; others are ignored)."""
    if not verdict.kept:
        return
    entry = dataclasses.asdict(verdict)
    del entry["variant"]
    verdicts = _read_all()
    verdicts.setdefault(identity.key, {})[verdict.variant] = entry
    _write_all(verdicts)


def forget(identity: Identity) -> int:
    """Deletes the verdicts for `identity`; how many there were."""
    verdicts = _read_all()
    dropped = verdicts.pop(identity.key, {})
    _write_all(verdicts)
    return len(dropped)


@contextlib.contextmanager
def probing_lock():
    """Held while this process probes: another process's probes wait for it (and then read its
    verdicts). Without a writable cache directory, no lock (each process probes alone)."""
    path = cache_dir() / "verdicts.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
