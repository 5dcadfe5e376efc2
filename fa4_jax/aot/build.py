"""Incremental AOT build: `python -m fa4_jax.aot.build [--jobs N] [--arch ARCH ...]`.

1. Compile each variant of the menu in a worker process (cute.compile + export_to_c), unless the
   cache already holds it: entries are keyed by a hash of the kernel module and the fa4_jax
   modules it imports, the menu and compile sources, the DSL
   version, the kernel class and the variant, and live outside the tree (FA4_JAX_CACHE_DIR,
   default ~/.cache/fa4_jax) so clean clones and venvs reuse them.
2. Generate the C++ dispatch table from the compiled variants, compile ffi/*.cc with it, and link
   everything with the DSL runtime and the static CUDA runtime into fa4_jax/_lib/libfa4_jax.so
   (needs only the NVIDIA driver at run time), plus fa4_jax/_lib/variants.json (the compiled menu).
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fa4_jax.aot import codegen, compile as aot_compile, toolchain, variants as menu

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parent
LIB_DIR = PACKAGE / "_lib"
LIBRARY = LIB_DIR / "libfa4_jax.so"
# Hashed into every variant's key besides its kernel module's own sources (see _kernel_sources).
# The menu (variants.py) is not: a variant's key holds its own fields and tuning settings, so
# adding an ablation compiles that ablation only, not all ~170 variants again.
_ALWAYS_HASHED = (PACKAGE / "aot" / "compile.py",)


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("FA4_JAX_CACHE_DIR") or Path.home() / ".cache" / "fa4_jax")


def _kernel_sources(kernel: str) -> list[Path]:
    """The kernel's module and every fa4_jax module it imports, transitively.

    So an edit to the backward kernel recompiles the backward variants only, and an edit to a
    shared piece (kernels/common/) recompiles every kernel that uses it.
    """
    todo, seen = [kernel.split(":")[0]], set()
    while todo:
        module = todo.pop()
        path = ROOT / (module.replace(".", "/") + ".py")
        if module in seen or not path.is_file():
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return sorted(ROOT / (m.replace(".", "/") + ".py") for m in seen)


@functools.cache
def _sources_digest(kernel: str) -> str:
    h = hashlib.sha256(toolchain.dsl_version().encode())
    for path in sorted({*_ALWAYS_HASHED, *_kernel_sources(kernel)}):
        h.update(str(path.relative_to(PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def variant_key(variant: menu.Variant, kernel: str) -> str:
    payload = json.dumps([_sources_digest(kernel), kernel, variant.to_json(), variant.tuning_kwargs],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def entry_dir(variant: menu.Variant, key: str, cache: Path | None = None) -> Path:
    """The cache entry of one compiled variant: NAME.h, NAME.o and its *.cubin."""
    return (cache or cache_dir()) / "variants" / f"{variant.name}-{key}"


def _compile_one(variant, kernel: str, entry: Path, shim: str) -> float:
    """Compiles into a scratch dir and renames it into place, so a killed build leaves no entry."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{variant.name}-", dir=entry.parent))
    job = {"variant": dataclasses.asdict(variant), "kernel": kernel, "out_dir": str(scratch)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fa4_jax.aot.compile", json.dumps(job)],
                          env=toolchain.compile_env(shim, str(scratch)), cwd=ROOT,
                          capture_output=True, text=True)
    elapsed = time.monotonic() - start
    produced = {p.suffix for p in scratch.iterdir()}
    if proc.returncode != 0 or not {".h", ".o", ".cubin"} <= produced:
        shutil.rmtree(scratch, ignore_errors=True)
        log = (proc.stdout + proc.stderr)[-6000:]
        raise BuildError(f"variant {variant.name} FAILED to compile (exit {proc.returncode}, "
                         f"outputs {sorted(produced)}):\n{log}")
    try:
        scratch.rename(entry)
    except OSError:  # a concurrent build got there first; its entry is as good as ours
        shutil.rmtree(scratch, ignore_errors=True)
    return elapsed


