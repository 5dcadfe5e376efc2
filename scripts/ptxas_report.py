"""Why ptxas serialized a kernel's WGMMAs, or spilled: one variant compiled with its PTX kept,
then fed to the CUDA toolkit's ptxas with -v.

    python scripts/ptxas_report.py bwd_sm90a_bf16_d64_dv64
    python scripts/ptxas_report.py bwd_sm90a_bf16_d128_dv128 --tuning '{"scores_ahead": true}'
    python scripts/ptxas_report.py fwd_sm90a_bf16_d128_dv128 --ptx fwd.ptx --sass fwd.sass

The variant is a shipping-menu name (fa4_jax/_lib/manifest.json) or an ablation's
(benchmarks/ablations.py).

The DSL runs ptxas in-process and keeps its messages to itself, so a kernel whose WGMMAs ptxas
had to serialize (every HGMMA followed by a wait: tests/test_build.py checks the menu for it)
compiles without a word. ptxas -v names the cause, e.g. "C7512 ... insufficient register
resources", "C7514 ... non wgmma instructions reading accumulator registers ... between start
and end of the pipeline stage". Prints those lines and each kernel's registers and spills;
exits 1 if there is a C75xx message. ("Used N registers" is the launch's bound, 65536 / threads;
setmaxnreg lets the MMA warp groups use more, up to their budget.) --tuning replaces the
variant's tuning settings (the keyword arguments of its kernel's constructor) for this compile
only; nothing goes into the build cache. --ptx and --sass keep the PTX and the SASS, e.g. to see
where ptxas placed a WGMMA wait against the PTX's order. It also prints, for each wait for all
but the newest WGMMA group, how much work ptxas left before the next wait for all of them (in
the forward: the softmax under the previous block's P·V GEMM), which has moved with code far
from the loop.
"""
import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fa4_jax.aot import menu, toolchain  # noqa: E402

# Run in a child process: LD_PRELOAD (the DSL runtime shim) and the DSL's dump settings only take
# effect at process start.
_CHILD = """
import json, sys
from fa4_jax.aot import compile as aot_compile
from fa4_jax.abi.routing import Variant
job = json.loads(sys.argv[1])
aot_compile.compile_variant(Variant(**job["variant"]), job["kernel"], job["tuning"], job["out_dir"])
"""


def _variants_and_settings():
    """name -> (variant, its tuning settings), the shipping menu's and the ablations'."""
    found = {v.name: (v, menu.tuning_kwargs(v)) for v in menu.MENU}
    try:
        from benchmarks import ablations
    except ImportError:
        return found
    return {**{v.name: (v, dict(ablations.TUNINGS[v.tuning])) for v in ablations.MENU}, **found}


def find_ptxas() -> str:
    candidates = [os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "ptxas"),
                  shutil.which("ptxas") or "", "/usr/local/cuda/bin/ptxas"]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        sys.exit("no ptxas: set CUDA_HOME to a CUDA toolkit, or put its bin/ on PATH")
    return found


def ptxas_messages(ptx_path: str, arch: str) -> str:
    """ptxas -v's output on the PTX, its .version lowered to what this ptxas reads if needed."""
    ptxas = find_ptxas()
    text = Path(ptx_path).read_text()
    for _ in range(2):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
            ptx.write(text)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx.name, "-o", os.devnull],
                              capture_output=True, text=True)
        os.unlink(ptx.name)
        # The DSL may emit a newer PTX ISA than the toolkit's ptxas knows; the kernels use
        # nothing from it, so the older version number is enough.
        newest = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", proc.stderr)
        if not newest:
            return proc.stdout + proc.stderr
        text = re.sub(r"^\.version [\d.]+", f".version {newest.group(1)}", text, flags=re.M)
    raise RuntimeError(f"ptxas could not read {ptx_path}:\n{proc.stderr}")


def sass_of(out_dir: str) -> str:
    """The kept cubin's SASS, e.g. to count shared-memory stores (STS vs STS.64) in a loop."""
    cubin = glob.glob(os.path.join(out_dir, "*.cubin"))
    # The toolkit's, else the nvidia-cuda-cuobjdump wheel's (a dependency of the DSL's CUDA libs).
    import nvidia
    wheels = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "cu*", "bin", "cuobjdump"))]
    cuobjdump = shutil.which("cuobjdump") or next(iter(wheels), None)
    if cuobjdump is None:
        sys.exit("no cuobjdump: put the CUDA toolkit's bin/ on PATH")
    return subprocess.run([cuobjdump, "-sass", cubin[0]], capture_output=True, text=True,
                          check=True).stdout


