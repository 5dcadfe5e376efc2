"""Static side-by-side of fa4_jax's Blackwell forward with FA4 upstream's, both compiled here for
the same target (upstream's persistent grid asks the driver for the SM count: a stand-in
answers a B200's 148): per kernel, the instruction families of the whole kernel and of its steady
softmax loop, registers, setmaxnreg budgets, local memory, block size. Neither kernel has run;
this compares what ptxas made of them (docs/blackwell.md holds the table and its reading).

    python scripts/upstream_peer/sm100_static.py --python UPSTREAM_VENV/bin/python \\
        --flash-attn-src UNPACKED_FLASH_ATTN_4_WHEEL [--out build/sm100_static] [--markdown FILE]

UPSTREAM_VENV as for build.py (nvidia-cutlass-dsl[cu13] at fa4_jax's version, quack-kernels and
apache-tvm-ffi with --no-deps, einops; no torch). Upstream's FlashAttentionForwardSm100 is
compiled unchanged (flash-attn-4 4.0.0b36) with CUTE_DSL_ARCH naming the target, at upstream's
own choices for a long bf16 call (q_stage 2, 128 x 128 tiles; the static persistent scheduler
without a mask, LPT with one; 2-CTA where upstream's interface picks it: d128 and d192/dv128
without a mask),
and, at d128 without a mask, also 1-CTA, the shape fa4_jax ships. Upstream's d256 forward is a
kernel of its own (BlackwellFusedMultiHeadAttentionForward, always a CTA pair) that the 4.0.0b36
wheel does not have: with --flash-attn-hd256-src (a flash-attn source tree that has
flash_attn/cute/sm100_hd256_2cta_fmha_forward.py, e.g. upstream's main at commit 0251105a) it is
compiled too, with and without the causal mask. fa4_jax's side is the shipping library's cubins
from the build cache (`python -m fa4_jax.aot.build` first).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import sass_facts  # noqa: E402

from fa4_jax.kernels.sm100 import hardware  # noqa: E402

# (head_dim, causal, 2-CTA) of upstream's kernels compiled.
UPSTREAM = ((64, False, False), (64, True, False), (96, False, False), (96, True, False),
            (128, False, True), (128, False, False), (128, True, False), (192, False, True),
            (192, True, False))
# (head_dim, causal, 2-CTA) of upstream's dedicated d256 kernel.
UPSTREAM_HD256 = ((256, False, True), (256, True, True))
TARGET = "sm_100a"

_CHILD = """
import json, os, sys
sys.path.insert(0, {export_dir!r})
from export_fwd import import_upstream
import_upstream({src!r})
import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.utils
from cutlass import BFloat16, Float32


# What upstream's persistent grid asks the driver, answered for a B200 (no GPU here).
class B200Info:

    def __init__(self, *args, **kwargs):
        pass

    def get_device_multiprocessor_count(self):
        return {sms}

    def get_max_active_clusters(self, cluster_size):
        return {sms} // cluster_size


cutlass.utils.HardwareInfo = B200Info
from quack.compile_utils import make_fake_tensor
head_dim, causal, two_cta = {job!r}
head_dim_v = 128 if head_dim == 192 else head_dim
if head_dim == 256:
    from flash_attn.cute.sm100_hd256_2cta_fmha_forward import BlackwellFusedMultiHeadAttentionForward
    kernel = BlackwellFusedMultiHeadAttentionForward(head_dim, head_dim_v, qhead_per_kvhead=1, is_causal=causal,
                                                     is_local=False, use_2cta_instrs=True)
else:
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100
    kernel = FlashAttentionForwardSm100(head_dim, head_dim_v, qhead_per_kvhead=1, is_causal=causal,
                                        is_local=False, m_block_size=128, n_block_size=128, q_stage=2,
                                        is_static_persistent=not causal, use_2cta_instrs=two_cta)
b, sq, sk, h, d = (cute.sym_int() for _ in range(5))
mQ, mK = (make_fake_tensor(BFloat16, (b, s, h, head_dim), divisibility=8) for s in (sq, sk))
mV, mO = (make_fake_tensor(BFloat16, (b, s, h, head_dim_v), divisibility=8) for s in (sk, sq))
mLSE = make_fake_tensor(Float32, (b, h, sq), divisibility=1)

