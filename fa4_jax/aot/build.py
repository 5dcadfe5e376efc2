"""Incremental AOT build: `python -m fa4_jax.aot.build [--jobs N] [--arch ARCH ...] [--only REGEX]
[--export-sources DIR]`.

1. Compile each variant of the menu on one of `jobs` worker processes (cute.compile +
   export_to_c; each worker compiles variant after variant), unless the
   cache already holds it: entries are keyed by a hash of the kernel module and the fa4_jax
   modules it imports, compile.py, the DSL version, the kernel class, the variant and its tuning
   settings, and live outside the tree (FA4_JAX_CACHE_DIR, default ~/.cache/fa4_jax) so clean
   clones and venvs reuse them. One line per variant goes to stdout and to the build log
   (build/aot/build.log, or FA4_JAX_BUILD_LOG), which `pip install` otherwise hides.
2. Generate the C++ dispatch table (variants and routes) from the compiled variants, compile
   ffi/*.cc with it, and link everything with the DSL runtime and the static CUDA runtime into
   fa4_jax/_lib/libfa4_jax.so (needs only the NVIDIA driver at run time), plus
   fa4_jax/_lib/manifest.json (the compiled menu and its routing rules, for fa4_jax.abi.routing).

`build()` also builds other menus into other libraries (benchmarks/ablations.py's development
library).
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
import threading
import time
from pathlib import Path
from typing import Callable

from fa4_jax.aot import codegen, menu, toolchain
from fa4_jax.aot import compile as compile_worker
from fa4_jax.abi.routing import Route, Variant

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parent
LIB_DIR = PACKAGE / "_lib"
LIBRARY = LIB_DIR / "libfa4_jax.so"
MANIFEST_VERSION = 1
# Hashed into every variant's key besides its kernel module's own sources (see _kernel_sources).
# The menu is not: a variant's key holds its own fields and tuning settings, so adding a variant
# compiles that variant only.
_ALWAYS_HASHED = (PACKAGE / "aot" / "compile.py",)


class BuildError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Menu:
    """What one library holds: its variants, how each is compiled, and its routing rules."""

    variants: tuple[Variant, ...]
    kernel_class: Callable[[Variant], str] = menu.kernel_class
    tuning_kwargs: Callable[[Variant], dict] = menu.tuning_kwargs
    routes: tuple[tuple[str, Route], ...] = ()
    dq_copies_max_keys: dict = dataclasses.field(default_factory=dict)
    # Archs whose kernels no GPU of the arch has run (an arch menu's VERIFIED = False): each of
    # their variants is checked on first use (fa4_jax.runtime.gate), and the handlers run it only
    # once checked (ffi/gate.h).
    unverified_arches: tuple[str, ...] = ()
    # The development library: its handlers also take a `tuning` attribute, the variant to run,
    # and it registers them under the development names of fa4_jax.abi.targets.
    tuning_targets: bool = False


def shipping_menu(arches: list[str] | None = None, only: str | None = None) -> Menu:
    variants = tuple(v for v in menu.MENU if (not arches or v.arch in arches)
                     and (only is None or re.search(only, v.name)))
    return Menu(variants, routes=menu.routes(), dq_copies_max_keys=menu.dq_copies_max_keys(),
                unverified_arches=menu.unverified_arches())


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
        # Named from the package (the shipped kernels), or from the repository for a kernel
        # outside it (the GPU tier's broken ones, tests/gpu/faults/).
        h.update(str(path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) else ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def variant_key(variant: Variant, kernel: str, tuning_kwargs: dict) -> str:
    payload = json.dumps([_sources_digest(kernel), kernel, variant.to_json(), tuning_kwargs],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def entry_dir(variant: Variant, key: str, cache: Path | None = None) -> Path:
    """The cache entry of one compiled variant: NAME.h, NAME.o and its *.cubin."""
    return (cache or cache_dir()) / "variants" / f"{variant.name}-{key}"


class _Worker:
    """One `python -m fa4_jax.aot.compile --serve` process, compiling variant after variant.

    Restarted after RECYCLE_AFTER jobs: a worker's memory grows with each compile (about 4 MB:
    475 MB after its first variant, 557 MB after 21, measured on 2026-12-01), which a restart
    (about 5 s) bounds.
    """

    RECYCLE_AFTER = 48

    def __init__(self, shim: str):
        self.shim = shim
        self.proc = None
        self.jobs_done = 0

    def _start(self) -> None:
        self.dump_dir = tempfile.mkdtemp(prefix="fa4_jax-dump-")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fa4_jax.aot.compile", "--serve"],
            env=toolchain.compile_env(self.shim, self.dump_dir), cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        self.jobs_done = 0

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.stderr.close()
            shutil.rmtree(self.dump_dir, ignore_errors=True)
            self.proc = None

    def _output_tail(self, printed: list[str]) -> str:
        self.stderr.seek(0)
        return ("".join(printed) + self.stderr.read())[-6000:]

    def compile(self, variant: Variant, kernel: str, tuning_kwargs: dict, entry: Path) -> float:
        """Compiles into a scratch dir and renames it into place, so a killed build leaves no
        entry. Returns the compile's seconds."""
        if self.proc is None or self.jobs_done >= self.RECYCLE_AFTER:
            self.close()
            self._start()
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{variant.name}-", dir=entry.parent))
        job = {"variant": dataclasses.asdict(variant), "kernel": kernel,
               "tuning_kwargs": tuning_kwargs, "out_dir": str(scratch)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        printed, result = [], None
        for line in self.proc.stdout:
            if line.startswith(compile_worker.RESULT):
                result = json.loads(line[len(compile_worker.RESULT):])
                break
            printed.append(line)
        self.jobs_done += 1
        produced = {p.suffix for p in scratch.iterdir()}
        if result is None or "error" in result or not {".h", ".o", ".cubin"} <= produced:
            shutil.rmtree(scratch, ignore_errors=True)
            what = ("the worker exited" if result is None else result.get("error")
                    or f"outputs {sorted(produced)}")
            output = self._output_tail(printed)
            self.close()
            raise BuildError(f"variant {variant.name} FAILED to compile: {what}\n{output}")
        try:
            scratch.rename(entry)
        except OSError:  # a concurrent build got there first; its entry is as good as ours
            shutil.rmtree(scratch, ignore_errors=True)
        return result["seconds"]


def entries(built: Menu, cache: Path | None = None) -> dict[str, Path]:
    """name -> the cache entry each variant of `built` has (or would have)."""
    return {v.name: entry_dir(v, variant_key(v, built.kernel_class(v), built.tuning_kwargs(v)), cache)
            for v in built.variants}


def compile_variants(built: Menu, jobs: int, cache: Path | None = None, log=print,
                     work: Path | None = None) -> dict[str, Path]:
    """Compiles what the cache lacks, in `jobs` worker processes (their runtime shim built in
    `work`, default build/aot). Returns name -> entry dir."""
    found = entries(built, cache)
    todo = [v for v in built.variants if not found[v.name].is_dir()]
    total = len(built.variants)
    width = len(str(total))
    done = total - len(todo)
    log(f"fa4_jax: {total} variants, {done} cached, {len(todo)} to compile on {jobs} workers")
    if not todo:
        return found
    shim = toolchain.build_runtime_shim(str(work or ROOT / "build" / "aot"))
    start = time.monotonic()
    workers, local = [], threading.local()

    def compile_on_this_thread(variant):
        if not hasattr(local, "worker"):
            local.worker = _Worker(shim)
            workers.append(local.worker)
        return local.worker.compile(variant, built.kernel_class(variant),
                                    built.tuning_kwargs(variant), found[variant.name])

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(compile_on_this_thread, v): v for v in todo}
            try:
                for fut in concurrent.futures.as_completed(futures):
                    seconds = fut.result()
                    done += 1
                    log(f"[{done:>{width}}/{total}] {futures[fut].name}: compiled in "
                        f"{seconds:.1f} s ({time.monotonic() - start:.0f} s elapsed)")
            except BaseException:
                for f in futures:  # stop queued work; running jobs finish on their own
                    f.cancel()
                raise
    finally:
        for worker in workers:
            worker.close()
    return found


