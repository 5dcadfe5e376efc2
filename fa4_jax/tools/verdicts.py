"""The first-use verdicts of this library on this GPU and driver (fa4_jax.runtime.gate):

    python -m fa4_jax verdicts show            list them
    python -m fa4_jax verdicts forget          delete them (the next call that needs a variant
                                               checks it again)
    python -m fa4_jax verdicts check [REGEX]   probe now the unjudged variants of this GPU's arch
                                               (whose names match)
"""
from __future__ import annotations

import argparse
import re
import sys

from fa4_jax.runtime import ffi, verdict_store, gate
from fa4_jax.abi import routing
from fa4_jax.runtime.probe import cases, runner


def check(library, identity, pattern: str | None) -> int:
    arch = routing.arch_name(*(int(x) for x in runner.default_gpu().compute_capability.split(".")))
    if arch not in gate.unverified_arches(library):
        print(f"{arch}'s kernels are not gated (FA4_JAX_UNVERIFIED_ARCHES adds an arch): nothing to check")
        return 2
    kept = verdict_store.load(identity)
    names = [v.name for v in cases.in_probe_order(ffi.manifest_variants(library.path).values())
             if v.arch == arch and (pattern is None or re.search(pattern, v.name)) and v.name not in kept]
    if not names:
        print("nothing to check: every matching variant has a verdict (`forget` deletes them)")
        return 2
    with verdict_store.probing_lock():
        verdicts = gate.probe(library, identity, names)
    for name in names:
        print(verdicts[name].line())
    return 0 if all(v.passed for v in verdicts.values()) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax verdicts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("show", "forget", "check"))
    parser.add_argument("pattern", nargs="?", metavar="REGEX", help="check: only the variants whose names match")
    args = parser.parse_args(argv)
    try:
        library = ffi.load()
        identity = gate.library_identity(library)
    except (ffi.LibraryUnavailable, RuntimeError, OSError) as error:
        print(f"fa4_jax verdicts: {error}", file=sys.stderr)
        return 2
    print(f"library {library.path} (sha256 {identity.library[:12]}), {identity.gpu}, driver {identity.driver}")
    if args.command == "show":
        for verdict in sorted(verdict_store.load(identity).values(), key=lambda v: v.variant):
            print(verdict.line())
        return 0
    if args.command == "forget":
        print(f"forgot {verdict_store.forget(identity)} verdict(s)")
        return 0
    return check(library, identity, args.pattern)
