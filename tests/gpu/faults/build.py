"""Builds the GPU tier's library of broken sm_90a forward kernels (tests/gpu/faults/kernels.py)
beside a good one, all marked unverified, into build/faults/ (`python -m tests.gpu.faults.build`;
carry build/faults to the GPU machine, which has no DSL).

One problem class each (bf16, d128, forward), so the first-use gate probes each on its own:

    fwd_sm90a_bf16_d128_dv128                  the shipped kernel: passes
    fwd_sm90a_bf16_d128_dv128_causal           RegisterPoolHang: hangs
    fwd_sm90a_bf16_d128_dv128_local            Trap: faults (illegal instruction)
    fwd_sm90a_bf16_d128_dv128_softcap          BadAddress: faults (illegal address)
    fwd_sm90a_bf16_d128_dv128_causal_softcap   WrongScale: a wrong answer
    fwd_sm90a_bf16_d128_dv128_local_softcap    the shipped kernel, image corrupted: does not load
"""
import json
import shutil
import sys
from pathlib import Path

from fa4_jax.aot import build, menu
from fa4_jax.abi.routing import Variant

OUT = build.ROOT / "build" / "faults" / "libfa4_jax.so"
_KERNELS = "tests.gpu.faults.kernels"
# variant name -> (kernel class, what a probe of it finds)
FAULTS = {
    "fwd_sm90a_bf16_d128_dv128": (None, "pass"),
    "fwd_sm90a_bf16_d128_dv128_causal": (f"{_KERNELS}:RegisterPoolHang", "hang"),
    "fwd_sm90a_bf16_d128_dv128_local": (f"{_KERNELS}:Trap", "fault"),
    "fwd_sm90a_bf16_d128_dv128_softcap": (f"{_KERNELS}:BadAddress", "fault"),
    "fwd_sm90a_bf16_d128_dv128_causal_softcap": (f"{_KERNELS}:WrongScale", "wrong"),
    "fwd_sm90a_bf16_d128_dv128_local_softcap": (None, "load-error"),
}
UNLOADABLE = "fwd_sm90a_bf16_d128_dv128_local_softcap"


def fault_menu() -> build.Menu:
    variants = tuple(Variant("sm_90a", "bf16", 128, 128, mask, softcap)
                     for mask in ("none", "causal", "local") for softcap in (False, True))
    assert {v.name for v in variants} == set(FAULTS)

    def kernel_class(variant):
        return FAULTS[variant.name][0] or menu.kernel_class(variant)

    return build.Menu(variants, kernel_class=kernel_class, tuning_kwargs=lambda v: {},
                      unverified_arches=("sm_90a",))


def _corrupt_image(entry: Path, name: str, scratch: Path) -> Path:
    """A copy of a compiled variant's cache entry whose embedded kernel image has no ELF magic:
    the CUDA runtime refuses to load it."""
    copy = scratch / entry.name
    shutil.copytree(entry, copy, dirs_exist_ok=True)
    obj = copy / f"{name}.o"
    data = bytearray(obj.read_bytes())
    image = data.find(b"\x7fELF", 1)  # the first is the object's own header
    assert image > 0, f"no embedded image in {obj}"
    data[image:image + 4] = b"\0\0\0\0"
    obj.write_bytes(bytes(data))
    return copy


def main() -> int:
    built = fault_menu()
    found = build.compile_variants(built, jobs=2)
    found[UNLOADABLE] = _corrupt_image(found[UNLOADABLE], UNLOADABLE, OUT.parent / "corrupted")
    build.link(built, found, OUT)
    (OUT.parent / "manifest.json").write_text(json.dumps(build.manifest(built), indent=1) + "\n")
    print(f"fault library: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
