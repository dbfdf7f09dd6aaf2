// Float conversions against a reference that knows nothing of bit tricks: the sorted table of
// every finite value of the target type, searched for the nearest, ties to the even bit
// pattern; and, for F16, the compiler's own _Float16 conversions.
#include "core/dtype_convert.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace tessera {
namespace {

// Every finite non-negative value of a 16-bit float format, sorted, with its bits.
struct Table {
  std::vector<std::pair<double, uint16_t>> values;
  double overflow = 0;  // magnitudes at or above this round to infinity
};

Table MakeTable(float (*decode)(uint16_t)) {
  Table t;
  for (uint32_t bits = 0; bits < 0x8000; ++bits) {
    const float v = decode(static_cast<uint16_t>(bits));
    if (std::isfinite(v)) t.values.emplace_back(v, static_cast<uint16_t>(bits));
  }
  std::sort(t.values.begin(), t.values.end());
  const double max = t.values.back().first;
  const double below = t.values[t.values.size() - 2].first;
  t.overflow = max + (max - below) / 2;  // the tie goes to infinity: max has an odd mantissa
  return t;
}

// The reference: nearest table value, ties to the even pattern; NaN and overflow by sign.
uint16_t Reference(const Table& t, double v, uint16_t infinity) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isnan(v)) return 0xffff;  // compared as "is NaN" by the caller
  if (a >= t.overflow) return sign | infinity;
  auto hi = std::lower_bound(t.values.begin(), t.values.end(), std::make_pair(a, uint16_t{0}));
  if (hi == t.values.end()) return sign | t.values.back().second;  // below the overflow bound
  if (hi->first == a) return sign | hi->second;
  auto lo = hi - 1;
  const double dl = a - lo->first, dh = hi->first - a;
  if (dl < dh) return sign | lo->second;
  if (dh < dl) return sign | hi->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

const Table& Bf16() {
  static const Table t = MakeTable(Bf16BitsToFloat);
  return t;
}
const Table& F16() {
  static const Table t = MakeTable(F16BitsToFloat);
  return t;
}

bool IsNanBf16(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }
bool IsNanF16(uint16_t b) { return (b & 0x7c00) == 0x7c00 && (b & 0x3ff) != 0; }

void CheckDouble(double v) {
  const uint16_t bf = DoubleToBf16Bits(v), h = DoubleToF16Bits(v);
  if (std::isnan(v)) {
    EXPECT_TRUE(IsNanBf16(bf));
    EXPECT_TRUE(IsNanF16(h));
    return;
  }
  EXPECT_EQ(bf, Reference(Bf16(), v, 0x7f80)) << std::hexfloat << v;
  EXPECT_EQ(h, Reference(F16(), v, 0x7c00)) << std::hexfloat << v;
#ifdef __FLT16_MAX__
  EXPECT_EQ(h, std::bit_cast<uint16_t>(static_cast<_Float16>(v))) << std::hexfloat << v;
#endif
}

void CheckFloat(float v) {
  const uint16_t bf = FloatToBf16Bits(v), h = FloatToF16Bits(v);
  if (std::isnan(v)) {
    EXPECT_TRUE(IsNanBf16(bf));
    EXPECT_TRUE(IsNanF16(h));
    return;
  }
  EXPECT_EQ(bf, Reference(Bf16(), v, 0x7f80)) << std::hexfloat << v;
  EXPECT_EQ(h, Reference(F16(), v, 0x7c00)) << std::hexfloat << v;
#ifdef __FLT16_MAX__
  EXPECT_EQ(h, std::bit_cast<uint16_t>(static_cast<_Float16>(v))) << std::hexfloat << v;
#endif
}

