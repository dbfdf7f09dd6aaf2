#include "core/dtype_convert.h"

#include <bit>
#include <cmath>
#include <cstring>

namespace tessera {
namespace {

template <typename T>
T Load(const void* base, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void Store(void* base, size_t i, T v) {
  std::memcpy(static_cast<char*>(base) + i * sizeof(T), &v, sizeof(T));
}

// The float nearest to `value` in the direction of zero, with its last bit set when it is not
// exact ("round to odd"). Rounding that float to nearest-even at 10 or fewer significant bits
// gives the same result as rounding `value` itself: float keeps 24, at least 2 more, and the
// odd last bit stands for every nonzero bit it dropped.
float RoundToOddFloat(double value) {
  const float nearest = static_cast<float>(value);
  if (std::isnan(value) || static_cast<double>(nearest) == value) return nearest;
  uint32_t bits = std::bit_cast<uint32_t>(nearest);
  // One step toward zero when rounding went away from it (also turns an overflow to infinity
  // into the largest finite float).
  if (std::fabs(static_cast<double>(nearest)) > std::fabs(value)) bits -= 1;
  return std::bit_cast<float>(bits | 1u);
}

// Reads element i of a convertible float type as a double (exact for all of them).
double LoadAsDouble(DType dtype, const void* src, size_t i) {
  switch (dtype) {
    case DType::kF64:
      return Load<double>(src, i);
    case DType::kF32:
      return Load<float>(src, i);
    case DType::kF16:
      return F16BitsToFloat(Load<uint16_t>(src, i));
    default:  // kBF16
      return Bf16BitsToFloat(Load<uint16_t>(src, i));
  }
}

void StoreDouble(DType dtype, void* dst, size_t i, double value) {
  switch (dtype) {
    case DType::kF64:
      return Store<double>(dst, i, value);
    case DType::kF32:
      return Store<float>(dst, i, static_cast<float>(value));
    case DType::kF16:
      return Store<uint16_t>(dst, i, DoubleToF16Bits(value));
    default:  // kBF16
      return Store<uint16_t>(dst, i, DoubleToBf16Bits(value));
  }
}

}  // namespace

bool IsConvertibleFloat(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kF16 ||
         dtype == DType::kBF16;
}

uint16_t FloatToBf16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest, ties to even;
  // a carry into the exponent is the right answer (up to infinity).
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

uint16_t FloatToF16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: quiet, with the top bits of its payload
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  // 65520 (0x477ff000) lies halfway between 65504, the largest F16, and 65536; the tie goes
  // to the even one, which is infinity. Infinity itself lands here too.
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude >= 0x38800000u) {  // a normal F16 (>= 2^-14)
    // Rebias the exponent (127 -> 15: minus 112 << 23) and round the 13 dropped bits to
    // nearest, ties to even; a carry out of the mantissa bumps the exponent, as it should.
    magnitude += 0xc8000fffu + ((magnitude >> 13) & 1u);
    return static_cast<uint16_t>(sign | (magnitude >> 13));
  }
  // Subnormal or zero: the hardware rounds (ties to even) when adding 0.5, whose last
  // mantissa bit is worth 2^-24, the F16 subnormal step; the mantissa is then the result.
  const float sum = std::bit_cast<float>(magnitude) + 0.5f;
  return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(sum) - 0x3f000000u));
}

uint16_t DoubleToBf16Bits(double value) { return FloatToBf16Bits(RoundToOddFloat(value)); }
uint16_t DoubleToF16Bits(double value) { return FloatToF16Bits(RoundToOddFloat(value)); }

float Bf16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

float F16BitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {  // infinity or NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  // Zero or subnormal: mantissa * 2^-24, exact in a float.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

void ConvertFloats(DType from, const void* src, DType to, void* dst, size_t count) {
  if (from == to) {
    if (src != dst) std::memmove(dst, src, count * DTypeSize(from));
    return;
  }
  // The common cases without the detour through double.
  if (from == DType::kF32 && to == DType::kBF16) {
    for (size_t i = 0; i < count; ++i) Store(dst, i, FloatToBf16Bits(Load<float>(src, i)));
    return;
  }
  if (from == DType::kF32 && to == DType::kF16) {
    for (size_t i = 0; i < count; ++i) Store(dst, i, FloatToF16Bits(Load<float>(src, i)));
    return;
  }
  if (to == DType::kF32 && (from == DType::kBF16 || from == DType::kF16)) {
    // Widening: back to front, so an in-place call would not clobber what it still reads
    // (the contract does not promise it, but the order costs nothing).
    for (size_t i = count; i-- > 0;) {
      const uint16_t bits = Load<uint16_t>(src, i);
      Store(dst, i, from == DType::kBF16 ? Bf16BitsToFloat(bits) : F16BitsToFloat(bits));
    }
    return;
  }
  for (size_t i = 0; i < count; ++i) StoreDouble(to, dst, i, LoadAsDouble(from, src, i));
}

}  // namespace tessera
