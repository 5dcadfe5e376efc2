"""Packed documents: segment ids read in the kernels against the alternatives, in one process.

Each case packs documents into rows of `row_tokens` tokens (d128, 16 heads, bf16, causal
within each document), as MaxText and Levanter pack a training batch, and times, forward and
forward+backward, on the same documents:

- fa4_jax_segments: `fa4_jax.attention(query_segment_ids=, kv_segment_ids=)` (the segments
  kernels: key blocks that share no document with a query tile are skipped);
- fa4_jax_segments_det (forward+backward only): the same with deterministic=True (dQ added in
  a fixed order; each key block walks the query tiles whose key hull holds it);
- fa4_jax_varlen: `fa4_jax.varlen_attention` on the documents packed without padding, one
  cu_seqlens for queries and keys (in place, as segment ids);
- fa4_jax_dense_equal: the same kernels' dense call on one sequence per row of the same useful
  work (causal, sqrt(2 · pairs per row) tokens rounded to 128): what the packed call should
  approach;
- fa4_jax_dense_docs (cases of equal documents only): the same documents as a dense batch, one
  sequence each: the kernels' own speed on sequences that short, which the packed call cannot
  beat (its tiles are as short), so the gap to it is the cost of the segment ids alone;
- cudnn_dense_equal, cudnn_dense_docs: the same two dense calls on cuDNN
  (`jax.nn.dot_product_attention(is_causal=True)`): how far below its long-sequence speed the
  best peer runs on documents that short;
- fa4_jax_varlen_apart: `fa4_jax.varlen_attention` with two cu_seqlens arrays (so it cannot
  assume one packing): the documents gathered into rows of total_q + total_k positions that
  align each document's diagonal with the row's (the padded ragged batch this replaced is in
  docs/perf-log.md, "Segment ids in the kernels");
- span_tables (forward only): the segment ids' span tables alone (fa4_jax.runtime.segments), the part
  of a segments call that is not the kernel;
- cudnn_mask: `jax.nn.dot_product_attention(implementation="cudnn")` with the block-diagonal
  causal mask as a bool array (skipped past --max-mask-gib: the mask is a [b, 1, T, T] array);
- fa4_jax_mask: `fa4_jax.dot_product_attention` with the same array (the mask_array kernels,
  which read it packed to bits with its span tables; same limit).

Document lengths are long-tailed (a log-normal with a median of 600 tokens, clipped to the row),
drawn with a fixed seed; the "one long + short" case is one 32k document and 255 of 128 tokens
in a 64k row, timed against that 32k document alone (fa4_jax_long_alone); two cases of equal
documents, 512 tokens (on the kernels' 128-token blocks) and 500 (across them), time the
packing against the same documents batched (fa4_jax_dense_docs).

TF/s count the useful work only: 4 · heads · d · (pairs a causal document attends) per
document, forward+backward 3.5×. The timer is bench_attention's; the segment ids are arguments
of the timed step, as a training step's batch is (closed over, XLA would fold their tables into
constants at compile time).

On the GPU machine:  python -m benchmarks.bench_packed --out .bench_packed
On any machine (CPU, tiny shapes, the reference): python -m benchmarks.bench_packed --dry-run
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax
from benchmarks.bench_attention import FWD_BWD_FLOP_FACTOR, MODES, Settings, time_step


# Peers timed in one mode only: the tables are a forward's; deterministic mode differs from
# the default in the backward alone.
ONLY_IN_MODE = {"span_tables": "fwd", "fa4_jax_segments_det": "fwd_bwd"}


@dataclasses.dataclass(frozen=True)
class PackedCase:
    """Rows of row_tokens tokens holding documents of `lengths` (in order, row after row; the
    rest of each row is padding)."""

    name: str
    rows: int
    row_tokens: int
    heads: int
    head_dim: int
    lengths: tuple  # per row, the documents' lengths

    @property
    def useful_pairs(self) -> int:
        return sum(n * (n + 1) // 2 for row in self.lengths for n in row)

    def flops(self, mode: str) -> float:
        return 4 * self.heads * self.head_dim * self.useful_pairs * (FWD_BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1)

    def segment_ids(self):
        """(query ids, kv ids) int32 [rows, row_tokens]: documents 0, 1, ..., padding -1 / -2."""
        ids = np.full((self.rows, self.row_tokens), -1, np.int32)
        for r, row in enumerate(self.lengths):
            ids[r, :sum(row)] = np.repeat(np.arange(len(row), dtype=np.int32), row)
        return jnp.asarray(ids), jnp.asarray(np.where(ids < 0, -2, ids))

    def equal_documents(self) -> int | None:
        """The documents' length when every row holds documents of one length and no padding
        (then they batch densely), else None."""
        lengths = {n for row in self.lengths for n in row}
        if len(lengths) == 1 and all(sum(row) == self.row_tokens for row in self.lengths):
            return lengths.pop()
        return None

    def equal_dense_tokens(self) -> int:
        """The causal sequence length of the same useful pairs, rounded to 128."""
        return max(128, round(math.sqrt(2 * self.useful_pairs / self.rows) / 128) * 128)

    def label(self) -> str:
        docs = sum(len(row) for row in self.lengths)
        return f"{self.name}: {self.rows}x{self.row_tokens} tokens, {docs} docs, h={self.heads} d={self.head_dim}"


def long_tailed_rows(rng, rows: int, row_tokens: int, median: float = 600.0) -> tuple:
    lengths = []
    for _ in range(rows):
        row, used = [], 0
        while used < row_tokens:
            n = int(min(max(1, rng.lognormal(math.log(median), 1.2)), row_tokens - used))
            row.append(n)
            used += n
        lengths.append(tuple(row))
    return tuple(lengths)


def cases(dry_run: bool) -> list[PackedCase]:
    rng = np.random.default_rng(0)
    if dry_run:
        return [PackedCase("long-tailed", 2, 256, 2, 32, long_tailed_rows(rng, 2, 256, median=40.0)),
                PackedCase("equal 40", 2, 200, 2, 32, ((40,) * 5,) * 2)]
    return [
        PackedCase("long-tailed 16k", 4, 16384, 16, 128, long_tailed_rows(rng, 4, 16384)),
        PackedCase("long-tailed 64k", 1, 65536, 16, 128, long_tailed_rows(rng, 1, 65536)),
        PackedCase("one long + short", 1, 65536, 16, 128, ((32768,) + (128,) * 255,)),
        PackedCase("equal 512", 4, 16384, 16, 128, ((512,) * 32,) * 4),
        PackedCase("equal 500", 4, 16000, 16, 128, ((500,) * 32,) * 4),
    ]


def _cu_seqlens(case: PackedCase):
    """Packed [total] layout of the rows' documents (padding dropped) and its cu_seqlens."""
    flat = [n for row in case.lengths for n in row]
    return jnp.asarray(np.concatenate([[0], np.cumsum(flat)]).astype(np.int32)), max(flat)


