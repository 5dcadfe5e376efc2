"""CPU tier: the AOT build's outputs (library, manifest, cubins) and its cache and failure modes.

Needs the library built first (`pip install -e .` or `python -m fa4_jax.aot.build`); the
incremental and failure checks never recompile a menu variant.
"""
import concurrent.futures
import ctypes
import itertools
import json
import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from fa4_jax.runtime import ffi
from fa4_jax.abi import routing, targets
from fa4_jax.aot import build, menu
from tests.scripts import load_script


@pytest.fixture(scope="module")
def library() -> Path:
    if not build.LIBRARY.exists():
        pytest.fail(f"{build.LIBRARY} is not built: run `python -m fa4_jax.aot.build`")
    return build.LIBRARY


def _handler_symbols(library) -> set[str]:
    """The XLA FFI handler stages the library exports (ffi/common.h, FA4_DEFINE_HANDLERS)."""
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                             text=True, check=True).stdout.split()
    return {s for s in symbols if re.fullmatch(r"Fa4\w+(Instantiate|Execute)", s)}


def test_the_library_exports_the_handler_pair_of_every_target(library):
    # Each name the table registers binds a pair the library defines, and the library defines no
    # pair that no name binds. The development library builds the same handlers.
    bound = {f"{target.handler}{stage}" for development in (False, True)
             for target in targets.registered(development) for stage in ("Instantiate", "Execute")}
    assert _handler_symbols(library) == bound


def test_loading_registers_the_tables_names_and_no_other(library, monkeypatch):
    # register_ffi_target(platform="CUDA") works on a CPU-only jaxlib too; the targets cannot run
    # there, which the GPU tier covers.
    import jax.ffi

    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, handlers, **kwargs: registered.append((name, kwargs["platform"])))
    for development in (False, True):
        registered.clear()
        ffi.load.__wrapped__(str(library), tuning_targets=development)
        assert registered == [(target.name, "CUDA") for target in targets.registered(development)]


def test_library_needs_only_libc(library):
    # The static CUDA runtime finds the driver at run time; nothing else may be a dependency.
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True,
                            check=True).stdout
    libs = {line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line}
    assert libs <= {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                    "ld-linux-x86-64.so.2"}, libs


def test_the_library_loads_with_the_whole_menu(library):
    assert ffi.load().compiled == {v.name for v in menu.MENU}


def test_manifest_is_the_menu(library):
    manifest = json.loads((library.parent / "manifest.json").read_text())
    assert manifest == build.manifest(build.shipping_menu())
    assert [v["name"] for v in manifest["variants"]] == [v.name for v in menu.MENU]


def _handler_choice(lib, call: routing.Call) -> str:
    choose = lib.Fa4ChooseVariant
    choose.restype = ctypes.c_char_p
    choose.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return choose(routing.KINDS.index(call.kind), call.arch.encode(), routing.DTYPES.index(call.dtype),
                  call.head_dim, call.head_dim_v, call.mask.encode(), int(call.softcap), call.seqlen_q,
                  call.seqlen_k, int(call.ragged), int(call.top_left), int(call.segments),
                  int(call.mask_array)).decode()


def test_the_handler_routes_calls_as_fa4_jax_routing_does(library):
    # The C++ rule (ffi/common.cc) that picks a call's variant, against the Python one that
    # explain and the tests use, over every problem class and lengths around each bound.
    lib = ctypes.CDLL(str(library))
    loaded = ffi.load()
    lengths = (1, 63, 64, 65, 176, 177, 300, 1000, 1024, 1025, 1100, 1152, 2048, 4096, 4200, 8192,
               8193, 16384)
    calls = 0
    for v in menu.MENU:
        if v.tuning != "default":
            continue
        for seqlen_q, seqlen_k, ragged, top_left in itertools.product(lengths, lengths, (False, True),
                                                                      (False, True)):
            call = routing.Call(v.kind, v.arch, v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap,
                                seqlen_q, seqlen_k, ragged, top_left, v.segments, v.mask_array)
            assert _handler_choice(lib, call) == loaded.choose(call).name, call
            calls += 1
    assert calls > 100_000
    missing = routing.Call("fwd", "sm_90a", "bf16", 88, 88, "none", False, 128, 128)
    assert _handler_choice(lib, missing) == ""


