"""The comparison rule itself must be able to fail."""
import numpy as np
import pytest

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