def peers(case: PackedCase, implementation: str, max_mask_gib: float):
    """name -> (attend(q, k, v, q_ids, kv_ids) on [rows, row_tokens, heads, d] inputs, or a
    reason to skip)."""
    flat_index = jnp.asarray(np.concatenate([r * case.row_tokens + np.arange(sum(row))
                                             for r, row in enumerate(case.lengths)]))
    cu_seqlens, longest = _cu_seqlens(case)

    def segments(deterministic):
        def attend(q, k, v, q_ids, kv_ids):
            return fa4_jax.attention(q, k, v, causal=True, implementation=implementation, deterministic=deterministic,
                                     query_segment_ids=q_ids, kv_segment_ids=kv_ids)
        return attend

    def varlen(apart):
        def attend(q, k, v, q_ids, kv_ids):
            packed = [jnp.take(x.reshape(-1, *x.shape[2:]), flat_index, axis=0, unique_indices=True,
                               indices_are_sorted=True) for x in (q, k, v)]
            # A second array of the same values: varlen_attention cannot know the packing is one.
            cu_k = jnp.array(cu_seqlens) if apart else cu_seqlens
            out = fa4_jax.varlen_attention(*packed, cu_seqlens, cu_k, max_seqlen_q=longest,
                                           max_seqlen_k=longest, causal=True, implementation=implementation)
            return jnp.zeros((case.rows * case.row_tokens, *out.shape[1:]), out.dtype).at[flat_index].set(
                out, unique_indices=True, indices_are_sorted=True).reshape(q.shape)
        return attend

    def span_tables(q, k, v, q_ids, kv_ids):
        from fa4_jax.runtime import segments as tables

        return tables.operands((q_ids, kv_ids))

    def document_mask(q_ids, kv_ids):
        causal = jnp.tril(jnp.ones((case.row_tokens, case.row_tokens), bool))
        return (q_ids[:, None, :, None] == kv_ids[:, None, None, :]) & causal

    def cudnn_mask(q, k, v, q_ids, kv_ids):
        return jax.nn.dot_product_attention(q, k, v, mask=document_mask(q_ids, kv_ids), implementation="cudnn")

    def fa4_jax_mask(q, k, v, q_ids, kv_ids):
        return fa4_jax.dot_product_attention(q, k, v, mask=document_mask(q_ids, kv_ids),
                                             implementation=implementation)

    mask_gib = case.rows * case.row_tokens ** 2 / 2**30
    result = {"fa4_jax_segments": segments(False), "fa4_jax_segments_det": segments(True),
              "fa4_jax_varlen": varlen(apart=False),
              "fa4_jax_varlen_apart": varlen(apart=True)}
    result["span_tables"] = span_tables
    result["cudnn_mask"] = cudnn_mask if implementation == "cute" and mask_gib <= max_mask_gib else (
        "cuDNN runs on a GPU only" if implementation != "cute" else f"the mask is {mask_gib:.0f} GiB")
    result["fa4_jax_mask"] = fa4_jax_mask if mask_gib <= max_mask_gib else f"the mask is {mask_gib:.0f} GiB"
    return result