def _link_inputs(built: Menu, found: dict[str, Path], work: Path) -> tuple[list[str], list[str]]:
    """Generates the dispatch source; returns (sources, objects)."""
    include = work / "include"
    include.mkdir(parents=True, exist_ok=True)
    headers = {}
    for v in built.variants:
        header = found[v.name] / f"{v.name}.h"
        headers[v.name] = header.read_text()
        shutil.copyfile(header, include / header.name)
    dispatch = work / "dispatch.cc"
    dispatch.write_text(codegen.dispatch_source(built.variants, headers, built.routes, built.unverified_arches))
    sources = sorted(str(p) for p in (ROOT / "ffi").glob("*.cc")) + [str(dispatch)]
    objects = [str(found[v.name] / f"{v.name}.o") for v in built.variants]
    return sources, objects


def link(built: Menu, found: dict[str, Path], out: Path = LIBRARY, log=print) -> None:
    work = ROOT / "build" / ("aot" if out == LIBRARY else f"aot-{out.stem}")
    sources, objects = _link_inputs(built, found, work)
    defines = ["FA4_JAX_TUNING_TARGETS"] if built.tuning_targets else []
    cmd = toolchain.ffi_library_command(str(out), [*sources, *objects],
                                        [str(ROOT / "ffi"), str(work / "include")], defines)
    # The FFI headers' path is the same for every jax version, their API version is not.
    key = hashlib.sha256(json.dumps([cmd, toolchain.jax_version()]).encode())
    for path in [*sources, *objects]:
        key.update(Path(path).read_bytes())
    stamp = out.with_suffix(".so.key")
    if out.exists() and stamp.exists() and stamp.read_text() == key.hexdigest():
        log(f"{out}: up to date")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    toolchain.run(cmd)
    stamp.write_text(key.hexdigest())
    log(f"{out}: linked {len(objects)} variants in {time.monotonic() - start:.1f} s")


