"""Grouped-query decode (one query row per sequence): GQA packing against no packing and cuDNN.

Each case is one attention call of a decoder at generation time: q [b, 1, heads_q, d] against a
KV cache k, v [b, seqlen_k, heads_kv, d]. Peers, in one process, on the same inputs:

- fa4_jax: `fa4_jax.attention` (GQA-packed and split-KV where fa4_jax/runtime/pack_gqa.py and
  fa4_jax/runtime/split_kv.py say so);
- fa4_jax_fulltile: the same, with the full-height tiles of longer calls instead of the
  64-row "decode" tiles (the development library's "linear" tuning, compiled at d64/d128/d256
  in bf16: `python -m benchmarks.ablations build`);
- fa4_jax_nosplit: the same, split-KV off (`dispatch.forward(..., split_kv=1)`);
- fa4_jax_unpacked: packing and split-KV off;
- fa4_jax_ragged: `fa4_jax.attention` with per-entry lengths (every cache 37 keys short of
  the buffer, so each entry's last key block is partial), as a serving batch calls it;
- cudnn, xla: `jax.nn.dot_product_attention`.

No mask: with one query row, fa4_jax's bottom-right causal mask sees every key, while
jax.nn.dot_product_attention's is_causal is aligned top-left and would see key 0 only.

Reported: µs per call and the KV cache's bytes read per second (decode reads the cache once; its
ceiling is the HBM bandwidth, ~4.8 TB/s on the H200). The timer is bench_attention's.

On the GPU machine:  python -m benchmarks.bench_decode --out .bench_decode
On any machine (CPU, tiny shapes, the reference): python -m benchmarks.bench_decode --dry-run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

import fa4_jax
from benchmarks.bench_attention import Settings, time_step

# (batch, seqlen_k, heads_q, heads_kv, head_dim): Llama-3-8B's attention (32 query heads over 8
# KV heads, d128) at a large batch with an 8k cache and a small batch with a 32k cache, and an
# MQA shape.
CASES = {
    "gpu": ((64, 8192, 32, 8, 128), (8, 32768, 32, 8, 128), (32, 8192, 16, 1, 128),
            (64, 8192, 32, 8, 64)),
    "dry_run": ((2, 64, 4, 2, 16), (1, 96, 4, 1, 16)),
}
# fa4_jax's rows: dispatch.forward settings (None: fa4_jax.attention itself).
FA4_SETTINGS = {"fa4_jax": None, "fa4_jax_fulltile": dict(tuning="linear"),
                "fa4_jax_nosplit": dict(split_kv=1),
                "fa4_jax_unpacked": dict(split_kv=1, pack_gqa=False)}
PEERS = (*FA4_SETTINGS, "fa4_jax_ragged", "cudnn", "xla")
RAGGED_SHORTFALL = 37


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim * 2

    def label(self) -> str:
        return (f"b={self.batch} sk={self.seqlen_k} hq={self.heads_q} hkv={self.heads_kv} "
                f"d={self.head_dim}")


def attend_fn(peer: str, implementation: str):
    if peer == "fa4_jax_ragged":
        def attend(q, k, v):
            b, sk = k.shape[:2]
            return fa4_jax.attention(
                q, k, v, implementation=implementation,
                query_seq_lengths=jnp.ones((b,), jnp.int32),
                key_value_seq_lengths=jnp.full((b,), max(sk - RAGGED_SHORTFALL, 1), jnp.int32))
        return attend
    if peer not in FA4_SETTINGS:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=peer)
    settings = FA4_SETTINGS[peer]
    if settings is None or implementation != "cute":
        return lambda q, k, v: fa4_jax.attention(q, k, v, implementation=implementation)
    from fa4_jax.runtime import dispatch
    from fa4_jax.api.attention import attention_params

    if "tuning" in settings:
        from benchmarks import ablations

        settings = dict(settings, library=ablations.library())

    def attend(q, k, v):
        params = attention_params(q, k, v, implementation=implementation)
        return dispatch.forward(q, k, v, params, **settings)[0]
    return attend


def inputs(case: DecodeCase, seed: int) -> list[tuple]:
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = ((case.batch, 1, case.heads_q, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim))
    tensors = [jax.random.normal(key, shapes[i % 3], jnp.bfloat16) for i, key in enumerate(keys)]
    jax.block_until_ready(tensors)
    return [tuple(tensors[0:3]), tuple(tensors[3:6])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the reference")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--out", default=".bench_decode")
    args = p.parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    implementation = "reference" if args.dry_run else "cute"
    settings = Settings(tokens=0, hidden=0, dtype="bf16", calls=2 if args.dry_run else 20,
                        repeats=2 if args.dry_run else 5, max_call_s=3.0, max_case_s=5.0,
                        warmup_s=0.0 if args.dry_run else 0.3, max_xla_seqlen=0,
                        fa4_implementation=implementation)
    results = []
    for shape in CASES["dry_run" if args.dry_run else "gpu"]:
        case = DecodeCase(*shape)
        input_sets = inputs(case, seed=len(results))
        for peer in args.peers.split(","):
            try:
                step = jax.jit(attend_fn(peer, implementation))
                timing = time_step(step, input_sets, settings)
            except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported
                print(f"{case.label()}  {peer:17s} error: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:160]}", flush=True)
                results.append(dict(case=dataclasses.asdict(case), peer=peer, status="error",
                                    error=str(error)[:500]))
                continue
            gb_s = case.kv_bytes / (timing.ms * 1e-3) / 1e9
            print(f"{case.label()}  {peer:17s} {timing.ms * 1e3:9.1f} us  {gb_s:7.0f} GB/s",
                  flush=True)
            results.append(dict(case=dataclasses.asdict(case), peer=peer, status="ok",
                                us=timing.ms * 1e3, kv_gb_s=gb_s, samples_ms=timing.samples_ms))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), argv=sys.argv[1:],
                       results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
