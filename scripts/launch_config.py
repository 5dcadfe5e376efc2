"""The launch configuration a compiled variant's exported host launcher issues, read without a GPU.

A cubin does not say how its kernel is launched: the host launcher that export_to_c wrote (the
variant's NAME.o in the build cache) does, when it calls the DSL runtime's _cudaLaunchKernelEx
with the grid, block, dynamic shared memory and launch attributes, a CTA pair's cluster among
them. This links launchers against stand-ins for the runtime's entry points
(launch_config_stub.cc) that record each call instead of reaching a driver, and calls them
through the dispatch table the build generates (fa4_jax/aot/codegen.py), as the FFI handler
does. tests/test_launch_config.py checks the shipping menu with it.

    python scripts/launch_config.py NAME [NAME ...]   # one JSON line per cached variant
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fa4_jax.aot import build, codegen, menu, toolchain  # noqa: E402

STUB = REPO / "scripts" / "launch_config_stub.cc"

# (b, sq, sk, h, hk) of the calls made to each variant: a short call, and a long GQA one whose
# grid a persistent kernel caps at its SM count.
SHAPES = ((1, 1000, 1000, 4, 4), (2, 5000, 3000, 16, 2))
# What the stand-in device answers for its opt-in shared memory per block: 227 KB, an H100's and
# a B200's alike.
SMEM_OPTIN = 232448
CLUSTER_DIMENSION = 4  # cudaLaunchAttributeClusterDimension


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # the name the launcher asked cudaLibraryGetKernel for ("?": a handle it never got)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int  # dynamic shared memory, bytes
    cluster: tuple[int, int, int] | None  # None: no cluster attribute
    attributes: dict  # every launch attribute: cudaLaunchAttributeID -> its value


@dataclasses.dataclass
class Call:
    shape: tuple[int, ...]  # SHAPES' (b, sq, sk, h, hk)
    returned: int  # the launcher's return code (0 = launched)
    launches: list[Launch]


@dataclasses.dataclass
class Record:
    """One variant: what its load() did and what each call launched."""

    name: str
    loaded: int  # load()'s cudaError_t
    # The runtime calls other than launches, in order, as the stub wrote them: load()'s kernel
    # attributes and device queries, and any a call made.
    runtime: list[dict]
    calls: list[Call]

    @property
    def launches(self) -> list[Launch]:
        return [launch for call in self.calls for launch in call.launches]


def _launch(line: dict) -> Launch:
    attributes = {a: tuple(v) if isinstance(v, list) else v for a, v in line["attrs"]}
    return Launch(line["kernel"], tuple(line["grid"]), tuple(line["block"]), line["smem"],
                  attributes.get(CLUSTER_DIMENSION), attributes)


def parse(stdout: str) -> dict[str, Record]:
    """The harness's JSON lines (launch_config_stub.cc) -> variant name -> Record."""
    records: dict[str, Record] = {}
    record = call = None
    for line in map(json.loads, filter(None, stdout.splitlines())):
        if "variant" in line:
            record = records[line["variant"]] = Record(line["variant"], -1, [], [])
            call = None
        elif "loaded" in line:
            record.loaded = line["loaded"]
        elif "shape" in line:
            call = Call(tuple(line["shape"]), -1, [])
            record.calls.append(call)
        elif "returned" in line:
            call.returned = line["returned"]
        elif line.get("call") == "cudaLaunchKernelEx" and call is not None:
            call.launches.append(_launch(line))
        else:
            record.runtime.append(line)
    return records


class Harness:
    """The stub compiled once into `work`; `run` links variants against it."""

    def __init__(self, work: Path):
        self.work = Path(work)
        self.includes = [f"-I{REPO / 'ffi'}", f"-I{toolchain.cuda().include}"]
        self.stub = self.work / "stub.o"
        self._compile(STUB, self.stub, "-O1")
        self.runs = 0

    def _compile(self, source: Path, out: Path, *flags: str) -> None:
        toolchain.run([toolchain.cxx(), "-std=c++17", *flags, "-c", str(source), "-o", str(out),
                       *self.includes])

    def run(self, variants: dict, shapes=SHAPES, smem_optin: int = SMEM_OPTIN) -> dict[str, Record]:
        """variants: Variant -> its cache entry (build.entries). One executable for all of them."""
        self.runs += 1
        work = self.work / f"run{self.runs}"
        work.mkdir()
        headers = {v.name: (entry / f"{v.name}.h").read_text() for v, entry in variants.items()}
        dispatch = work / "dispatch.cc"
        dispatch.write_text(codegen.dispatch_source(list(variants), headers))
        # -O0: the table's wrappers only fill structs; optimising them costs more than it saves.
        self._compile(dispatch, work / "dispatch.o", "-O0", *(f"-I{e}" for e in variants.values()))
        exe = work / "harness"
        # A launcher that needs a runtime entry point the stub lacks fails here, at the link.
        toolchain.run([toolchain.cxx(), "-o", str(exe), str(self.stub), str(work / "dispatch.o"),
                       *(str(entry / f"{v.name}.o") for v, entry in variants.items())])
        proc = subprocess.run([str(exe), str(smem_optin), *(",".join(map(str, s)) for s in shapes)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{exe} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr}")
        return parse(proc.stdout)


def launch_config(variant, entry: Path, shapes=SHAPES) -> Record:
    """What `variant`'s launcher, from its cache entry (build.entries), asks CUDA for."""
    with tempfile.TemporaryDirectory(prefix="fa4_jax-launch-") as work:
        return Harness(Path(work)).run({variant: Path(entry)}, shapes)[variant.name]


def main(argv: list[str]) -> int:
    by_name = {v.name: v for v in menu.MENU}
    variants = [by_name[name] for name in argv]
    found = build.entries(build.Menu(tuple(variants)))
    with tempfile.TemporaryDirectory(prefix="fa4_jax-launch-") as work:
        records = Harness(Path(work)).run({v: found[v.name] for v in variants})
    for record in records.values():
        print(json.dumps(dataclasses.asdict(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