def manifest(built: Menu) -> dict:
    """What fa4_jax.runtime.ffi reads at run time: the variants, the routes, the dQ-copies rule, the
    archs whose kernels are checked on first use, and the query tile of each segments backward
    (whose deterministic walk the dispatch computes for that tile: fa4_jax.runtime.segments)."""
    return {
        "version": MANIFEST_VERSION,
        "variants": [v.to_json() for v in built.variants],
        "routes": [{"arch": arch, **route.to_json()} for arch, route in built.routes],
        "dq_copies_max_keys": {arch: {str(d): keys for d, keys in rule.items()}
                               for arch, rule in built.dq_copies_max_keys.items()},
        "unverified_arches": list(built.unverified_arches),
        "segments_backward_tile_m": segments_backward_tile_m(built),
    }


def segments_backward_tile_m(built: Menu) -> dict[str, int]:
    """Each segments backward variant's query tile rows, from its kernel (constructed, not
    compiled): the tile a deterministic call's walk is computed at (fa4_jax.runtime.segments)."""
    return {v.name: compile_worker.construct_kernel(v, built.kernel_class(v), built.tuning_kwargs(v)).tile_m
            for v in built.variants if v.kind == "bwd" and v.segments}


def build(built: Menu, out: Path = LIBRARY, jobs: int | None = None, log=print) -> None:
    if not built.variants:
        raise BuildError("the menu has no variant to build")
    start = time.monotonic()
    found = compile_variants(built, jobs or os.cpu_count() or 1, log=log)
    link(built, found, out, log=log)
    (out.parent / "manifest.json").write_text(json.dumps(manifest(built), indent=1) + "\n")
    log(f"fa4_jax: built {len(built.variants)} variants into {out} in {time.monotonic() - start:.1f} s")


def export_sources(built: Menu, out_dir: Path, jobs: int | None = None, log=print) -> None:
    """What another build system links into the same library (the Bazel build, BUILD):
    out_dir/dispatch.cc (the generated table, each variant's exported header inlined),
    out_dir/kernels.a (the variants' objects) and out_dir/manifest.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fa4_jax-export-") as work:
        found = compile_variants(built, jobs or os.cpu_count() or 1, log=log, work=Path(work))
    headers = {v.name: (found[v.name] / f"{v.name}.h").read_text() for v in built.variants}
    source = codegen.dispatch_source(built.variants, headers, built.routes, built.unverified_arches)
    for name, header in headers.items():  # #pragma once is a warning outside a header
        source = source.replace(f'#include "{name}.h"\n', header.replace("#pragma once\n", "") + "\n", 1)
    (out_dir / "dispatch.cc").write_text(source)
    archive = out_dir / "kernels.a"
    archive.unlink(missing_ok=True)
    toolchain.run(["ar", "rcs", str(archive), *(str(found[v.name] / f"{v.name}.o")
                                              for v in built.variants)])
    (out_dir / "manifest.json").write_text(json.dumps(manifest(built), indent=1) + "\n")
    log(f"fa4_jax: exported {len(built.variants)} variants' sources into {out_dir}")


def cubins(variants=menu.MENU, built: Menu | None = None) -> dict[str, list[Path]]:
    """The cached cubins of compiled variants (for disassembly checks)."""
    built = built or Menu(tuple(variants))
    return {name: sorted(Path(p) for p in glob.glob(str(entry / "*.cubin")))
            for name, entry in entries(built).items()}


def build_log_path() -> Path:
    return Path(os.environ.get("FA4_JAX_BUILD_LOG") or ROOT / "build" / "aot" / "build.log")


def _logger():
    """print, and the same lines appended to the build log (which survives pip's silence)."""
    path = build_log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = path.open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        stream.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        stream.flush()

    return log


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
    parser.add_argument("--export-sources", metavar="DIR", type=Path,
                        help="instead of linking, write the generated dispatch source, an archive "
                             "of the kernels and the manifest into DIR (the Bazel build's step)")
    args = parser.parse_args(argv)
    log = _logger()
    try:
        if args.export_sources:
            export_sources(shipping_menu(args.arch, args.only), args.export_sources,
                           jobs=args.jobs, log=log)
            return 0
        build(shipping_menu(args.arch, args.only), jobs=args.jobs, log=log)
    except (BuildError, toolchain.ToolchainError) as e:
        log(f"fa4_jax BUILD FAILED: {e}")
        print(f"\nfa4_jax BUILD FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
