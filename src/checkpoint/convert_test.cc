// Convert: a sharded tessera checkpoint (saved by 4 ranks: rows, columns, flat ranges,
// replicas, objects) or Hugging Face files, exported to Hugging Face safetensors and to tessera,
// on 1 to 4 ranks, with key selection, prefix stripping and dtype conversion; checked with an
// independent reader (src/format/huggingface/testdata/read_hf.py) and by loading; DST complete
// or absent under every single storage fault.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include "checkpoint/hf_test_util.h"
#include "checkpoint/marker.h"
#include "core/dtype_convert.h"
#include "format/tessera/manifest.h"
#include "format/tessera/names.h"
#include "format/torch_dist/dcp_metadata.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TempDir;

// A whole tensor of the source, as every test expects to find it.
struct Expected {
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

int64_t Elements(const Shape& shape) { return Box::Whole(shape).NumElements(); }

// The source state, whole. Values of float tensors are finite (random bytes would be NaNs and
// infinities as often as not, which hides conversion mistakes).
std::map<std::string, Expected> SourceTensors() {
  std::map<std::string, Expected> t;
  auto add = [&](const std::string& key, DType dtype, Shape shape, uint64_t seed) {
    Expected e{dtype, shape, testing::RandomBytes(Elements(shape) * DTypeSize(dtype), seed)};
    const size_t n = static_cast<size_t>(Elements(shape));
    for (size_t i = 0; i < n; ++i) {
      const double value = (static_cast<double>(e.bytes[i * DTypeSize(dtype)]) - 128.0) / 7.0 +
                           static_cast<double>(i % 97) / 1024.0;
      if (dtype == DType::kF32) {
        const float f = static_cast<float>(value);
        std::memcpy(&e.bytes[i * 4], &f, 4);
      } else if (dtype == DType::kF64) {
        std::memcpy(&e.bytes[i * 8], &value, 8);
      } else if (dtype == DType::kF16) {
        const uint16_t h = FloatToF16Bits(static_cast<float>(value));
        std::memcpy(&e.bytes[i * 2], &h, 2);
      } else if (dtype == DType::kBF16) {
        const uint16_t h = FloatToBf16Bits(static_cast<float>(value));
        std::memcpy(&e.bytes[i * 2], &h, 2);
      } else if (dtype == DType::kBool) {
        e.bytes[i] &= 1;
      }
    }
    t[key] = std::move(e);
  };
  add("model.embed", DType::kF32, {64, 48}, 1);
  add("model.layers.0.w", DType::kF16, {40, 30}, 2);
  add("model.layers.0.b", DType::kBF16, {30}, 3);
  add("model.norm", DType::kF64, {17}, 4);
  add("model.count", DType::kI64, {}, 5);
  add("model.mask", DType::kBool, {5, 7}, 6);
  add("model.empty", DType::kF32, {0, 3}, 7);
  add("optimizer.m", DType::kF32, {64, 48}, 8);
  return t;
}

const std::vector<uint8_t> kStepObject = {'{', '"', 's', '"', ':', '7', '}'};

// Saves SourceTensors() from 4 ranks: embed by rows, layers.0.w by (uneven) columns, the bias
// replicated on every rank, norm, count and empty on rank 0, mask on rank 1, optimizer.m as
// four flat ranges of the whole tensor, and a JSON object "step".
void SaveSource(const std::string& path, std::shared_ptr<Storage> storage = nullptr) {
  const std::map<std::string, Expected> tensors = SourceTensors();
  const Status saved = FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    StateDict state;
    std::vector<std::vector<uint8_t>> keep;
    auto add_box = [&](const std::string& key, const Box& box, ReplicaId replica = {}) {
      const Expected& e = tensors.at(key);
      keep.push_back(hf_testing::BoxBytes(e.bytes, e.shape, DTypeSize(e.dtype), box));
      return state.Add(ShardedTensor::Shard(key, TensorView(keep.back().data(), e.dtype, box.sizes),
                                            e.shape, box.offsets, std::move(replica)));
    };
    TESSERA_RETURN_IF_ERROR(add_box("model.embed", Box({16 * r, 0}, {16, 48})));
    const int64_t c0 = 30 * r / 4, c1 = 30 * (r + 1) / 4;
    TESSERA_RETURN_IF_ERROR(add_box("model.layers.0.w", Box({0, c0}, {40, c1 - c0})));
    TESSERA_RETURN_IF_ERROR(add_box("model.layers.0.b", Box({0}, {30}), {r}));
    if (r == 0) {
      TESSERA_RETURN_IF_ERROR(add_box("model.norm", Box({0}, {17})));
      TESSERA_RETURN_IF_ERROR(add_box("model.count", Box({}, {})));
      TESSERA_RETURN_IF_ERROR(add_box("model.empty", Box({0, 0}, {0, 3})));
      TESSERA_RETURN_IF_ERROR(
          state.Add(ShardedObject{"step", kStepObject, {}, ObjectEncoding::kJson}));
    }
    if (r == 1) TESSERA_RETURN_IF_ERROR(add_box("model.mask", Box({0, 0}, {5, 7})));
    const Expected& m = tensors.at("optimizer.m");
    const int64_t n = Elements(m.shape), b0 = n * r / 4, b1 = n * (r + 1) / 4;
    keep.emplace_back(m.bytes.begin() + b0 * 4, m.bytes.begin() + b1 * 4);
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::FlatShard(
        "optimizer.m", TensorView(keep.back().data(), DType::kF32, {b1 - b0}), m.shape, {0, 0},
        m.shape, b0)));
    SaveOptions options;
    options.sync = SyncPolicy::kNone;
    options.storage = storage;
    options.user_metadata = {{"step", "7"}, {"tessera.python.structure", "{}"}};
    return Save(state, path, comm, options).status();
  }));
  ASSERT_OK(saved);
}

