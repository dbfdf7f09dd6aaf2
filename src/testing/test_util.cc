#include "testing/test_util.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include <stdlib.h>

namespace tessera::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/tessera-test-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  const char* made = mkdtemp(buf.data());
  path_ = made ? made : pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void FillRandom(void* data, size_t n, uint64_t seed) {
  auto* out = static_cast<uint8_t*>(data);
  uint64_t x = seed;
  size_t i = 0;
  while (i < n) {
    x += 0x9e3779b97f4a7c15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    size_t take = n - i < 8 ? n - i : 8;
    std::memcpy(out + i, &z, take);
    i += take;
  }
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  FillRandom(out.data(), n, seed);
  return out;
}

}  // namespace tessera::testing