def wgmma_wait_gaps(sass: str) -> list[tuple[str, int, int, int]]:
    """(address, instructions, MUFU, FMNMX) from each wait for all but the newest WGMMA group
    (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the forward's wait for S) to the next wait for all
    (`0x0`: for the previous block's P·V). ptxas moves the second wait up from where the PTX has
    it, and how far depends on code far from the loop: the softmax work left between the two is
    what overlaps the P·V GEMM (docs/perf-log.md, "The P·V wait's place in each forward loop,
    ours against upstream's": a change outside the loop once left 6 fewer FMNMX there, and the
    kernel ran 3-5% slower)."""
    lines = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    gaps = []
    for i, line in enumerate(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in line:
            continue
        between = []
        for later in lines[i + 1:]:
            if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in later:
                gaps.append((re.search(r"/\*([0-9a-f]+)\*/", line).group(1), len(between),
                             sum("MUFU" in x for x in between), sum("FMNMX" in x for x in between)))
                break
            if "WARPGROUP.DEPBAR" in later:
                break
            between.append(later)
    return gaps


def summarize(messages: str) -> tuple[list[str], bool]:
    """The C75xx lines and each kernel's register and spill line, kernel names shortened."""
    lines, serialized, kernel = [], False, "?"
    for line in messages.splitlines():
        name = re.search(r"Function properties for (\S+)", line)
        if name:
            kernel = next((k for k in ("ForwardSm90", "BackwardSm90", "BackwardPreprocess",
                                       "BackwardPostprocess") if k in name.group(1)), name.group(1)[:60])
        text = re.sub(r"^ptxas info\s*:\s*", "", line.strip())
        if re.search(r"\(C75\d\d\)", text):
            serialized = True
            lines.append(re.sub(r" (in|for) the function '.*", "", text))
        elif "spill" in text or text.startswith("Used"):
            lines.append(f"{kernel}: {text}")
    return lines, serialized


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variant", help="a variant's name (fa4_jax/_lib/manifest.json, benchmarks/ablations.py)")
    parser.add_argument("--tuning", type=json.loads, help="constructor settings, as JSON")
    parser.add_argument("--ptx", metavar="FILE", help="also copy the kept PTX here")
    parser.add_argument("--sass", metavar="FILE",
                        help="also write the compiled cubin's disassembly (cuobjdump -sass) here")
    args = parser.parse_args(argv)
    by_name = _variants_and_settings()
    if args.variant not in by_name:
        parser.error(f"unknown variant {args.variant!r}; e.g. {next(iter(by_name))}")
    variant, settings = by_name[args.variant]
    kernel = menu.kernel_class(variant)
    settings = settings if args.tuning is None else args.tuning

    with tempfile.TemporaryDirectory(prefix="fa4_ptxas_") as out_dir:
        shim = toolchain.build_runtime_shim(out_dir)
        env = toolchain.compile_env(shim, out_dir)
        env["CUTE_DSL_KEEP"] = "ptx,cubin"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        job = {"variant": dataclasses.asdict(variant), "kernel": kernel, "out_dir": out_dir,
               "tuning": settings}
        print(f"compiling {variant.name} ({kernel}, tuning {settings})", flush=True)
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(job)], env=env,
                              cwd=str(REPO), capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 2
        ptx = glob.glob(os.path.join(out_dir, "*.ptx"))
        if len(ptx) != 1:
            print(f"expected one PTX file in {out_dir}, found {ptx}", file=sys.stderr)
            return 2
        lines, serialized = summarize(ptxas_messages(ptx[0], variant.arch))
        if args.ptx:
            shutil.copyfile(ptx[0], args.ptx)
        sass = sass_of(out_dir)
        if args.sass:
            Path(args.sass).write_text(sass)
            print(f"SASS: {args.sass}")
    print("\n".join(lines))
    for address, count, mufu, fmnmx in wgmma_wait_gaps(sass):
        print(f"wait for all WGMMAs {count} instructions ({mufu} MUFU, {fmnmx} FMNMX) after the "
              f"wait for all but one at 0x{address}")
    print("WGMMAs serialized: see the C75xx lines" if serialized else "no C75xx message")
    return 1 if serialized else 0


if __name__ == "__main__":
    sys.exit(main())
