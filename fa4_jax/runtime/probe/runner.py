"""The parent's side of the probes: runs `python -m fa4_jax.runtime.probe` on the caller's GPU and turns
what it prints into verdicts (fa4_jax.runtime.probe.protocol), whatever becomes of it.

The child gets the caller's CUDA_VISIBLE_DEVICES narrowed to the one entry of the caller's GPU
(its local hardware id), so it opens that GPU and no other, as device 0. Each variant has
`timeout` seconds from its START to its RESULT; a variant that overruns is a hang, and a child
that dies while running one (a crash, a fault) leaves a fault: either way the child's process
group is killed and a new child takes the variants left. A child that stops answering between
variants or before its first, or exits early without a fault, leaves the variants it did not
reach inconclusive.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fa4_jax.runtime.probe.protocol import DEVICE, RESULT, START, Verdict

DEFAULT_TIMEOUT = 20.0
# Allowed before the first START (imports, the context) and between variants (the reference).
SETUP_SECONDS = 120.0


def timeout_seconds() -> float:
    """Each variant's timeout: FA4_JAX_PROBE_TIMEOUT seconds, default 20."""
    value = os.environ.get("FA4_JAX_PROBE_TIMEOUT", "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"FA4_JAX_PROBE_TIMEOUT={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"FA4_JAX_PROBE_TIMEOUT={value!r} must be a positive number of seconds")
    return seconds


def child_visible_devices(visible: str | None, hardware_id: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child that must see exactly the caller's GPU, given the
    caller's CUDA_VISIBLE_DEVICES (None: unset) and the GPU's local hardware id (its CUDA
    ordinal in the caller, i.e. its position in that list)."""
    if visible is None or not visible.strip():
        return str(hardware_id)
    entries = [entry.strip() for entry in visible.split(",")]
    if not 0 <= hardware_id < len(entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {hardware_id}")
    return entries[hardware_id]


def probe_command() -> list[str]:
    """The probe process: `python -m fa4_jax.runtime.probe` with this interpreter."""
    return [sys.executable, "-m", "fa4_jax.runtime.probe"]


def default_gpu():
    """This process's default JAX device, the GPU the dispatch serves calls on; RuntimeError when
    it is not a CUDA GPU."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        raise RuntimeError(f"the first-use probes need a CUDA GPU as the default JAX device, not {device.platform}")
    return device


@dataclasses.dataclass(frozen=True)
class Target:
    """Where to probe: the library, and the caller's GPU (its local hardware id and the caller's
    CUDA_VISIBLE_DEVICES)."""

    library: str
    hardware_id: int
    visible_devices: str | None = None

    @classmethod
    def on(cls, library: str, device) -> "Target":
        """The library on `device` (a JAX device of this process)."""
        return cls(library, device.local_hardware_id, os.environ.get("CUDA_VISIBLE_DEVICES"))

    def environment(self) -> dict:
        """The child's: this fa4_jax first on its path, JAX on the CPU, the caller's GPU alone,
        and BLAS on one thread (the child computes its references on a pool of threads, one per
        core; a multi-threaded BLAS under it ran small matmuls up to 100x slower)."""
        package_root = str(Path(__file__).resolve().parents[3])  # the folder holding fa4_jax/
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        one_thread = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=python_path, **one_thread,
                    CUDA_VISIBLE_DEVICES=child_visible_devices(self.visible_devices, self.hardware_id))


class _Child:
    """One probe process: its job written to stdin, its stdout read line by line with deadlines,
    its stderr kept in a file for the reasons."""

    def __init__(self, command: list[str], job: dict, env: dict):
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, env=env, start_new_session=True)
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode())
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # it died before reading its job: its end says why
        self.buffer = b""

    def next_line(self, deadline: float) -> str | None:
        """The next line of stdout; None at its end. Raises TimeoutError at `deadline`."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def ending(self) -> str:
        """How it ended and the tail of its stderr."""
        status = self.process.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip()[-1500:]
        how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        return how + (f"; its stderr ends: {tail}" if tail else "")

    def close(self) -> None:
        """Kills it if it still runs (its parent was interrupted), and closes its pipes."""
        if self.process.poll() is None:
            self.kill()
        self.process.stdout.close()
        self.stderr.close()


def run(target: Target, variants, timeout: float | None = None, on_start=None, on_verdict=None,
        on_device=None, command: list[str] | None = None) -> tuple[dict, dict]:
    """Probes `variants` (names) in order. Returns (the device the child opened, as it reported
    it, or {"error": ...}; name -> Verdict). on_device(device), on_start(name) and
    on_verdict(verdict) are called as they happen. command: the probe process (default
    `python -m fa4_jax.runtime.probe`)."""
    timeout = timeout or timeout_seconds()
    command = command or probe_command()
    verdicts, device = {}, {}
    pending = list(variants)

    def record(verdict: Verdict) -> None:
        verdicts[verdict.variant] = verdict
        if verdict.variant in pending:
            pending.remove(verdict.variant)
        if on_verdict is not None:
            on_verdict(verdict)

    while pending:
        child = _Child(command, {"library": target.library, "device": 0, "variants": pending}, target.environment())
        try:
            stopped = _follow(child, timeout, device, on_device, on_start, record)
        finally:
            child.close()
        for name in list(pending) if stopped else ():
            record(Verdict(name, "inconclusive", stopped))
    return device, verdicts


def _follow(child: _Child, timeout: float, device: dict, on_device, on_start, record) -> str | None:
    """Reads one child to its end. None when a new child should take the variants left (this one
    hung, faulted or died in a variant); else why it stopped, which leaves the variants it did not
    judge (if any) inconclusive."""
    started, last = None, None
    deadline = time.monotonic() + SETUP_SECONDS
    while True:
        try:
            line = child.next_line(deadline)
        except TimeoutError:
            child.kill()
            if started is None:
                return f"the probe process did not answer within {SETUP_SECONDS:g} s and was killed ({child.ending()})"
            record(Verdict(started, "hang", f"it did not finish within {timeout:g} s "
                                            f"(FA4_JAX_PROBE_TIMEOUT); the probe process was killed"))
            return None
        if line is None:
            if started is not None:
                record(Verdict(started, "fault", f"the probe process died while running it ({child.ending()})"))
                return None
            ending = child.ending()
            return None if last is not None and last.verdict == "fault" else (
                f"the probe process stopped before reaching it ({ending})")
        if line.startswith(DEVICE):
            device.update(json.loads(line[len(DEVICE):]))
            if on_device is not None:
                on_device(device)
        elif line.startswith(START):
            started = line[len(START):].strip()
            if on_start is not None:
                on_start(started)
            deadline = time.monotonic() + timeout
            continue
        elif line.startswith(RESULT):
            last = Verdict.from_json(line[len(RESULT):])
            record(last)
            started = None
        deadline = time.monotonic() + SETUP_SECONDS
