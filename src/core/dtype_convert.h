// Converting the elements of floating-point tensors between F64, F32, F16 and BF16 (what
// `tessera convert --dtype` does), and to and from the float8 kinds F8_E4M3 (float8_e4m3fn)
// and F8_E5M2 (what LoadOptions::cast_dtypes does). Every conversion rounds to nearest, ties
// to even, once:
// from the exact source value to the target, so F64 -> BF16 gives the same bits as rounding
// the double directly (no double rounding through F32). Values too large for the target
// become infinities of their sign, NaN stays NaN (quiet, sign kept), subnormals are kept as
// far as the target can represent them. Into F8_E4M3, which has no infinity, a value whose
// rounding lies beyond its largest finite value (448) and an infinity become NaN, as torch's
// `.to(torch.float8_e4m3fn)` does; into F8_E5M2 they become infinities (57344 is its largest).
#ifndef TESSERA_CORE_DTYPE_CONVERT_H_
#define TESSERA_CORE_DTYPE_CONVERT_H_

#include <cstddef>
#include <cstdint>

#include "tessera/dtype.h"

namespace tessera {

// F64, F32, F16, BF16: the dtypes `tessera convert --dtype` converts between.
bool IsConvertibleFloat(DType dtype);

// Those four and F8_E4M3, F8_E5M2: the dtypes ConvertFloats converts between.
bool IsFloatDType(DType dtype);

// Converts `count` elements of `from` at `src` into `to` at `dst`. Both dtypes must be
// IsFloatDType; the same dtype copies. `src` and `dst` must not overlap unless they are
// equal and DTypeSize(to) <= DTypeSize(from) (an in-place narrowing works front to back).
// Unaligned pointers are fine.
void ConvertFloats(DType from, const void* src, DType to, void* dst, size_t count);

// One value: the bits of the nearest BF16 / F16 (ties to even) to a float or double.
uint16_t FloatToBf16Bits(float value);
uint16_t DoubleToBf16Bits(double value);
uint16_t FloatToF16Bits(float value);
uint16_t DoubleToF16Bits(double value);
float Bf16BitsToFloat(uint16_t bits);
float F16BitsToFloat(uint16_t bits);
// The bits of the nearest F8_E4M3 / F8_E5M2 value to a double (see the top of this file for
// overflow), and back (exact).
uint8_t DoubleToF8E4M3Bits(double value);
uint8_t DoubleToF8E5M2Bits(double value);
double F8E4M3BitsToDouble(uint8_t bits);
double F8E5M2BitsToDouble(uint8_t bits);

}  // namespace tessera

#endif  // TESSERA_CORE_DTYPE_CONVERT_H_