uint64_t SourceBytes(const std::vector<std::string>& prefixes = {}) {
  uint64_t n = 0;
  for (const auto& [key, e] : SourceTensors()) {
    bool keep = prefixes.empty();
    for (const std::string& p : prefixes) keep |= key.starts_with(p);
    if (keep) n += e.bytes.size();
  }
  return n;
}

// What the independent reader makes of a Hugging Face directory.
nlohmann::json ReadHf(const std::string& dir) {
  std::string output;
  const std::string script =
      std::string(TESSERA_SOURCE_DIR) + "/src/format/huggingface/testdata/read_hf.py";
  const int status = torch_dist::testing::RunCommand(
      std::string(TESSERA_PYTHON) + " " + torch_dist::testing::ShellQuote(script) + " " +
          torch_dist::testing::ShellQuote(dir) + " 2>/dev/null",
      &output);
  EXPECT_EQ(status, 0) << output;
  return status == 0 ? nlohmann::json::parse(output) : nlohmann::json();
}

std::string Hex(const std::vector<uint8_t>& bytes) {
  return torch_dist::testing::Hex(bytes.data(), bytes.size());
}

// The bytes of `e` in `to` (ConvertFloats is tested on its own in core).
std::vector<uint8_t> Converted(const Expected& e, DType to) {
  if (!IsConvertibleFloat(e.dtype) || e.dtype == to) return e.bytes;
  std::vector<uint8_t> out(static_cast<size_t>(Elements(e.shape)) * DTypeSize(to));
  ConvertFloats(e.dtype, e.bytes.data(), to, out.data(), static_cast<size_t>(Elements(e.shape)));
  return out;
}

// Every tensor of `hf` (ReadHf's document) is the source tensor `prefix + name`, converted to
// `dtype` when set; and every source tensor under `keys` is there.
void ExpectHfHolds(const nlohmann::json& hf, const std::vector<std::string>& keys,
                   const std::string& strip, std::optional<DType> dtype) {
  size_t expected = 0;
  for (const auto& [key, e] : SourceTensors()) {
    bool keep = keys.empty();
    for (const std::string& p : keys) keep |= key.starts_with(p);
    if (!keep) continue;
    ++expected;
    const std::string name = key.starts_with(strip) ? key.substr(strip.size()) : key;
    ASSERT_TRUE(hf["tensors"].contains(name)) << name;
    const nlohmann::json& t = hf["tensors"][name];
    const DType out = dtype && IsConvertibleFloat(e.dtype) ? *dtype : e.dtype;
    EXPECT_EQ(t["dtype"], std::string(DTypeName(out))) << name;
    EXPECT_EQ(t["shape"].get<Shape>(), e.shape) << name;
    EXPECT_EQ(t["hex"], Hex(Converted(e, out))) << name;
  }
  EXPECT_EQ(hf["tensors"].size(), expected);
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(ConvertTest, ShardedTesseraToHuggingFaceShards) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions options;
  options.max_file_bytes = 8 << 10;  // several shards
  options.sync = SyncPolicy::kNone;
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out"), options));
  EXPECT_EQ(report.source_format, CheckpointFormat::kTessera);
  EXPECT_EQ(report.tensors, SourceTensors().size());
  EXPECT_EQ(report.objects, 0u);
  EXPECT_THAT(report.skipped_objects, ElementsAre("step"));
  EXPECT_EQ(report.total_bytes, SourceBytes());
  EXPECT_EQ(report.bytes_written, SourceBytes());
  // Every source byte read once: each output tensor is loaded whole, chunk by chunk.
  EXPECT_EQ(report.bytes_read, SourceBytes());
  const nlohmann::json hf = ReadHf(tmp.Sub("out"));
  ASSERT_FALSE(hf.is_null());
  const size_t n = hf["files"].size();
  ASSERT_GE(n, 3u);
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, n);
    EXPECT_EQ(hf["files"][i], name);
  }
  ExpectHfHolds(hf, {}, "", std::nullopt);
  std::vector<std::string> files = hf["files"].get<std::vector<std::string>>();
  files.push_back("model.safetensors.index.json");
  std::sort(files.begin(), files.end());
  EXPECT_EQ(Entries(tmp.Sub("out")), files);
  EXPECT_THAT(Entries(tmp.path()), ElementsAre("out", "src"));  // no temporary left
  // And tessera reads its own export.
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub("out")));
  EXPECT_EQ(m.format, CheckpointFormat::kSafetensors);
  EXPECT_EQ(m.tensors.size(), SourceTensors().size());
}