TEST(DtypeConvertTest, EveryBf16AndF16ValueSurvivesARoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const float bf = Bf16BitsToFloat(b), h = F16BitsToFloat(b);
    if (IsNanBf16(b)) {
      EXPECT_TRUE(std::isnan(bf));
      EXPECT_TRUE(IsNanBf16(FloatToBf16Bits(bf)));
    } else {
      EXPECT_EQ(FloatToBf16Bits(bf), b);
      EXPECT_EQ(DoubleToBf16Bits(bf), b);
    }
    if (IsNanF16(b)) {
      EXPECT_TRUE(std::isnan(h));
      EXPECT_TRUE(IsNanF16(FloatToF16Bits(h)));
    } else {
      EXPECT_EQ(FloatToF16Bits(h), b);
      EXPECT_EQ(DoubleToF16Bits(h), b);
#ifdef __FLT16_MAX__
      EXPECT_EQ(std::bit_cast<uint32_t>(h),
                std::bit_cast<uint32_t>(static_cast<float>(std::bit_cast<_Float16>(b))));
#endif
    }
  }
}

TEST(DtypeConvertTest, FloatsRoundToNearestEven) {
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; ++i) CheckFloat(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  // Exact midpoints of both formats, and one float step on either side.
  for (const Table* t : {&Bf16(), &F16()}) {
    for (size_t i = 1; i < t->values.size(); i += 7) {
      const float mid = static_cast<float>((t->values[i - 1].first + t->values[i].first) / 2);
      for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
        CheckFloat(v);
        CheckFloat(-v);
      }
    }
  }
  for (float v : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.9802322e-8f, 1e38f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), std::nanf("")}) {
    CheckFloat(v);
    CheckFloat(-v);
  }
}

// A double just above a midpoint of the target rounds up, though rounding it to a float first
// would land on the midpoint and then go to the even neighbour below: no double rounding.
TEST(DtypeConvertTest, DoublesRoundOnceNotTwice) {
  std::mt19937_64 rng(11);
  for (const Table* t : {&Bf16(), &F16()}) {
    for (size_t i = 1; i < t->values.size(); i += 3) {
      const double mid = (t->values[i - 1].first + t->values[i].first) / 2;
      const double tiny = std::max(std::fabs(mid) * 0x1p-40, 0x1p-1074);
      for (double v : {mid, mid + tiny, mid - tiny}) {
        CheckDouble(v);
        CheckDouble(-v);
      }
    }
  }
  for (int i = 0; i < 200000; ++i) {
    // Doubles in the ranges that matter (not mostly huge or tiny exponents).
    const double v =
        std::ldexp(static_cast<double>(rng() >> 11) * 0x1p-53, static_cast<int>(rng() % 300) - 160);
    CheckDouble(rng() % 2 ? v : -v);
  }
  for (double v : {1e300, -1e300, 1e-300, 0.0, std::numeric_limits<double>::infinity(),
                   std::nan(""), 3.3961775292304172e38, 65520.0, 65519.999999}) {
    CheckDouble(v);
  }
}

TEST(DtypeConvertTest, ConvertFloatsMatchesTheScalarsForEveryPair) {
  std::mt19937 rng(3);
  const size_t n = 1000;
  std::vector<double> values(n);
  for (double& v : values)
    v = std::ldexp(static_cast<double>(rng()) - 2147483648.0, -static_cast<int>(rng() % 40));
  values[0] = std::numeric_limits<double>::infinity();
  values[1] = 1e10;
  const DType kAll[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16};
  for (DType from : kAll) {
    // The source: the values rounded into `from`.
    std::vector<uint8_t> src(n * DTypeSize(from));
    ConvertFloats(DType::kF64, values.data(), from, src.data(), n);
    std::vector<double> exact(n);  // what the source holds
    ConvertFloats(from, src.data(), DType::kF64, exact.data(), n);
    for (DType to : kAll) {
      SCOPED_TRACE(std::string(DTypeName(from)) + " -> " + std::string(DTypeName(to)));
      std::vector<uint8_t> dst(n * DTypeSize(to) + 1);  // +1: an unaligned destination
      ConvertFloats(from, src.data(), to, dst.data() + 1, n);
      for (size_t i = 0; i < n; ++i) {
        const uint8_t* at = dst.data() + 1 + i * DTypeSize(to);
        if (to == DType::kF64) {
          double d;
          std::memcpy(&d, at, 8);
          EXPECT_EQ(d, exact[i]);
        } else if (to == DType::kF32) {
          float f;
          std::memcpy(&f, at, 4);
          EXPECT_EQ(f, static_cast<float>(exact[i]));
        } else {
          uint16_t b;
          std::memcpy(&b, at, 2);
          EXPECT_EQ(b, to == DType::kF16 ? DoubleToF16Bits(exact[i]) : DoubleToBf16Bits(exact[i]));
        }
      }
      // Narrowing in place, front to back, gives the same bytes.
      if (DTypeSize(to) <= DTypeSize(from)) {
        std::vector<uint8_t> in_place = src;
        ConvertFloats(from, in_place.data(), to, in_place.data(), n);
        EXPECT_TRUE(std::equal(dst.begin() + 1, dst.end(), in_place.begin()));
      }
    }
  }
}