def _disassemble(variant) -> str:
    """The disassembly of a menu variant's cached cubin(s)."""
    cubins = build.cubins([variant])[variant.name]
    assert cubins, f"no cached cubin for {variant.name} under {build.cache_dir()}"
    sass_facts = load_script("sass_facts")
    try:
        return "".join(sass_facts.disassemble(str(cubin)) for cubin in cubins)
    except FileNotFoundError as missing:
        pytest.fail(str(missing))


SM90_MENU = [v for v in menu.MENU if v.arch == "sm_90a"]
# The walk over every Hopper variant's SASS disassembles ~450 cubins at ~0.5 s each in cuobjdump,
# which was most of the CPU tier's time spent here: each test reads the next variants ahead on
# the other cores, and keeps no SASS once its own is read (~1 MB each).
_READ_AHEAD = max(1, (os.cpu_count() or 1))
_reader = concurrent.futures.ThreadPoolExecutor(_READ_AHEAD)
_pending: dict[str, concurrent.futures.Future] = {}


def _sass(variant, read_ahead: bool = False) -> str:
    """The disassembly of `variant`; read_ahead: with the variants after it in the walk started."""
    order = [v.name for v in SM90_MENU]
    following = SM90_MENU[order.index(variant.name) + 1:][:_READ_AHEAD] if read_ahead else []
    for v in [variant, *following]:
        if v.name not in _pending:
            _pending[v.name] = _reader.submit(_disassemble, v)
    return _pending.pop(variant.name).result()


@pytest.mark.parametrize("variant", SM90_MENU, ids=lambda v: v.name)
def test_sm90_sass_keeps_the_gemms_pipelined(library, variant):
    """Every Hopper variant's SASS: its WGMMAs in flight, and where the forward pins the wait for
    P·V, the block's exponentials under that GEMM (two checks on one disassembly)."""
    sass = _sass(variant, read_ahead=True)
    # Expected to hold for the real Hopper kernel (WGMMA -> HGMMA in SASS); the naive stand-in
    # kernel that preceded it had no tensor-core instructions and failed here by design.
    # When ptxas cannot keep WGMMAs in flight (C7512-C7515: too few registers, an accumulator
    # touched or a pipeline stage crossing a loop edge) it waits after every one of them, which
    # runs the kernel 2-3x slower but correctly: only the SASS shows it, as one
    # WARPGROUP.DEPBAR per HGMMA. The menu's kernels have at most one per five.
    assert "HGMMA" in sass, f"{variant.name}: no HGMMA in its SASS"
    hgmma, waits = sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR")
    assert waits <= hgmma // 2, (
        f"{variant.name}: {waits} WGMMA waits for {hgmma} HGMMA: ptxas serialized the WGMMAs "
        f"(why: python scripts/ptxas_report.py {variant.name})")
    if variant.kind == "fwd":
        _check_pinned_pv_wait(variant, sass)


# A ragged entry's padding V rows are zeroed in shared memory between a tile's first softmax and
# its next S GEMM (fwd.zero_v_past_keys). Element by element (STS.U16) that loop held the MMA warps
# up to 64 stores per thread and the short ragged forward ran 19% slower (docs/perf-log.md,
# "Ragged entries' V padding zeroed in 16-byte stores"). The forward has no other 2-byte
# shared-memory store; one kernel per head dim (the zeroing is the same code in every variant).
@pytest.mark.parametrize("variant", [v for v in menu.MENU if v.arch == "sm_90a" and v.kind == "fwd"
                                     and v.dtype == "bf16" and v.mask == "none" and not v.softcap
                                     and v.tuning == "default" and not v.segments],
                         ids=lambda v: v.name)
def test_ragged_v_padding_is_zeroed_in_vector_stores(library, variant):
    sass = _sass(variant)
    assert "STS.128" in sass, f"{variant.name}: no 16-byte shared-memory store in its SASS"
    assert "STS.U16" not in sass, (
        f"{variant.name}: {sass.count('STS.U16')} two-byte shared-memory stores: the V padding "
        "rows are zeroed element by element again")


# ptxas moves the forward's wait for the previous block's P·V GEMM up from where the PTX has it,
# and how far depends on code far from the loop: a change outside the loop once left 6 fewer max
# steps under the GEMM and the kernel ran 3-5% slower; the tree maximum put 41 exponentials under
# it on 128-key blocks, +2-3% (docs/perf-log.md, "The wait for P·V: the row maximum as a tree").
# Floors at about half the exponentials (MUFU) that these kernels' steady loops keep between the
# wait for S and the wait for P·V (`ptxas_report.wgmma_wait_gaps`; the last pair is the unmasked
# loop); the counts when the floors were set in the comments. A failure means: check the
# kernel's speed before accepting it.
PV_OVERLAP_FLOORS = {
    "fwd_sm90a_bf16_d128_dv128": 32,  # 65
    "fwd_sm90a_bf16_d128_dv128_tn128_tree": 20,  # 41
    "fwd_sm90a_bf16_d64_dv64_causal": 10,  # 23
}


