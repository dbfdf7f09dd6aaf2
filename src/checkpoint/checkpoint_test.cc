// End-to-end tests of Save / Load / ReadMetadata / Verify, single and multi rank, on memory and
// POSIX storage.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "format/tessera/manifest.h"
#include "format/torch_dist/test_util.h"
#include "tessera/checkpoint.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/remove_keys.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

// A tensor and the buffer that holds it.
struct Owned {
  std::vector<uint8_t> bytes;
  ShardedTensor tensor;
};

Owned MakeWhole(const std::string& key, DType dtype, Shape shape, uint64_t seed) {
  Owned o;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  o.bytes = testing::RandomBytes(n * DTypeSize(dtype), seed);
  o.tensor = ShardedTensor::Whole(key, TensorView(o.bytes.data(), dtype, shape));
  return o;
}

class CheckpointTest : public ::testing::TestWithParam<bool> {
 protected:
  // Parameter: true = POSIX files in a temp dir, false = MemoryStorage.
  void SetUp() override {
    if (GetParam()) {
      storage_ = NewPosixStorage();
      path_ = dir_.Sub("ckpt");
    } else {
      storage_ = std::make_shared<MemoryStorage>();
      path_ = "/mem/ckpt";
    }
    save_.storage = storage_;
    save_.num_io_threads = 3;
    load_.storage = storage_;
  }

  TempDir dir_;
  std::shared_ptr<Storage> storage_;
  std::string path_;
  SaveOptions save_;
  LoadOptions load_;
};

// Sleeps before every file a save creates and before every publication (the manifest's commit
// among them), so that each phase of a save takes a time the test knows.
class SlowStorage : public StorageWrapper {
 public:
  explicit SlowStorage(std::shared_ptr<Storage> base) : StorageWrapper(std::move(base)) {}
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    std::this_thread::sleep_for(kDelay);
    return target().NewWritableFile(path, mode);
  }
  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    std::this_thread::sleep_for(kDelay);
    return target().Publish(path, bytes, mode, sync);
  }
  static constexpr std::chrono::milliseconds kDelay{40};
};

// Each data file holds its items under 1 MiB first, then the others, each part in key order:
// a rank that needs many small items of another rank's file (the norms one rank saved for all)
// finds them side by side, fetched from an object store in few requests.
TEST(DataFileLayoutTest, SmallItemsComeFirstEachPartInKeyOrder) {
  auto storage = std::make_shared<MemoryStorage>();
  std::vector<float> a_big(1 << 19, 1.0f), c_big(1 << 19, 2.0f), e_big(1 << 18, 3.0f);
  std::vector<float> b_small(256, 4.0f), d_small(1024, 5.0f);
  StateDict state;
  for (auto& [key, data] :
       std::vector<std::pair<std::string, std::vector<float>*>>{{"a_big", &a_big},
                                                                {"b_small", &b_small},
                                                                {"c_big", &c_big},
                                                                {"d_small", &d_small},
                                                                {"e_big", &e_big}}) {
    ASSERT_OK(state.Add(ShardedTensor::Whole(
        key, TensorView(data->data(), DType::kF32, {static_cast<int64_t>(data->size())}))));
  }
  SaveOptions options;
  options.storage = storage;
  options.num_io_threads = 1;  // one data file
  ASSERT_OK(Save(state, "/ck", options).status());
  LoadOptions load;
  load.storage = storage;
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/ck", storage));
  ASSERT_EQ(m.files.size(), 1u);
  std::vector<std::pair<uint64_t, std::string>> by_offset;
  for (const TensorInfo& t : m.tensors) {
    by_offset.emplace_back(t.chunks.at(0).location.offset, t.key);
  }
  std::sort(by_offset.begin(), by_offset.end());
  std::vector<std::string> order;
  for (const auto& [offset, key] : by_offset) order.push_back(key);
  // e_big is 1 MiB: not under it.
  EXPECT_EQ(order, (std::vector<std::string>{"b_small", "d_small", "a_big", "c_big", "e_big"}));
  StateDict back;
  std::vector<float> d_back(1024, 0.0f);
  ASSERT_OK(
      back.Add(ShardedTensor::Whole("d_small", TensorView(d_back.data(), DType::kF32, {1024}))));
  load.unexpected_keys = KeyPolicy::kSkip;
  ASSERT_OK(Load(back, "/ck", load).status());
  EXPECT_EQ(d_back, d_small);
}

TEST(SaveReportTest, ThePhasesSayWhereTheTimeWentOnEveryRankCollectiveOrNot) {
  auto slow = std::make_shared<SlowStorage>(std::make_shared<MemoryStorage>());
  const double delay = std::chrono::duration<double>(SlowStorage::kDelay).count();
  for (const bool collective : {true, false}) {
    Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
      std::vector<float> rows(4 * 64, 1.0f + comm.rank());
      StateDict state;
      TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
          "w", TensorView(rows.data(), DType::kF32, {4, 64}), {8, 64}, {4 * comm.rank(), 0})));
      SaveOptions o;
      o.storage = slow;
      o.collective = collective;
      if (!collective) o.save_tag = "t";
      const auto start = std::chrono::steady_clock::now();
      TESSERA_ASSIGN_OR_RETURN(SaveReport r, Save(state, collective ? "/c" : "/l", comm, o));
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::string what =
          std::string(collective ? "collective" : "rank-local") + " save on rank " +
          std::to_string(comm.rank()) + ": plan " + std::to_string(r.plan_seconds) + " s, write " +
          std::to_string(r.write_seconds) + " s, commit " + std::to_string(r.commit_seconds) +
          " s, call " + std::to_string(elapsed) + " s";
      // Each rank creates its data file in the write phase; the commit publishes a manifest
      // (the coordinator's, or each rank's own part), which every rank waits for.
      if (r.plan_seconds < 0 || r.write_seconds < delay || r.commit_seconds < delay ||
          r.plan_seconds + r.write_seconds + r.commit_seconds > elapsed) {
        return Internal(what);
      }
      return Status::Ok();
    }));
    EXPECT_OK(s);
  }
}