TEST(ConvertTest, OneModelSafetensorsWhenEverythingFits) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out")));
  EXPECT_THAT(report.files, ElementsAre("model.safetensors"));
  EXPECT_THAT(Entries(tmp.Sub("out")), ElementsAre("model.safetensors"));
  ExpectHfHolds(ReadHf(tmp.Sub("out")), {}, "", std::nullopt);
}

TEST(ConvertTest, KeysStripPrefixAndBf16) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions options;
  options.keys = {"model."};
  options.strip_prefix = "model.";
  options.dtype = DType::kBF16;
  options.max_file_bytes = 8 << 10;
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out"), options));
  EXPECT_TRUE(report.skipped_objects.empty());  // "step" is not under "model."
  EXPECT_EQ(report.bytes_read, SourceBytes({"model."}));
  ExpectHfHolds(ReadHf(tmp.Sub("out")), {"model."}, "model.", DType::kBF16);
}

TEST(ConvertTest, F32AndF16Targets) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  for (DType to : {DType::kF32, DType::kF16, DType::kF64}) {
    const std::string out = tmp.Sub(std::string("out_") + std::string(DTypeName(to)));
    ConvertOptions options;
    options.dtype = to;
    ASSERT_OK(Convert(tmp.Sub("src"), out, options));
    ExpectHfHolds(ReadHf(out), {}, "", to);
  }
}

TEST(ConvertTest, SmallBuffersAndManyThreadsGiveTheSameFiles) {
  TempDir tmp;
  // Tensors of several units each, saved in 4 row pieces.
  const std::vector<uint8_t> big = testing::RandomBytes(3 << 20, 11);
  const std::vector<uint8_t> wide = testing::RandomBytes(1 << 20, 12);
  ASSERT_OK(FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "big", TensorView(big.data() + r * (big.size() / 4), DType::kF64, {96, 1024}), {384, 1024},
        {96 * r, 0})));
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "wide", TensorView(wide.data() + r * (wide.size() / 4), DType::kF32, {256, 256}),
        {1024, 256}, {256 * r, 0})));
    SaveOptions options;
    options.sync = SyncPolicy::kNone;
    return Save(state, tmp.Sub("src"), comm, options).status();
  })));
  std::vector<std::string> dirs;
  for (int threads : {1, 3}) {
    for (uint64_t buffer : {uint64_t{1}, uint64_t{256} << 20}) {
      for (bool bf16 : {false, true}) {
        ConvertOptions options;
        options.num_threads = threads;
        options.buffer_bytes = buffer;
        if (bf16) options.dtype = DType::kBF16;
        options.sync = SyncPolicy::kNone;
        const std::string out = tmp.Sub("out_" + std::to_string(threads) + "_" +
                                        std::to_string(buffer) + (bf16 ? "_bf16" : ""));
        ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), out, options));
        // Units are cut on the 256 KiB grid the source's chunks and checksum blocks lie on
        // here: every byte is read once, though every unit needs parts of chunks.
        EXPECT_EQ(report.bytes_read, big.size() + wide.size());
        std::ifstream in(out + "/model.safetensors", std::ios::binary);
        const std::string bytes((std::istreambuf_iterator<char>(in)), {});
        dirs.push_back(bytes);
      }
    }
  }
  // Every buffer size and thread count writes the same bytes.
  for (size_t i = 2; i < dirs.size(); ++i) EXPECT_EQ(dirs[i], dirs[i % 2]) << i;
  const nlohmann::json hf = ReadHf(tmp.Sub("out_1_1"));
  EXPECT_EQ(hf["tensors"]["big"]["hex"], Hex(big));
  EXPECT_EQ(hf["tensors"]["wide"]["hex"], Hex(wide));
}