def compile_variants(variants, jobs: int, kernels: dict[str, str] | None = None,
                     cache: Path | None = None, log=print) -> dict[str, Path]:
    """Compiles what the cache lacks, in `jobs` worker processes. Returns name -> entry dir."""
    kernels = kernels or aot_compile.KERNELS
    todo, entries = [], {}
    for v in variants:
        if (v.kind, v.arch) not in kernels:
            raise BuildError(f"variant {v.name}: no {v.kind} kernel for {v.arch} yet")
        entries[v.name] = entry_dir(v, variant_key(v, kernels[v.kind, v.arch]), cache)
        if not entries[v.name].is_dir():
            todo.append(v)
    width = len(str(len(variants)))
    done = 0
    for v in variants:
        if v not in todo:
            done += 1
            log(f"[{done:>{width}}/{len(variants)}] {v.name}: cached")
    if not todo:
        return entries
    shim = toolchain.build_runtime_shim(str(ROOT / "build" / "aot"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_compile_one, v, kernels[v.kind, v.arch], entries[v.name], shim): v
                   for v in todo}
        try:
            for fut in concurrent.futures.as_completed(futures):
                seconds = fut.result()
                done += 1
                log(f"[{done:>{width}}/{len(variants)}] {futures[fut].name}: compiled in "
                    f"{seconds:.1f} s")
        except BaseException:
            for f in futures:  # stop queued work; running workers finish on their own
                f.cancel()
            raise
    return entries


def _link_inputs(variants, entries: dict[str, Path]) -> tuple[Path, list[str], list[str]]:
    """Generates the dispatch source; returns (work dir, sources, objects)."""
    work = ROOT / "build" / "aot"
    include = work / "include"
    include.mkdir(parents=True, exist_ok=True)
    headers = {}
    for v in variants:
        header = entries[v.name] / f"{v.name}.h"
        headers[v.name] = header.read_text()
        shutil.copyfile(header, include / header.name)
    dispatch = work / "dispatch.cc"
    dispatch.write_text(codegen.dispatch_source(variants, headers))
    sources = sorted(str(p) for p in (ROOT / "ffi").glob("*.cc")) + [str(dispatch)]
    objects = [str(entries[v.name] / f"{v.name}.o") for v in variants]
    return work, sources, objects


def link(variants, entries: dict[str, Path], out: Path = LIBRARY, log=print) -> None:
    work, sources, objects = _link_inputs(variants, entries)
    cmd = toolchain.ffi_library_command(str(out), [*sources, *objects],
                                        [str(ROOT / "ffi"), str(work / "include")])
    # The FFI headers' path is the same for every jax version, their API version is not.
    key = hashlib.sha256(json.dumps([cmd, toolchain.jax_version()]).encode())
    for path in [*sources, *objects]:
        key.update(Path(path).read_bytes())
    stamp = out.with_suffix(".so.key")
    if out.exists() and stamp.exists() and stamp.read_text() == key.hexdigest():
        log(f"{out.relative_to(ROOT)}: up to date")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    toolchain.run(cmd)
    stamp.write_text(key.hexdigest())
    log(f"{out.relative_to(ROOT)}: linked {len(objects)} variants in "
        f"{time.monotonic() - start:.1f} s")


def write_manifest(variants, out: Path = LIB_DIR / "variants.json") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([v.to_json() for v in variants], indent=1) + "\n")


def build(jobs: int | None = None, arches: list[str] | None = None, only: str | None = None,
          log=print) -> None:
    variants = [v for v in menu.MENU if (not arches or v.arch in arches)
                and (only is None or re.search(only, v.name))]
    if not variants:
        raise BuildError(f"the menu has no variant for arch {arches} matching {only!r}")
    start = time.monotonic()
    entries = compile_variants(variants, jobs or os.cpu_count() or 1, log=log)
    link(variants, entries, log=log)
    write_manifest(variants)
    log(f"fa4_jax: built {len(variants)} variants in {time.monotonic() - start:.1f} s")


def cubins(variants=menu.MENU) -> dict[str, list[Path]]:
    """The cached cubins of the menu's compiled variants (for disassembly checks)."""
    out = {}
    for v in variants:
        kernel = aot_compile.KERNELS.get((v.kind, v.arch))
        if kernel is not None:
            entry = entry_dir(v, variant_key(v, kernel))
            out[v.name] = sorted(Path(p) for p in glob.glob(str(entry / "*.cubin")))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax.aot.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="parallel compile workers (default: CPU count)")
    parser.add_argument("--arch", action="append", choices=menu.ARCHES,
                        help="only this arch (repeatable; default: the whole menu)")
    parser.add_argument("--only", metavar="REGEX",
                        help="only the variants whose name matches: a quick library for an "
                             "experiment, which then lacks (and its manifest omits) the rest")
    args = parser.parse_args(argv)
    try:
        build(args.jobs, args.arch, args.only, log=lambda s: print(s, flush=True))
    except (BuildError, toolchain.ToolchainError) as e:
        print(f"\nfa4_jax BUILD FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
