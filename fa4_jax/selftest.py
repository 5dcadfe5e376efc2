"""Check every kernel of the installed library on this GPU against the reference, and print a
report to paste into an issue.

    python -m fa4_jax.selftest                 # every compiled variant for this GPU's arch
    python -m fa4_jax.selftest --only d128     # the variants whose names match a regex
    python -m fa4_jax.selftest --json out.json # the report as JSON too

For each problem class of the library (dtype, head dims, mask kind, softcap) it runs a few
small calls of fixed shapes and seeds, chosen so that together they reach every compiled variant
through the router (`fa4_jax.explain` says which each call runs), one with segment ids
(two documents of different lengths on each side, and padding) for the segments variants, and
one with a bool mask (those documents, and every fifth key shown to every row) for the mask
array variants, forward and backward, and
compares out, lse and the gradients with `fa4_jax.reference.dense_attention` (the reference's
semantics, unchunked), in float32 and in the input dtype, under docs/design.md's numerics rule
(max error at most twice the low-precision reference's, three times with softcap), with a floor
of one rounding step of the input dtype at the largest magnitude, so a correct kernel never
fails on one unlucky element. Exit status 0 when every check passes, 1 when one fails, 2 when
there is nothing to check (no CUDA GPU, no library, no kernels for this arch).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import platform
import re
import sys
import time

from fa4_jax import routing, verification

# (seqlen_q, seqlen_k) probes, in the order tried: a generic odd shape first, then the shapes
# the routes key on (decode rows, short calls, block-aligned diagonals, short last key blocks).
PROBE_LENGTHS = ((200, 333), (1, 777), (64, 64), (256, 256), (1024, 1024), (1152, 1152),
                 (1206, 1206), (2048, 2048), (4096, 4096), (4096, 4272), (4096, 4320),
                 (4096, 4352))
HEADS_Q, HEADS_KV = 4, 2
# The segment probe's lengths and documents: (query rows, keys) of each, then padding.
SEGMENT_PROBE = ((200, 333), ((70, 150), (110, 140)))
# The mask probe's lengths: the segment probe's, and a call past the short mask route (1024).
MASK_PROBE_LENGTHS = (SEGMENT_PROBE[0], (1152, 1152))
# The options of each mask kind (causal folds into a window's right bound).
MASK_OPTIONS = {"none": {}, "causal": {"causal": True}, "local": {"window_size": (64, 16)}}
SOFTCAP = 20.0


@dataclasses.dataclass
class Check:
    """One call checked: what it ran and how far it was from the reference."""

    problem: str
    seqlen_q: int
    seqlen_k: int
    forward_variant: str
    backward_variant: str | None
    errors: dict  # name -> (max error, bound)
    seconds: float

    @property
    def passed(self) -> bool:
        return all(error <= bound for error, bound in self.errors.values())

    def line(self) -> str:
        # A NaN or a misplaced inf comes back as (inf, 0): the worst by any measure.
        worst = max(self.errors, key=lambda n: self.errors[n][0] / self.errors[n][1]
                    if self.errors[n][1] > 0 else float("inf"))
        error, bound = self.errors[worst]
        status = "PASS" if self.passed else "FAIL"
        return (f"{status}  {self.problem:28s} sq={self.seqlen_q:<5d} sk={self.seqlen_k:<5d} "
                f"{self.forward_variant} / {self.backward_variant or '-'}  worst {worst}: "
                f"{error:.3g} <= {bound:.3g}" + ("" if self.passed else "  <-- exceeds"))


def _bound_by_rule(out, ref, lowp, factor, dtype):
    import jax.numpy as jnp
    import numpy as np

    out, ref, lowp = (np.asarray(x, np.float64) for x in (out, ref, lowp))
    finite = np.isfinite(ref)
    if (np.isinf(ref) != np.isinf(out)).any() or np.isnan(out).any():
        return float("inf"), 0.0
    error = float(np.abs(out[finite] - ref[finite]).max(initial=0.0))
    # jnp.finfo: numpy's own refuses bfloat16 in newer releases (ml_dtypes registers it with jax's).
    step = float(jnp.finfo(dtype).eps) * float(np.abs(ref[finite]).max(initial=0.0))
    bound = max(factor * float(np.abs(lowp[finite] - ref[finite]).max(initial=0.0)), step) + 1e-5
    return error, bound


def _check_call(problem, dtype, head_dim, head_dim_v, options, seqlen_q, seqlen_k, seed,
                implementation="cute", batch=1) -> Check:
    import jax
    import jax.numpy as jnp

    import fa4_jax
    from fa4_jax.reference import dense_attention

    keys = jax.random.split(jax.random.key(seed), 5)
    segments = {name: options[name] for name in ("query_segment_ids", "kv_segment_ids", "mask")
                if name in options}
    q = jax.random.normal(keys[0], (batch, seqlen_q, HEADS_Q, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seqlen_k, HEADS_KV, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seqlen_k, HEADS_KV, head_dim_v), dtype)
    d_out = jax.random.normal(keys[3], (batch, seqlen_q, HEADS_Q, head_dim_v), dtype)
    explanation = fa4_jax.explain(q, k, v, return_lse=True, implementation=implementation, **options)
    start = time.perf_counter()

    def kernels(q, k, v):
        return fa4_jax.attention(q, k, v, return_lse=True, implementation=implementation, **options)

    window_left, window_right = options.get("window_size", (None, None))

    def reference(compute_dtype):
        return functools.partial(dense_attention, compute_dtype=compute_dtype,
                                 causal=options.get("causal", False), window_left=window_left,
                                 window_right=window_right, softcap=options.get("softcap"), **segments)

    def forward_and_grads(attend):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        # d_lse 0: the gradient of out alone, what training takes.
        return (out, lse) + vjp((d_out.astype(out.dtype), jnp.zeros_like(lse)))

    ours = jax.jit(lambda: forward_and_grads(kernels))()
    ref = jax.jit(lambda: forward_and_grads(reference(jnp.float32)))()
    lowp = jax.jit(lambda: forward_and_grads(reference(dtype)))()
    jax.block_until_ready((ours, ref, lowp))
    factor = 3 if options.get("softcap") else 2
    errors = {name: _bound_by_rule(a, b, c, factor, dtype)
              for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, lowp)}
    return Check(problem, seqlen_q, seqlen_k, explanation.forward_variant,
                 explanation.backward_variant, errors, time.perf_counter() - start)


def _segment_ids(seqlen_q: int = SEGMENT_PROBE[0][0], seqlen_k: int = SEGMENT_PROBE[0][1]):
    """The segment probe's (query ids [1, sq], kv ids [1, sk]): SEGMENT_PROBE's documents,
    padding that matches nothing after them."""
    import numpy as np

    documents = SEGMENT_PROBE[1]
    ids = []
    for side, (length, no_match) in enumerate(((seqlen_q, -1), (seqlen_k, -2))):
        side_ids = np.full((1, length), no_match, np.int32)
        side_ids[0, :sum(doc[side] for doc in documents)] = np.repeat(
            np.arange(len(documents), dtype=np.int32), [doc[side] for doc in documents])
        ids.append(side_ids)
    return tuple(ids)


def _mask(seqlen_q: int, seqlen_k: int):
    """The mask probe's bool [1, 1, sq, sk]: the segment probe's documents, and every fifth key
    shown to every row (so no key block is one run of a tile's keys)."""
    import numpy as np

    q_ids, kv_ids = _segment_ids(seqlen_q, seqlen_k)
    every_fifth = np.arange(kv_ids.shape[1]) % 5 == 0
    return ((q_ids[:, None, :, None] == kv_ids[:, None, None, :]) | every_fifth)


def _probes(options):
    """(seqlen_q, seqlen_k, options) of a problem class's calls: PROBE_LENGTHS, then the
    segment probe and the mask probes."""
    for seqlen_q, seqlen_k in PROBE_LENGTHS:
        yield seqlen_q, seqlen_k, options
    q_ids, kv_ids = _segment_ids()
    yield *SEGMENT_PROBE[0], dict(options, query_segment_ids=q_ids, kv_segment_ids=kv_ids)
    for seqlen_q, seqlen_k in MASK_PROBE_LENGTHS:
        yield seqlen_q, seqlen_k, dict(options, mask=_mask(seqlen_q, seqlen_k))


def _problem_classes(library, arch):
    """(dtype, head_dim, head_dim_v, mask, softcap) of each compiled default forward variant."""
    for (d, dv), dtype, mask, softcap in itertools.product(
            sorted(library.head_dims.get(arch, ())), routing.DTYPES, routing.MASKS, (False, True)):
        if routing.Variant(arch, dtype, d, dv, mask, softcap).name in library.compiled:
            yield dtype, d, dv, mask, softcap


def run(only: str | None = None, out=sys.stdout) -> dict:
    """Runs the checks and prints the report to `out`; returns it as a dict."""
    import jax
    import jax.numpy as jnp

    import fa4_jax
    from fa4_jax import dispatch, ffi

    report = dict(fa4_jax=fa4_jax.__version__, jax=jax.__version__, python=platform.python_version(),
                  checks=[], unreached=[], status="nothing to check")
    arch, reason = dispatch.device_arch()
    try:
        library = ffi.load()
    except ffi.LibraryUnavailable as error:
        reason = reason or str(error)
    if reason is not None:
        report["reason"] = reason
        print(f"fa4_jax selftest: nothing to check: {reason}", file=out)
        return report
    device = jax.devices()[0]
    report.update(device=device.device_kind, arch=arch, library=library.path)
    print(f"fa4_jax {fa4_jax.__version__} selftest on {device.device_kind} ({arch}), jax "
          f"{jax.__version__}, library {library.path}", file=out)
    arch_variants = {n for n in library.compiled
                     if any(n.startswith(routing.name_prefix(kind, arch)) for kind in routing.KINDS)}
    wanted = {n for n in arch_variants if only is None or re.search(only, n)}
    if not wanted:
        report["reason"] = f"no compiled variant for {arch}" + (f" matches {only!r}" if only else "")
        print(f"fa4_jax selftest: nothing to check: {report['reason']}", file=out)
        return report
    dtypes = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
    with verification.bypassed():
        _run_checks(library, arch, wanted, dtypes, report, out)
    failed = sum(not c["passed"] for c in report["checks"])
    report["status"] = "fail" if failed else "pass"
    print(f"fa4_jax selftest: {len(report['checks']) - failed} passed, {failed} failed; "
          f"{len(set(wanted) - set(report['unreached']))} of {len(wanted)} variants reached"
          + (f", not reached: {', '.join(report['unreached'])}" if report["unreached"] else ""),
          file=out)
    return report


def _run_checks(library, arch, wanted, dtypes, report, out) -> None:
    """The checks of every problem class, into report["checks"] and report["unreached"]. The
    first-use checks of unverified kernels are bypassed: this reports on the kernels themselves,
    a failing one included."""
    import jax

    import fa4_jax

    reached = set()
    for seed, (dtype, d, dv, mask, softcap) in enumerate(_problem_classes(library, arch)):
        options = dict(MASK_OPTIONS[mask], **({"softcap": SOFTCAP} if softcap else {}))
        problem = f"{dtype} d{d}/dv{dv} {mask}{' softcap' if softcap else ''}"
        for seqlen_q, seqlen_k, probe_options in _probes(options):
            q = jax.ShapeDtypeStruct((1, seqlen_q, HEADS_Q, d), dtypes[dtype])
            kv = jax.ShapeDtypeStruct((1, seqlen_k, HEADS_KV, dv), dtypes[dtype])
            k = kv.update(shape=(1, seqlen_k, HEADS_KV, d))
            explanation = fa4_jax.explain(q, k, kv, return_lse=True, **probe_options)
            variants = {explanation.forward_variant, explanation.backward_variant} - {None}
            if explanation.backend != "cute" or not variants & (wanted - reached):
                continue
            segmented = (" segments" if "query_segment_ids" in probe_options
                         else " mask array" if "mask" in probe_options else "")
            # An arch without backward kernels (Blackwell's, so far) takes the reference backward.
            implementation = "cute" if explanation.backward_variant else None
            check = _check_call(problem + segmented, dtypes[dtype], d, dv, probe_options, seqlen_q,
                                seqlen_k, seed, implementation=implementation)
            reached |= variants
            report["checks"].append(dataclasses.asdict(check) | {"passed": check.passed})
            print(check.line(), file=out, flush=True)
    report["unreached"] = sorted(wanted - reached)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="REGEX", help="check the variants whose names match")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = run(args.only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return {"pass": 0, "fail": 1}.get(report["status"], 2)


if __name__ == "__main__":
    sys.exit(main())