// Any number of ranks writes the same files, each rank its share.
TEST(ConvertTest, RanksSplitTheFilesAndWriteTheSameBytes) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions options;
  options.max_file_bytes = 8 << 10;
  options.sync = SyncPolicy::kNone;
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("one"), options));
  const std::vector<std::string> names = Entries(tmp.Sub("one"));
  for (int ranks : {2, 3, 4}) {
    const std::string out = tmp.Sub("ranks" + std::to_string(ranks));
    std::vector<ConvertReport> reports(ranks);
    ASSERT_OK(FirstError(RunLocalRanks(ranks, [&](Comm& comm) -> Status {
      TESSERA_ASSIGN_OR_RETURN(reports[comm.rank()], Convert(tmp.Sub("src"), out, options, comm));
      return Status::Ok();
    })));
    int files = 0;
    uint64_t written = 0;
    for (const ConvertReport& r : reports) {
      files += r.files_written;
      written += r.bytes_written;
      EXPECT_EQ(r.files, reports[0].files);
    }
    EXPECT_EQ(files + 1, static_cast<int>(names.size()));  // + the index
    EXPECT_EQ(written, SourceBytes());
    EXPECT_GT(reports[1].files_written, 0);
    ASSERT_EQ(Entries(out), names);
    for (const std::string& name : names) {
      std::ifstream a(tmp.Sub("one/" + name), std::ios::binary),
          b(out + "/" + name, std::ios::binary);
      EXPECT_EQ(std::string((std::istreambuf_iterator<char>(a)), {}),
                std::string((std::istreambuf_iterator<char>(b)), {}))
          << ranks << " ranks: " << name;
    }
  }
}

// Loads every tensor of the tessera checkpoint at `path` whole and compares with the source.
void ExpectTesseraHolds(const std::string& path, const std::string& strip,
                        std::optional<DType> dtype) {
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  EXPECT_EQ(m.format, CheckpointFormat::kTessera);
  StateDict state;
  std::map<std::string, std::vector<uint8_t>> buffers;
  for (const TensorInfo& t : m.tensors) {
    buffers[t.key].resize(static_cast<size_t>(Elements(t.global_shape)) * DTypeSize(t.dtype));
    ASSERT_OK(state.Add(
        ShardedTensor::Whole(t.key, TensorView(buffers[t.key].data(), t.dtype, t.global_shape))));
  }
  for (const ObjectInfo& o : m.objects) ASSERT_OK(state.Add(ShardedObject{o.key}));
  ASSERT_OK(Load(state, path));
  for (const auto& [key, e] : SourceTensors()) {
    const std::string name = key.starts_with(strip) ? key.substr(strip.size()) : key;
    const DType out = dtype && IsConvertibleFloat(e.dtype) ? *dtype : e.dtype;
    ASSERT_TRUE(buffers.count(name)) << name;
    EXPECT_EQ(m.FindTensor(name)->dtype, out);
    EXPECT_EQ(buffers[name], Converted(e, out)) << name;
  }
  const auto* step = std::get_if<ShardedObject>(state.Find("step"));
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->data, kStepObject);
  EXPECT_EQ(step->encoding, ObjectEncoding::kJson);
}

TEST(ConvertTest, ToTesseraOnOneAndThreeRanks) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  for (int ranks : {1, 3}) {
    const std::string out = tmp.Sub("out" + std::to_string(ranks));
    ConvertOptions options;
    options.to = CheckpointFormat::kTessera;
    options.max_file_bytes = 8 << 10;
    options.dtype = DType::kBF16;
    ASSERT_OK(FirstError(RunLocalRanks(ranks, [&](Comm& comm) -> Status {
      return Convert(tmp.Sub("src"), out, options, comm).status();
    })));
    ASSERT_OK_AND_ASSIGN(VerifyReport verified, Verify(out));
    EXPECT_TRUE(verified.checksums);
    EXPECT_GT(verified.files_checked, 1);
    ExpectTesseraHolds(out, "", DType::kBF16);
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(out));
    EXPECT_EQ(m.num_ranks, ranks);
    EXPECT_EQ(m.user_metadata.at("step"), "7");
    // Keys unchanged: the Python package's structure record still describes them.
    EXPECT_TRUE(m.user_metadata.count("tessera.python.structure"));
    for (const TensorInfo& t : m.tensors) EXPECT_EQ(t.chunks.size(), 1u) << t.key;
  }
  // Renamed keys: the structure record no longer applies and is dropped.
  ConvertOptions options;
  options.to = CheckpointFormat::kTessera;
  options.strip_prefix = "model.";
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("stripped"), options));
  ExpectTesseraHolds(tmp.Sub("stripped"), "model.", std::nullopt);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub("stripped")));
  EXPECT_FALSE(m.user_metadata.count("tessera.python.structure"));
}

