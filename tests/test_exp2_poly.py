"""FA4's exp2 polynomial (kernels/common/exp2.py) evaluated on the CPU in float32, step for step
as its PTX does: the kernels' FMA-pipe exponential must stay within bf16-irrelevant error."""
import numpy as np
import pytest

# The kernels' modules import the DSL; the GPU machine runs the built library without it.
pytest.importorskip("cutlass")

from fa4_jax.kernels.common.exp2 import EXP2_MIN_EXPONENT, POLY_COEFFS


def exp2_poly_f32(x):
    """The PTX sequence in numpy float32: clamp, floor, Horner, add ⌊x⌋ to the exponent bits."""
    c1, c2, c3 = (np.float32(c) for c in POLY_COEFFS)
    x = np.maximum(np.asarray(x, np.float32), np.float32(EXP2_MIN_EXPONENT))
    whole = np.floor(x)
    frac = x - whole
    p = (c3 * frac + c2) * frac
    p = (p + c1) * frac + np.float32(1.0)
    # cvt.rzi.s32 turns NaN into 0; the NaN mantissa then survives the exponent add.
    exponent = np.where(np.isnan(whole), 0, whole).astype(np.int32)
    bits = p.view(np.int32) + (exponent << 23)
    return bits.view(np.float32)


def test_relative_error_within_the_fitted_bound(seed):
    rng = np.random.default_rng(seed)
    # Softmax arguments: s·scale − m ≤ 0, up to 2^8 above with conditional rescaling.
    x = np.concatenate([rng.uniform(-126.0, 8.0, 200_000), np.arange(-126, 9)]).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(exp2_poly_f32(x) - exact) / exact
    assert rel.max() < 1e-4  # fitted maximum 8.6e-5; bf16's half-ulp is 2e-3
    assert np.all(exp2_poly_f32(np.arange(-126, 9)) == np.exp2(np.arange(-126, 9)))


def test_masked_and_nan_scores():
    assert exp2_poly_f32(np.float32(-np.inf)) < 1e-37  # a masked score contributes nothing
    assert np.isnan(exp2_poly_f32(np.float32(np.nan)))
