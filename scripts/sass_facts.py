"""What a compiled kernel's SASS and ELF attributes say about it, without running it: instruction
families (overall and per loop), setmaxnreg budgets, named barriers, local-memory traffic and
launch facts. The build's and the Blackwell checks (tests/test_build.py, tests/test_sm100_sass.py),
the static comparison with FA4 upstream (scripts/upstream_peer/sm100_static.py) and the cycle
model (benchmarks/sm100_prediction.py) read kernels through it.

    python scripts/sass_facts.py CUBIN [CUBIN ...]     # one JSON line per cubin
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

# Instruction families counted; a key counts the instructions whose text contains it.
FAMILIES = {
    "utchmma": "UTCHMMA",          # tcgen05.mma, 16-bit inputs
    "utchmma_2cta": "UTCHMMA.2CTA",
    "ldtm": "LDTM",                # tcgen05.ld
    "sttm": "STTM",                # tcgen05.st
    "utcbar": "UTCBAR",            # tcgen05.commit
    "tmem_alloc": "FIND_AND_SET",     # tcgen05.alloc (UTCATOMSWS[.2CTA].FIND_AND_SET)
    "tmem_alloc_2cta": "UTCATOMSWS.2CTA.FIND_AND_SET",
    "utcbar_multicast": "UTCBAR.2CTA.MULTICAST",  # a CTA pair's commit to both CTAs' barriers
    "tma_load_2cta": "UTMALDG.4D.2CTA",  # a pair's load, completing on the leader's barrier
    "cluster_wait": "UCGABAR_WAIT",
    "tmem_dealloc": "UTCATOMSWS.AND",
    "mufu_ex2": "MUFU.EX2",
    "mufu_tanh": "MUFU.TANH",
    "ffma2": "FFMA2",
    "fmul2": "FMUL2",
    "ffma": "FFMA ",
    "local_load": "LDL",
    "local_store": "STL",
    "tma_load": "UTMALDG",
    "tma_store": "UTMASTG",
    "global_store": "STG.E",       # st.global (not UTMASTG, whose name holds "STG")
    "bar_sync": "BAR.SYNC",
    "mbarrier_wait": "SYNCS.PHASECHK",
}
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.U)?\s+(?:!?U?P[T0-9]+,\s*)?0x([0-9a-f]+)")


def tool(name: str) -> str:
    """cuobjdump or nvdisasm: CUDA_HOME's, the nvidia-cu13 wheels', or PATH's."""
    candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", name)] if os.environ.get("CUDA_HOME") else []
    try:
        import nvidia.cu13

        candidates.append(os.path.join(list(nvidia.cu13.__path__)[0], "bin", name))
    except ImportError:
        pass
    candidates.append(shutil.which(name) or "")
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        raise FileNotFoundError(f"no {name}: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                                "or set CUDA_HOME")
    return found


def disassemble(cubin: str) -> str:
    """cuobjdump --dump-sass of one cubin."""
    return _cuobjdump("--dump-sass", cubin)


def _cuobjdump(*args: str) -> str:
    cuobjdump = tool("cuobjdump")
    # --dump-sass runs nvdisasm, which the wheels install beside cuobjdump.
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(cuobjdump), os.environ.get("PATH", "")]))
    proc = subprocess.run([cuobjdump, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """[first, last] addresses of each loop: a backward branch before the function's last EXIT
    (after it, ptxas places the retry paths of mbarrier waits, which branch back to the wait)."""
    exits = [a for a, t in code if t.split()[-1:] == ["EXIT"] or t.endswith("EXIT")]
    body_end = max(exits) if exits else max(a for a, _ in code)
    found = []
    for address, text in code:
        match = _BRANCH.search(text)
        if match and address < body_end and int(match.group(1), 16) < address:
            found.append((int(match.group(1), 16), address))
    return found


def encloses(outer: dict, inner: dict) -> bool:
    """Whether loop `outer` of `Facts.loop_families` holds loop `inner` (a different one)."""
    return outer is not inner and outer["first"] <= inner["first"] and inner["last"] <= outer["last"]


def innermost(loop_families: list) -> list:
    """The loops of `Facts.loop_families` that hold no other loop (a persistent kernel's tile
    loop holds its key-block loops)."""
    return [loop for loop in loop_families if not any(encloses(loop, other) for other in loop_families)]


def loop_instructions(loop: dict) -> int:
    """Instructions in a loop of `Facts.loop_families` (16 bytes each)."""
    return (loop["last"] - loop["first"]) // 16 + 1


def count(code, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    return sum(key in text for address, text in code if lo <= address <= hi)


def tmem_alloc_columns(code) -> list:
    """The TMEM columns each allocation asks for. `tcgen05.alloc` becomes
    UTCATOMSWS.FIND_AND_SET (UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN for a CTA pair), whose count
    operand is a uniform register holding the columns in granules of 32; ptxas loads it with a
    UMOV of an immediate just before. An operand it did not load that way reads None."""
    found = []
    for index, (_, text) in enumerate(code):
        if "UTCATOMSWS" not in text or "FIND_AND_SET" not in text:
            continue
        register = text.split(",")[-1].strip()
        value = None
        for _, earlier in reversed(code[:index]):
            match = re.match(rf"UMOV\s+{register},\s*0x([0-9a-f]+)$", earlier)
            if match:
                value = int(match.group(1), 16) * 32
                break
            if re.match(rf"\S+\s+{register}\b", earlier):
                break  # written some other way
        found.append(value)
    return found


@dataclasses.dataclass
class Facts:
    families: dict
    # Per loop (outermost first by start address): its instruction families.
    loop_families: list
    setmaxnreg: list  # (kind, registers): "DEALLOC" / "TRY_ALLOC"
    named_barriers: list  # (id, threads) of BAR.SYNC / BAR.ARV with a thread count
    mma_forms: dict  # "ss": both operands from shared memory, "ts": A from TMEM
    launch: dict  # registers, threads (REQNTID), named barriers the module declares
    tmem_alloc_columns: list  # TMEM columns of each allocation (its retry path's too)


def sass_facts(sass: str) -> tuple:
    code = instructions(sass)
    families = {name: count(code, key) for name, key in FAMILIES.items()}
    loop_families = [dict(first=lo, last=hi, **{name: count(code, key, lo, hi) for name, key in FAMILIES.items()})
                     for lo, hi in loops(code)]
    setmaxnreg = [(m.group(1), int(m.group(2), 16))
                  for m in (re.search(r"USETMAXREG\.(DEALLOC|TRY_ALLOC)\S*\s+(?:U?P\d+,\s*)?0x([0-9a-f]+)", t)
                            for _, t in code) if m]
    barriers = sorted({(int(m.group(1), 16), int(m.group(2), 16))
                       for m in (re.search(r"BAR\.(?:SYNC\S*|ARV)\s+0x([0-9a-f]+),\s*0x([0-9a-f]+)", t)
                                 for _, t in code) if m})
    mma = [t for _, t in code if "UTCHMMA" in t]
    forms = {"ss": sum(bool(re.search(r"UTCHMMA\S*\s+gdesc\[", t)) for t in mma),
             "ts": sum(bool(re.search(r"UTCHMMA\S*\s+tmem\[", t)) for t in mma)}
    return families, loop_families, setmaxnreg, barriers, forms, tmem_alloc_columns(code)


def launch_facts(cubin: str) -> dict:
    """REGCOUNT, REQNTID (the block size the kernel was compiled for) and NUM_BARRIERS from the
    cubin's ELF attributes."""
    elf = _cuobjdump("-elf", cubin)

    def attribute(name):
        match = re.search(rf"Attribute:\s*{name}\s*\n\s*Format:.*\n\s*Value:\s*(.*)", elf)
        return match.group(1).strip() if match else None

    regcount = attribute("EIATTR_REGCOUNT")
    reqntid = attribute("EIATTR_REQNTID")
    barriers = attribute("EIATTR_NUM_BARRIERS")
    return {
        "registers": int(regcount.rsplit(":", 1)[1]) if regcount else None,
        "threads": [int(x, 16) for x in reqntid.split()] if reqntid else None,
        "num_barriers": int(barriers, 16) if barriers else None,
    }


def facts(cubin: str) -> Facts:
    families, loop_families, setmaxnreg, barriers, forms, tmem_columns = sass_facts(disassemble(cubin))
    return Facts(families, loop_families, setmaxnreg, barriers, forms, launch_facts(cubin), tmem_columns)


def steady_loop(kernel: Facts) -> dict:
    """The softmax loop a long unmasked call spends its time in: of the loops that run a block's
    exponentials (at least 64 MUFU.EX2 or FFMA2-emulated ones), the one of fewest instructions;
    {} when there is none."""
    candidates = [loop for loop in kernel.loop_families if loop["mufu_ex2"] + loop["ffma2"] >= 64]
    return min(candidates, key=loop_instructions) if candidates else {}


def main(argv: list[str]) -> int:
    for cubin in argv:
        print(json.dumps({"cubin": cubin, **dataclasses.asdict(facts(cubin))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
