// Helpers shared by tests of several layers.
#ifndef TESSERA_TESTING_TEST_UTIL_H_
#define TESSERA_TESTING_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/status.h"

namespace tessera::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Deterministic pseudo-random bytes from `seed` (splitmix64).
std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed);
void FillRandom(void* data, size_t n, uint64_t seed);

}  // namespace tessera::testing

// gtest helpers: EXPECT_OK(status_or_result), ASSERT_OK(...), ASSERT_OK_AND_ASSIGN(lhs, expr).
#define TESSERA_TEST_STATUS(expr) ::tessera::internal::GetStatus(expr)
#define EXPECT_OK(expr) EXPECT_TRUE(TESSERA_TEST_STATUS(expr).ok()) << TESSERA_TEST_STATUS(expr).ToString()
#define ASSERT_OK(expr) ASSERT_TRUE(TESSERA_TEST_STATUS(expr).ok()) << TESSERA_TEST_STATUS(expr).ToString()
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)             \
  auto tmp = (expr);                                          \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();           \
  lhs = std::move(tmp).value()
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(TESSERA_CONCAT(_tessera_test_result_, __LINE__), lhs, expr)

#endif  // TESSERA_TESTING_TEST_UTIL_H_
