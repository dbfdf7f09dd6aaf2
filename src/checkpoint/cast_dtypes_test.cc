// LoadOptions::cast_dtypes: a tensor saved in one float dtype loads into memory of another,
// resharded, through every read path (straight runs, checked blocks read through the buffer,
// flat ranges, read sharing), giving exactly what ConvertFloats gives for the saved values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/dtype_convert.h"
#include "format/tessera/manifest.h"
#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// 300 x 700 F32 (840 KB: several 256 KiB checksum blocks per chunk), values of every kind a
// conversion treats apart: normal over a wide range, subnormal in the narrow targets, zeros,
// infinities, NaN, values that overflow F16 and F8.
constexpr int64_t kRows = 300, kCols = 700;

std::vector<float> Values() {
  std::vector<float> v(kRows * kCols);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(mantissa(rng), exponent(rng));
  v[1] = 0.0f;
  v[2] = -0.0f;
  v[3] = std::numeric_limits<float>::infinity();
  v[4] = -std::numeric_limits<float>::infinity();
  v[5] = std::numeric_limits<float>::quiet_NaN();
  v[6] = 70000.0f;  // beyond F16 and F8_E5M2
  v[7] = 470.0f;    // rounds beyond F8_E4M3's 448: NaN
  v[8] = 1e-40f;    // an F32 subnormal
  v[9] = 3.0e-5f;   // an F16 subnormal
  return v;
}

// Saves Values() as 3 uneven row blocks from 3 ranks (chunks of 100, 120 and 80 rows).
void SaveRowBlocks(const std::vector<float>& full, const std::string& path,
                   std::shared_ptr<Storage> storage) {
  const int64_t rows[] = {0, 100, 220, 300};
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    std::vector<float> mine(full.begin() + rows[r] * kCols, full.begin() + rows[r + 1] * kCols);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(mine.data(), DType::kF32, {rows[r + 1] - rows[r], kCols}), {kRows, kCols},
        {rows[r], 0})));
    SaveOptions options;
    options.storage = storage;
    return Save(state, path, comm, options).status();
  });
  ASSERT_OK(FirstError(statuses));
}

// The elements of `box` of the full tensor, converted to `to` by ConvertFloats.
std::vector<uint8_t> Expected(const std::vector<float>& full, const Box& box, DType to) {
  std::vector<float> part;
  for (int64_t i = 0; i < box.sizes[0]; ++i) {
    for (int64_t j = 0; j < box.sizes[1]; ++j) {
      part.push_back(full[(box.offsets[0] + i) * kCols + box.offsets[1] + j]);
    }
  }
  std::vector<uint8_t> out(part.size() * DTypeSize(to));
  ConvertFloats(DType::kF32, part.data(), to, out.data(), part.size());
  return out;
}

// Equal bytes, except that any NaN equals any NaN (ConvertFloats keeps payload bits the
// reader has no reason to change, but compare values, not payloads).
void ExpectSameValues(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType to,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const size_t size = DTypeSize(to);
  int reported = 0;
  for (size_t i = 0; i < got.size() / size && reported < 5; ++i) {
    if (std::memcmp(got.data() + i * size, want.data() + i * size, size) == 0) continue;
    double a = 0, b = 0;
    ConvertFloats(to, got.data() + i * size, DType::kF64, &a, 1);
    ConvertFloats(to, want.data() + i * size, DType::kF64, &b, 1);
    if (std::isnan(a) && std::isnan(b)) continue;
    ADD_FAILURE() << what << ": element " << i << " is " << a << ", expected " << b;
    ++reported;
  }
}

constexpr DType kTargets[] = {DType::kBF16, DType::kF16, DType::kF64, DType::kF8E4M3,
                              DType::kF8E5M2};

// Parameter: verify_checksums. With it, boxes that cut the saved chunks read whole checksum
// blocks through the buffer and convert the parts they need; without, every run is read in
// pieces through the buffer and converted.
class CastDTypesTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    storage_ = std::make_shared<MemoryStorage>();
    full_ = Values();
    SaveRowBlocks(full_, path_, storage_);
    load_.storage = storage_;
    load_.cast_dtypes = true;
    load_.verify_checksums = GetParam();
    load_.unexpected_keys = KeyPolicy::kSkip;
  }

  std::shared_ptr<MemoryStorage> storage_;
  std::string path_ = "/mem/ckpt";
  std::vector<float> full_;
  LoadOptions load_;
};