@pytest.mark.parametrize("name,floor", PV_OVERLAP_FLOORS.items())
def test_softmax_work_stays_under_the_pv_gemm(library, name, floor):
    variant = next(v for v in menu.MENU if v.name == name)
    gaps = load_script("ptxas_report").wgmma_wait_gaps(_sass(variant))
    assert gaps, f"{name}: no wait for S followed by a wait for P·V in its SASS"
    exponentials = gaps[-1][2]
    assert exponentials >= floor, (
        f"{name}: {exponentials} exponentials between the wait for S and the wait for P·V in "
        f"its steady loop, under the floor of {floor} (python scripts/ptxas_report.py {name})")


# With pv_wait_in_branch (d128's masked kernels, the short causal rule's, the decode kernels) the
# wait for P·V sits in both arms of O's rescale branch, where ptxas cannot hoist it: every
# exponential of the block runs under the GEMM. Each steady loop's span between the wait for S
# and the wait for P·V must hold them on the MUFU pipe: tile_n / 2 per thread (64 rows × tile_n
# over 128 threads), less those the FMA pipes compute.
def _fwd_sm90_config(variant):
    from fa4_jax.aot.compile import construct_kernel

    return construct_kernel(variant, menu.kernel_class(variant), menu.tuning_kwargs(variant)).config


def _check_pinned_pv_wait(variant, sass: str) -> None:
    config = _fwd_sm90_config(variant)
    if not config.pv_wait_in_branch:
        return  # the P·V wait is not pinned in this kernel (PV_OVERLAP_FLOORS covers some)
    gaps = load_script("ptxas_report").wgmma_wait_gaps(sass)
    assert gaps, f"{variant.name}: no wait for S followed by a wait for P·V in its SASS"
    columns = config.tile_n // 4
    exponentials = 2 * sum(not config.softmax.uses_poly(c) for c in range(columns))
    short = [(address, mufu) for address, _, mufu, _ in gaps if mufu < exponentials]
    assert not short, (
        f"{variant.name}: loops at {short} have fewer than the block's {exponentials} exponentials "
        f"between the wait for S and the wait for P·V (python scripts/ptxas_report.py {variant.name})")


def test_second_build_is_all_cached(library):
    missing = [name for name, found in build.cubins().items() if not found]
    assert not missing, f"not in the cache {build.cache_dir()} (built with another one?): {missing}"
    lines = []
    start = time.monotonic()
    build.compile_variants(build.shipping_menu(), jobs=2, log=lines.append)
    assert time.monotonic() - start < 30
    assert lines == [f"fa4_jax: {len(menu.MENU)} variants, {len(menu.MENU)} cached, 0 to compile on 2 workers"]


_BROKEN_KERNEL = """
    import cutlass.cute as cute

    class Broken:
        def __init__(self, dtype, head_dim, head_dim_v, mask, has_softcap, **tuning):
            pass

        @cute.jit
        def __call__(self, mQ, mK, mV, mO, mLSE, mSeqUsedQ, mSeqUsedK, mQSegmentIds, mKSegmentIds,
                     mRowSpans, mKeySpans, mMaskBits, softmax_scale, softcap, window_left,
                     window_right, top_left, stream):
            this_name_is_not_defined(mQ)
"""


