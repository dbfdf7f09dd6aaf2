#include "tessera/dims.h"

#include <gtest/gtest.h>

#include <compare>
#include <utility>
#include <vector>

#include "tessera/box.h"

namespace tessera {
namespace {

std::vector<int64_t> Iota(size_t n, int64_t first = 1) {
  std::vector<int64_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + static_cast<int64_t>(i);
  return v;
}

// Sizes on both sides of the inline capacity: every operation must behave as a vector's.
class DimsTest : public ::testing::TestWithParam<size_t> {};

TEST_P(DimsTest, HoldsWhatAVectorHoldsAcrossCopiesAndMoves) {
  const std::vector<int64_t> want = Iota(GetParam());
  if (want.empty()) {
    EXPECT_TRUE(Dims(want).empty());
    EXPECT_EQ(Dims(want), Dims());
    return;
  }
  Dims d(want);
  EXPECT_EQ(d.size(), want.size());
  EXPECT_EQ(d.ToVector(), want);
  EXPECT_TRUE(d == want);

  Dims copy = d;
  EXPECT_EQ(copy.ToVector(), want);
  copy[0] = -7;  // a copy owns its numbers, inline or on the heap
  EXPECT_EQ(d.ToVector(), want);

  Dims moved = std::move(copy);
  EXPECT_EQ(moved[0], -7);
  EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  copy = moved;               // and usable again
  EXPECT_EQ(copy.ToVector(), moved.ToVector());

  Dims assigned({9});
  assigned = std::move(moved);
  EXPECT_EQ(assigned.size(), want.size());
  const Dims& self = assigned;
  assigned = self;  // self-assignment keeps the numbers
  EXPECT_EQ(assigned.size(), want.size());
}

TEST_P(DimsTest, GrowsAndShrinksLikeAVector) {
  const size_t n = GetParam();
  Dims d;
  std::vector<int64_t> v;
  for (size_t i = 0; i < n; ++i) {
    d.push_back(static_cast<int64_t>(i) * 3);
    v.push_back(static_cast<int64_t>(i) * 3);
  }
  EXPECT_EQ(d.ToVector(), v);
  d.resize(n + 3, 5);
  v.resize(n + 3, 5);
  EXPECT_EQ(d.ToVector(), v);
  d.insert(d.begin() + 1, 42);
  v.insert(v.begin() + 1, 42);
  EXPECT_EQ(d.ToVector(), v);
  d.erase(d.begin());
  v.erase(v.begin());
  EXPECT_EQ(d.ToVector(), v);
  d.resize(1);
  v.resize(1);
  EXPECT_EQ(d.ToVector(), v);
  d.assign(n, 8);
  v.assign(n, 8);
  EXPECT_EQ(d.ToVector(), v);
  EXPECT_EQ(std::span<const int64_t>(d).size(), n);
}

INSTANTIATE_TEST_SUITE_P(InlineAndHeap, DimsTest,
                         ::testing::Values(0, 1, Dims::kInlineDims, Dims::kInlineDims + 1, 9));

TEST(DimsOrderTest, ComparesAsVectorsDo) {
  const std::vector<std::vector<int64_t>> cases = {
      {}, {0}, {1}, {1, 0}, {1, 2, 3, 4}, {1, 2, 3, 4, 5}, {1, 2, 3, 5}, {2}, {-1, 9, 9, 9, 9, 9}};
  for (const auto& a : cases) {
    for (const auto& b : cases) {
      EXPECT_EQ(Dims(a) == Dims(b), a == b);
      EXPECT_EQ(Dims(a) <=> Dims(b), a <=> b) << "comparing sizes " << a.size() << ", " << b.size();
    }
  }
}

TEST(DimsOrderTest, BoxesOfManyDimensionsKeepTheirArithmetic) {
  // Seven dimensions: the numbers live on the heap, and a box still intersects and contains.
  const Box a(std::vector<int64_t>(7, 0), std::vector<int64_t>(7, 4));
  const Box b(std::vector<int64_t>(7, 2), std::vector<int64_t>(7, 4));
  std::optional<Box> both = Intersect(a, b);
  ASSERT_TRUE(both.has_value());
  EXPECT_EQ(both->offsets.ToVector(), std::vector<int64_t>(7, 2));
  EXPECT_EQ(both->sizes.ToVector(), std::vector<int64_t>(7, 2));
  EXPECT_TRUE(a.Contains(*both));
  EXPECT_EQ(a.NumElements(), 4 * 4 * 4 * 4 * 4 * 4 * 4);
  EXPECT_TRUE(a.InBounds(std::vector<int64_t>(7, 4)));
  EXPECT_FALSE(b.InBounds(std::vector<int64_t>(7, 4)));
}

}  // namespace
}  // namespace tessera
