"""FA4's exp2 polynomial (kernels/common/exp2.py) evaluated on the CPU in float32, step for step
as its PTX does: the kernels' FMA-pipe exponential must stay within bf16-irrelevant error."""
import numpy as np
import pytest

# The kernels' modules import the DSL; the GPU machine runs the built library without it.
pytest.importorskip("cutlass")

from fa4_jax.kernels.common.exp2 import EXP2_MIN_EXPONENT, FLOOR_SHIFT, POLY_COEFFS


def clamped(x):
    return np.maximum(np.asarray(x, np.float32), np.float32(EXP2_MIN_EXPONENT))  # max.NaN


def shifted_sum(x):
    """add.rm x + FLOOR_SHIFT for clamped x: the sum is within [2^23, 2^24), so rounding down
    gives floor(x) + FLOOR_SHIFT exactly; numpy rounds to nearest, so the floor is taken in
    float64, where the sum is exact."""
    shifted = (np.floor(x.astype(np.float64)) + np.float64(FLOOR_SHIFT)).astype(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), shifted)


def power_of_two(shifted):
    """The shifted sum's bits moved up by 23: the float 2^floor(x)."""
    return (shifted.view(np.uint32) << np.uint32(23)).view(np.float32)


def exp2_poly_f32(x):
    """The PTX sequence in numpy float32: clamp, floor by a rounded-down add, Horner, times the
    power of two read off the shifted sum's bits."""
    c1, c2, c3 = (np.float32(c) for c in POLY_COEFFS)
    x = clamped(x)
    shifted = shifted_sum(x)
    frac = x - (shifted - np.float32(FLOOR_SHIFT))
    p = (c3 * frac + c2) * frac
    p = (p + c1) * frac + np.float32(1.0)
    return p * power_of_two(shifted)


def test_relative_error_within_the_fitted_bound(seed):
    rng = np.random.default_rng(seed)
    # Softmax arguments: s·scale − m ≤ 0, up to 2^8 above with conditional rescaling.
    x = np.concatenate([rng.uniform(-126.0, 8.0, 200_000), np.arange(-126, 9)]).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(exp2_poly_f32(x) - exact) / exact
    assert rel.max() < 1e-4  # fitted maximum 8.6e-5; bf16's half-ulp is 2e-3
    assert np.all(exp2_poly_f32(np.arange(-126, 9)) == np.exp2(np.arange(-126, 9)))


def test_floor_by_rounded_add_matches_floor(seed):
    """The shifted sum's bits, shifted by 23, are exactly the float 2^floor(x) on the whole
    clamped range, the ends and every integer included."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-127.0, 128.0, 100_000), np.arange(-127, 128),
                        np.arange(-127, 128) - np.float32(2**-17)]).astype(np.float32)
    x = clamped(x)
    shifted = shifted_sum(x)
    assert np.all(shifted.astype(np.float64) == np.floor(x.astype(np.float64)) + FLOOR_SHIFT)
    scale = power_of_two(shifted).astype(np.float64)
    expected = np.where(np.floor(x) <= -127, 0.0, np.exp2(np.floor(x.astype(np.float64))))
    assert np.all(scale == expected)


def test_masked_and_nan_scores():
    assert exp2_poly_f32(np.float32(-np.inf)) < 1e-37  # a masked score contributes nothing
    assert np.isnan(exp2_poly_f32(np.float32(np.nan)))


def _ops(ptx: str) -> list[str]:
    """The instructions of a PTX block, register declarations and moves left out."""
    ops = []
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", "{", "}", "mov")):
            continue
        ops.append(line.split()[0])
    return ops


def test_the_packed_pair_is_the_scalar_sequence_lane_by_lane():
    # Blackwell's pair (exp2_poly_pair) has no numpy model of its own: it must be the scalar
    # sequence above, each FMA-pipe step on f32x2, the clamp and the exponent shift per lane.
    from fa4_jax.kernels.common import exp2

    scalar, pair = _ops(exp2._EXP2_POLY_PTX), _ops(exp2._EXP2_POLY_PAIR_PTX)
    expected = []
    for op in scalar:
        if op.startswith(("max", "shl")):
            expected += [op, op]
        else:
            expected.append(op.replace(".f32", ".f32x2"))
    assert pair == expected
    assert scalar == ["max.ftz.NaN.f32", "add.rm.ftz.f32", "sub.rn.ftz.f32", "sub.rn.ftz.f32",
                      "fma.rn.ftz.f32", "fma.rn.ftz.f32", "fma.rn.ftz.f32", "shl.b32", "mul.rn.ftz.f32"]