TEST(ConvertTest, RoundTripThroughHuggingFaceIsExact) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions to_hf;
  to_hf.max_file_bytes = 10 << 10;
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("hf"), to_hf));
  // Hugging Face in, Hugging Face out (resharded into one file), and tessera out.
  ASSERT_OK_AND_ASSIGN(ConvertReport again, Convert(tmp.Sub("hf"), tmp.Sub("hf1")));
  EXPECT_EQ(again.source_format, CheckpointFormat::kSafetensors);
  EXPECT_EQ(again.bytes_read, SourceBytes());
  ExpectHfHolds(ReadHf(tmp.Sub("hf1")), {}, "", std::nullopt);
  ConvertOptions to_tessera;
  to_tessera.to = CheckpointFormat::kTessera;
  const std::string second = ReadHf(tmp.Sub("hf"))["files"][1];
  ASSERT_OK_AND_ASSIGN(ConvertReport one,
                       Convert(tmp.Sub("hf/" + second), tmp.Sub("one_file"), to_tessera));
  EXPECT_EQ(one.tensors, 2u);  // model.embed and model.empty
  ASSERT_OK(Convert(tmp.Sub("hf"), tmp.Sub("back"), to_tessera));
  ASSERT_OK(Verify(tmp.Sub("back")));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub("back")));
  EXPECT_EQ(m.tensors.size(), SourceTensors().size());
  for (const auto& [key, e] : SourceTensors()) {
    std::vector<uint8_t> got(e.bytes.size());
    StateDict state;
    ASSERT_OK(state.Add(ShardedTensor::Whole(key, TensorView(got.data(), e.dtype, e.shape))));
    LoadOptions lo;
    lo.unexpected_keys = KeyPolicy::kSkip;
    ASSERT_OK(Load(state, tmp.Sub("back"), lo));
    EXPECT_EQ(got, e.bytes) << key;
  }
}

TEST(ConvertTest, ProgressCountsUpToWhatThisRankWrites) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  ConvertOptions options;
  options.progress = [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); };
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out"), options));
  ASSERT_FALSE(calls.empty());
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_LE(calls[i - 1].first, calls[i].first);
    EXPECT_EQ(calls[i].second, calls[0].second);
  }
  EXPECT_EQ(calls.back().first, report.bytes_written);
  EXPECT_EQ(calls.back().second, report.bytes_written);
}

// ---- DST complete or absent ----------------------------------------------------------------

TEST(ConvertTest, AnExistingDestinationIsRefusedUnlessEmpty) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  std::filesystem::create_directories(tmp.Sub("full"));
  std::ofstream(tmp.Sub("full/keep")) << "mine";
  const Result<ConvertReport> refused = Convert(tmp.Sub("src"), tmp.Sub("full"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(refused.status().message(), HasSubstr(tmp.Sub("full") + " exists and is not empty"));
  EXPECT_THAT(Entries(tmp.Sub("full")), ElementsAre("keep"));
  std::filesystem::create_directories(tmp.Sub("empty"));
  EXPECT_OK(Convert(tmp.Sub("src"), tmp.Sub("empty/")));
  EXPECT_THAT(Entries(tmp.Sub("empty")), ElementsAre("model.safetensors"));
  // A parent that does not exist yet is created.
  EXPECT_OK(Convert(tmp.Sub("src"), tmp.Sub("a/b/c")));
  EXPECT_THAT(Entries(tmp.path()), ElementsAre("a", "empty", "full", "src"));
}

// A store that refuses to rename a directory (as a FUSE mount of an object store may): a
// conversion never asks, it commits inside DST.
class NoDirectoryRenameStorage : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  Status Rename(const std::string& from, const std::string& to) override {
    Result<FileType> type = Stat(from);
    if (type.ok() && *type == FileType::kDirectory) {
      ++directory_renames;
      return Unimplemented("this store renames no directory (" + from + ")");
    }
    return StorageWrapper::Rename(from, to);
  }
  int directory_renames = 0;
};

TEST(ConvertTest, EveryOutputIsCommittedInPlaceWithoutRenamingADirectory) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  auto storage = std::make_shared<NoDirectoryRenameStorage>(NewPosixStorage());
  struct Case {
    std::string name;
    CheckpointFormat to;
    uint64_t max_file_bytes;
  };
  for (const Case& c : {Case{"hf_one", CheckpointFormat::kSafetensors, 1u << 30},
                        Case{"hf_shards", CheckpointFormat::kSafetensors, 16u << 10},
                        Case{"tessera", CheckpointFormat::kTessera, 16u << 10},
                        Case{"dcp", CheckpointFormat::kTorchDist, 16u << 10}}) {
    SCOPED_TRACE(c.name);
    ConvertOptions options;
    options.to = c.to;
    options.max_file_bytes = c.max_file_bytes;
    options.storage = storage;
    ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub(c.name), options));
    std::vector<std::string> files = report.files;
    if (c.to == CheckpointFormat::kTessera) files.push_back(std::string(kSequenceHintFileName));
    std::sort(files.begin(), files.end());
    EXPECT_EQ(Entries(tmp.Sub(c.name)), files);  // no marker, no hidden file left
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub(c.name)));
    EXPECT_EQ(m.tensors.size(), SourceTensors().size());
  }
  EXPECT_EQ(storage->directory_renames, 0);
  EXPECT_THAT(Entries(tmp.path()), ElementsAre("dcp", "hf_one", "hf_shards", "src", "tessera"));
}

