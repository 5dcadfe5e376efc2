"""Head dims without a kernel of their own: the padded call against the dim that serves it and cuDNN.

A call at head dim d (not in the menu) runs zero-padded on the narrowest wider compiled pair D
(`fa4_jax.abi.routing.serving_head_dims`). Per case, in one process, on inputs of the same
batch, sequence length and heads:

- fa4_jax: `fa4_jax.attention` at d (padded inside);
- fa4_jax_served: `fa4_jax.attention` on inputs made at D directly (the kernel alone, no pad
  or slice);
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")` at d.

TF/s count every row's work at the true dim d (bench_attention's `Case.flops`: forward
4·b·h·s²·d, halved when causal, 3.5× that forward+backward). The padded row's time over the served
row's is the cost of serving d with D's kernel plus the pad and slice copies.

On the GPU machine:  python -m benchmarks.bench_head_dims --out .bench_head_dims
On any machine (CPU, tiny shapes, the reference): python -m benchmarks.bench_head_dims --dry-run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax

import fa4_jax
from benchmarks.bench_attention import (DTYPES, MODES, Case, Settings, make_input_sets, make_step,
                                        time_step)
from fa4_jax.kernels.sm90 import menu as sm90
from fa4_jax.abi.routing import serving_head_dims

HEAD_DIMS = {"gpu": (32, 40, 80, 112, 160), "dry_run": (24,)}
SEQLENS = {"gpu": (4096, 16384), "dry_run": (128,)}
TOKENS = {"gpu": 16384, "dry_run": 256}
HEADS = {"gpu": 16, "dry_run": 2}
PEERS = ("fa4_jax", "fa4_jax_served", "cudnn")


def served_head_dim(case: Case) -> int:
    """The compiled head dim whose kernel serves the case's (square) head dim."""
    served = serving_head_dims(case.head_dim, case.head_dim, sm90.HEAD_DIMS)
    if served is None or served[0] != served[1]:
        raise ValueError(f"no square compiled head dim serves d{case.head_dim}")
    return served[0]


def _label(case: Case) -> str:
    return f"{case.label()} (served d{served_head_dim(case)})"


def attend_fn(peer: str, case: Case, implementation: str):
    if peer == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                                            implementation="cudnn")
    return lambda q, k, v: fa4_jax.attention(q, k, v, causal=case.causal,
                                             implementation=implementation)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the reference")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--out", default=".bench_head_dims")
    args = p.parse_args(argv)
    grid = "dry_run" if args.dry_run else "gpu"
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    implementation = "reference" if args.dry_run else "cute"
    settings = Settings(tokens=TOKENS[grid], hidden=0, dtype="bf16",
                        calls=2 if args.dry_run else 20, repeats=2 if args.dry_run else 5,
                        max_call_s=3.0, max_case_s=5.0, warmup_s=0.0 if args.dry_run else 0.3,
                        max_xla_seqlen=0, fa4_implementation=implementation)
    results = []
    for mode in MODES:
        for head_dim in HEAD_DIMS[grid]:
            for seqlen in SEQLENS[grid]:
                for causal in (False, True):
                    case = Case(mode, head_dim, seqlen, causal, TOKENS[grid] // seqlen, HEADS[grid])
                    results.extend(_time_case(case, args.peers.split(","), implementation,
                                              settings, seed=len(results)))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "head_dims.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), argv=sys.argv[1:],
                       results=results), f, indent=1)
    return 0


def _time_case(case: Case, peers, implementation: str, settings: Settings, seed: int) -> list[dict]:
    rows = []
    for peer in peers:
        head_dim = served_head_dim(case) if peer == "fa4_jax_served" else case.head_dim
        row = dict(case=dataclasses.asdict(case), peer=peer, timed_head_dim=head_dim)
        try:
            step = make_step(attend_fn(peer, case, implementation), case.mode)
            inputs = make_input_sets(dataclasses.replace(case, head_dim=head_dim), DTYPES["bf16"], seed)
            timing = time_step(step, inputs, settings)
        except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported
            print(f"{_label(case)}  {peer:15s} error: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:160]}", flush=True)
            rows.append(dict(row, status="error", error=str(error)[:500]))
            continue
        tflops = case.flops / (timing.ms * 1e-3) / 1e12
        rows.append(dict(row, status="ok", ms=timing.ms, tflops=tflops, samples_ms=timing.samples_ms))
        print(f"{_label(case)}  {peer:15s} {timing.ms:8.3f} ms  {tflops:6.1f} TF/s", flush=True)
    ok = {row["peer"]: row["ms"] for row in rows if row["status"] == "ok"}
    if "fa4_jax" in ok:
        ratios = [f"{name} {ok[name] / ok['fa4_jax']:.3f}x" for name in ("fa4_jax_served", "cudnn")
                  if name in ok]
        print(f"{_label(case)}  fa4_jax's time against: {', '.join(ratios)}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
