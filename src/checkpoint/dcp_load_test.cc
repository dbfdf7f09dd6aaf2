// Reading PyTorch DCP checkpoints written by the real torch 1.13
// (testdata/make_dcp_read_fixtures.py, run once per test binary): ReadMetadata, Load whole and
// resharded by rows and columns over 1 and 3 ranks, a transposed and a permuted view, objects,
// a checkpoint saved by 2 gloo processes, the bytes a resharded load reads, Verify, damaged
// files; and tessera's own torch 2.x-flavour DCP directories read back with no format named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "format/torch_dist/test_util.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/local_comm.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::nlohmann::json;
using ::tessera::testing::TempDir;
using ::testing::HasSubstr;

struct Expected {
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;  // row-major
};

struct Fixture {
  std::map<std::string, Expected> tensors;
  std::map<std::string, std::vector<uint8_t>> objects;  // key -> the item's bytes
};

// The fixtures, written by torch 1.13. ctest runs every test in a process of its own, so they
// are written once per version of the script, into
// $TMPDIR/tessera-dcp-read-fixtures-<hash of the script> (generated in a fresh directory, then
// renamed into place: concurrent test processes agree on one), and only read afterwards.
class DcpFixtures {
 public:
  static DcpFixtures& Get() {
    static DcpFixtures* fixtures = new DcpFixtures();
    return *fixtures;
  }
  const std::string& error() const { return error_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  const Fixture& Of(const std::string& name) { return fixtures_.at(name); }

 private:
  DcpFixtures() {
    const std::string script =
        std::string(TESSERA_SOURCE_DIR) + "/src/checkpoint/testdata/make_dcp_read_fixtures.py";
    const std::vector<uint8_t> text = torch_dist::testing::ReadFileBytes(script);
    const size_t hash = std::hash<std::string>()(std::string(text.begin(), text.end()));
    dir_ = (fs::temp_directory_path() / ("tessera-dcp-read-fixtures-" + std::to_string(hash)))
               .string();
    if (!fs::exists(dir_ + "/done")) Generate(script);
    if (!error_.empty()) return;
    for (const char* name : {"single", "sharded2", "megatron"}) {
      std::ifstream in(Path(std::string(name) + ".expected.json"));
      const json doc = json::parse(in);
      Fixture& f = fixtures_[name];
      for (const auto& [key, t] : doc["tensors"].items()) {
        f.tensors[key] = Expected{*torch_dist::DTypeFromTorchName(t["dtype"].get<std::string>()),
                                  t["shape"].get<Shape>(),
                                  torch_dist::testing::FromHex(t["hex"].get<std::string>())};
      }
      for (const auto& [key, o] : doc["objects"].items()) {
        f.objects[key] = torch_dist::testing::FromHex(o["item_hex"].get<std::string>());
      }
    }
  }

  void Generate(const std::string& script) {
    const std::string fresh = dir_ + ".tmp-" + std::to_string(::getpid());
    fs::remove_all(fresh);
    std::string output;
    const int status = torch_dist::testing::RunCommand(
        std::string(TESSERA_PYTHON) + " " + torch_dist::testing::ShellQuote(script) + " " +
            torch_dist::testing::ShellQuote(fresh),
        &output);
    if (status != 0) {
      error_ = "make_dcp_read_fixtures.py failed: " + output;
      fs::remove_all(fresh);
      return;
    }
    std::ofstream(fresh + "/done") << "ok\n";
    std::error_code ec;
    fs::rename(fresh, dir_, ec);  // fails when another process got there first: use its
    if (ec) fs::remove_all(fresh);
  }

  std::string dir_;
  std::string error_;
  std::map<std::string, Fixture> fixtures_;
};

class DcpLoadTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(DcpFixtures::Get().error(), ""); }
  static std::string Path(const std::string& name) { return DcpFixtures::Get().Path(name); }
  static const Fixture& Of(const std::string& name) { return DcpFixtures::Get().Of(name); }
};