// What a conversion that was killed leaves in DST (its marker, naming a process that ended,
// and files carrying its save id) is removed by the next conversion into DST; anything else
// there, or the marker of a conversion still running, is refused and kept.
TEST(ConvertTest, TheNextConversionRemovesWhatAKilledOneLeftAndNothingElse) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  std::shared_ptr<Storage> posix = NewPosixStorage();
  const std::string id = "0123456789abcdef";
  auto leave_killed_conversion = [&](const std::string& dir) {
    std::filesystem::create_directories(dir);
    const pid_t child = fork();
    if (child == 0) {
      const bool ok = CreateSaveMarker(*posix, dir, id, SyncPolicy::kNone).ok();
      std::ofstream(dir + "/.model-00001-of-00002.safetensors.tessera-convert-" + id) << "part";
      std::ofstream(dir + "/__0_0." + id + ".distcp") << "part";
      _exit(ok ? 0 : 1);  // without removing its marker, as a killed process
    }
    int wstatus = 0;
    waitpid(child, &wstatus, 0);
    ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  };
  leave_killed_conversion(tmp.Sub("out"));
  ASSERT_EQ(Entries(tmp.Sub("out")).size(), 3u);
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("out")));
  EXPECT_THAT(Entries(tmp.Sub("out")), ElementsAre("model.safetensors"));

  // A file of someone else beside the leftovers: refused, nothing removed.
  leave_killed_conversion(tmp.Sub("mixed"));
  std::ofstream(tmp.Sub("mixed/notes.txt")) << "mine";
  Result<ConvertReport> refused = Convert(tmp.Sub("src"), tmp.Sub("mixed"));
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(refused.status().message(), HasSubstr("is not empty (it holds notes.txt"));
  EXPECT_EQ(Entries(tmp.Sub("mixed")).size(), 4u);

  // A marker whose owner runs (this process holds it): refused, nothing removed.
  std::filesystem::create_directories(tmp.Sub("busy"));
  ASSERT_OK(CreateSaveMarker(*posix, tmp.Sub("busy"), id, SyncPolicy::kNone));
  refused = Convert(tmp.Sub("src"), tmp.Sub("busy"));
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(refused.status().message(), HasSubstr("still running writes into it"));
  EXPECT_THAT(Entries(tmp.Sub("busy")), ElementsAre(MarkerName(id)));
  RemoveSaveMarker(*posix, tmp.Sub("busy"), id);
}

// Without the index, a set of shards is read only when complete: between the renames of a
// conversion's shards, or after a copy that stopped, a reader gets an error naming the missing
// shard rather than a checkpoint without some of its tensors.
TEST(ConvertTest, ShardsWithoutTheirIndexAreReadOnlyAsACompleteSet) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions options;
  options.max_file_bytes = 4u << 10;
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out"), options));
  ASSERT_GE(report.files.size(), 4u);  // 3 or more shards and the index
  ASSERT_EQ(report.files.back(), "model.safetensors.index.json");
  std::filesystem::remove(tmp.Sub("out/model.safetensors.index.json"));
  ASSERT_OK_AND_ASSIGN(Metadata whole, ReadMetadata(tmp.Sub("out")));
  EXPECT_EQ(whole.tensors.size(), SourceTensors().size());
  const std::string second = report.files[1];
  std::filesystem::remove(tmp.Sub("out/" + second));
  const Result<Metadata> partial = ReadMetadata(tmp.Sub("out"));
  EXPECT_EQ(partial.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(partial.status().message(),
              HasSubstr("safetensors shard " + tmp.Sub("out/" + second) + " is missing"));
}

TEST(ConvertTest, ACorruptSourceLeavesNoDestination) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub("src")));
  const TensorInfo& t = *m.FindTensor("model.embed");
  const std::string file = tmp.Sub("src/" + m.files[t.chunks[1].location.file_index].name);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(t.chunks[1].location.offset + 5));
    f.put('\x7f');
  }
  for (int ranks : {1, 2}) {
    const std::vector<Status> statuses = RunLocalRanks(ranks, [&](Comm& comm) -> Status {
      return Convert(tmp.Sub("src"), tmp.Sub("out"), {}, comm).status();
    });
    for (const Status& s : statuses) {
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
      EXPECT_THAT(s.message(), HasSubstr("checksum mismatch in key 'model.embed' chunk 1"));
      EXPECT_THAT(s.message(), HasSubstr(file));
    }
    EXPECT_THAT(Entries(tmp.path()), ElementsAre("src"));
  }
}

