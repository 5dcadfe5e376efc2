"""Boolean masks: what reading jax's `mask=` costs against the same mask as a flag, in one process.

Dense causal calls (d128, 16k tokens per batch, 16 heads, bf16), forward and forward+backward,
through the drop-in `dot_product_attention`:

- fa4_jax_is_causal: `is_causal=True` (the causal kernels);
- fa4_jax_mask: `mask=` a causal [1, 1, T, T] bool array (the mask_array kernels: the mask's
  span tables skip the blocks above the diagonal, run those below unmasked, and read bits on the
  diagonal; the bits and tables are made in every step, from the mask passed to it);
- mask_operands (forward only): that preparation alone (`fa4_jax.runtime.mask_bits.operands`);
- cudnn_is_causal / cudnn_mask: `jax.nn.dot_product_attention(implementation="cudnn")` with the
  flag and with the same array;
- fa4_jax_padding_mask / cudnn_padding_mask: a key padding mask [B, 1, 1, T] instead (each
  entry's keys past a length drawn from [T/2, T] hidden), as BERT-style encoders pass one.

TF/s count the causal work (half the square) for the causal peers and the visible pairs for the
padding ones. The masks are arguments of the timed step, as a model's mask is built outside its
attention call.

On the GPU machine:  python -m benchmarks.bench_mask --out .bench_mask
On any machine (CPU, tiny shapes, the reference): python -m benchmarks.bench_mask --dry-run
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax
from benchmarks.bench_attention import FWD_BWD_FLOP_FACTOR, MODES, Settings, time_step
from benchmarks.bench_packed import input_sets, step


def peers(implementation: str):
    """name -> attend(q, k, v, mask)."""
    drop_in = functools.partial(fa4_jax.dot_product_attention, implementation=implementation)

    def operands(q, k, v, mask):
        from fa4_jax.core.params import AttentionParams
        from fa4_jax.runtime import mask_bits

        params = AttentionParams(softmax_scale=1.0)  # no rules: a mask's call folds them into the bits
        return mask_bits.operands(mask[:, 0], params, None, q.shape[1], k.shape[1], q.shape[0])

    result = {
        "fa4_jax_is_causal": lambda q, k, v, mask, padding: drop_in(q, k, v, is_causal=True),
        "fa4_jax_mask": lambda q, k, v, mask, padding: drop_in(q, k, v, mask=mask),
        "mask_operands": lambda q, k, v, mask, padding: operands(q, k, v, mask),
        "fa4_jax_padding_mask": lambda q, k, v, mask, padding: drop_in(q, k, v, mask=padding),
    }
    if implementation == "cute":
        cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
        result["cudnn_is_causal"] = lambda q, k, v, mask, padding: cudnn(q, k, v, is_causal=True)
        result["cudnn_mask"] = lambda q, k, v, mask, padding: cudnn(q, k, v, mask=mask)
        # cuDNN through jax takes a mask of whole [T, S] planes only.
        result["cudnn_padding_mask"] = lambda q, k, v, mask, padding: cudnn(
            q, k, v, mask=jnp.broadcast_to(padding, (q.shape[0], 1, q.shape[1], k.shape[1])))
    return result


def key_padding(batch: int, seqlen: int):
    """(bool [batch, 1, 1, seqlen] key padding mask, visible pairs): lengths drawn from
    [seqlen / 2, seqlen] with a fixed seed."""
    lengths = np.random.default_rng(seqlen).integers(seqlen // 2, seqlen + 1, batch)
    mask = np.arange(seqlen)[None, :] < lengths[:, None]
    return jnp.asarray(mask[:, None, None, :]), int(lengths.sum()) * seqlen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the reference")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--peers", default="", help="comma-separated peer names (default: all)")
    p.add_argument("--out", default=".bench_mask")
    args = p.parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    implementation = "reference" if args.dry_run else "cute"
    tokens, heads, head_dim = (256, 2, 32) if args.dry_run else (16384, 16, 128)
    seqlens = [128] if args.dry_run else [int(s) for s in args.seqlens.split(",")]
    settings = Settings(tokens=0, hidden=0, dtype="bf16", calls=2 if args.dry_run else 10,
                        repeats=2 if args.dry_run else 5, max_call_s=3.0, max_case_s=6.0,
                        warmup_s=0.0 if args.dry_run else 0.3, max_xla_seqlen=0,
                        fa4_implementation=implementation)
    results = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        shape = (batch, seqlen, heads, head_dim)
        mask = jnp.tril(jnp.ones((seqlen, seqlen), bool))[None, None]
        padding, padding_pairs = key_padding(batch, seqlen)
        print(f"causal {batch} x {seqlen}, {heads} heads of {head_dim}", flush=True)
        for mode in args.modes.split(","):
            factor = FWD_BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1
            for peer, attend in peers(implementation).items():
                pairs = padding_pairs if peer.endswith("padding_mask") else batch * seqlen ** 2 / 2
                flops = 4 * heads * head_dim * pairs * factor
                if args.peers and peer not in args.peers.split(","):
                    continue
                if peer == "mask_operands" and mode != "fwd":
                    continue
                record = dict(seqlen=seqlen, batch=batch, mode=mode, peer=peer)
                try:
                    timing = time_step(step(attend, mode), input_sets(shape, len(results), (mask, padding)), settings)
                except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported
                    message = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    print(f"  {mode:7s} {peer:18s} error: {message}", flush=True)
                    results.append(dict(record, status="error", error=message))
                    continue
                tflops = 0.0 if peer == "mask_operands" else flops / (timing.ms * 1e-3) / 1e12
                print(f"  {mode:7s} {peer:18s} {timing.ms:9.3f} ms  {tflops:6.0f} TF/s", flush=True)
                results.append(dict(record, status="ok", ms=timing.ms, tflops=tflops,
                                    samples_ms=timing.samples_ms))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mask.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), argv=sys.argv[1:], results=results), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