TEST_P(CheckpointTest, RoundTripEveryDtypeScalarsEmptyTensorsObjectsMetadata) {
  std::vector<Owned> owned;
  uint64_t seed = 1;
  for (DType d : kAllDTypes) {
    owned.push_back(MakeWhole("t." + std::string(DTypeName(d)), d, {3, 5}, seed++));
  }
  owned.push_back(MakeWhole("scalar", DType::kF64, {}, seed++));
  owned.push_back(MakeWhole("empty", DType::kF32, {4, 0, 3}, seed++));
  StateDict state;
  for (Owned& o : owned) ASSERT_OK(state.Add(o.tensor));
  ASSERT_OK(state.Add(ShardedObject{"rng", {1, 2, 3, 250}, {}}));
  ASSERT_OK(state.Add(ShardedObject{"empty_object", {}, {}}));
  save_.user_metadata = {{"step", "100"}, {"framework", "test"}};
  ASSERT_OK_AND_ASSIGN(SaveReport report, Save(state, path_, save_));
  EXPECT_EQ(report.total_bytes, report.bytes_written);

  ASSERT_OK_AND_ASSIGN(Metadata metadata, ReadMetadata(path_, storage_));
  EXPECT_EQ(metadata.user_metadata, save_.user_metadata);
  EXPECT_EQ(metadata.tensors.size(), owned.size());
  ASSERT_NE(metadata.FindTensor("scalar"), nullptr);
  EXPECT_TRUE(metadata.FindTensor("scalar")->global_shape.empty());
  ASSERT_NE(metadata.FindTensor("empty"), nullptr);
  EXPECT_EQ(metadata.FindTensor("empty")->global_shape, (Shape{4, 0, 3}));
  EXPECT_EQ(metadata.objects.size(), 2u);

  std::vector<Owned> loaded;
  for (const Owned& o : owned) {
    Owned l = o;
    std::fill(l.bytes.begin(), l.bytes.end(), 0);
    l.tensor.data.data = l.bytes.data();
    loaded.push_back(std::move(l));
  }
  StateDict target;
  for (Owned& l : loaded) ASSERT_OK(target.Add(l.tensor));
  ASSERT_OK(target.Add(ShardedObject{"rng", {}, {}}));
  ASSERT_OK(target.Add(ShardedObject{"empty_object", {9}, {}}));
  ASSERT_OK_AND_ASSIGN(LoadReport load_report, Load(target, path_, load_));
  for (size_t i = 0; i < owned.size(); ++i) {
    EXPECT_EQ(loaded[i].bytes, owned[i].bytes) << owned[i].tensor.key;
  }
  EXPECT_EQ(std::get<ShardedObject>(*target.Find("rng")).data,
            (std::vector<uint8_t>{1, 2, 3, 250}));
  EXPECT_TRUE(std::get<ShardedObject>(*target.Find("empty_object")).data.empty());
  EXPECT_EQ(load_report.bytes_read, load_report.bytes_needed);
  ASSERT_OK_AND_ASSIGN(VerifyReport verify, Verify(path_, storage_));
  EXPECT_EQ(verify.bytes_checked, metadata.TotalTensorBytes() + 4);
}

// Loads `key` of the checkpoint as box `box` and returns the bytes.
Result<std::vector<uint8_t>> LoadBox(const std::string& path, const LoadOptions& options,
                                     const std::string& key, DType dtype, Shape global, Box box) {
  std::vector<uint8_t> out(box.NumElements() * DTypeSize(dtype), 0xAB);
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(
      ShardedTensor::Shard(key, TensorView(out.data(), dtype, box.sizes), global, box.offsets)));
  LoadOptions o = options;
  o.unexpected_keys = KeyPolicy::kSkip;
  TESSERA_RETURN_IF_ERROR(Load(state, path, o));
  return out;
}

TEST_P(CheckpointTest, LoadsAnyBoxOfASavedTensor) {
  // A 6x10 int32 tensor whose value is its linear index, saved as 3 column blocks by 3 ranks.
  std::vector<int32_t> full(60);
  for (int i = 0; i < 60; ++i) full[i] = i;
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    int r = comm.rank();
    int64_t c0 = r * 4, cn = r == 2 ? 2 : 4;  // uneven: 4, 4, 2 columns
    std::vector<int32_t> local;
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = c0; j < c0 + cn; ++j) local.push_back(full[i * 10 + j]);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "x", TensorView(local.data(), DType::kI32, {6, cn}), {6, 10}, {0, c0})));
    return Save(state, path_, comm, save_).status();
  });
  ASSERT_OK(FirstError(statuses));
  for (const Box& box :
       {Box({0, 0}, {6, 10}), Box({1, 3}, {4, 6}), Box({5, 9}, {1, 1}), Box({2, 0}, {1, 10})}) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                         LoadBox(path_, load_, "x", DType::kI32, {6, 10}, box));
    const auto* got = reinterpret_cast<const int32_t*>(bytes.data());
    for (int64_t i = 0; i < box.sizes[0]; ++i)
      for (int64_t j = 0; j < box.sizes[1]; ++j)
        EXPECT_EQ(got[i * box.sizes[1] + j], (box.offsets[0] + i) * 10 + box.offsets[1] + j)
            << box.ToString();
  }
}