// The bytes of `box` of a row-major tensor of `shape`.
std::vector<uint8_t> BoxBytes(const std::vector<uint8_t>& full, const Shape& shape, const Box& box,
                              size_t element) {
  std::vector<uint8_t> out(static_cast<size_t>(box.NumElements()) * element);
  if (out.empty()) return out;
  const size_t rank = shape.size();
  std::vector<int64_t> index(rank, 0);
  for (size_t n = 0; n < out.size() / element; ++n) {
    int64_t at = 0;
    for (size_t d = 0; d < rank; ++d) at = at * shape[d] + box.offsets[d] + index[d];
    std::memcpy(out.data() + n * element, full.data() + at * element, element);
    for (size_t d = rank; d-- > 0;) {
      if (++index[d] < box.sizes[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// Rank `rank` of `ranks`'s part of `shape` split along `dim` (whole when it cannot be split).
Box PartOf(const Shape& shape, int rank, int ranks, size_t dim) {
  Box box = Box::Whole(shape);
  if (shape.empty() || ranks == 1 || shape[dim] < ranks) return box;
  const int64_t base = shape[dim] / ranks, rem = shape[dim] % ranks;
  box.offsets[dim] = rank * base + std::min<int64_t>(rank, rem);
  box.sizes[dim] = base + (rank < rem ? 1 : 0);
  return box;
}

enum class Split { kRows, kCols };

// Loads every key of `fixture` (only `only` when not empty) from `path` over `ranks` LocalComm
// ranks, each its part split by rows or columns, and compares; returns each rank's report.
std::vector<LoadReport> LoadAndCompare(const std::string& path, const Fixture& fixture, int ranks,
                                       Split split, const std::string& only = "",
                                       bool skip_unexpected = false,
                                       ReadSharing sharing = ReadSharing::kAuto) {
  std::vector<LoadReport> reports(ranks);
  std::mutex mu;
  const std::vector<Status> statuses = RunLocalRanks(ranks, [&](Comm& comm) -> Status {
    StateDict state;
    std::map<std::string, std::vector<uint8_t>> buffers;
    std::map<std::string, Box> boxes;
    for (const auto& [key, t] : fixture.tensors) {
      if (!only.empty() && key != only) continue;
      const size_t dim = split == Split::kRows || t.shape.empty() ? 0 : t.shape.size() - 1;
      const Box box = PartOf(t.shape, comm.rank(), ranks, dim);
      std::vector<uint8_t>& buffer = buffers[key];
      buffer.assign(static_cast<size_t>(box.NumElements()) * DTypeSize(t.dtype), 0xEE);
      TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
          key, TensorView(buffer.data(), t.dtype, box.sizes), t.shape, box.offsets)));
      boxes[key] = box;
    }
    for (const auto& [key, bytes] : fixture.objects) {
      if (only.empty()) TESSERA_RETURN_IF_ERROR(state.Add(ShardedObject{key}));
    }
    LoadOptions options;
    options.read_sharing = sharing;
    if (!only.empty() || skip_unexpected) options.unexpected_keys = KeyPolicy::kSkip;
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(state, path, comm, options));
    for (const auto& [key, box] : boxes) {
      const Expected& t = fixture.tensors.at(key);
      if (buffers[key] != BoxBytes(t.bytes, t.shape, box, DTypeSize(t.dtype))) {
        return Internal("rank " + std::to_string(comm.rank()) + ": key '" + key + "' box " +
                        box.ToString() + " differs from what torch saved");
      }
    }
    for (const StateEntry& entry : state.entries()) {
      if (const auto* object = std::get_if<ShardedObject>(&entry)) {
        if (object->data != fixture.objects.at(object->key) ||
            object->encoding != ObjectEncoding::kTorchSave) {
          return Internal("object '" + object->key + "' differs from torch's item");
        }
      }
    }
    std::lock_guard lock(mu);
    reports[comm.rank()] = report;
    return Status::Ok();
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
  return reports;
}

TEST_F(DcpLoadTest, ReadMetadataOfTorchCheckpoint) {
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(Path("single")));
  EXPECT_EQ(m.format, CheckpointFormat::kTorchDist);
  EXPECT_EQ(m.checksum, ChecksumKind::kNone);
  EXPECT_EQ(m.user_metadata.at("torch_dist.flavor"), "1.13");
  const Fixture& f = Of("single");
  ASSERT_EQ(m.tensors.size(), f.tensors.size());
  for (const TensorInfo& t : m.tensors) {
    const Expected& e = f.tensors.at(t.key);
    EXPECT_EQ(t.dtype, e.dtype) << t.key;
    EXPECT_EQ(t.global_shape, e.shape) << t.key;
    ASSERT_EQ(t.chunks.size(), 1u) << t.key;
    EXPECT_EQ(t.chunks[0].encoding, ChunkEncoding::kTorchSaveItem) << t.key;
  }
  ASSERT_EQ(m.objects.size(), 2u);
  for (const ObjectInfo& o : m.objects) {
    EXPECT_EQ(o.encoding, ObjectEncoding::kTorchSave);
    EXPECT_EQ(o.location.length, f.objects.at(o.key).size());
  }
}

TEST_F(DcpLoadTest, SameLayoutLoadReadsOnlyTheElements) {
  const std::vector<LoadReport> reports =
      LoadAndCompare(Path("single"), Of("single"), 1, Split::kRows);
  ASSERT_EQ(reports.size(), 1u);
  // Elements + objects + the probes of 8 items (each at most 8 KiB: zip directory, data.pkl).
  EXPECT_LE(reports[0].bytes_read, reports[0].bytes_needed + 8 * 8192);
}

TEST_F(DcpLoadTest, ReshardedByRowsAndColumnsIncludingStridedViews) {
  for (int ranks : {2, 3}) {
    for (Split split : {Split::kRows, Split::kCols}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks, " + (split == Split::kRows ? "rows" : "cols"));
      LoadAndCompare(Path("single"), Of("single"), ranks, split);
    }
  }
}

TEST_F(DcpLoadTest, ReshardedLoadReadsAtMostFivePercentMore) {
  for (Split split : {Split::kRows, Split::kCols}) {
    const std::vector<LoadReport> reports = LoadAndCompare(Path("single"), Of("single"), 3, split,
                                                           "big", false, ReadSharing::kReadOnce);
    // Read once per job (the default): the job's storage reads against the union of what the
    // ranks needed.
    for (const LoadReport& r : reports) {
      EXPECT_GT(r.bytes_needed, 300000u);
      EXPECT_GT(r.job_bytes_needed, 3 * 300000u);
      EXPECT_LE(static_cast<double>(r.job_bytes_read),
                1.05 * static_cast<double>(r.job_bytes_needed));
    }
  }
}

TEST_F(DcpLoadTest, TwoRankTorchSaveLoadsIntoOneAndThreeRanks) {
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(Path("sharded2")));
  ASSERT_NE(m.FindTensor("emb"), nullptr);
  EXPECT_EQ(m.FindTensor("emb")->chunks.size(), 2u);
  EXPECT_EQ(m.FindTensor("proj")->chunks.size(), 2u);
  for (int ranks : {1, 3}) {
    for (Split split : {Split::kRows, Split::kCols}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks");
      LoadAndCompare(Path("sharded2"), Of("sharded2"), ranks, split);
    }
  }
}

TEST_F(DcpLoadTest, VerifyChecksStructureAndTheCrcOfEveryZipRecord) {
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(Path("single"), VerifyOptions{}));
  EXPECT_EQ(report.format, CheckpointFormat::kTorchDist);
  EXPECT_TRUE(report.checksums);  // the zip records' CRC-32s (issue 22)
  EXPECT_EQ(report.chunks_checked, 10u);
  // Every record of every item: more than the tensors' elements (data.pkl, version, objects).
  uint64_t elements = 0;
  for (const auto& [key, t] : Of("single").tensors) elements += t.bytes.size();
  EXPECT_GT(report.bytes_checked, elements);
}

