"""Triton helpers of the fp8 KV cache: quantize a tile on store (``x / scale``, clamped to the
format's largest finite value, rounded to nearest even) and the formats' constants.

The compiled path converts with the hardware (``cvt.rn.satfinite``). Triton 3.x's interpreter
rounds float32 -> fp8 wrongly (a mantissa carry is dropped, halving values just below a power of
two; fp8 subnormals come out as garbage), so under ``TRITON_INTERPRET=1`` the bits are computed
here in integer arithmetic (round to nearest even, subnormals included) and bit-cast: the CPU tests
then see exactly what ``torch``'s ``.to(float8)`` gives.
"""

import torch
import triton
import triton.language as tl

# cache dtype -> (largest finite value, mantissa bits, exponent bias)
FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 3, 7), torch.float8_e5m2: (57344.0, 2, 15)}


def fp8_constexprs(cache_dtype) -> dict:
    """The store kernels' constexprs for a K/V pool of ``cache_dtype``."""
    fmax, mant, bias = FP8_FORMATS.get(cache_dtype, (0.0, 0, 0))
    return dict(KV_FP8=cache_dtype in FP8_FORMATS, FP8_MAX=fmax, FP8_MANT=mant, FP8_BIAS=bias)


@triton.jit
def _fp8_bits(x, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    # x: float32, |x| <= the format's max. Returns its fp8 encoding as int32 (sign in bit 7).
    a = tl.abs(x)
    sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 128, 0)  # -0.0 too
    # subnormal range: a multiple of 2^(1 - bias - mant); the magic-number add rounds to nearest
    # even in float32 (exact: the quotient is < 2^(mant + 1))
    min_normal = 2.0 ** (1 - FP8_BIAS)
    sub_q = tl.minimum(a, min_normal) * (2.0 ** (FP8_BIAS - 1 + FP8_MANT))
    sub = ((sub_q + 8388608.0) - 8388608.0).to(tl.int32)
    # normal range: round the float32 mantissa to FP8_MANT bits (a carry moves into the exponent)
    bits = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - FP8_MANT
    odd = (bits >> SHIFT) & 1
    r = (bits + ((1 << (SHIFT - 1)) - 1) + odd) >> SHIFT
    norm = r - ((127 - FP8_BIAS) << FP8_MANT)
    return sign | tl.where(a < min_normal, sub, norm)


@triton.jit
def quantize(x, scale, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
             FP8_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """x (any float) / scale, clamped to +-FP8_MAX, as ``out_dtype`` (an fp8 type)."""
    # IEEE division (plain `/` is div.full.f32, 2 ulp), so the value is the reference's
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if INTERPRET:
        return _fp8_bits(y, FP8_MANT, FP8_BIAS).to(tl.uint8).to(out_dtype, bitcast=True)
    return y.to(out_dtype)
