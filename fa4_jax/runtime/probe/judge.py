"""One variant run on its probe problems and judged against the reference under the numerics
rule (fa4_jax.core.numerics): out and lse for a forward variant, dq, dk and dv for a backward
one, and in a ragged batch the rows (and keys) past each entry's length exactly 0, lse −inf.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from fa4_jax.core import numerics
from fa4_jax.abi import routing
from fa4_jax.runtime.probe import calls, cases
from fa4_jax.runtime.probe.device import CudaError
from fa4_jax.runtime.probe.problems import Problem
from fa4_jax.runtime.probe.protocol import Verdict
from fa4_jax.abi.segment_layout import WIDEST_BACKWARD_TILE_M

# A wrong verdict's reason names this many failing comparisons at most.
_REASONS = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a launch needs beyond the problem: the device's SM count (the backward's), and the
    manifest's dQ-copies rule and segments backward query tiles, as fa4_jax.runtime.dispatch uses them."""

    num_sms: int
    dq_copies_max_keys: dict
    segments_backward_tile_m: dict


def kernel_call(variant: routing.Variant, problem: Problem, settings: Settings) -> calls.KernelCall:
    case = cases.case(cases.ProblemClass.of(variant), problem)
    if variant.kind == "fwd":
        return calls.forward_call(case)
    return calls.backward_call(case, problem.deterministic,
                               calls.dq_copies(settings.dq_copies_max_keys, variant, problem), settings.num_sms,
                               settings.segments_backward_tile_m.get(variant.name, WIDEST_BACKWARD_TILE_M))


def _past_lengths(variant: routing.Variant, case: cases.Case, results: dict) -> numerics.Comparison | None:
    """A failed comparison when a ragged batch's rows past an entry's query length (out 0, lse
    −inf; dq 0) or keys past its key length (dk, dv 0) are not exactly that, else None."""
    inputs = case.inputs
    rows = np.arange(inputs.q.shape[1])[None, :] >= inputs.q_len[:, None]  # [b, sq]
    keys = np.arange(inputs.k.shape[1])[None, :] >= inputs.kv_len[:, None]  # [b, sk]
    if variant.kind == "fwd":
        exact = (np.asarray(results["out"], np.float32)[rows] == 0).all() and \
            np.isneginf(results["lse"].transpose(0, 2, 1)[rows]).all()
    else:
        exact = all((np.asarray(results[name], np.float32)[where] == 0).all()
                    for name, where in (("dq", rows), ("dk", keys), ("dv", keys)))
    return None if exact else numerics.Comparison(
        np.inf, 0.0, "rows or keys past an entry's length are not exactly 0 (lse -inf)")


def compare(variant: routing.Variant, problem: Problem, results: dict) -> dict:
    """name -> numerics.Comparison of each result (and "past lengths" for a ragged batch)."""
    problem_class = cases.ProblemClass.of(variant)
    case = cases.case(problem_class, problem)
    exact, lowp = case.forward() if variant.kind == "fwd" else case.backward()
    names = ("out", "lse") if variant.kind == "fwd" else ("dq", "dk", "dv")
    comparisons = {name: numerics.compare(results[name], ref, low, problem_class.factor, problem_class.numpy_dtype)
                   for name, ref, low in zip(names, exact, lowp)}
    if problem.lengths is not None:
        past = _past_lengths(variant, case, results)
        if past is not None:
            comparisons["past lengths"] = past
    return comparisons


def _ratio(comparison: numerics.Comparison) -> float:
    return comparison.error / comparison.bound if comparison.bound > 0 and comparison.problem is None else np.inf


def judge(variant: routing.Variant, problems: tuple[Problem, ...], device, settings: Settings) -> Verdict:
    """Loads `variant` on `device` (a `device.Device`, or a stand-in with load and run), runs
    each problem and compares; the verdict (fault, load-error and inconclusive from the device's
    errors)."""
    start = time.perf_counter()

    def verdict(kind: str, reason: str | None, **details) -> Verdict:
        return Verdict(variant.name, kind, reason, time.perf_counter() - start,
                       dict(details, problems=[p.name for p in problems]))

    if not problems:
        return verdict("inconclusive", "no probe problem routes to it")
    try:
        device.load(variant.name)
    except CudaError as error:
        return verdict("load-error", str(error))
    worst, failures = None, []
    for problem in problems:
        try:
            results = device.run(variant.name, kernel_call(variant, problem, settings))
        except CudaError as error:
            kind = "inconclusive" if error.stage == "memory" else "fault"
            return verdict(kind, f"{problem.name}: {error}")
        for name, comparison in compare(variant, problem, results).items():
            if worst is None or _ratio(comparison) > worst[0]:
                worst = (_ratio(comparison), problem.name, name, comparison)
            if not comparison.passed:
                failures.append(f"{problem.name}: {comparison.describe(name)}")
    _, problem_name, name, comparison = worst
    worst_details = {"problem": problem_name, "result": name, "error": comparison.error, "bound": comparison.bound}
    if failures:
        more = f"; and {len(failures) - _REASONS} more" if len(failures) > _REASONS else ""
        return verdict("wrong", "; ".join(failures[:_REASONS]) + more, worst=worst_details)
    return verdict("pass", None, worst=worst_details)