TEST_P(CheckpointTest, FlatRangesOnBothSides) {
  // Saved: a 5x7 float tensor as 3 flat ranges of the whole box (a distributed optimizer).
  std::vector<float> full(35);
  for (int i = 0; i < 35; ++i) full[i] = 0.5f * i;
  const int64_t cuts[] = {0, 9, 22, 35};
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    int r = comm.rank();
    std::vector<float> mine(full.begin() + cuts[r], full.begin() + cuts[r + 1]);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(
        ShardedTensor::FlatShard("m", TensorView(mine.data(), DType::kF32, {cuts[r + 1] - cuts[r]}),
                                 {5, 7}, {0, 0}, {5, 7}, cuts[r])));
    return Save(state, path_, comm, save_).status();
  });
  ASSERT_OK(FirstError(statuses));
  // Loaded: flat range [4, 30) of the box rows 1..4, columns 2..6.
  Box local({1, 2}, {4, 5});
  std::vector<float> out(16, -1);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::FlatShard("m", TensorView(out.data(), DType::kF32, {16}),
                                               {5, 7}, local.offsets, local.sizes, 4)));
  ASSERT_OK(Load(state, path_, load_));
  for (int k = 0; k < 16; ++k) {
    int64_t flat = 4 + k, i = 1 + flat / 5, j = 2 + flat % 5;
    EXPECT_EQ(out[k], full[i * 7 + j]) << "element " << k;
  }
}

TEST_P(CheckpointTest, BadInputErrorsNameWhatIsWrong) {
  // Missing directory; directory without manifest.
  StateDict nothing;
  Result<LoadReport> r = Load(nothing, path_ + "-missing", load_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("does not exist"));
  ASSERT_OK(storage_->CreateDirs(path_));
  r = Load(nothing, path_, load_);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("no committed checkpoint"));

  Owned a = MakeWhole("a", DType::kF32, {4, 4}, 5);
  StateDict state;
  ASSERT_OK(state.Add(a.tensor));
  ASSERT_OK(Save(state, path_, save_));

  // dtype mismatch, shape mismatch, out of bounds, missing key, unexpected key.
  auto expect_error = [&](ShardedTensor t, const std::string& text, LoadOptions o) {
    std::vector<uint8_t> buf(t.data.NumBytes() + 64);
    t.data.data = buf.data();
    StateDict s;
    Status add = s.Add(t);
    Status st = add.ok() ? Load(s, path_, o).status() : add;
    EXPECT_FALSE(st.ok()) << text;
    EXPECT_THAT(st.message(), HasSubstr(text));
  };
  expect_error(ShardedTensor::Whole("a", TensorView(nullptr, DType::kBF16, {4, 4})),
               "key 'a': saved dtype F32, requested BF16", load_);
  expect_error(ShardedTensor::Whole("a", TensorView(nullptr, DType::kF32, {4, 5})),
               "key 'a': saved global shape [4, 4], requested [4, 5]", load_);
  expect_error(ShardedTensor::Shard("a", TensorView(nullptr, DType::kF32, {2, 2}), {4, 4}, {3, 3}),
               "outside the global shape [4, 4]", load_);
  expect_error(ShardedTensor::Whole("b", TensorView(nullptr, DType::kF32, {4, 4})),
               "has no key 'b'", load_);
  StateDict empty;
  Status st = Load(empty, path_, load_).status();
  EXPECT_THAT(st.message(), HasSubstr("keys no rank asked for: 'a'"));
  LoadOptions lenient = load_;
  lenient.unexpected_keys = KeyPolicy::kSkip;
  ASSERT_OK_AND_ASSIGN(LoadReport report, Load(empty, path_, lenient));
  EXPECT_EQ(report.unexpected_keys, std::vector<std::string>{"a"});
  lenient.missing_keys = KeyPolicy::kSkip;
  std::vector<uint8_t> buf(64);
  StateDict with_missing;
  ASSERT_OK(
      with_missing.Add(ShardedTensor::Whole("b", TensorView(buf.data(), DType::kF32, {4, 4}))));
  ASSERT_OK_AND_ASSIGN(report, Load(with_missing, path_, lenient));
  EXPECT_EQ(report.missing_keys, std::vector<std::string>{"b"});
}

TEST_P(CheckpointTest, AllowShapeMismatchLoadsTheCommonPart) {
  std::vector<int32_t> saved = {1, 2, 3, 4, 5, 6};  // [2, 3]
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("emb", TensorView(saved.data(), DType::kI32, {2, 3}))));
  ASSERT_OK(Save(state, path_, save_));
  std::vector<int32_t> bigger(12, -1);  // [3, 4]: padded vocabulary
  ShardedTensor t = ShardedTensor::Whole("emb", TensorView(bigger.data(), DType::kI32, {3, 4}));
  t.allow_shape_mismatch = true;
  StateDict target;
  ASSERT_OK(target.Add(t));
  ASSERT_OK_AND_ASSIGN(LoadReport report, Load(target, path_, load_));
  EXPECT_EQ(bigger, (std::vector<int32_t>{1, 2, 3, -1, 4, 5, 6, -1, -1, -1, -1, -1}));
  EXPECT_EQ(report.shape_mismatched_keys, std::vector<std::string>{"emb"});
}

TEST_P(CheckpointTest, PartialTensorsSaveAndLoadWhatWasSaved) {
  std::vector<int32_t> half = {1, 2, 3, 4};
  ShardedTensor t =
      ShardedTensor::Shard("p", TensorView(half.data(), DType::kI32, {2, 2}), {4, 2}, {0, 0});
  StateDict state;
  ASSERT_OK(state.Add(t));
  Result<SaveReport> refused = Save(state, path_, save_);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("cover 4 of the 8 elements"));
  std::get<ShardedTensor>(state.entries()[0]).partial = true;
  ASSERT_OK(Save(state, path_, save_));
  ASSERT_OK_AND_ASSIGN(Metadata metadata, ReadMetadata(path_, storage_));
  EXPECT_TRUE(metadata.tensors[0].partial);
  EXPECT_OK(Verify(path_, storage_));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> got,
                       LoadBox(path_, load_, "p", DType::kI32, {4, 2}, Box({1, 0}, {1, 2})));
  EXPECT_EQ(reinterpret_cast<const int32_t*>(got.data())[1], 4);
  Result<std::vector<uint8_t>> unsaved =
      LoadBox(path_, load_, "p", DType::kI32, {4, 2}, Box({1, 0}, {2, 2}));
  ASSERT_FALSE(unsaved.ok());
  EXPECT_THAT(unsaved.status().message(),
              HasSubstr("key 'p': box [1:3, 0:2] is covered by 2 of its 4 elements"));
}

