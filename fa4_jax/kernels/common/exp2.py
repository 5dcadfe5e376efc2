"""2^x on the FMA pipes: FA4's way around the 16-per-clock MUFU exponential unit.

Cody-Waite range reduction, 2^x = 2^⌊x⌋ · 2^f with f = x − ⌊x⌋ in [0, 1): a degree-3 polynomial
for 2^f (Horner, three FMAs), then ⌊x⌋ added straight into the exponent bits. The coefficients
minimise the maximum relative error of 1 + c1·f + c2·f² + c3·f³ over [0, 1) (fitted with
iteratively reweighted least squares): 8.6e-5, twenty times finer than bf16's half-ulp (2e-3),
so a bf16 P built from it is indistinguishable from one built from MUFU's ex2. x is clamped at
−127 so masked scores (−inf) land on the smallest exponent instead of wrapping the bit pattern;
the clamp is NaN-propagating, so a NaN score stays NaN as it would through MUFU.

The floor is taken without a conversion instruction. Adding B = 1.5·2^23 + 127 with round-down
leaves x + B in [2^23, 2^24), where the float spacing is 1, so the sum is ⌊x⌋ + B exactly and
its bits are those of 1.5·2^23 plus ⌊x⌋ + 127: shifted left by 23 (the rest shifted out), they
are the float 2^⌊x⌋, or 0 for ⌊x⌋ = −127. The result is p · 2^⌊x⌋, a multiply rather than an
integer add into p's exponent, so that a NaN stays NaN. On sm_90 the conversions (cvt.rmi,
cvt.rzi: FRND, F2I) issue to the same 16-per-clock unit as MUFU.EX2, so the first version of
this polynomial, which used two of them, took more of that unit than the ex2 it replaced (a 25%
share lost 16% at d128, docs/perf-log.md). Here every instruction is an FMA-pipe or integer op.
"""
import math
import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

# Natural-log scores times this are in the exp2 domain.
LOG2_E = math.log2(math.e)
# (c1, c2, c3), the kernel uses their float32 roundings.
POLY_COEFFS = (0.6951165357771781, 0.227646107777347, 0.07706601932206254)
EXP2_MIN_EXPONENT = -127.0


def _ptx_f32(value: float) -> str:
    """A float32 immediate in PTX's exact hex spelling (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


_C1, _C2, _C3 = (_ptx_f32(c) for c in POLY_COEFFS)
# x + this, rounded down, is ⌊x⌋ + this exactly for −127 <= x <= 128 (module docstring).
FLOOR_SHIFT = 1.5 * 2**23 + 127
_EXP2_POLY_PTX = f"""{{
.reg .f32 x, shifted, whole, f, p, scale;
.reg .b32 scale_bits;
max.ftz.NaN.f32 x, $1, {_ptx_f32(EXP2_MIN_EXPONENT)};
add.rm.ftz.f32 shifted, x, {_ptx_f32(FLOOR_SHIFT)};
sub.rn.ftz.f32 whole, shifted, {_ptx_f32(FLOOR_SHIFT)};
sub.rn.ftz.f32 f, x, whole;
fma.rn.ftz.f32 p, f, {_C3}, {_C2};
fma.rn.ftz.f32 p, p, f, {_C1};
fma.rn.ftz.f32 p, p, f, {_ptx_f32(1.0)};
mov.b32 scale_bits, shifted;
shl.b32 scale_bits, scale_bits, 23;
mov.b32 scale, scale_bits;
mul.rn.ftz.f32 $0, p, scale;
}}"""


# Columns of a row are assigned to the polynomial in groups of this many.
EXP2_SPLIT_PERIOD = 8


def uses_poly(share: float, column: int) -> bool:
    """Whether register column `column` of a row computes its exponential with `exp2_poly` when
    a static `share` of them does: the first round(share · 8) of every 8 columns, so that the
    polynomial's FMA-pipe work spreads evenly between the MUFU.EX2s."""
    return column % EXP2_SPLIT_PERIOD < round(share * EXP2_SPLIT_PERIOD)


def exp2_poly(x: Float32) -> Float32:
    """2^x for x <= 128 on the FMA and integer pipes (no MUFU), relative error <= 8.6e-5."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value()],
            _EXP2_POLY_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


# The same sequence on two lanes at once with Blackwell's packed f32x2 FMA-pipe instructions
# (FADD2/FFMA2/FMUL2: one instruction for both), lane by lane identical to _EXP2_POLY_PTX; the
# clamp and the exponent shift stay per lane. sm_100 and later only: sm_90 has no f32x2.
_EXP2_POLY_PAIR_PTX = f"""{{
.reg .f32 x0, x1, lo, hi, shift_f, c1, c2, c3, one;
.reg .b64 x, shift, shifted, whole, f, p, c1x2, c2x2, c3x2, onex2, scale;
.reg .b32 bits0, bits1;
max.ftz.NaN.f32 x0, $2, {_ptx_f32(EXP2_MIN_EXPONENT)};
max.ftz.NaN.f32 x1, $3, {_ptx_f32(EXP2_MIN_EXPONENT)};
mov.b64 x, {{x0, x1}};
mov.f32 shift_f, {_ptx_f32(FLOOR_SHIFT)};
mov.b64 shift, {{shift_f, shift_f}};
mov.f32 c1, {_C1};
mov.f32 c2, {_C2};
mov.f32 c3, {_C3};
mov.f32 one, {_ptx_f32(1.0)};
mov.b64 c1x2, {{c1, c1}};
mov.b64 c2x2, {{c2, c2}};
mov.b64 c3x2, {{c3, c3}};
mov.b64 onex2, {{one, one}};
add.rm.ftz.f32x2 shifted, x, shift;
sub.rn.ftz.f32x2 whole, shifted, shift;
sub.rn.ftz.f32x2 f, x, whole;
fma.rn.ftz.f32x2 p, f, c3x2, c2x2;
fma.rn.ftz.f32x2 p, p, f, c1x2;
fma.rn.ftz.f32x2 p, p, f, onex2;
mov.b64 {{bits0, bits1}}, shifted;
shl.b32 bits0, bits0, 23;
shl.b32 bits1, bits1, 23;
mov.b64 scale, {{bits0, bits1}};
mul.rn.ftz.f32x2 p, p, scale;
mov.b64 {{lo, hi}}, p;
mov.f32 $0, lo;
mov.f32 $1, hi;
}}"""


def exp2_poly_pair(x0: Float32, x1: Float32) -> tuple[Float32, Float32]:
    """(2^x0, 2^x1) by `exp2_poly`'s sequence on packed f32x2 instructions (sm_100+)."""
    pair = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [Float32(x0).ir_value(), Float32(x1).ir_value()],
        _EXP2_POLY_PAIR_PTX,
        "=f,=f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (Float32(llvm.extractvalue(T.f32(), pair, [0])), Float32(llvm.extractvalue(T.f32(), pair, [1])))