@cute.jit
def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
          softmax_scale: Float32, stream: cuda.CUstream):
    kernel(mQ, mK, mV, mO, mLSE, softmax_scale, stream=stream)

cute.compile(entry, mQ, mK, mV, mO, mLSE, Float32(0.0), cute.runtime.make_fake_stream(),
             options="--gpu-arch {target} --keep-cubin")
"""


def upstream_name(head_dim: int, causal: bool, two_cta: bool) -> str:
    return f"upstream_fwd_d{head_dim}" + ("_causal" if causal else "") + ("_2cta" if two_cta else "")


def compile_upstream(python: str, src: str, out: Path, jobs=UPSTREAM) -> dict[str, Path]:
    cubins = {}
    for job in jobs:
        name = upstream_name(*job)
        dump = out / name
        dump.mkdir(parents=True, exist_ok=True)
        for old in dump.glob("*.cubin"):
            old.unlink()
        env = dict(os.environ, CUTE_DSL_ARCH=TARGET, CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=str(dump))
        # The DSL compiles a @cute.jit function from its source file.
        script = dump / "compile_upstream.py"
        script.write_text(_CHILD.format(export_dir=str(Path(__file__).parent), src=src, job=job, target=TARGET,
                                        sms=hardware.NUM_SMS))
        proc = subprocess.run([python, str(script)], capture_output=True, text=True, env=env)
        found = sorted(dump.glob("*.cubin"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"{name} did not compile:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        cubins[name] = found[-1]
        print(f"{name}: compiled", flush=True)
    return cubins


def ours() -> dict[str, Path]:
    from fa4_jax.aot import build
    from fa4_jax.kernels.sm100 import menu as sm100

    wanted = [v for v in sm100.MENU if v.dtype == "bf16" and not v.softcap and v.mask in ("none", "causal")]
    found = build.cubins(wanted)
    missing = [n for n, paths in found.items() if not paths]
    if missing:
        raise SystemExit(f"not in the build cache: {missing}; run python -m fa4_jax.aot.build --arch sm_100f")
    return {name: paths[0] for name, paths in found.items()}


def row(name: str, facts: sass_facts.Facts) -> dict:
    loop = sass_facts.steady_loop(facts)
    fam = facts.families
    return {
        "kernel": name,
        "threads": facts.launch["threads"][0] if facts.launch["threads"] else None,
        "regs": facts.launch["registers"],
        "setmaxnreg": "/".join(str(r) for _, r in facts.setmaxnreg),
        "UTCHMMA ss/ts": f"{facts.mma_forms['ss']}/{facts.mma_forms['ts']}",
        "2CTA": fam["utchmma_2cta"],
        "LDTM/STTM": f"{fam['ldtm']}/{fam['sttm']}",
        "local ld/st": f"{fam['local_load']}/{fam['local_store']}",
        "loop instrs": sass_facts.loop_instructions(loop) if loop else None,
        "loop MUFU.EX2": loop.get("mufu_ex2"),
        "loop FFMA2": loop.get("ffma2"),
        "loop FFMA": loop.get("ffma"),
        "loop LDTM/STTM": f"{loop.get('ldtm')}/{loop.get('sttm')}" if loop else None,
    }


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("" if r[k] is None else str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the upstream environment's python")
    parser.add_argument("--flash-attn-src", required=True, help="the unpacked flash-attn-4 wheel")
    parser.add_argument("--flash-attn-hd256-src", help="a flash-attn source tree with the d256 kernel")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "sm100_static")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    rows = [row(name, sass_facts.facts(str(cubin))) for name, cubin in ours().items()]
    rows += [row(name, sass_facts.facts(str(cubin)))
             for name, cubin in compile_upstream(args.python, args.flash_attn_src, args.out).items()]
    if args.flash_attn_hd256_src:
        rows += [row(name, sass_facts.facts(str(cubin))) for name, cubin in
                 compile_upstream(args.python, args.flash_attn_hd256_src, args.out, UPSTREAM_HD256).items()]
    table = markdown(rows)
    print(table)
    (args.out / "sm100_static.json").write_text(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
