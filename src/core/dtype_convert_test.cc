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

}  // namespace
}  // namespace tessera
