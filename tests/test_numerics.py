"""The comparison rule itself must be able to fail."""
import ml_dtypes
import numpy as np
import pytest

from fa4_jax.core.numerics import compare, rounding_step
from tests.numerics import assert_close_by_rule

REF = np.array([1.0, -2.0, 0.5, -np.inf])
LOWP = REF + np.array([0.01, 0.0, 0.0, 0.0])  # rule bound: 2 * 0.01 + 1e-5


def test_within_the_bound_passes():
    assert_close_by_rule(REF + np.array([0.0, 0.02, 0.0, 0.0]), REF, LOWP)


def test_beyond_the_bound_fails():
    with pytest.raises(AssertionError, match="max\\|out - ref\\|"):
        assert_close_by_rule(REF + np.array([0.0, 0.021, 0.0, 0.0]), REF, LOWP)


def test_nan_never_passes():
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_by_rule(np.array([np.nan, -2.0, 0.5, -np.inf]), REF, np.full(4, np.nan))


@pytest.mark.parametrize("bad_last", [0.0, np.inf, -1e30])
def test_infinities_must_match(bad_last):
    with pytest.raises(AssertionError, match="infinity"):
        assert_close_by_rule(np.array([1.0, -2.0, 0.5, bad_last]), REF, LOWP)


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match="shape"):
        assert_close_by_rule(REF[:3], REF, LOWP)


# fa4_jax.core.numerics itself, which the selftest and the first-use probes judge by.

def test_the_rule_passes_one_rounding_step_of_the_dtype_where_lowp_is_exact():
    ref = np.linspace(-4.0, 4.0, 101)
    one_step = ref + 4.0 * rounding_step(ml_dtypes.bfloat16) * np.sign(ref)  # one bf16 step at 4
    assert compare(one_step, ref, ref, dtype=ml_dtypes.bfloat16).passed
    assert not compare(one_step * 1.01, ref, ref, dtype=ml_dtypes.bfloat16).passed
    # The floor is the dtype's: float16's step is 8x finer.
    assert not compare(one_step, ref, ref, dtype=np.float16).passed


def test_the_rule_takes_its_floor_from_outs_dtype_by_default():
    ref = np.linspace(-4.0, 4.0, 101)
    out = (ref + 0.02).astype(ml_dtypes.bfloat16)
    assert compare(out, ref, ref).passed and not compare(out.astype(np.float32), ref, ref).passed


@pytest.mark.parametrize("bad", ["wrong", "nan", "inf for finite", "finite for -inf", "+inf for -inf"])
def test_the_rule_fails_a_wrong_answer_nan_and_misplaced_infinities(bad):
    ref = np.array([1.0, -2.0, 0.5, -np.inf])
    out = {"wrong": [1.0, -2.5, 0.5, -np.inf], "nan": [1.0, np.nan, 0.5, -np.inf],
           "inf for finite": [1.0, np.inf, 0.5, -np.inf], "finite for -inf": [1.0, -2.0, 0.5, -1e30],
           "+inf for -inf": [1.0, -2.0, 0.5, np.inf]}[bad]
    comparison = compare(np.array(out), ref, ref + [0.01, 0, 0, 0])
    assert not comparison.passed and ("NaN" in comparison.describe("x")) == (bad == "nan")


def test_the_rule_gives_no_bound_when_lowp_is_nan():
    ref = np.array([1.0, -2.0])
    assert not compare(ref, ref, np.array([np.nan, -2.0])).passed
