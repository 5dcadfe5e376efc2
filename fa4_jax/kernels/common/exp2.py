"""2^x on the FMA pipes: FA4's way around the 16-per-clock MUFU exponential unit.

Cody-Waite range reduction, 2^x = 2^⌊x⌋ · 2^f with f = x − ⌊x⌋ in [0, 1): a degree-3 polynomial
for 2^f (Horner, three FMAs), then ⌊x⌋ added straight into the exponent bits. The coefficients
minimise the maximum relative error of 1 + c1·f + c2·f² + c3·f³ over [0, 1) (fitted with
iteratively reweighted least squares): 8.6e-5, twenty times finer than bf16's half-ulp (2e-3),
so a bf16 P built from it is indistinguishable from one built from MUFU's ex2. x is clamped at
−127 so masked scores (−inf) land on the smallest exponent instead of wrapping the bit pattern;
the clamp is NaN-propagating, so a NaN score stays NaN as it would through MUFU.
"""
import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

# (c1, c2, c3), the kernel uses their float32 roundings.
POLY_COEFFS = (0.6951165357771781, 0.227646107777347, 0.07706601932206254)
EXP2_MIN_EXPONENT = -127.0


def _ptx_f32(value: float) -> str:
    """A float32 immediate in PTX's exact hex spelling (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


_C1, _C2, _C3 = (_ptx_f32(c) for c in POLY_COEFFS)
_EXP2_POLY_PTX = f"""{{
.reg .f32 x, xi, f, p;
.reg .s32 i, pb;
max.ftz.NaN.f32 x, $1, {_ptx_f32(EXP2_MIN_EXPONENT)};
cvt.rmi.f32.f32 xi, x;
sub.ftz.f32 f, x, xi;
fma.rn.ftz.f32 p, f, {_C3}, {_C2};
fma.rn.ftz.f32 p, p, f, {_C1};
fma.rn.ftz.f32 p, p, f, {_ptx_f32(1.0)};
cvt.rzi.s32.f32 i, xi;
shl.b32 i, i, 23;
mov.b32 pb, p;
add.s32 pb, pb, i;
mov.b32 $0, pb;
}}"""


def exp2_poly(x: Float32) -> Float32:
    """2^x for x <= 128 on the FMA/ALU pipes (no MUFU), relative error <= 8.6e-5."""
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