TEST_F(DcpLoadTest, ConvertsToTesseraAndSafetensors) {
  TempDir dir;
  for (CheckpointFormat to : {CheckpointFormat::kTessera, CheckpointFormat::kSafetensors}) {
    SCOPED_TRACE(CheckpointFormatName(to));
    const std::string out = dir.Sub(CheckpointFormatName(to));
    ConvertOptions options;
    options.to = to;
    options.max_file_bytes = 200000;  // several files, several units
    ASSERT_OK(Convert(Path("single"), out, options).status());
    Fixture tensors_only = Of("single");
    if (to == CheckpointFormat::kSafetensors) tensors_only.objects.clear();  // no objects there
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(out));
    EXPECT_EQ(m.format, to);
    for (const auto& [key, t] : tensors_only.tensors) {
      ASSERT_NE(m.FindTensor(key), nullptr) << key;
      for (const ChunkInfo& c : m.FindTensor(key)->chunks) {
        EXPECT_EQ(c.encoding, ChunkEncoding::kRaw) << key;
      }
    }
    if (to == CheckpointFormat::kTessera) {
      // Objects keep their bytes and encoding (a DCP byte item stays a torch.save archive).
      for (const ObjectInfo& o : m.objects) EXPECT_EQ(o.encoding, ObjectEncoding::kTorchSave);
    }
    LoadAndCompare(out, tensors_only, 3, Split::kCols);
  }
}