// Pieces whose bytes are runs of the source's chunks (row splits, whole tensors) are copied
// file to file, their blocks hashed where they lie (mapped: pieces of 1 MiB and more); units
// that cut chunks in the middle, and column-split neighbours in the same unit, give the same
// files; a corrupt block is still a checksum mismatch naming the key, the chunk and the file,
// and loads unchecked when checks are off.
TEST(ConvertTest, CopiedRowSplitAndWholeChunksKeepEveryCheck) {
  TempDir tmp;
  const Shape rows_shape = {1024, 512}, whole_shape = {2048, 256}, cols_shape = {96, 64};
  const std::vector<uint8_t> rows = testing::RandomBytes(1024 * 512 * 4, 21);
  const std::vector<uint8_t> whole = testing::RandomBytes(2048 * 256 * 2, 22);
  const std::vector<uint8_t> cols = testing::RandomBytes(96 * 64 * 4, 23);
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    StateDict state;
    const std::vector<uint8_t> part =
        hf_testing::BoxBytes(rows, rows_shape, 4, Box({512 * r, 0}, {512, 512}));
    const std::vector<uint8_t> half =
        hf_testing::BoxBytes(cols, cols_shape, 4, Box({0, 32 * r}, {96, 32}));
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "a.rows", TensorView(part.data(), DType::kF32, {512, 512}), rows_shape, {512 * r, 0})));
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "b.cols", TensorView(half.data(), DType::kF32, {96, 32}), cols_shape, {0, 32 * r})));
    TESSERA_RETURN_IF_ERROR(state.Add(
        ShardedTensor::Shard("c.whole", TensorView(whole.data(), DType::kBF16, whole_shape),
                             whole_shape, {0, 0}, ReplicaId{r})));
    SaveOptions options;
    options.sync = SyncPolicy::kNone;
    return Save(state, tmp.Sub("src"), comm, options).status();
  })));
  auto expect_holds = [&](const std::string& dir) {
    for (const auto& [key, dtype, shape, bytes] :
         {std::tuple{"a.rows", DType::kF32, rows_shape, &rows},
          std::tuple{"b.cols", DType::kF32, cols_shape, &cols},
          std::tuple{"c.whole", DType::kBF16, whole_shape, &whole}}) {
      std::vector<uint8_t> got(bytes->size());
      StateDict state;
      ASSERT_OK(state.Add(ShardedTensor::Whole(key, TensorView(got.data(), dtype, shape))));
      LoadOptions lo;
      lo.unexpected_keys = KeyPolicy::kSkip;
      ASSERT_OK(Load(state, dir, lo));
      EXPECT_TRUE(got == *bytes) << dir << ": " << key;
    }
  };
  // Default units (a.rows whole: both chunks mapped), then units of 1.5 MiB: a.rows's chunk 1
  // is cut in two, its second half (512 KiB) checked through a buffer, and b.cols (loaded)
  // shares that unit.
  ConvertOptions options;
  ASSERT_OK_AND_ASSIGN(ConvertReport report, Convert(tmp.Sub("src"), tmp.Sub("out"), options));
  EXPECT_EQ(report.bytes_written, rows.size() + whole.size() + cols.size());
  expect_holds(tmp.Sub("out"));
  options.buffer_bytes = 6 << 20;
  options.max_file_bytes = 3 << 20;
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("small_units"), options));
  expect_holds(tmp.Sub("small_units"));

  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.Sub("src")));
  const TensorInfo& t = *m.FindTensor("a.rows");
  ASSERT_EQ(t.chunks.size(), 2u);
  const ChunkInfo& chunk = t.chunks[1];
  const std::string file = tmp.Sub("src/" + m.files[chunk.location.file_index].name);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(chunk.location.offset + 600000));
    const char c = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(chunk.location.offset + 600000));
    f.put(static_cast<char>(c ^ 0x20));
  }
  for (uint64_t buffer : {256ull << 20, 6ull << 20}) {  // the bad block mapped, then read
    options.buffer_bytes = buffer;
    const Result<ConvertReport> corrupt = Convert(tmp.Sub("src"), tmp.Sub("corrupt"), options);
    ASSERT_FALSE(corrupt.ok());
    EXPECT_EQ(corrupt.status().code(), StatusCode::kDataLoss) << corrupt.status().ToString();
    EXPECT_THAT(corrupt.status().message(),
                HasSubstr("checksum mismatch in key 'a.rows' chunk 1 [512:1024, 0:512] (block of "
                          "262144 bytes at chunk byte 524288) of file " +
                          file));
    EXPECT_FALSE(std::filesystem::exists(tmp.Sub("corrupt")));
  }
  options.verify_checksums = false;
  ASSERT_OK(Convert(tmp.Sub("src"), tmp.Sub("unchecked"), options));
}

