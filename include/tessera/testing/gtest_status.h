// GoogleTest checks of a tessera::Status or Result<T>, for the conformance suites
// (tessera/testing/) and a user's own tests. Each evaluates its expression once and prints the
// status when it is not OK.
//
//   TESSERA_EXPECT_OK(storage.Remove(path));
//   TESSERA_ASSERT_OK(file->Sync());
//   TESSERA_ASSIGN_OR_FAIL(auto file, storage.NewReadableFile(path));  // fatal on error
#ifndef TESSERA_TESTING_GTEST_STATUS_H_
#define TESSERA_TESTING_GTEST_STATUS_H_

#include <gtest/gtest.h>

#include <utility>

#include "tessera/status.h"

#define TESSERA_EXPECT_OK(expr)                                                            \
  do {                                                                                     \
    const ::tessera::Status _tessera_expect_status = ::tessera::internal::GetStatus(expr); \
    EXPECT_TRUE(_tessera_expect_status.ok())                                               \
        << #expr << ": " << _tessera_expect_status.ToString();                             \
  } while (0)
#define TESSERA_ASSERT_OK(expr)                                                            \
  do {                                                                                     \
    const ::tessera::Status _tessera_assert_status = ::tessera::internal::GetStatus(expr); \
    ASSERT_TRUE(_tessera_assert_status.ok())                                               \
        << #expr << ": " << _tessera_assert_status.ToString();                             \
  } while (0)
#define TESSERA_ASSIGN_OR_FAIL_IMPL(tmp, lhs, expr)                  \
  auto tmp = (expr);                                                 \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
#define TESSERA_ASSIGN_OR_FAIL(lhs, expr) \
  TESSERA_ASSIGN_OR_FAIL_IMPL(TESSERA_CONCAT(_tessera_assign_or_fail_, __LINE__), lhs, expr)

#endif  // TESSERA_TESTING_GTEST_STATUS_H_