TEST_P(CastDTypesTest, ResharddedBoxesLoadConverted) {
  // The whole tensor; a box across two chunks cutting rows and columns; one column; a box
  // inside one chunk.
  const Box boxes[] = {Box({0, 0}, {kRows, kCols}), Box({50, 3}, {200, 650}),
                       Box({0, 699}, {kRows, 1}), Box({230, 10}, {20, 300})};
  for (DType to : kTargets) {
    for (const Box& box : boxes) {
      const std::string what = std::string(DTypeName(to)) + " " + box.ToString();
      std::vector<uint8_t> out(box.NumElements() * DTypeSize(to), 0xAB);
      StateDict state;
      ASSERT_OK(state.Add(ShardedTensor::Shard("w", TensorView(out.data(), to, box.sizes),
                                               {kRows, kCols}, box.offsets)));
      uint64_t last_done = 0, last_total = 0;
      LoadOptions options = load_;
      options.progress = [&](uint64_t done, uint64_t total) {
        last_done = done, last_total = total;
      };
      ASSERT_OK_AND_ASSIGN(LoadReport report, Load(state, path_, options));
      ExpectSameValues(out, Expected(full_, box, to), to, what);
      // Counted in memory: the requested dtype's bytes.
      EXPECT_EQ(report.bytes_needed, out.size()) << what;
      EXPECT_EQ(last_done, out.size()) << what;
      EXPECT_EQ(last_total, out.size()) << what;
      EXPECT_GE(report.bytes_read, static_cast<uint64_t>(box.NumElements()) * 4) << what;
    }
  }
}

TEST_P(CastDTypesTest, FlatRangeLoadsConverted) {
  // Elements [1000, 150000) of the flattening of rows 20..279: a distributed optimizer's shard,
  // in BF16.
  const Box local({20, 0}, {260, kCols});
  const int64_t begin = 1000, end = 150000;
  std::vector<uint16_t> out(end - begin, 0xFFFF);
  StateDict state;
  ASSERT_OK(
      state.Add(ShardedTensor::FlatShard("w", TensorView(out.data(), DType::kBF16, {end - begin}),
                                         {kRows, kCols}, local.offsets, local.sizes, begin)));
  ASSERT_OK(Load(state, path_, load_));
  for (int64_t k = 0; k < end - begin; ++k) {
    const float v = full_[(20 + (begin + k) / kCols) * kCols + (begin + k) % kCols];
    uint16_t want = 0;
    ConvertFloats(DType::kF32, &v, DType::kBF16, &want, 1);
    if (std::isnan(v)) continue;
    ASSERT_EQ(out[k], want) << "element " << k;
  }
}

TEST_P(CastDTypesTest, ReadSharingExchangesConvertedBytes) {
  // 4 ranks: ranks 0 and 1 want the whole tensor in BF16, ranks 2 and 3 in F16 (the same file
  // bytes, other results: they must not be mixed up). Each pair reads once and exchanges.
  for (ReadSharing sharing :
       {ReadSharing::kAllGather, ReadSharing::kBroadcast, ReadSharing::kReadOnce}) {
    std::vector<std::vector<uint8_t>> outs(4);
    std::vector<LoadReport> reports(4);
    std::vector<Status> statuses = RunLocalRanks(4, [&](Comm& comm) -> Status {
      const DType to = comm.rank() < 2 ? DType::kBF16 : DType::kF16;
      std::vector<uint8_t>& out = outs[comm.rank()];
      out.assign(kRows * kCols * 2, 0xAB);
      StateDict state;
      TESSERA_RETURN_IF_ERROR(
          state.Add(ShardedTensor::Whole("w", TensorView(out.data(), to, {kRows, kCols}))));
      LoadOptions options = load_;
      options.read_sharing = sharing;
      options.exchange_bytes = 100000;  // several rounds, pieces that cut elements
      TESSERA_ASSIGN_OR_RETURN(reports[comm.rank()], Load(state, path_, comm, options));
      return Status::Ok();
    });
    ASSERT_OK(FirstError(statuses));
    const Box whole({0, 0}, {kRows, kCols});
    for (int r = 0; r < 4; ++r) {
      const DType to = r < 2 ? DType::kBF16 : DType::kF16;
      ExpectSameValues(outs[r], Expected(full_, whole, to), to, "rank " + std::to_string(r));
      EXPECT_EQ(reports[r].bytes_needed, outs[r].size());
    }
    if (sharing == ReadSharing::kReadOnce) {
      // The whole job read the file bytes once (they are the same for both dtypes: each rank
      // converts what it receives itself).
      EXPECT_EQ(reports[0].job_bytes_read, static_cast<uint64_t>(kRows * kCols * 4));
      continue;
    }
    // Within each pair, the bytes were read once: what one read, the other received.
    EXPECT_EQ(reports[0].bytes_read + reports[1].bytes_read,
              static_cast<uint64_t>(kRows * kCols * 4));
    EXPECT_EQ(reports[0].bytes_received + reports[1].bytes_received,
              static_cast<uint64_t>(kRows * kCols * 2));
    EXPECT_EQ(reports[2].bytes_read + reports[3].bytes_read,
              static_cast<uint64_t>(kRows * kCols * 4));
  }
}