def input_sets(shape, seed: int, extras):
    """Two (q, k, v, d_out, *extras) sets (extras: the step's other arguments, ids or a mask)."""
    keys = jax.random.split(jax.random.key(seed), 8)
    tensors = [jax.random.normal(key, shape, jnp.bfloat16) for key in keys]
    jax.block_until_ready(tensors)
    return [(*tensors[0:4], *extras), (*tensors[4:8], *extras)]


def step(attend, mode: str):
    """A jit'd step of (q, k, v, d_out, *extras): the forward, or its value and gradients."""
    if mode == "fwd":
        return jax.jit(lambda q, k, v, do, *extras: attend(q, k, v, *extras))

    def loss(q, k, v, do, *extras):
        return jnp.sum(attend(q, k, v, *extras).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _dense(rows: int, tokens: int, case: PackedCase, attend):
    """(input shape, step's attend) of a dense causal call of rows x tokens; attend(q, k, v) is
    fa4_jax's or cuDNN's, or a reason to skip."""
    if isinstance(attend, str):
        return None, attend
    return (rows, tokens, case.heads, case.head_dim), lambda q, k, v, *ids: attend(q, k, v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the reference")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-mask-gib", type=float, default=8.0)
    p.add_argument("--peers", default="", help="comma-separated peer names (default: all)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--out", default=".bench_packed")
    args = p.parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    implementation = "reference" if args.dry_run else "cute"
    settings = Settings(tokens=0, hidden=0, dtype="bf16", calls=2 if args.dry_run else 10,
                        repeats=2 if args.dry_run else 5, max_call_s=3.0, max_case_s=6.0,
                        warmup_s=0.0 if args.dry_run else 0.3, max_xla_seqlen=0,
                        fa4_implementation=implementation)
    results = []
    for case in cases(args.dry_run):
        if args.cases and case.name not in args.cases.split(","):
            continue
        print(case.label(), flush=True)
        runs = dict(peers(case, implementation, args.max_mask_gib))
        ids = case.segment_ids()
        shape = (case.rows, case.row_tokens, case.heads, case.head_dim)
        inputs = {name: shape for name in runs}
        dense_tokens = case.equal_dense_tokens()
        document_length = case.equal_documents()
        dense_calls = {
            "fa4_jax": functools.partial(fa4_jax.attention, causal=True, implementation=implementation),
            "cudnn": (functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
                      if implementation == "cute" else "cuDNN runs on a GPU only"),
        }
        for prefix, attend in dense_calls.items():
            inputs[f"{prefix}_dense_equal"], runs[f"{prefix}_dense_equal"] = _dense(case.rows, dense_tokens, case,
                                                                                    attend)
            if document_length:
                documents = sum(len(row) for row in case.lengths)
                inputs[f"{prefix}_dense_docs"], runs[f"{prefix}_dense_docs"] = _dense(
                    documents, document_length, case, attend)
        if case.name == "one long + short":
            inputs["fa4_jax_long_alone"], runs["fa4_jax_long_alone"] = _dense(1, case.lengths[0][0], case,
                                                                             dense_calls["fa4_jax"])
        for mode in args.modes.split(","):
            for peer, attend in runs.items():
                record = dict(case=case.name, mode=mode, peer=peer, useful_tflop=case.flops(mode) / 1e12)
                if ONLY_IN_MODE.get(peer, mode) != mode or (args.peers and peer not in args.peers.split(",")):
                    continue
                if isinstance(attend, str):
                    print(f"  {mode:7s} {peer:22s} skipped: {attend}", flush=True)
                    results.append(dict(record, status="skipped", reason=attend))
                    continue
                try:
                    timing = time_step(step(attend, mode), input_sets(inputs[peer], len(results), ids), settings)
                except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported
                    message = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    print(f"  {mode:7s} {peer:22s} error: {message}", flush=True)
                    results.append(dict(record, status="error", error=message))
                    continue
                # dense_equal and long_alone do their own work; dense_docs the same documents'.
                flops = case.flops(mode)
                if peer == "span_tables":
                    flops = 0.0
                elif peer == "fa4_jax_long_alone":
                    flops = 4 * case.heads * case.head_dim * (case.lengths[0][0] ** 2 / 2) * (
                        FWD_BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1)
                elif peer.endswith("_dense_equal"):
                    flops = 2 * case.rows * case.heads * case.head_dim * dense_tokens ** 2 * (
                        FWD_BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1)
                tflops = flops / (timing.ms * 1e-3) / 1e12
                print(f"  {mode:7s} {peer:22s} {timing.ms:9.3f} ms  {tflops:6.0f} TF/s", flush=True)
                results.append(dict(record, status="ok", ms=timing.ms, tflops=tflops,
                                    samples_ms=timing.samples_ms))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "packed.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), argv=sys.argv[1:], results=results), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
