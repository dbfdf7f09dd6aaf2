#include "core/hex.h"

namespace tessera {
namespace {

constexpr char kDigits[] = "0123456789abcdef";

}  // namespace

std::string HexEncode(std::span<const uint8_t> bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::string HexByte(uint8_t byte) { return HexEncode(std::span<const uint8_t>(&byte, 1)); }

std::string Hex64(uint64_t value) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[i] = kDigits[value & 15];
  return out;
}

}  // namespace tessera