// ---- float8 -------------------------------------------------------------------------------

// A float8 format's table: every finite non-negative value decoded by the format's definition
// written out here (not by the code under test), sorted, and what overflows.
struct F8Table {
  std::vector<std::pair<double, uint8_t>> values;
  double bound = 0;      // halfway between the largest value and the next step above it
  bool bound_overflows;  // a value exactly at `bound` overflows (the largest has odd bits)
  uint8_t overflow;      // NaN (E4M3: no infinity) or infinity (E5M2), without sign
};

F8Table MakeF8Table(int mantissa_bits, int bias, uint8_t overflow) {
  F8Table t;
  t.overflow = overflow;
  const int exponent_bits = 7 - mantissa_bits;
  for (uint32_t bits = 0; bits < 0x80; ++bits) {
    const uint32_t e = bits >> mantissa_bits, m = bits & ((1u << mantissa_bits) - 1);
    if (overflow == 0x7f && bits == 0x7f) continue;                    // E4M3's NaN
    if (overflow != 0x7f && e == (1u << exponent_bits) - 1) continue;  // E5M2's inf, NaN
    const double v = e == 0 ? m * std::pow(2.0, 1 - bias - mantissa_bits)
                            : (1.0 + m / std::pow(2.0, mantissa_bits)) *
                                  std::pow(2.0, static_cast<int>(e) - bias);
    t.values.emplace_back(v, static_cast<uint8_t>(bits));
  }
  std::sort(t.values.begin(), t.values.end());
  const double max = t.values.back().first, below = t.values[t.values.size() - 2].first;
  t.bound = max + (max - below) / 2;
  t.bound_overflows = (t.values.back().second & 1) != 0;
  return t;
}

const F8Table& E4M3() {
  static const F8Table t = MakeF8Table(3, 7, 0x7f);
  return t;
}
const F8Table& E5M2() {
  static const F8Table t = MakeF8Table(2, 15, 0x7c);
  return t;
}