INSTANTIATE_TEST_SUITE_P(Storages, CheckpointTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Posix" : "Memory"; });

// ---- corruption, on real files ---------------------------------------------------------------

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.Sub("ckpt");
    a_ = MakeWhole("layer.weight", DType::kF32, {64, 64}, 11);
    StateDict state;
    ASSERT_OK(state.Add(a_.tensor));
    SaveOptions o;
    o.num_io_threads = 1;
    ASSERT_OK(Save(state, path_, o));
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path_));
    data_file_ = path_ + "/" + m.files[0].name;
    offset_ = m.tensors[0].chunks[0].location.offset;
  }
  Status LoadIt() {
    std::vector<uint8_t> out(a_.bytes.size());
    StateDict state;
    Status s = state.Add(
        ShardedTensor::Whole("layer.weight", TensorView(out.data(), DType::kF32, {64, 64})));
    if (!s.ok()) return s;
    return Load(state, path_).status();
  }
  TempDir dir_;
  std::string path_, data_file_;
  uint64_t offset_ = 0;
  Owned a_;
};

TEST_F(CorruptionTest, FlippedByteIsACheckumMismatchNamingKeyChunkAndFile) {
  std::fstream f(data_file_, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset_ + 100);
  char c;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(offset_ + 100);
  f.write(&c, 1);
  f.close();
  for (Status s : {LoadIt(), Verify(path_).status()}) {
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_THAT(s.message(),
                HasSubstr("checksum mismatch in key 'layer.weight' chunk 0 [0:64, 0:64]"));
    EXPECT_THAT(s.message(), HasSubstr(data_file_));
  }
}

// A load that needs part of a chunk checks the checksum blocks it touches, reading each whole:
// a corrupt byte it does not need, in a block it needs, is caught. A checkpoint of format
// version 1 has one checksum per chunk: its parts are checked only with verify_partial_chunks,
// by reading the chunk whole.
TEST(PartialChunkVerificationTest, CatchesCorruptionInTheBlocksALoadTouches) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  std::vector<int32_t> full(8 * 16);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<int32_t>(i);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("m", TensorView(full.data(), DType::kI32, {8, 16}))));
  ASSERT_OK(Save(state, path));
  // Columns 2..5 of every row: a part of the one chunk (one block), in 8 runs.
  auto load_part = [&](bool verify_partial) -> Result<std::vector<int32_t>> {
    std::vector<int32_t> out(8 * 4, -1);
    StateDict part;
    TESSERA_RETURN_IF_ERROR(part.Add(
        ShardedTensor::Shard("m", TensorView(out.data(), DType::kI32, {8, 4}), {8, 16}, {0, 2})));
    LoadOptions o;
    o.verify_partial_chunks = verify_partial;
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(part, path, o));
    if (report.bytes_read != full.size() * 4) {
      return Internal("expected the whole chunk read, got " + std::to_string(report.bytes_read));
    }
    return out;
  };
  for (bool verify_partial : {false, true}) {
    ASSERT_OK_AND_ASSIGN(std::vector<int32_t> got, load_part(verify_partial));
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 4; ++c) EXPECT_EQ(got[r * 4 + c], r * 16 + 2 + c);
  }
  // Corrupt column 10 of row 3: a byte this load does not need.
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  const std::string file = path + "/" + m.files[0].name;
  const uint64_t at = m.tensors[0].chunks[0].location.offset + (3 * 16 + 10) * 4;
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(at);
    f.put('\x7f');
  }
  for (bool verify_partial : {false, true}) {
    Result<std::vector<int32_t>> checked = load_part(verify_partial);
    ASSERT_FALSE(checked.ok());
    EXPECT_EQ(checked.status().code(), StatusCode::kDataLoss);
    EXPECT_THAT(checked.status().message(), HasSubstr("checksum mismatch in key 'm' chunk 0"));
  }
  // The same checkpoint under a version 1 manifest (whose one checksum covers the chunk).
  {
    std::ofstream out(testing::CommitPath(path), std::ios::binary | std::ios::trunc);
    const Bytes v1 = EncodeManifestVersion1(m);
    out.write(reinterpret_cast<const char*>(v1.data()), v1.size());
  }
  LoadOptions unchecked;
  std::vector<int32_t> out(8 * 4, -1);
  StateDict part;
  ASSERT_OK(part.Add(
      ShardedTensor::Shard("m", TensorView(out.data(), DType::kI32, {8, 4}), {8, 16}, {0, 2})));
  ASSERT_OK_AND_ASSIGN(LoadReport report, Load(part, path, unchecked));
  EXPECT_EQ(report.bytes_read, 8u * 4 * 4);  // only what it needs, not checked
  unchecked.verify_partial_chunks = true;
  EXPECT_EQ(Load(part, path, unchecked).status().code(), StatusCode::kDataLoss);
}