// Every single storage operation of a conversion, failed in turn: DST is then absent, or
// complete and right (a failure after the commit became visible, e.g. a directory sync after
// it), and nothing but DST is ever written.
// Safetensors twice: with source checks (row-split pieces read, checked and written through a
// buffer) and without (those pieces copied with CopyFrom, one operation each).
TEST(ConvertTest, EveryStorageFaultLeavesDestinationCompleteOrAbsent) {
  for (const auto& [to, verify] : {std::pair{CheckpointFormat::kSafetensors, true},
                                   std::pair{CheckpointFormat::kSafetensors, false},
                                   std::pair{CheckpointFormat::kTessera, true},
                                   std::pair{CheckpointFormat::kTorchDist, true}}) {
    SCOPED_TRACE(std::string(CheckpointFormatName(to)) + (verify ? "" : ", unchecked"));
    auto memory = std::make_shared<MemoryStorage>();
    SaveSource("/ckpt/src", memory);
    auto faulty = std::make_shared<FaultInjectingStorage>(memory);
    ConvertOptions options;
    options.to = to;
    options.max_file_bytes = 16 << 10;
    options.num_threads = 2;
    options.verify_checksums = verify;
    options.storage = faulty;
    faulty->SetPlan({});
    ASSERT_OK(Convert("/ckpt/src", "/ckpt/clean", options));
    const int64_t operations = faulty->operation_count();
    ASSERT_GT(operations, 20);
    int failed = 0;
    for (int64_t k = 0; k < operations; ++k) {
      faulty->SetPlan(FaultPlan{.fail_at = k});
      const std::string out = "/ckpt/out" + std::to_string(k);
      const Result<ConvertReport> result = Convert("/ckpt/src", out, options);
      failed += !result.ok();
      ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, memory->ListDir("/ckpt"));
      for (const std::string& name : names) {
        EXPECT_EQ(name.find("tessera-convert"), std::string::npos) << "fault " << k << ": " << name;
      }
      ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat(out));
      if (type == FileType::kNotFound) {
        EXPECT_FALSE(result.ok()) << "fault " << k;
        continue;
      }
      // Present: complete, whatever the status said.
      ASSERT_OK_AND_ASSIGN(std::vector<std::string> files, memory->ListDir(out));
      ASSERT_OK_AND_ASSIGN(std::vector<std::string> clean, memory->ListDir("/ckpt/clean"));
      // The sequence hint is best effort (a failure to write it fails nothing): not counted.
      std::erase(files, std::string(kSequenceHintFileName));
      std::erase(clean, std::string(kSequenceHintFileName));
      // So is the removal of the conversion's marker once it committed (a later operation in
      // DST removes it as a dead process's).
      std::erase_if(files, [](const std::string& n) { return n.starts_with(kMarkerPrefix); });
      EXPECT_EQ(files.size(), clean.size()) << "fault " << k << ": " << result.status().ToString();
      if (to == CheckpointFormat::kTessera) {
        const Result<VerifyReport> verified = Verify(out, memory);
        EXPECT_TRUE(verified.ok()) << "fault " << k << ": " << verified.status().ToString();
      } else if (to == CheckpointFormat::kTorchDist) {
        // Its .metadata is there and names every tensor (dcp_save_test.cc reads the values).
        const std::string path = out + "/.metadata";
        ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, memory->GetFileContents(path));
        ASSERT_OK_AND_ASSIGN(torch_dist::DcpMetadata m, torch_dist::ReadDcpMetadata(bytes, path));
        EXPECT_EQ(m.tensors.size(), SourceTensors().size()) << "fault " << k;
      } else {
        ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(out, memory));
        EXPECT_EQ(m.tensors.size(), SourceTensors().size()) << "fault " << k;
      }
    }
    EXPECT_GT(failed, operations / 2);
  }
}

TEST(ConvertTest, BadOptionsAndEmptySelectionsAreClearErrors) {
  TempDir tmp;
  SaveSource(tmp.Sub("src"));
  ConvertOptions options;
  options.keys = {"nothing."};
  Result<ConvertReport> result = Convert(tmp.Sub("src"), tmp.Sub("out"), options);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("no key to export starts with any of the "
                                                   "prefixes 'nothing.'"));
  options = {};
  options.keys = {"step"};
  result = Convert(tmp.Sub("src"), tmp.Sub("out"), options);
  EXPECT_THAT(result.status().message(), HasSubstr("only objects ('step'), which safetensors"));
  options = {};
  options.dtype = DType::kI32;
  result = Convert(tmp.Sub("src"), tmp.Sub("out"), options);
  EXPECT_THAT(result.status().message(), HasSubstr("F64, F32, F16 or BF16, not I32"));
  options = {};
  options.num_threads = 0;
  result = Convert(tmp.Sub("src"), tmp.Sub("out"), options);
  EXPECT_THAT(result.status().message(), HasSubstr("num_threads must be at least 1, got 0"));
  result = Convert(tmp.Sub("nope"), tmp.Sub("out"));
  EXPECT_EQ(result.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(Entries(tmp.path()), ElementsAre("src"));
}

}  // namespace
}  // namespace tessera