// ---- Megatron-Core torch_dist --------------------------------------------------------------

TEST_F(DcpLoadTest, MegatronFilesAndNdReformulatedTensor) {
  const std::string path = Path("megatron");
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  EXPECT_EQ(m.user_metadata.at("torch_dist.megatron"), "true");
  const TensorInfo* w = m.FindTensor("optimizer.state.exp_avg.decoder.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->global_shape, (Shape{4, 6}));  // the original shape, not (2, 2, 6)
  // 4 fragments of (2, 3), each split at flat 4: [row 0] + [row 1, col 0] and [row 1, cols 1-2].
  EXPECT_EQ(w->chunks.size(), 12u);
  for (const char* key : {"metadata.json", "common.pt", "optimizer.param_groups/shard_0_1"}) {
    EXPECT_NE(m.FindObject(key), nullptr) << key;
  }
  EXPECT_EQ(m.FindObject("metadata.json")->encoding, ObjectEncoding::kJson);
  EXPECT_EQ(m.FindObject("common.pt")->encoding, ObjectEncoding::kTorchSave);
  for (int ranks : {1, 2, 3}) {
    for (Split split : {Split::kRows, Split::kCols}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks");
      LoadAndCompare(path, Of("megatron"), ranks, split, "", /*skip_unexpected=*/true);
    }
  }
  // The whole files, as objects.
  StateDict state;
  ASSERT_OK(state.Add(ShardedObject{"metadata.json"}));
  ASSERT_OK(state.Add(ShardedObject{"common.pt"}));
  LoadOptions options;
  options.unexpected_keys = KeyPolicy::kSkip;
  ASSERT_OK(Load(state, path, options).status());
  EXPECT_EQ(std::get<ShardedObject>(state.entries()[0]).data,
            torch_dist::testing::ReadFileBytes(path + "/metadata.json"));
  EXPECT_EQ(std::get<ShardedObject>(state.entries()[1]).data,
            torch_dist::testing::ReadFileBytes(path + "/common.pt"));
}

TEST_F(DcpLoadTest, FlatShardOfNdReformulatedTensor) {
  // A distributed optimizer's flat range of the original tensor, read from the fragments.
  const Expected& e = Of("megatron").tensors.at("optimizer.state.exp_avg.decoder.weight");
  std::vector<float> got(13, -1.0f);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::FlatShard("optimizer.state.exp_avg.decoder.weight",
                                               TensorView(got.data(), DType::kF32, {13}), {4, 6},
                                               {0, 0}, {4, 6}, 5)));
  LoadOptions options;
  options.unexpected_keys = KeyPolicy::kSkip;
  ASSERT_OK(Load(state, Path("megatron"), options).status());
  EXPECT_EQ(0, std::memcmp(got.data(), e.bytes.data() + 5 * 4, 13 * 4));
}

// ---- damaged checkpoints ---------------------------------------------------------------------

class DamagedDcpTest : public DcpLoadTest {
 protected:
  void SetUp() override {
    DcpLoadTest::SetUp();
    fs::copy(Path("single"), dir_.Sub("c"), fs::copy_options::recursive);
  }
  std::string Dir() const { return dir_.Sub("c"); }
  std::string File(const std::string& name) const { return Dir() + "/" + name; }
  Status LoadAll() {
    const Fixture& f = Of("single");
    std::map<std::string, std::vector<uint8_t>> buffers;
    StateDict state;
    for (const auto& [key, t] : f.tensors) {
      buffers[key].resize(t.bytes.size());
      EXPECT_OK(
          state.Add(ShardedTensor::Whole(key, TensorView(buffers[key].data(), t.dtype, t.shape))));
    }
    for (const auto& [key, o] : f.objects) EXPECT_OK(state.Add(ShardedObject{key}));
    return Load(state, Dir()).status();
  }
  TempDir dir_;
};

TEST_F(DamagedDcpTest, TruncatedDataFileNamesTheFile) {
  fs::resize_file(File("__0_7.distcp"), 5000);
  Result<Metadata> m = ReadMetadata(Dir());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("__0_7.distcp"));
  EXPECT_THAT(m.status().message(), HasSubstr("key 'big'"));
}