uint8_t F8Reference(const F8Table& t, double v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(v);
  if (a > t.bound || (a == t.bound && t.bound_overflows)) return sign | t.overflow;
  auto hi = std::lower_bound(t.values.begin(), t.values.end(), std::make_pair(a, uint8_t{0}));
  if (hi == t.values.end()) return sign | t.values.back().second;
  if (hi->first == a) return sign | hi->second;
  auto lo = hi - 1;
  const double dl = a - lo->first, dh = hi->first - a;
  if (dl < dh) return sign | lo->second;
  if (dh < dl) return sign | hi->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

TEST(DtypeConvertTest, Float8RoundsToNearestEvenAndOverflowsAsTorch) {
  struct Case {
    const F8Table* table;
    uint8_t (*encode)(double);
    double (*decode)(uint8_t);
  };
  for (const Case& c : {Case{&E4M3(), DoubleToF8E4M3Bits, F8E4M3BitsToDouble},
                        Case{&E5M2(), DoubleToF8E5M2Bits, F8E5M2BitsToDouble}}) {
    // Every value decodes as the table says and encodes back to itself.
    for (const auto& [value, bits] : c.table->values) {
      EXPECT_EQ(c.decode(bits), value);
      EXPECT_EQ(c.encode(value), bits);
      EXPECT_EQ(c.encode(-value), bits | 0x80);
    }
    // Midpoints and their neighbours, then random doubles over the whole range and beyond.
    std::vector<double> probes;
    for (size_t i = 1; i < c.table->values.size(); ++i) {
      const double mid = (c.table->values[i - 1].first + c.table->values[i].first) / 2;
      probes.insert(probes.end(), {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9)});
    }
    probes.insert(probes.end(), {c.table->bound, std::nextafter(c.table->bound, 0.0),
                                 std::nextafter(c.table->bound, 1e9), 1e9, 1e-12, 0.0});
    std::mt19937_64 rng(5);
    for (int i = 0; i < 100000; ++i) {
      probes.push_back(std::ldexp(static_cast<double>(rng() >> 11) * 0x1p-53,
                                  static_cast<int>(rng() % 50) - 30));
    }
    for (double v : probes) {
      EXPECT_EQ(c.encode(v), F8Reference(*c.table, v)) << std::hexfloat << v;
      EXPECT_EQ(c.encode(-v), F8Reference(*c.table, -v)) << std::hexfloat << -v;
    }
    EXPECT_EQ(c.encode(std::numeric_limits<double>::infinity()), c.table->overflow);
    EXPECT_EQ(c.encode(-std::numeric_limits<double>::infinity()), 0x80 | c.table->overflow);
    EXPECT_TRUE(std::isnan(c.decode(c.encode(std::nan("")))));
  }
  // torch's choices: 448 is E4M3's largest, 464 (a tie) stays there, 470 is NaN; E5M2's
  // largest is 57344 and 61440 (a tie, odd below) is infinity.
  EXPECT_EQ(DoubleToF8E4M3Bits(448), 0x7e);
  EXPECT_EQ(DoubleToF8E4M3Bits(464), 0x7e);
  EXPECT_EQ(DoubleToF8E4M3Bits(470), 0x7f);
  EXPECT_EQ(DoubleToF8E5M2Bits(57344), 0x7b);
  EXPECT_EQ(DoubleToF8E5M2Bits(61440), 0x7c);
  EXPECT_EQ(DoubleToF8E4M3Bits(0x1p-9), 0x01);   // the smallest subnormal
  EXPECT_EQ(DoubleToF8E4M3Bits(0x1p-10), 0x00);  // its half: a tie, to even (zero)
}

TEST(DtypeConvertTest, ConvertFloatsReachesFloat8FromEveryFloatAndBack) {
  const std::vector<double> values = {0.1, -3.5, 448, 1000, 1e-3, 0x1p-9, 57344, -0.0};
  const size_t n = values.size();
  for (DType f8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    const auto encode = f8 == DType::kF8E4M3 ? DoubleToF8E4M3Bits : DoubleToF8E5M2Bits;
    for (DType from : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> src(n * DTypeSize(from));
      ConvertFloats(DType::kF64, values.data(), from, src.data(), n);
      std::vector<double> exact(n);
      ConvertFloats(from, src.data(), DType::kF64, exact.data(), n);
      std::vector<uint8_t> got(n);
      ConvertFloats(from, src.data(), f8, got.data(), n);
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(got[i], encode(exact[i])) << DTypeName(from) << i;
      // And back: F8 values are exact in every wider float.
      std::vector<uint8_t> back(n * DTypeSize(from));
      ConvertFloats(f8, got.data(), from, back.data(), n);
      std::vector<double> widened(n);
      ConvertFloats(from, back.data(), DType::kF64, widened.data(), n);
      for (size_t i = 0; i < n; ++i) {
        const double want =
            f8 == DType::kF8E4M3 ? F8E4M3BitsToDouble(got[i]) : F8E5M2BitsToDouble(got[i]);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(widened[i]));
        } else if (!(from == DType::kF16 && std::fabs(want) > 65504)) {
          EXPECT_EQ(widened[i], want) << DTypeName(from) << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tessera
