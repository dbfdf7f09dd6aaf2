// CoalescingFile (reader_internal.h): one thread's reads of an object-store file, fetched in
// few requests.

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/reader_internal.h"

namespace tessera {
namespace {

// A file in memory that records every read it serves.
class RecordingFile final : public ReadableFile {
 public:
  explicit RecordingFile(uint64_t size) : bytes_(size) {
    for (uint64_t i = 0; i < size; ++i) bytes_[i] = static_cast<std::byte>(i * 7 + 3);
  }
  Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
    reads.emplace_back(offset, n);
    if (offset > bytes_.size() || n > bytes_.size() - offset) {
      return DataLoss("read of " + path_ + " past the end");
    }
    if (fail) return IOError("injected failure reading " + path_);
    std::memcpy(dst, bytes_.data() + offset, n);
    return Status::Ok();
  }
  uint64_t size() const override { return bytes_.size(); }
  const std::string& path() const override { return path_; }

  std::byte at(uint64_t i) const { return bytes_[i]; }
  mutable std::vector<std::pair<uint64_t, size_t>> reads;
  bool fail = false;

 private:
  std::vector<std::byte> bytes_;
  const std::string path_ = "d/f.bin";
};

// Reads [offset, offset + n) through `file` and checks the bytes against `base`.
void ExpectRead(const ReadableFile& file, const RecordingFile& base, uint64_t offset, size_t n) {
  std::vector<std::byte> out(n);
  ASSERT_TRUE(file.ReadAt(offset, out.data(), n).ok()) << offset << "+" << n;
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], base.at(offset + i)) << offset + i;
}

TEST(CoalescingFileTest, TouchingRangesAreFetchedTogetherUpToTheBound) {
  RecordingFile base(1000);
  // Touching: [100, 200) [200, 350) [350, 400); apart: [600, 700).
  const CoalescingFile file(base, {{200, 350}, {100, 200}, {600, 700}, {350, 400}}, 256);
  for (uint64_t at = 100; at < 400; at += 50) ExpectRead(file, base, at, 50);
  ExpectRead(file, base, 600, 100);
  // 100..356 in one read (the bound), then from the first read it does not hold (350) to the
  // span's end, then the range apart.
  const std::vector<std::pair<uint64_t, size_t>> want = {{100, 256}, {350, 50}, {600, 100}};
  EXPECT_EQ(base.reads, want);
  EXPECT_EQ(file.reads(), 3u);
}

// Ranges at most max_bytes / kMaxGapFraction apart are fetched together, the gap with them (a
// request costs more than those bytes), the smallest gaps first while all of them stay within
// 1 / kMaxGapShare of the bytes needed; farther apart, each range is a fetch of its own.
TEST(CoalescingFileTest, NearbyRangesAreFetchedTogetherWithinTheGapBudget) {
  RecordingFile base(100000);
  const uint64_t max_bytes = 32000;
  const uint64_t max_gap = max_bytes / CoalescingFile::kMaxGapFraction;  // 1000
  // 4000 bytes needed: a budget of 200 gap bytes. Gaps: 150, 100, 60, and 1001 (too wide).
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {0, 1000}, {1150, 2000}, {2100, 3000}, {3060, 3310}, {4311, 5311}};
  uint64_t needed = 0;
  for (const auto& [b, e] : ranges) needed += e - b;
  ASSERT_EQ(needed, 4000u);
  ASSERT_EQ(4311u - 3310u, max_gap + 1);
  const CoalescingFile file(base, ranges, max_bytes);
  for (const auto& [b, e] : ranges) ExpectRead(file, base, b, e - b);
  // Gaps by size: 60 (bridged, 140 left), 100 (bridged, 40 left), 150 (over what is left).
  const std::vector<std::pair<uint64_t, size_t>> want = {{0, 1000}, {1150, 2160}, {4311, 1000}};
  EXPECT_EQ(base.reads, want);
}

TEST(CoalescingFileTest, ReadsOutsideThePlanOrAsLargeAsTheBoundGoStraightThrough) {
  RecordingFile base(1000);
  const CoalescingFile file(base, {{0, 100}}, 64);
  ExpectRead(file, base, 500, 10);  // not planned
  ExpectRead(file, base, 90, 20);   // crosses the planned range's end
  ExpectRead(file, base, 0, 64);    // as large as the bound
  const std::vector<std::pair<uint64_t, size_t>> want = {{500, 10}, {90, 20}, {0, 64}};
  EXPECT_EQ(base.reads, want);
}

TEST(CoalescingFileTest, AFailedFetchIsReturnedAndNothingStaleIsServed) {
  RecordingFile base(1000);
  const CoalescingFile file(base, {{0, 400}}, 200);
  base.fail = true;
  std::vector<std::byte> out(10);
  const Status failed = file.ReadAt(0, out.data(), 10);
  EXPECT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  EXPECT_NE(failed.message().find("d/f.bin"), std::string::npos);
  base.fail = false;
  ExpectRead(file, base, 0, 10);  // fetched again, not served from a half-filled buffer
  EXPECT_EQ(base.reads.size(), 2u);
}

TEST(CoalescingFileTest, AReadPastTheEndIsTheFilesError) {
  RecordingFile base(100);
  const CoalescingFile file(base, {{50, 150}}, 64);  // planned past the end (a truncated file)
  std::vector<std::byte> out(10);
  const Status past = file.ReadAt(95, out.data(), 10);
  EXPECT_EQ(past.code(), StatusCode::kDataLoss) << past.ToString();
}

}  // namespace
}  // namespace tessera