TEST_F(DamagedDcpTest, DamagedZipDirectoryNamesFileAndOffset) {
  // The classic end record (the last 22 bytes) of layer.weight's item.
  const std::string path = File("__0_0.distcp");
  std::vector<uint8_t> bytes = torch_dist::testing::ReadFileBytes(path);
  std::fill(bytes.end() - 22, bytes.end(), 0x5A);
  torch_dist::testing::WriteFileBytes(path, bytes);
  ASSERT_OK(ReadMetadata(Dir()).status());  // the index does not read items
  const Status load = LoadAll();
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load.ToString();
  EXPECT_THAT(load.message(), HasSubstr("__0_0.distcp"));
  EXPECT_THAT(load.message(), HasSubstr("key 'layer.weight'"));
  EXPECT_THAT(load.message(), HasSubstr("offset"));
  Result<VerifyReport> verify = Verify(Dir(), VerifyOptions{});
  ASSERT_FALSE(verify.ok());
  EXPECT_THAT(verify.status().message(), HasSubstr("__0_0.distcp"));
}

// Issue 22: a flipped byte in a tensor's elements went unnoticed (DCP has no checksums of its
// own), though every zip record carries a CRC-32. A load that reads a whole record checks it;
// one that reads part of it does so with verify_partial_chunks (reading it whole); Verify
// checks every record.
TEST_F(DamagedDcpTest, AFlippedElementByteIsACrcMismatch) {
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(Dir()));
  const TensorInfo* w = nullptr;
  for (const TensorInfo& t : m.tensors) w = t.key == "layer.weight" ? &t : w;
  ASSERT_NE(w, nullptr);
  const ByteLocation item_at = w->chunks[0].location;
  const std::string path = File(m.files[item_at.file_index].name);
  std::vector<uint8_t> bytes = torch_dist::testing::ReadFileBytes(path);
  ASSERT_OK_AND_ASSIGN(
      torch_dist::TorchTensorItem item,
      torch_dist::ParseTorchTensorItem(
          std::span<const uint8_t>(bytes).subspan(item_at.offset, item_at.length), "item"));
  bytes[item_at.offset + item.data_offset + 5] ^= 0x40;
  torch_dist::testing::WriteFileBytes(path, bytes);

  const Status load = LoadAll();
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load.ToString();
  EXPECT_THAT(load.message(), HasSubstr("CRC-32 mismatch in key 'layer.weight'"));
  EXPECT_THAT(load.message(), HasSubstr(path));
  const Result<VerifyReport> verify = Verify(Dir(), VerifyOptions{});
  ASSERT_FALSE(verify.ok());
  EXPECT_THAT(verify.status().message(), HasSubstr(path));
  EXPECT_THAT(verify.status().message(), HasSubstr("CRC-32"));

  // Rows 0..1 of the (8, 6) tensor: part of the record. Unchecked by default (the bytes read
  // are not the record); with verify_partial_chunks the record is read whole and checked.
  const Shape shape = w->global_shape;
  for (bool partial : {false, true}) {
    std::vector<uint8_t> out(2 * shape[1] * 4);
    StateDict state;
    ASSERT_OK(state.Add(ShardedTensor::Shard(
        "layer.weight", TensorView(out.data(), DType::kF32, {2, shape[1]}), shape, {0, 0})));
    LoadOptions options;
    options.unexpected_keys = KeyPolicy::kSkip;
    options.verify_partial_chunks = partial;
    const Status s = Load(state, Dir(), options).status();
    if (partial) {
      EXPECT_THAT(s.message(), HasSubstr("CRC-32 mismatch in key 'layer.weight'"));
    } else {
      EXPECT_OK(s);
    }
  }
}

// Verify reads every record of every item, objects' too: a flipped byte in a record no load
// reads (an object's data.pkl is checked when read; here the "version" record) is caught.
TEST_F(DamagedDcpTest, VerifyChecksEveryRecord) {
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(Dir()));
  const ByteLocation item_at = m.tensors[0].chunks[0].location;
  const std::string path = File(m.files[item_at.file_index].name);
  std::vector<uint8_t> bytes = torch_dist::testing::ReadFileBytes(path);
  const std::string_view item(reinterpret_cast<const char*>(bytes.data()) + item_at.offset,
                              item_at.length);
  // The version record's data "3\n" follows its local header, named ".../version".
  const size_t name = item.find("/version");
  ASSERT_NE(name, std::string_view::npos);
  const size_t data = item.find("3\n", name);
  ASSERT_NE(data, std::string_view::npos);
  bytes[item_at.offset + data] = '4';
  torch_dist::testing::WriteFileBytes(path, bytes);
  const Result<VerifyReport> verify = Verify(Dir(), VerifyOptions{});
  ASSERT_FALSE(verify.ok());
  EXPECT_THAT(verify.status().message(), HasSubstr("version has CRC-32"));
  EXPECT_THAT(verify.status().message(), HasSubstr(path));
}

