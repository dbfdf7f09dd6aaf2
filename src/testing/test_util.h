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
// Each evaluates its expression once.
#define TESSERA_TEST_CHECK_OK(expr, fail)                                                       \
  do {                                                                                          \
    const auto& _tessera_test_value = (expr);                                                   \
    const ::tessera::Status& _tessera_test_status =                                             \
        ::tessera::internal::GetStatus(_tessera_test_value);                                    \
    if (!_tessera_test_status.ok()) fail() << #expr << ": " << _tessera_test_status.ToString(); \
  } while (0)
#define EXPECT_OK(expr) TESSERA_TEST_CHECK_OK(expr, ADD_FAILURE)
#define ASSERT_OK(expr) TESSERA_TEST_CHECK_OK(expr, FAIL)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)   \
  auto tmp = (expr);                                \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(TESSERA_CONCAT(_tessera_test_result_, __LINE__), lhs, expr)

#endif  // TESSERA_TESTING_TEST_UTIL_H_
