#include "core/crc32.h"

#include <isa-l/crc.h>

namespace tessera {

uint32_t Crc32(const void* data, size_t n, uint32_t crc) {
  if (n == 0) return crc;
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

namespace {

// Carry-less multiplication of two polynomials modulo the reflected CRC-32 polynomial: the
// bits are reflected, so bit 31 is x^0 (Mark Adler's formulation, as in zlib 1.2.12+).
constexpr uint32_t kPolynomial = 0xEDB88320u;

uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31;
  uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;
  }
  return p;
}

// x^(2^k) modulo P for k = 0..31, reflected.
struct PowerTable {
  uint32_t x2n[32];
  constexpr PowerTable() : x2n() {
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int k = 1; k < 32; ++k) {
      // p = p * p mod P, spelled out for constexpr.
      uint32_t a = p, b = p, m = 1u << 31, r = 0;
      for (;;) {
        if (a & m) {
          r ^= b;
          if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;
      }
      x2n[k] = p = r;
    }
  }
};
constexpr PowerTable kPowers;

// x^(8 * n) modulo P: the factor that shifts a CRC past n zero bytes.
uint32_t XPow8n(uint64_t n) {
  uint32_t p = 1u << 31;  // x^0
  int k = 3;              // 8 * n = n << 3: start at x^(2^3)
  while (n) {
    if (n & 1) p = MultiplyModP(kPowers.x2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return MultiplyModP(XPow8n(length_b), crc_a) ^ crc_b;
}

}  // namespace tessera
