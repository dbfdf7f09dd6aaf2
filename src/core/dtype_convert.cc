#include "core/dtype_convert.h"

#include <algorithm>
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

// A float8 format: sign, exponent, `mantissa_bits` of mantissa, exponent `bias`.
struct F8Format {
  int mantissa_bits;
  int bias;
  double max_finite;
  uint8_t overflow;  // the bits (without sign) of what overflows: NaN or infinity
};
constexpr F8Format kE4M3{3, 7, 448.0, 0x7f};     // no infinity: 0x7f is NaN
constexpr F8Format kE5M2{2, 15, 57344.0, 0x7c};  // IEEE-like: 0x7c is infinity, 0x7f NaN

// Rounds |value| to the format's grid (nearest, ties to even): the value is split into an
// integer r of at most mantissa_bits + 1 bits times a power of two, exactly, in a double.
uint8_t DoubleToF8(double value, const F8Format& f) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  if (std::isnan(value)) return sign | 0x7f;
  const double a = std::fabs(value);
  if (std::isinf(a)) return sign | f.overflow;
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);                                         // a in [2^(e-1), 2^e)
  const int exponent = std::max(e - 1, 1 - f.bias);          // subnormals share the smallest one
  const int quantum = exponent - f.mantissa_bits;            // the weight of the last mantissa bit
  const double r = std::nearbyint(std::ldexp(a, -quantum));  // ties to even (default mode)
  if (std::ldexp(r, quantum) > f.max_finite) return sign | f.overflow;
  const double implicit = std::ldexp(1.0, f.mantissa_bits);
  if (r < implicit) return sign | static_cast<uint8_t>(r);  // subnormal (or rounded to zero)
  // r == 2 * implicit (a carry) is the next binade's first value: its bits are the same sum.
  const uint32_t bits = (static_cast<uint32_t>(exponent + f.bias) << f.mantissa_bits) +
                        static_cast<uint32_t>(r - implicit);
  return sign | static_cast<uint8_t>(bits);
}

double F8ToDouble(uint8_t bits, const F8Format& f) {
  const int exponent_bits = 7 - f.mantissa_bits;
  const uint32_t mantissa = bits & ((1u << f.mantissa_bits) - 1);
  const uint32_t exponent = (bits >> f.mantissa_bits) & ((1u << exponent_bits) - 1);
  const double sign = (bits & 0x80) ? -1.0 : 1.0;
  const uint32_t all_ones = (1u << exponent_bits) - 1;
  if (f.overflow == 0x7f && (bits & 0x7f) == 0x7f) return std::copysign(NAN, sign);
  if (f.overflow != 0x7f && exponent == all_ones) {
    return mantissa == 0 ? sign * INFINITY : std::copysign(NAN, sign);
  }
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - f.bias - f.mantissa_bits);
  return sign * std::ldexp((1u << f.mantissa_bits) + mantissa,
                           static_cast<int>(exponent) - f.bias - f.mantissa_bits);
}

// Reads element i of a float type as a double (exact for all of them).
double LoadAsDouble(DType dtype, const void* src, size_t i) {
  switch (dtype) {
    case DType::kF8E4M3:
      return F8ToDouble(Load<uint8_t>(src, i), kE4M3);
    case DType::kF8E5M2:
      return F8ToDouble(Load<uint8_t>(src, i), kE5M2);
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
    case DType::kF8E4M3:
      return Store<uint8_t>(dst, i, DoubleToF8(value, kE4M3));
    case DType::kF8E5M2:
      return Store<uint8_t>(dst, i, DoubleToF8(value, kE5M2));
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

bool IsFloatDType(DType dtype) {
  return IsConvertibleFloat(dtype) || dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2;
}

uint8_t DoubleToF8E4M3Bits(double value) { return DoubleToF8(value, kE4M3); }
uint8_t DoubleToF8E5M2Bits(double value) { return DoubleToF8(value, kE5M2); }
double F8E4M3BitsToDouble(uint8_t bits) { return F8ToDouble(bits, kE4M3); }
double F8E5M2BitsToDouble(uint8_t bits) { return F8ToDouble(bits, kE5M2); }

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