// Verify hashes chunks where they lie in mapped pieces of the file when the storage maps
// (PosixStorageOptions::map_reads, on by default), else reads them through a buffer. Both give
// the same verdicts on a chunk of several MiB, and so does a partial load, which checks the
// checksum blocks it touches and only those.
TEST(MappedReadTest, VerifyAndPartialChunkChecksAgreeWithAndWithoutMapping) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  const Shape shape = {2600, 1003};  // 10.4 MB of F32: odd lengths, several 1 MiB pieces
  Owned big = MakeWhole("big", DType::kF32, shape, 5);
  StateDict state;
  ASSERT_OK(state.Add(big.tensor));
  ASSERT_OK(Save(state, path));
  const Box lower_half({1300, 0}, {1300, 1003});
  const auto posix = [](bool map_reads) { return NewPosixStorage({.map_reads = map_reads}); };
  LoadOptions checked;
  const std::vector<uint8_t> want(big.bytes.begin() + big.bytes.size() / 2, big.bytes.end());
  for (bool map_reads : {true, false}) {
    checked.storage = posix(map_reads);
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> part,
                         LoadBox(path, checked, "big", DType::kF32, shape, lower_half));
    EXPECT_EQ(part, want) << "map_reads " << map_reads;
    ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(path, posix(map_reads)));
    EXPECT_EQ(report.bytes_checked, big.bytes.size());
  }
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  ASSERT_EQ(m.checksum_block_bytes, kChecksumBlockBytes);
  auto flip = [&](uint64_t byte) {
    std::fstream f(path + "/" + m.files[0].name, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(m.tensors[0].chunks[0].location.offset + byte);
    f.put(static_cast<char>(big.bytes[byte] ^ 0x40));
  };
  // A flipped byte in the upper half, in a block the partial load does not touch: only Verify
  // sees it.
  const uint64_t half = big.bytes.size() / 2;
  const uint64_t far = (4u << 20) - 5;
  ASSERT_LT(far / kChecksumBlockBytes, half / kChecksumBlockBytes);
  flip(far);
  for (bool map_reads : {true, false}) {
    SCOPED_TRACE("map_reads " + std::to_string(map_reads));
    checked.storage = posix(map_reads);
    EXPECT_OK(LoadBox(path, checked, "big", DType::kF32, shape, lower_half).status());
    const Status s = Verify(path, posix(map_reads)).status();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("checksum mismatch in key 'big' chunk 0"));
  }
  // A flipped byte just before the lower half, in the block where it starts: the partial load
  // does not need it, reads its block whole and sees it.
  flip(far);  // restores it
  const uint64_t near = half - 5;
  ASSERT_EQ(near / kChecksumBlockBytes, half / kChecksumBlockBytes);
  flip(near);
  for (bool map_reads : {true, false}) {
    SCOPED_TRACE("map_reads " + std::to_string(map_reads));
    checked.storage = posix(map_reads);
    for (const Status& s : {LoadBox(path, checked, "big", DType::kF32, shape, lower_half).status(),
                            Verify(path, posix(map_reads)).status()}) {
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
      EXPECT_THAT(s.message(), HasSubstr("checksum mismatch in key 'big' chunk 0"));
    }
  }
}

// Verify checks files on several threads; what it reports does not depend on how many: the
// same totals, and with two corrupt files the error of the first one in manifest order.
TEST(VerifyTest, ThreadsChangeNeitherTheReportNorWhichErrorIsReturned) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  std::vector<Owned> owned;
  StateDict state;
  for (int i = 0; i < 6; ++i) {
    owned.push_back(MakeWhole("t" + std::to_string(i), DType::kF32, {64, 64}, 100 + i));
  }
  for (Owned& o : owned) ASSERT_OK(state.Add(o.tensor));
  SaveOptions so;
  so.num_io_threads = 4;  // 4 data files
  ASSERT_OK(Save(state, path, so));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  ASSERT_EQ(m.files.size(), 4u);
  ASSERT_OK_AND_ASSIGN(VerifyReport one, Verify(path, VerifyOptions{.num_threads = 1}));
  ASSERT_OK_AND_ASSIGN(VerifyReport four, Verify(path, VerifyOptions{.num_threads = 4}));
  EXPECT_EQ(one.files_checked, 4);
  EXPECT_EQ(four.files_checked, 4);
  EXPECT_EQ(four.chunks_checked, one.chunks_checked);
  EXPECT_EQ(four.bytes_checked, one.bytes_checked);
  EXPECT_EQ(one.bytes_checked, 6u * 64 * 64 * 4);

  // Flip a byte of the first chunk of files 1 and 3.
  for (uint32_t f : {3u, 1u}) {
    for (const TensorInfo& t : m.tensors) {
      if (t.chunks[0].location.file_index != f) continue;
      std::fstream out(path + "/" + m.files[f].name,
                       std::ios::in | std::ios::out | std::ios::binary);
      out.seekp(t.chunks[0].location.offset + 7);
      out.put('\x55');
      break;
    }
  }
  for (int threads : {1, 2, 4, 8}) {
    const Status s = Verify(path, VerifyOptions{.num_threads = threads}).status();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << threads << ": " << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr(m.files[1].name)) << threads;
  }
  const Status bad = Verify(path, VerifyOptions{.num_threads = 0}).status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("num_threads"));
}

// Issue 22, defect 14: a data file's safetensors header (what other readers of the file go
// by) corrupted: Verify failed on it, a load did not look at it and succeeded. A load now
// checks what Verify checks of every file it reads from: the header parses, and describes
// each chunk it reads where the manifest puts it. Every byte of the header, one at a time.
TEST_F(CorruptionTest, DamagedSafetensorsHeaderFailsTheLoadAsItFailsVerify) {
  const std::vector<uint8_t> good = torch_dist::testing::ReadFileBytes(data_file_);
  uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= uint64_t{good[i]} << (8 * i);
  const std::string json(good.begin() + 8, good.begin() + 8 + header);
  const uint64_t end = 8 + json.find_last_not_of(' ') + 1;  // the padding after it is spaces
  int damaged = 0;
  for (uint64_t at = 0; at < end; ++at) {
    std::vector<uint8_t> bytes = good;
    bytes[at] ^= at < 8 ? 0x01 : 0x20;  // a letter changes case, a quote becomes a '\x02'
    torch_dist::testing::WriteFileBytes(data_file_, bytes);
    const Status verify = Verify(path_).status();
    if (verify.ok()) continue;  // e.g. a space that became a NUL... inside a string
    ++damaged;
    const Status load = LoadIt();
    ASSERT_FALSE(load.ok()) << "byte " << at << " damaged (" << verify.ToString()
                            << ") but the load succeeded";
    EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load.ToString();
    EXPECT_THAT(load.message(), HasSubstr(data_file_)) << load.ToString();
  }
  EXPECT_GT(damaged, static_cast<int>(end) / 2);
  torch_dist::testing::WriteFileBytes(data_file_, good);
  EXPECT_OK(LoadIt());
}

