"""Compare the shipping menu's cubins, compiled from this tree, with those of another build.

    python scripts/compare_cubins.py BASELINE_CACHE [--only REGEX] [--jobs N]

Compiles what $FA4_JAX_CACHE_DIR (default ~/.cache/fa4_jax) lacks, then compares each variant's
cubins byte for byte (sha256) with the entry of the same variant name in BASELINE_CACHE, a
cache directory filled by a build of another commit. A refactor that must not change the kernels
shows every variant identical. Exit status 1 if any differs or is missing there.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

from fa4_jax.aot import build


def _digests(entry: Path) -> list[str]:
    return sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in entry.glob("*.cubin"))


def _baseline_entry(baseline: Path, name: str) -> Path | None:
    candidates = sorted((baseline / "variants").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    candidates = [c for c in candidates if re.fullmatch(re.escape(name) + r"-[0-9a-f]{20}", c.name)]
    return candidates[-1] if candidates else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("--only", metavar="REGEX")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    shipped = build.shipping_menu(only=args.only)
    found = build.compile_variants(shipped, args.jobs or 2)
    counts = {"identical": 0, "different": 0, "missing": 0}
    for variant in shipped.variants:
        baseline = _baseline_entry(args.baseline, variant.name)
        if baseline is None:
            verdict = "missing"
        else:
            verdict = "identical" if _digests(baseline) == _digests(found[variant.name]) else "different"
        counts[verdict] += 1
        if verdict != "identical":
            print(f"{verdict}: {variant.name}")
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 0 if counts["different"] == counts["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
