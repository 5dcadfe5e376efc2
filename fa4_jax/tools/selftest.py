"""Check every kernel of the installed library on this GPU against the reference, and print a
report to paste into an issue.

    python -m fa4_jax selftest                 # every compiled variant for this GPU's arch
    python -m fa4_jax selftest --only d128     # the variants whose names match a regex
    python -m fa4_jax selftest --json out.json # the report as JSON too, written as it goes

Each variant runs in a child process (fa4_jax.runtime.probe, the first-use gate's probes) on its probe
problems: small calls at kernel level that the handler routes to it (odd lengths over several
tiles, a decode row, a batch of many tiles with keyless ones under a mask, a ragged batch with
NaN padding; the segment and mask probes for those variants), forward out and lse or backward
dq, dk and dv compared with a numpy reference under docs/design.md's numerics rule. A variant
that hangs (FA4_JAX_PROBE_TIMEOUT seconds, default 20) or faults costs its child process, which
is replaced for the rest. This reports on the kernels themselves: the first-use gate plays no
part, and no verdict is kept. Exit status 0 when every variant passes, 1 when one fails, 2 when
there is nothing to check (no CUDA GPU, no library, no kernels for this arch) or the probes were
inconclusive (not the kernels' doing: out of memory, exclusive compute mode).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys

from fa4_jax.runtime.probe import cases, runner


def _write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _status(verdicts) -> str:
    if any(v.kept and not v.passed for v in verdicts):
        return "fail"
    return "pass" if all(v.passed for v in verdicts) else "inconclusive"


def run(only: str | None = None, out=None, json_path: str | None = None) -> dict:
    """Probes the variants, printing a line as each starts and one with its verdict to `out`
    (default stdout; and the report to `json_path` after each); returns the report."""
    import jax

    import fa4_jax
    from fa4_jax.runtime import device, ffi

    out = out or sys.stdout
    report = dict(fa4_jax=fa4_jax.__version__, jax=jax.__version__, python=platform.python_version(),
                  variants=[], status="nothing to check")
    arch, reason = device.device_arch()
    try:
        library = ffi.load()
    except ffi.LibraryUnavailable as error:
        reason = reason or str(error)
    names = [] if reason else [v.name for v in cases.in_probe_order(ffi.manifest_variants(library.path).values())
                               if v.arch == arch and (only is None or re.search(only, v.name))]
    if not names:
        report["reason"] = reason or f"no compiled variant for {arch}" + (f" matches {only!r}" if only else "")
        print(f"fa4_jax selftest: nothing to check: {report['reason']}", file=out)
        _write(report, json_path)
        return report
    gpu = runner.default_gpu()
    timeout = runner.timeout_seconds()
    report.update(gpu=gpu.device_kind, arch=arch, library=library.path, timeout=timeout)
    print(f"fa4_jax {fa4_jax.__version__} selftest on {gpu.device_kind} ({arch}), jax {jax.__version__}, "
          f"library {library.path}: {len(names)} variants, up to {timeout:g} s each", file=out, flush=True)
    started = []

    def on_start(name: str) -> None:
        started.append(name)
        print(f"[{len(started)}/{len(names)}] {name} ...", file=out, flush=True)

    def on_verdict(verdict) -> None:
        report["variants"].append(dataclasses.asdict(verdict))
        print(verdict.line(), file=out, flush=True)
        _write(report, json_path)

    opened, verdicts = runner.run(runner.Target.on(library.path, gpu), names, timeout, on_start=on_start,
                                  on_verdict=on_verdict)
    report.update(device=opened, status=_status(verdicts.values()))
    counts = {kind: sum(v.verdict == kind for v in verdicts.values()) for kind in ("pass", "wrong", "hang", "fault",
                                                                                   "load-error", "inconclusive")}
    print("fa4_jax selftest: " + ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
          + f" of {len(names)} variants", file=out)
    _write(report, json_path)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="REGEX", help="check the variants whose names match")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON, as it goes")
    args = parser.parse_args(argv)
    # This process only finds the GPU; the probes run in a child, which needs the memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    report = run(args.only, json_path=args.json)
    return {"pass": 0, "fail": 1}.get(report["status"], 2)