TEST_F(CorruptionTest, TruncatedAndMissingDataFiles) {
  std::filesystem::resize_file(data_file_, offset_ + 1000);
  for (Status s : {LoadIt(), Verify(path_).status()}) {
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_THAT(s.message(), HasSubstr("(truncated)"));
    EXPECT_THAT(s.message(), HasSubstr(data_file_));
    EXPECT_THAT(s.message(), HasSubstr("layer.weight"));
  }
  std::filesystem::remove(data_file_);
  for (Status s : {LoadIt(), Verify(path_).status()}) {
    EXPECT_THAT(s.message(), HasSubstr("is missing"));
    EXPECT_THAT(s.message(), HasSubstr("layer.weight"));
  }
}

TEST_F(CorruptionTest, ManifestEscapingTheDirectoryIsRejected) {
  ASSERT_OK_AND_ASSIGN(const Metadata good, ReadMetadata(path_));
  for (const std::string bad : {"../outside.safetensors", "/etc/passwd", "a/b.safetensors", ".."}) {
    Metadata m = good;
    m.files[0].name = bad;
    Bytes bytes = EncodeManifest(m);
    std::ofstream(testing::CommitPath(path_), std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    Status s = LoadIt();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr(bad));
  }
}

// ---- many ranks --------------------------------------------------------------------------------

TEST(MultiRankTest, ARankWhoseStorageFailsFailsTheSaveEverywhereAndLeavesNoManifest) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(4, [&](Comm& comm) -> Status {
    std::vector<float> data(100, 1.0f * comm.rank());
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(data.data(), DType::kF32, {100}), {400}, {100 * comm.rank()})));
    SaveOptions o;
    o.storage = memory;
    if (comm.rank() == 2) {
      o.storage = std::make_shared<FaultInjectingStorage>(
          memory, FaultPlan{.fail_at = 1, .crash = false, .path_filter = ""});
    }
    return Save(state, "/ck", comm, o).status();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
    EXPECT_THAT(statuses[r].message(), HasSubstr("rank 2")) << statuses[r].ToString();
    EXPECT_THAT(statuses[r].message(), HasSubstr("injected fault")) << statuses[r].ToString();
  }
  EXPECT_FALSE(testing::HasCommit(*memory, "/ck"));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> left, memory->ListDir("/ck"));
  EXPECT_TRUE(left.empty()) << left.size() << " files left, first " << left[0];
}

TEST(MultiRankTest, OverlappingShardsFailOnEveryRankNamingKeyAndRanks) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    std::vector<float> data(6);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(data.data(), DType::kF32, {6}), {10}, {4 * comm.rank()})));
    SaveOptions o;
    o.storage = memory;
    return Save(state, "/ck", comm, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_THAT(s.message(),
                HasSubstr("key 'w': boxes [0:6] and [4:10] overlap (held by rank 0 and rank 1)"));
  }
}

// ---- crash consistency -------------------------------------------------------------------------

// Saves generation `gen` (values depend on it) of a small two-tensor state.
struct Generation {
  std::vector<float> a, b;
  std::vector<uint8_t> obj;
  explicit Generation(int gen) : a(300), b(77), obj{static_cast<uint8_t>(gen), 7} {
    for (size_t i = 0; i < a.size(); ++i) a[i] = gen * 1000.0f + i;
    for (size_t i = 0; i < b.size(); ++i) b[i] = -gen * 1000.0f - i;
  }
  StateDict Dict() {
    StateDict s;
    (void)s.Add(ShardedTensor::Whole("a", TensorView(a.data(), DType::kF32, {20, 15})));
    (void)s.Add(ShardedTensor::Whole("b", TensorView(b.data(), DType::kF32, {77})));
    (void)s.Add(ShardedObject{"o", obj, {}});
    return s;
  }
};

// Loads the checkpoint and returns which generation it holds: -1 when the load fails.
int LoadedGeneration(const std::string& path, std::shared_ptr<Storage> storage, Status* error) {
  Generation g(0);
  StateDict s = g.Dict();
  LoadOptions o;
  o.storage = storage;
  *error = Load(s, path, o).status();
  if (!error->ok()) return -1;
  g.obj = std::get<ShardedObject>(*s.Find("o")).data;
  for (int gen : {1, 2}) {
    Generation want(gen);
    if (g.a == want.a && g.b == want.b && g.obj == want.obj) return gen;
  }
  return -2;  // loaded, but neither generation: torn
}

// Saves generation 1 into a fresh MemoryStorage, then generation 2 over it through a
// FaultInjectingStorage with `plan`. `first` is the first save's status, `second` the second's.
struct SaveOverExisting {
  std::shared_ptr<MemoryStorage> memory = std::make_shared<MemoryStorage>();
  std::shared_ptr<FaultInjectingStorage> faulty;
  Status first, second;

  explicit SaveOverExisting(FaultPlan plan) {
    Generation g1(1), g2(2);
    SaveOptions o;
    o.storage = memory;
    first = Save(g1.Dict(), "/ck", o).status();
    faulty = std::make_shared<FaultInjectingStorage>(memory, std::move(plan));
    o.storage = faulty;
    second = Save(g2.Dict(), "/ck", o).status();
  }
};

