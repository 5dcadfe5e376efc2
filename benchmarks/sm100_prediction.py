"""A cycle-count prediction of the Blackwell forward's throughput, per head dim, from the kernel's
own tables and compiled loop (no Blackwell GPU has run it; docs/blackwell.md).

    python -m benchmarks.sm100_prediction [--markdown]

Per 128-row query tile and 128-key block (one stage's step), each unit's cycles on one SM at
B200's published rates:

- tensor: S = Q·Kᵀ and O += P·V, 2·128·128·(d + dv) FLOPs at 8192 dense bf16 FLOPs per clock
  (2.25 PFLOP/s over 148 SMs at the 1.855 GHz this implies);
- MUFU: the row's exponentials that run on MUFU.EX2 (all but the polynomial share) plus the row
  scale, at 16 per clock;
- issue: the softmax loop's instructions (the steady loop of the compiled kernel, from the build
  cache), one warp instruction per clock on each of the 4 sub-partitions, for the softmax warp
  group's 4 warps;
- SMEM: the MMAs' operand reads from shared memory (Q and K for S; V for P·V, P comes from TMEM)
  at 128 bytes per clock; on a CTA pair each SM reads its own Q rows but only its half of K
  and V (the pair's MMA takes the other half from the partner's shared memory).

Beside the bound, the K/V bytes each SM loads per clock at the bound: a block's K and V serve
q_stages stages (two with two Q tiles, one at d256), halved on a pair. B200's L2 bandwidth is
not published; the column compares the kernels with each other.

The steady state is bounded by the busiest unit; the two stages ping-pong (at d256 one stage's
softmax overlaps the next block's S GEMM) so that exponentials overlap MMAs, and the prediction
assumes that overlap holds (the bound), then takes
FA4 upstream's measured share of its own bound (its 1613 TFLOP/s bf16 d128 forward against the
same model's bound for its kernel, docs/blackwell.md) as the efficiency this kernel reaches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fa4_jax.kernels.common.exp2 import uses_poly
from fa4_jax.kernels.sm100 import hardware, plan

TENSOR_FLOPS_PER_CLOCK = 8192
MUFU_PER_CLOCK = 16
SMEM_BYTES_PER_CLOCK = 128
SUB_PARTITIONS = 4
CLOCK_HZ = 2.25e15 / (hardware.NUM_SMS * TENSOR_FLOPS_PER_CLOCK)
# FA4's paper: 1613 TFLOP/s, bf16 forward at d128 on B200.
UPSTREAM_D128_TFLOPS = 1613.0
# FA4 upstream's d128 softmax loop as compiled here (scripts/upstream_peer/sm100_static.py,
# flash-attn-4 4.0.0b36, causal d128, 1-CTA): 514 instructions, 113 MUFU.EX2 per block.
UPSTREAM_D128_LOOP = {"instructions": 514, "mufu_ex2": 113}


def cycles(head_dim: int, head_dim_v: int, loop_instructions: int, mufu_ex2: int, ctas: int = 1) -> dict:
    rows = plan.ROWS_PER_STAGE
    config = plan.TILE_CONFIGS.get((head_dim, head_dim_v), plan.TileConfig())
    tile_n = config.tile_n
    flops = 2 * rows * tile_n * (head_dim + head_dim_v)
    smem_bytes = 2 * (rows * head_dim + (tile_n * head_dim + tile_n * head_dim_v) // ctas)
    return {
        "tensor": flops / TENSOR_FLOPS_PER_CLOCK,
        "mufu": rows * mufu_ex2 / MUFU_PER_CLOCK,
        "issue": plan.WARPS_PER_GROUP * loop_instructions / SUB_PARTITIONS,
        "smem": smem_bytes / SMEM_BYTES_PER_CLOCK,
        "flops": flops,
        "kv_bytes": 2 * tile_n * (head_dim + head_dim_v) / ctas / config.q_stages,
    }


def bound_cycles(c: dict) -> float:
    return max(c["tensor"], c["mufu"], c["issue"], c["smem"])


def tflops(c: dict) -> float:
    return c["flops"] / bound_cycles(c) * hardware.NUM_SMS * CLOCK_HZ / 1e12


def upstream_efficiency() -> float:
    """Upstream's measured d128 throughput over this model's bound for its loop."""
    c = cycles(128, 128, UPSTREAM_D128_LOOP["instructions"], UPSTREAM_D128_LOOP["mufu_ex2"])
    return UPSTREAM_D128_TFLOPS / tflops(c)


def our_loops() -> dict[tuple[int, int, int], dict]:
    """(d, dv, CTAs per MMA) -> the steady softmax loop of the bf16 unmasked kernel, from the
    build cache."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sass_facts

    from fa4_jax.aot import build
    from fa4_jax.kernels.sm100 import menu as sm100

    out = {}
    for variant in sm100.MENU:
        if variant.dtype == "bf16" and variant.mask == "none" and not variant.softcap:
            cubins = build.cubins([variant])[variant.name]
            loop = sass_facts.steady_loop(sass_facts.facts(str(cubins[0])))
            ctas = plan.tile_config(variant.head_dim, variant.head_dim_v, sm100.TUNINGS[variant.tuning]).ctas
            out[(variant.head_dim, variant.head_dim_v, ctas)] = {
                "instructions": sass_facts.loop_instructions(loop), "mufu_ex2": loop["mufu_ex2"]}
    return out


def table(loops: dict) -> list[dict]:
    efficiency = upstream_efficiency()
    rows = []
    for (d, dv, ctas), loop in sorted(loops.items()):
        c = cycles(d, dv, loop["instructions"], loop["mufu_ex2"], ctas)
        bound = tflops(c)
        rows.append({"head dim": f"{d}/{dv}" + (" pair" if ctas == 2 else ""),
                     **{k: round(v) for k, v in c.items() if k not in ("flops", "kv_bytes")},
                     "bound TF/s": round(bound), "at upstream's efficiency": round(bound * efficiency),
                     "K/V loaded, B/clock": round(c["kv_bytes"] / bound_cycles(c))})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true")
    parser.parse_args(argv)
    rows = table(our_loops())
    keys = list(rows[0])
    print(f"clock {CLOCK_HZ / 1e9:.3f} GHz; upstream's efficiency against its bound: {upstream_efficiency():.2f}")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