def test_broken_variant_fails_loudly(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_kernel.py").write_text(textwrap.dedent(_BROKEN_KERNEL))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FA4_JAX_BUILD_LOG", str(tmp_path / "build.log"))
    victim = menu.MENU[0]
    broken = build.Menu((victim,), kernel_class=lambda v: "broken_kernel:Broken")
    monkeypatch.setattr(build, "shipping_menu", lambda *args: broken)
    assert build.main(["--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "BUILD FAILED" in err and f"variant {victim.name} FAILED" in err
    assert "this_name_is_not_defined" in err  # the worker's own error reaches the user
    assert f"variant {victim.name} FAILED" in (tmp_path / "build.log").read_text()
    assert not list((tmp_path / "cache" / "variants").iterdir())  # no half-written entry


def test_build_log_says_what_the_build_does(tmp_path, monkeypatch):
    # pip hides a build backend's output: the log file carries the per-variant progress.
    monkeypatch.setenv("FA4_JAX_BUILD_LOG", str(tmp_path / "build.log"))
    log = build._logger()
    build.compile_variants(build.shipping_menu(only="^fwd_sm90a_bf16_d64_dv64$"), jobs=1, log=log)
    text = (tmp_path / "build.log").read_text()
    assert "fa4_jax: 1 variants, 1 cached, 0 to compile" in text


def test_cache_keys_follow_each_variants_own_settings():
    # A variant's key covers its kernel's sources and its own fields and tuning settings, not
    # the rest of the menu: adding or renaming another tuning recompiles nothing else.
    variant = routing.Variant("sm_90a", "bf16", 128, 128, "causal", False, "fwd", "short")
    kernel = menu.kernel_class(variant)
    key = build.variant_key(variant, kernel, menu.tuning_kwargs(variant))
    assert build.variant_key(variant, kernel, {**menu.tuning_kwargs(variant), "tile_n": 64}) != key
    for menu_file in (build.PACKAGE / "aot" / "menu.py", build.PACKAGE / "kernels" / "sm90" / "menu.py"):
        assert menu_file not in build._ALWAYS_HASHED
        for kind in ("fwd", "bwd"):
            assert menu_file not in build._kernel_sources(menu.arch_menu("sm_90a").KERNELS[kind]), kind


def test_the_ffi_headers_come_from_the_pinned_build_jax():
    # A library built against a newer jax's FFI headers does not load into the oldest jaxlib
    # the package allows; toolchain.BUILD_JAX names the pin and warns when the build differs.
    import tomllib

    from fa4_jax.aot import toolchain

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    requires = pyproject["build-system"]["requires"]
    assert f"jax=={toolchain.BUILD_JAX}" in requires and f"jaxlib=={toolchain.BUILD_JAX}" in requires
    assert any(dep == f"jax>={toolchain.BUILD_JAX.rsplit('.', 1)[0]}"
               for dep in pyproject["project"]["dependencies"])


def test_a_worker_keeps_each_jobs_cubin_apart_and_state_free(tmp_path):
    # Two variants of one kernel signature (their cubins share a file name in the dump dir) on
    # one worker, after a failed job: each entry holds its own cubin, and the second is the
    # cubin a fresh worker makes of it.
    import hashlib

    first, second = (routing.Variant("sm_90a", "bf16", 128, 128, "causal", False, "fwd", tuning)
                     for tuning in ("short", "short_diag"))
    shim = build.toolchain.build_runtime_shim(str(build.ROOT / "build" / "aot"))

    def compile_on(worker, variant, where):
        worker.compile(variant, menu.kernel_class(variant), menu.tuning_kwargs(variant), where)
        cubins = list(where.glob("*.cubin"))
        assert len(cubins) == 1, cubins
        return hashlib.sha256(cubins[0].read_bytes()).hexdigest()

    worker = build._Worker(shim)
    try:
        with pytest.raises(build.BuildError, match="NoSuchKernel"):
            worker.compile(first, "fa4_jax.kernels.sm90.fwd:NoSuchKernel", {}, tmp_path / "broken")
        digests = [compile_on(worker, v, tmp_path / v.tuning) for v in (first, second)]
    finally:
        worker.close()
    assert digests[0] != digests[1]
    fresh = build._Worker(shim)
    try:
        assert compile_on(fresh, second, tmp_path / "fresh") == digests[1]
    finally:
        fresh.close()


def test_exported_sources_are_what_the_library_links(tmp_path):
    # The Bazel build's inputs (BUILD): every cached kernel object in the archive, each header
    # inlined into the dispatch table (Bazel sees no per-variant header), the same manifest.
    shipped = build.shipping_menu()
    build.export_sources(shipped, tmp_path, jobs=2, log=lambda line: None)
    members = subprocess.run(["ar", "t", str(tmp_path / "kernels.a")], capture_output=True,
                             text=True, check=True).stdout.split()
    assert sorted(members) == sorted(f"{v.name}.o" for v in shipped.variants)
    source = (tmp_path / "dispatch.cc").read_text()
    for v in shipped.variants:
        assert f'#include "{v.name}.h"' not in source and f"_mlir_{v.name}_cuda_init" in source, v.name
    assert "#pragma once" not in source
    assert json.loads((tmp_path / "manifest.json").read_text()) == build.manifest(shipped)