TEST(CrashConsistencyTest, CrashAtEveryStepOfASaveOverAnExistingCheckpoint) {
  // Count the operations of a save over an existing checkpoint.
  SaveOverExisting clean{FaultPlan{}};
  ASSERT_OK(clean.first);
  ASSERT_OK(clean.second);
  const int64_t total_ops = clean.faulty->operation_count();
  ASSERT_GT(total_ops, 8);
  int old_seen = 0, new_seen = 0;
  for (int64_t n = 0; n <= total_ops; ++n) {
    SCOPED_TRACE("crash at operation " + std::to_string(n));
    SaveOverExisting run{FaultPlan{.fail_at = n, .crash = true, .path_filter = ""}};
    ASSERT_OK(run.first);
    const Status& saved = run.second;
    const std::shared_ptr<MemoryStorage>& memory = run.memory;
    memory->SimulateCrash();
    Status error;
    int gen = LoadedGeneration("/ck", memory, &error);
    ASSERT_TRUE(gen == 1 || gen == 2) << "generation " << gen << ": " << error.ToString();
    if (saved.ok()) {
      EXPECT_EQ(gen, 2) << "a save that reported success must be durable";
    }
    (gen == 1 ? old_seen : new_seen)++;
    // After the crash a new save must succeed and clean up.
    SaveOptions o;
    o.storage = memory;
    Generation g3(1);
    ASSERT_OK(Save(g3.Dict(), "/ck", o));
    ASSERT_OK(Verify("/ck", memory));
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

TEST(CrashConsistencyTest, FailureAtEveryStepLeavesTheOldCheckpointOrTheNew) {
  int64_t n = 0;
  for (;; ++n) {
    SCOPED_TRACE("failure at operation " + std::to_string(n));
    SaveOverExisting run{FaultPlan{.fail_at = n, .crash = false, .path_filter = ""}};
    ASSERT_OK(run.first);
    const Status& saved = run.second;
    Status error;
    int gen = LoadedGeneration("/ck", run.memory, &error);
    if (saved.ok()) {
      if (!run.faulty->fault_fired()) break;  // past the last operation
      EXPECT_EQ(gen, 2);
    } else {
      EXPECT_THAT(saved.message(), HasSubstr("injected fault"));
      EXPECT_TRUE(gen == 1 || gen == 2) << error.ToString();
    }
  }
  EXPECT_GT(n, 8);
}

// A synced save hands every 8 MiB of a data file to StartWriteback as it goes. A failing
// StartWriteback fails the save like a failing write: the error names the file, and the
// previous checkpoint stays the committed one.
TEST(CrashConsistencyTest, SyncedSaveStartsWritebackAndItsFailureKeepsTheOldCheckpoint) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveOptions o;
  o.storage = memory;
  o.num_io_threads = 1;
  Generation g1(1);
  ASSERT_OK(Save(g1.Dict(), "/ck", o));
  Owned big = MakeWhole("a", DType::kF32, {5, 1u << 20}, 9);  // 20 MiB: two writebacks
  StateDict state;
  ASSERT_OK(state.Add(big.tensor));
  int writebacks_failed = 0;
  for (int64_t n = 0;; ++n) {
    auto faulty = std::make_shared<FaultInjectingStorage>(
        memory, FaultPlan{.fail_at = n, .crash = false, .path_filter = ""});
    o.storage = faulty;
    const Status saved = Save(state, "/ck", o).status();
    if (!faulty->fault_fired()) {
      ASSERT_OK(saved);
      break;
    }
    if (saved.message().find("(StartWriteback ") == std::string::npos) continue;
    ++writebacks_failed;
    EXPECT_EQ(saved.code(), StatusCode::kIOError) << saved.ToString();
    EXPECT_THAT(saved.message(), HasSubstr("writing /ck/tsr-"));
    Status error;
    EXPECT_EQ(LoadedGeneration("/ck", memory, &error), 1) << error.ToString();
  }
  EXPECT_EQ(writebacks_failed, 2);
  // Without kFull, no writeback is started: the page cache decides.
  auto counting = std::make_shared<FaultInjectingStorage>(memory, FaultPlan{});
  o.storage = counting;
  o.sync = SyncPolicy::kNone;
  ASSERT_OK(Save(state, "/ck2", o));
  const int64_t unsynced_ops = counting->operation_count();
  counting->SetPlan(FaultPlan{});
  o.sync = SyncPolicy::kFull;
  ASSERT_OK(Save(state, "/ck3", o));
  // kFull adds: 2 writebacks, the data file's Sync, the manifest's Sync, SyncDir of the parent
  // of the new directory and two SyncDir of the directory; for the in-progress marker its Sync
  // and a SyncDir.
  EXPECT_EQ(counting->operation_count() - unsynced_ops, 2 + 1 + 1 + 1 + 2 + 2);
}

TEST(CrashConsistencyTest, CrashDuringAFirstSaveLeavesNoCheckpoint) {
  auto memory = std::make_shared<MemoryStorage>();
  Generation g1(1);
  SaveOptions o;
  o.storage = std::make_shared<FaultInjectingStorage>(
      memory, FaultPlan{.fail_at = 3, .crash = true, .path_filter = ""});
  EXPECT_FALSE(Save(g1.Dict(), "/ck", o).ok());
  memory->SimulateCrash();
  Status error;
  EXPECT_EQ(LoadedGeneration("/ck", memory, &error), -1);
  EXPECT_TRUE(error.code() == StatusCode::kNotFound ||
              error.code() == StatusCode::kFailedPrecondition)
      << error.ToString();
}

// ---- crash consistency of RemoveKeys ----------------------------------------------------------

// What the checkpoint at "/ck" holds after RemoveKeys(prefix "b") of generation 1: 1 for the
// old checkpoint (a, b and o), 2 for the new one (a and o, b gone, values of generation 1),
// -1 when neither loads (`error` says why).
int OldOrNewAfterRemoval(std::shared_ptr<Storage> storage, Status* error) {
  Generation g(0), want(1);
  LoadOptions o;
  o.storage = storage;
  StateDict all = g.Dict();
  if (Load(all, "/ck", o).ok()) {
    g.obj = std::get<ShardedObject>(*all.Find("o")).data;
    return g.a == want.a && g.b == want.b && g.obj == want.obj ? 1 : -2;
  }
  StateDict kept;
  (void)kept.Add(ShardedTensor::Whole("a", TensorView(g.a.data(), DType::kF32, {20, 15})));
  (void)kept.Add(ShardedObject{"o", {}, {}});
  *error = Load(kept, "/ck", o).status();
  if (!error->ok()) return -1;
  return g.a == want.a && std::get<ShardedObject>(*kept.Find("o")).data == want.obj ? 2 : -2;
}

// Saves generation 1 into a fresh MemoryStorage (`save` decides the files: with one I/O thread
// "b" shares its file with "a" and "o", so removing it rewrites that file; with
// separate_prefixes {"b"} it has files of its own, dropped whole), then removes "b" through a
// FaultInjectingStorage with `plan`.
struct RemoveFromExisting {
  std::shared_ptr<MemoryStorage> memory = std::make_shared<MemoryStorage>();
  std::shared_ptr<FaultInjectingStorage> faulty;
  Status saved, removed;
  RemoveKeysReport report;

  RemoveFromExisting(FaultPlan plan, SaveOptions save) {
    Generation g1(1);
    save.storage = memory;
    saved = Save(g1.Dict(), "/ck", save).status();
    faulty = std::make_shared<FaultInjectingStorage>(memory, std::move(plan));
    RemoveKeysOptions o;
    o.storage = faulty;
    Result<RemoveKeysReport> r = RemoveKeys("/ck", {"b"}, o);
    removed = r.status();
    if (r.ok()) report = *r;
  }
};

std::vector<SaveOptions> RemovalLayouts() {
  SaveOptions shared_file, own_files;
  shared_file.num_io_threads = 1;
  own_files.num_io_threads = 1;
  own_files.separate_prefixes = {"b"};
  return {shared_file, own_files};
}

TEST(CrashConsistencyTest, CrashAtEveryStepOfRemoveKeysLeavesTheOldCheckpointOrTheNew) {
  for (const SaveOptions& layout : RemovalLayouts()) {
    const bool own_files = !layout.separate_prefixes.empty();
    SCOPED_TRACE(own_files ? "b in files of its own" : "b shares its file");
    RemoveFromExisting clean{FaultPlan{}, layout};
    ASSERT_OK(clean.saved);
    ASSERT_OK(clean.removed);
    EXPECT_EQ(clean.report.files_rewritten, own_files ? 0 : 1);
    EXPECT_EQ(clean.report.bytes_copied, own_files ? 0u : 300u * 4 + 2);
    const int64_t total_ops = clean.faulty->operation_count();
    ASSERT_GT(total_ops, 8);
    int old_seen = 0, new_seen = 0;
    for (int64_t n = 0; n <= total_ops; ++n) {
      SCOPED_TRACE("crash at operation " + std::to_string(n));
      RemoveFromExisting run{FaultPlan{.fail_at = n, .crash = true, .path_filter = ""}, layout};
      ASSERT_OK(run.saved);
      run.memory->SimulateCrash();
      Status error;
      const int state = OldOrNewAfterRemoval(run.memory, &error);
      ASSERT_TRUE(state == 1 || state == 2) << "state " << state << ": " << error.ToString();
      if (run.removed.ok()) {
        EXPECT_EQ(state, 2) << "a removal that reported success must last";
      }
      (state == 1 ? old_seen : new_seen)++;
      // After the crash, removing again succeeds (or finds nothing left to remove).
      RemoveKeysOptions o;
      o.storage = run.memory;
      ASSERT_OK_AND_ASSIGN(RemoveKeysReport again, RemoveKeys("/ck", {"b"}, o));
      EXPECT_EQ(again.removed_tensors.size(), state == 1 ? 1u : 0u);
      ASSERT_OK(Verify("/ck", run.memory));
      EXPECT_EQ(OldOrNewAfterRemoval(run.memory, &error), 2) << error.ToString();
    }
    EXPECT_GT(old_seen, 0);
    EXPECT_GT(new_seen, 0);
  }
}

TEST(CrashConsistencyTest, FailureAtEveryStepOfRemoveKeysLeavesTheOldCheckpointOrTheNew) {
  for (const SaveOptions& layout : RemovalLayouts()) {
    SCOPED_TRACE(layout.separate_prefixes.empty() ? "b shares its file" : "b in own files");
    int64_t n = 0;
    for (;; ++n) {
      SCOPED_TRACE("failure at operation " + std::to_string(n));
      RemoveFromExisting run{FaultPlan{.fail_at = n, .crash = false, .path_filter = ""}, layout};
      ASSERT_OK(run.saved);
      Status error;
      const int state = OldOrNewAfterRemoval(run.memory, &error);
      if (run.removed.ok()) {
        EXPECT_EQ(state, 2) << error.ToString();
        if (!run.faulty->fault_fired()) break;  // past the last operation
      } else {
        EXPECT_THAT(run.removed.message(), HasSubstr("injected fault"));
        EXPECT_TRUE(state == 1 || state == 2) << error.ToString();
      }
    }
    EXPECT_GT(n, 8);
  }
}

TEST(ResaveTest, OldFilesAreRemovedOnlyAfterTheNewManifestCommits) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  Generation g1(1), g2(2);
  ASSERT_OK_AND_ASSIGN(SaveReport first, Save(g1.Dict(), path));
  ASSERT_OK_AND_ASSIGN(Metadata m1, ReadMetadata(path));
  ASSERT_OK_AND_ASSIGN(SaveReport second, Save(g2.Dict(), path));
  EXPECT_NE(first.save_id, second.save_id);
  ASSERT_OK_AND_ASSIGN(Metadata m2, ReadMetadata(path));
  for (const FileInfo& f : m1.files) {
    EXPECT_FALSE(std::filesystem::exists(path + "/" + f.name)) << f.name;
    for (const FileInfo& g : m2.files) EXPECT_NE(f.name, g.name);
  }
  Status error;
  EXPECT_EQ(LoadedGeneration(path, NewPosixStorage(), &error), 2) << error.ToString();
}

}  // namespace
}  // namespace tessera