TEST_F(DamagedDcpTest, ItemOfAnotherDtypeIsRefused) {
  // transposed's item (int64 (4, 6), 939 bytes) where layer.weight's (float32 (8, 6)) was.
  fs::copy_file(File("__0_2.distcp"), File("__0_0.distcp"), fs::copy_options::overwrite_existing);
  const Status load = LoadAll();
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load.ToString();
  EXPECT_THAT(load.message(), HasSubstr("__0_0.distcp"));
  EXPECT_THAT(load.message(), HasSubstr("int64"));
}

TEST_F(DamagedDcpTest, TruncatedMetadataNamesIt) {
  fs::resize_file(File(".metadata"), 700);
  Result<Metadata> m = ReadMetadata(Dir());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss) << m.status().ToString();
  EXPECT_THAT(m.status().message(), HasSubstr(".metadata"));
  EXPECT_THAT(m.status().message(), HasSubstr("offset"));
}

TEST_F(DamagedDcpTest, MissingDataFileNamesIt) {
  fs::remove(File("__0_3.distcp"));
  Result<Metadata> m = ReadMetadata(Dir());
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("__0_3.distcp"));
  EXPECT_THAT(m.status().message(), HasSubstr("missing"));
}

// ---- tessera's own DCP directories, torch 2.x flavour ----------------------------------------

TEST(DcpRoundTripTest, Torch2FlavourSavedByTesseraLoadsResharded) {
  TempDir dir;
  const Shape shape = {9, 7};
  std::vector<float> full(63);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i) * 0.5f - 3.0f;
  const std::vector<uint8_t> blob = {1, 2, 3, 250};
  // Saved by 3 ranks, rows split.
  const std::vector<Status> saved = RunLocalRanks(3, [&](Comm& comm) -> Status {
    const Box box = PartOf(shape, comm.rank(), 3, 0);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(full.data() + box.offsets[0] * 7, DType::kF32, box.sizes), shape,
        box.offsets)));
    TESSERA_RETURN_IF_ERROR(
        state.Add(ShardedObject{"blob", blob, {comm.rank()}, ObjectEncoding::kBytes}));
    SaveOptions options;
    options.format = CheckpointFormat::kTorchDist;
    options.format_options = TorchDistOptions{.flavor = TorchDistFlavor::kTorch2};
    return Save(state, dir.path(), comm, options).status();
  });
  ASSERT_OK(FirstError(saved));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(dir.path()));
  EXPECT_EQ(m.format, CheckpointFormat::kTorchDist);
  EXPECT_EQ(m.user_metadata.at("torch_dist.flavor"), "2.x");
  EXPECT_EQ(m.user_metadata.at("torch_dist.version"), "1.0.0");
  ASSERT_EQ(m.FindTensor("w")->chunks.size(), 3u);
  // Loaded by 2 ranks, columns split.
  const std::vector<Status> loaded = RunLocalRanks(2, [&](Comm& comm) -> Status {
    const Box box = PartOf(shape, comm.rank(), 2, 1);
    std::vector<float> mine(static_cast<size_t>(box.NumElements()), -1.0f);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(mine.data(), DType::kF32, box.sizes), shape, box.offsets)));
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedObject{"blob"}));
    TESSERA_RETURN_IF_ERROR(Load(state, dir.path(), comm).status());
    for (int64_t r = 0; r < box.sizes[0]; ++r) {
      for (int64_t c = 0; c < box.sizes[1]; ++c) {
        if (mine[r * box.sizes[1] + c] != full[r * 7 + box.offsets[1] + c]) {
          return Internal("w differs at (" + std::to_string(r) + ", " + std::to_string(c) + ")");
        }
      }
    }
    const auto& object = std::get<ShardedObject>(state.entries()[1]);
    if (object.encoding != ObjectEncoding::kTorchSave || object.data.size() <= blob.size()) {
      return Internal("blob: not the torch.save item of the bytes");
    }
    return Status::Ok();
  });
  ASSERT_OK(FirstError(loaded));
}

}  // namespace
}  // namespace tessera