INSTANTIATE_TEST_SUITE_P(Verify, CastDTypesTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Checked" : "Unchecked"; });

TEST(CastDTypesErrorsTest, MismatchWithoutTheOptionNamesKeyAndBothDtypes) {
  auto storage = std::make_shared<MemoryStorage>();
  std::vector<float> f32(12, 1.5f);
  std::vector<int32_t> i32(12, 7);
  StateDict saved;
  ASSERT_OK(
      saved.Add(ShardedTensor::Whole("layer.w", TensorView(f32.data(), DType::kF32, {3, 4}))));
  ASSERT_OK(saved.Add(ShardedTensor::Whole("step", TensorView(i32.data(), DType::kI32, {3, 4}))));
  SaveOptions save;
  save.storage = storage;
  ASSERT_OK(Save(saved, "/mem/c", save));

  LoadOptions load;
  load.storage = storage;
  load.unexpected_keys = KeyPolicy::kSkip;
  std::vector<uint16_t> bf16(12, 0);
  StateDict want;
  ASSERT_OK(
      want.Add(ShardedTensor::Whole("layer.w", TensorView(bf16.data(), DType::kBF16, {3, 4}))));
  Status status = Load(want, "/mem/c", load).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("'layer.w'"), HasSubstr("F32"), HasSubstr("BF16"),
                                      HasSubstr("LoadOptions::cast_dtypes")));
  EXPECT_EQ(bf16, std::vector<uint16_t>(12, 0)) << "nothing loaded on error";
  load.cast_dtypes = true;
  ASSERT_OK(Load(want, "/mem/c", load));
  EXPECT_EQ(bf16, std::vector<uint16_t>(12, 0x3FC0));  // 1.5 in BF16

  // Integers are never converted: I32 -> F32 and F32 -> I32 fail with or without the option.
  for (bool cast : {false, true}) {
    load.cast_dtypes = cast;
    std::vector<float> f(12, 0);
    StateDict as_float;
    ASSERT_OK(
        as_float.Add(ShardedTensor::Whole("step", TensorView(f.data(), DType::kF32, {3, 4}))));
    status = Load(as_float, "/mem/c", load).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), AllOf(HasSubstr("'step'"), HasSubstr("saved dtype I32"),
                                        HasSubstr("requested F32")));
    // Only floats convert: the hint is not offered where it cannot help.
    EXPECT_THAT(status.message(), ::testing::Not(HasSubstr("to convert between float dtypes")));
    std::vector<int32_t> i(12, 0);
    StateDict as_int;
    ASSERT_OK(
        as_int.Add(ShardedTensor::Whole("layer.w", TensorView(i.data(), DType::kI32, {3, 4}))));
    status = Load(as_int, "/mem/c", load).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), AllOf(HasSubstr("'layer.w'"), HasSubstr("saved dtype F32"),
                                        HasSubstr("requested I32")));
    EXPECT_EQ(f, std::vector<float>(12, 0));
  }
}

// A chunk stored in another dimension order (ChunkInfo::storage_order, as a transposed view
// saved by torch is): the reader copies element by element, converting each one.
TEST(CastDTypesPermutedTest, ChunkInAnotherDimensionOrderLoadsConverted) {
  auto storage = std::make_shared<MemoryStorage>();
  // M is 4 x 6, M[i][j] = 10 i + j + 0.3; stored transposed: the row-major bytes of M^T.
  std::vector<float> transposed(24);
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 6; ++j) transposed[j * 4 + i] = 10.0f * i + j + 0.3f;
  }
  StateDict saved;
  ASSERT_OK(
      saved.Add(ShardedTensor::Whole("m", TensorView(transposed.data(), DType::kF32, {6, 4}))));
  SaveOptions save;
  save.storage = storage;
  ASSERT_OK(Save(saved, "/mem/p", save));
  // The same bytes described as M, dimension 1 outermost.
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/mem/p", storage));
  m.tensors[0].global_shape = {4, 6};
  m.tensors[0].chunks[0].box = Box({0, 0}, {4, 6});
  m.tensors[0].chunks[0].storage_order = {1, 0};
  const Bytes manifest = EncodeManifest(m);
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<WritableFile> out,
      storage->NewWritableFile(testing::CommitPath(*storage, "/mem/p"), CreateMode::kTruncate));
  ASSERT_OK(out->WriteAt(0, manifest.data(), manifest.size()));
  ASSERT_OK(out->Close());

  LoadOptions load;
  load.storage = storage;
  load.cast_dtypes = true;
  for (DType to : {DType::kF32, DType::kBF16, DType::kF64}) {  // F32: the test's own check
    for (const Box& box : {Box({0, 0}, {4, 6}), Box({1, 2}, {2, 3})}) {
      std::vector<uint8_t> got(box.NumElements() * DTypeSize(to), 0xAB);
      StateDict state;
      ASSERT_OK(state.Add(
          ShardedTensor::Shard("m", TensorView(got.data(), to, box.sizes), {4, 6}, box.offsets)));
      ASSERT_OK_AND_ASSIGN(LoadReport report, Load(state, "/mem/p", load));
      EXPECT_EQ(report.bytes_needed, got.size());
      std::vector<float> want;
      for (int64_t i = 0; i < box.sizes[0]; ++i) {
        for (int64_t j = 0; j < box.sizes[1]; ++j) {
          want.push_back(10.0f * (box.offsets[0] + i) + (box.offsets[1] + j) + 0.3f);
        }
      }
      std::vector<uint8_t> converted(want.size() * DTypeSize(to));
      ConvertFloats(DType::kF32, want.data(), to, converted.data(), want.size());
      EXPECT_EQ(got, converted) << DTypeName(to) << " " << box.ToString();
    }
  }
}

}  // namespace
}  // namespace tessera
