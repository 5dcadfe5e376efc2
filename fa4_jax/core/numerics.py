"""docs/design.md's numerics rule, the one comparison of a result with the reference: the tests
(tests/numerics.py), the selftest and the first-use probes (fa4_jax.runtime.probe) all judge by it.

    max |out − ref| <= factor · max |lowp − ref|, at least one rounding step of the dtype at the
    largest magnitude, + 1e-5

over the entries where `ref` is finite. `ref` is the reference in float64 (or float32), `lowp`
the same reference computed in the input dtype (its rounding error is what a kernel may have);
factor 2, 3 with softcap. NaN in `out` never passes; infinite entries of `ref` (lse −inf of a
row that sees no key) must be matched exactly; NaN in `lowp` leaves no bound (no free pass).

numpy and ml_dtypes only: the probe process imports it without JAX.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

# The absolute slack added to every bound.
SLACK = 1e-5


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One result against the reference: the worst error, the bound, and what broke the rule
    beyond the bound (a shape, NaN entries, infinities), if anything."""

    error: float
    bound: float
    problem: str | None = None

    @property
    def passed(self) -> bool:
        # A NaN bound (NaN in lowp) fails: `error <= nan` is False.
        return self.problem is None and self.error <= self.bound

    def describe(self, name: str) -> str:
        if self.problem is not None:
            return f"{name}: {self.problem}"
        verdict = "<=" if self.passed else ">"
        return f"{name}: max|out - ref| = {self.error:.3g} {verdict} {self.bound:.3g}"


def rounding_step(dtype) -> float:
    """The spacing of `dtype`'s numbers at 1.0 (bfloat16 2^-7, float16 2^-10)."""
    return float(ml_dtypes.finfo(dtype).eps)


def _float_or_float64(dtype):
    try:
        ml_dtypes.finfo(dtype)  # bfloat16 included, which numpy's own finfo refuses
    except ValueError:
        return np.float64
    return dtype


def compare(out, ref, lowp, factor: float = 2, dtype=None) -> Comparison:
    """`out` against `ref` under the rule, with `lowp`'s error as the yardstick. dtype: the input
    dtype whose rounding step floors the bound (default: out's own dtype, when it is a float)."""
    if dtype is None:
        dtype = _float_or_float64(np.asarray(out).dtype)
    out, ref, lowp = (np.asarray(x, np.float64) for x in (out, ref, lowp))
    if out.shape != ref.shape:
        return Comparison(np.inf, 0.0, f"shape {out.shape} != reference {ref.shape}")
    nan = int(np.isnan(out).sum())
    if nan:
        return Comparison(np.inf, 0.0, f"{nan} NaN entries")
    infinite = np.isinf(ref)
    mismatched = int(((infinite != np.isinf(out)) | (infinite & (out != ref))).sum())
    if mismatched:
        return Comparison(np.inf, 0.0, f"{mismatched} entries differ in infinity from the reference")

    def largest(x):
        """max |x| over the entries where ref is finite (NaN if x has NaN there); x is a fresh
        array (no boolean indexing: a copy per call, slow on the probes' largest results)."""
        x = np.abs(x, out=x)
        x[infinite] = 0
        return float(x.max(initial=0.0))

    with np.errstate(invalid="ignore"):  # inf - inf where ref is infinite, zeroed after
        error = largest(out - ref)
        lowp_error = largest(lowp - ref)
    step = rounding_step(dtype) * largest(np.abs(ref))
    # max() would drop a NaN lowp_error whichever side it is on; keep it, so the bound fails.
    bound = lowp_error * factor if np.isnan(lowp_error) else max(factor * lowp_error, step)
    return Comparison(error, bound + SLACK)
