// Loading Hugging Face safetensors checkpoints written by an independent writer (Python's
// standard library, src/format/huggingface/testdata/write_hf.py): one model.safetensors, shards
// with model.safetensors.index.json, a directory of shards without index, one file by path;
// whole and resharded over 1, 2 and 4 ranks by rows and by columns; every dtype; invalid files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/hf_test_util.h"
#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using hf_testing::BoxBytes;
using hf_testing::NumBytes;
using hf_testing::PatternBytes;
using hf_testing::TensorSpec;
using hf_testing::WriteHuggingFace;
using hf_testing::WriteRawSafetensors;
using ::testing::HasSubstr;
using testing::TempDir;

// One tensor of every dtype tessera knows, plus a scalar, a 3-D and an empty tensor.
std::vector<TensorSpec> EveryDtype() {
  std::vector<TensorSpec> specs;
  for (DType d : kAllDTypes) {
    specs.push_back({"t." + std::string(DTypeName(d)), std::string(DTypeName(d)), {6, 10}});
  }
  specs.push_back({"scalar", "F32", {}});
  specs.push_back({"cube", "BF16", {3, 4, 5}});
  specs.push_back({"empty", "F16", {0, 4}});
  return specs;
}

std::vector<std::string> Names(const std::vector<TensorSpec>& specs) {
  std::vector<std::string> names;
  for (const TensorSpec& t : specs) names.push_back(t.name);
  return names;
}

void Write(const std::string& dir,
           const std::vector<std::pair<std::string, std::vector<std::string>>>& files,
           const std::vector<TensorSpec>& tensors, bool index) {
  auto [status, output] = WriteHuggingFace(dir, files, tensors, index, {{"format", "pt"}});
  ASSERT_EQ(status, 0) << output;
}

// Loads every tensor of `specs` whole from `path` on one rank and compares it with the
// writer's pattern.
void ExpectWholeLoad(const std::string& path, const std::vector<TensorSpec>& specs) {
  std::vector<std::vector<uint8_t>> buffers;
  StateDict state;
  for (const TensorSpec& t : specs) buffers.emplace_back(NumBytes(t), 0);
  for (size_t i = 0; i < specs.size(); ++i) {
    ASSERT_OK(state.Add(ShardedTensor::Whole(
        specs[i].name,
        TensorView(buffers[i].data(), *DTypeFromName(specs[i].dtype), specs[i].shape))));
  }
  ASSERT_OK_AND_ASSIGN(LoadReport report, Load(state, path));
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(buffers[i], PatternBytes(specs[i].name, NumBytes(specs[i]))) << specs[i].name;
  }
  EXPECT_EQ(report.bytes_read, report.bytes_needed);
}

TEST(HuggingFaceTest, OneFileOfEveryDtypeByDirectoryAndByPath) {
  TempDir tmp;
  const std::vector<TensorSpec> specs = EveryDtype();
  Write(tmp.path(), {{"model.safetensors", Names(specs)}}, specs, /*index=*/false);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.path()));
  EXPECT_EQ(m.format, CheckpointFormat::kSafetensors);
  EXPECT_EQ(m.checksum, ChecksumKind::kNone);
  ASSERT_EQ(m.tensors.size(), specs.size());
  for (const TensorSpec& t : specs) {
    const TensorInfo* info = m.FindTensor(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_EQ(DTypeName(info->dtype), t.dtype);
    EXPECT_EQ(info->global_shape, t.shape);
  }
  EXPECT_EQ(m.user_metadata.at("format"), "pt");
  ExpectWholeLoad(tmp.path(), specs);
  ExpectWholeLoad(tmp.Sub("model.safetensors"), specs);
}

TEST(HuggingFaceTest, ShardsWithIndexHoldExactlyTheIndexedTensors) {
  TempDir tmp;
  const std::vector<TensorSpec> specs = EveryDtype();
  const std::vector<std::string> names = Names(specs);
  const std::vector<std::pair<std::string, std::vector<std::string>>> files = {
      {"model-00001-of-00003.safetensors", {names.begin(), names.begin() + 6}},
      {"model-00002-of-00003.safetensors", {names.begin() + 6, names.begin() + 12}},
      {"model-00003-of-00003.safetensors", {names.begin() + 12, names.end()}}};
  Write(tmp.path(), files, specs, /*index=*/true);
  // A stray file the index does not name is not part of the checkpoint.
  Write(tmp.path(), {{"stray.safetensors", {"stray"}}}, {{"stray", "F32", {2}}}, false);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.path()));
  EXPECT_EQ(m.tensors.size(), specs.size());
  EXPECT_EQ(m.files.size(), 3u);
  EXPECT_EQ(m.FindTensor("stray"), nullptr);
  ExpectWholeLoad(tmp.path(), specs);
}

TEST(HuggingFaceTest, ADirectoryOfShardsWithoutIndex) {
  TempDir tmp;
  const std::vector<TensorSpec> specs = EveryDtype();
  const std::vector<std::string> names = Names(specs);
  Write(tmp.path(),
        {{"a.safetensors", {names.begin(), names.begin() + 9}},
         {"b.safetensors", {names.begin() + 9, names.end()}}},
        specs, /*index=*/false);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(tmp.path()));
  EXPECT_EQ(m.tensors.size(), specs.size());
  EXPECT_EQ(m.files.size(), 2u);
  ExpectWholeLoad(tmp.path(), specs);
}

// How the files are laid out, and how the test names the checkpoint.
enum class Layout { kOneFile, kFilePath, kIndexed, kNoIndex };

struct ReshardCase {
  Layout layout;
  int ranks;
  size_t dim;  // split dimension: 0 rows, 1 columns
};

class HuggingFaceReshardTest : public ::testing::TestWithParam<ReshardCase> {};

// Every rank asks for its slice along the split dimension of every tensor that has it (uneven
// where the size does not divide), and the whole of the others; it must read exactly the
// bytes it needs (Hugging Face files have no checksums to check).
TEST_P(HuggingFaceReshardTest, EveryRankReadsExactlyItsBox) {
  const ReshardCase c = GetParam();
  TempDir tmp;
  const std::vector<TensorSpec> specs = {{"w1", "F32", {16, 24}},   {"w2", "BF16", {10, 7}},
                                         {"w3", "F64", {8, 12, 3}}, {"bias", "F16", {24}},
                                         {"scalar", "I64", {}},     {"mask", "BOOL", {5, 9}}};
  const std::vector<std::string> names = Names(specs);
  std::string path = tmp.path();
  switch (c.layout) {
    case Layout::kOneFile:
    case Layout::kFilePath:
      Write(tmp.path(), {{"model.safetensors", names}}, specs, false);
      if (c.layout == Layout::kFilePath) path = tmp.Sub("model.safetensors");
      break;
    case Layout::kIndexed:
    case Layout::kNoIndex:
      Write(tmp.path(),
            {{"model-00001-of-00002.safetensors", {"bias", "mask", "w1"}},
             {"model-00002-of-00002.safetensors", {"scalar", "w2", "w3"}}},
            specs, c.layout == Layout::kIndexed);
      break;
  }
  std::vector<std::vector<uint8_t>> wholes;
  for (const TensorSpec& t : specs) wholes.push_back(PatternBytes(t.name, NumBytes(t)));
  const Status status = FirstError(RunLocalRanks(c.ranks, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    StateDict state;
    std::vector<Box> boxes;
    std::vector<std::vector<uint8_t>> buffers(specs.size());
    uint64_t expected_bytes = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& t = specs[i];
      const DType dtype = *DTypeFromName(t.dtype);
      Box box = Box::Whole(t.shape);
      if (c.dim < t.shape.size()) {
        const int64_t n = t.shape[c.dim];
        box.offsets[c.dim] = n * r / c.ranks;
        box.sizes[c.dim] = n * (r + 1) / c.ranks - box.offsets[c.dim];
      }
      boxes.push_back(box);
      buffers[i].assign(static_cast<size_t>(box.NumElements()) * DTypeSize(dtype), 0xEE);
      expected_bytes += buffers[i].size();
      TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
          t.name, TensorView(buffers[i].data(), dtype, box.sizes), t.shape, box.offsets)));
    }
    // Each rank reading alone reads exactly its box; read once per job (the default), the job
    // reads the union of the boxes (rounded out to 256 KiB cells where two ranks share one),
    // never more than the files' tensor bytes.
    for (const ReadSharing sharing : {ReadSharing::kNone, ReadSharing::kReadOnce}) {
      for (std::vector<uint8_t>& b : buffers) std::fill(b.begin(), b.end(), 0xEE);
      LoadOptions options;
      options.read_sharing = sharing;
      TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(state, path, comm, options));
      for (size_t i = 0; i < specs.size(); ++i) {
        const std::vector<uint8_t> want = BoxBytes(
            wholes[i], specs[i].shape, DTypeSize(*DTypeFromName(specs[i].dtype)), boxes[i]);
        if (buffers[i] != want) {
          return Internal("rank " + std::to_string(r) + ": wrong bytes in " + specs[i].name + " " +
                          boxes[i].ToString());
        }
      }
      const bool alone = sharing == ReadSharing::kNone;
      if (report.bytes_needed != expected_bytes ||
          (alone && report.bytes_read != report.bytes_needed) ||
          (!alone && (report.job_bytes_read > report.checkpoint_bytes ||
                      report.job_bytes_read < report.job_bytes_needed))) {
        return Internal("rank " + std::to_string(r) + " needed " +
                        std::to_string(report.bytes_needed) + " (expected " +
                        std::to_string(expected_bytes) + ") and read " +
                        std::to_string(report.bytes_read) + "; the job read " +
                        std::to_string(report.job_bytes_read) + " of a union of " +
                        std::to_string(report.job_bytes_needed) + " and a checkpoint of " +
                        std::to_string(report.checkpoint_bytes));
      }
    }
    return Status::Ok();
  }));
  EXPECT_OK(status);
}

std::vector<ReshardCase> ReshardCases() {
  std::vector<ReshardCase> cases;
  for (Layout layout : {Layout::kOneFile, Layout::kFilePath, Layout::kIndexed, Layout::kNoIndex}) {
    for (int ranks : {1, 2, 4}) {
      for (size_t dim : {0, 1}) cases.push_back({layout, ranks, dim});
    }
  }
  return cases;
}

std::string ReshardCaseName(const ::testing::TestParamInfo<ReshardCase>& info) {
  static const char* kLayouts[] = {"OneFile", "FilePath", "Indexed", "NoIndex"};
  return std::string(kLayouts[static_cast<int>(info.param.layout)]) + "_" +
         std::to_string(info.param.ranks) + "ranks_" + (info.param.dim == 0 ? "rows" : "columns");
}

INSTANTIATE_TEST_SUITE_P(LayoutsRanksAndSplits, HuggingFaceReshardTest,
                         ::testing::ValuesIn(ReshardCases()), ReshardCaseName);

TEST(HuggingFaceTest, VerifyChecksStructureOnly) {
  TempDir tmp;
  const std::vector<TensorSpec> specs = EveryDtype();
  Write(tmp.path(), {{"model.safetensors", Names(specs)}}, specs, false);
  ASSERT_OK_AND_ASSIGN(VerifyReport report, Verify(tmp.path()));
  EXPECT_FALSE(report.checksums);
  EXPECT_EQ(report.format, CheckpointFormat::kSafetensors);
  EXPECT_EQ(report.files_checked, 1);
  EXPECT_EQ(report.chunks_checked, specs.size());
  EXPECT_EQ(report.bytes_checked, 0u);  // no byte was checked against anything
  // A changed data byte goes unnoticed: there is nothing to check it against.
  const std::string file = tmp.Sub("model.safetensors");
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x5a');
  }
  EXPECT_OK(Verify(tmp.path()));
  // A truncated file does not.
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 1);
  const Result<VerifyReport> truncated = Verify(tmp.path());
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(truncated.status().message(), HasSubstr(file));
}

// ---- errors -------------------------------------------------------------------------------

// The error of reading `path` (a directory or a file) by ReadMetadata, Load and Verify: the
// same, kDataLoss, naming `file` and holding `what`.
void ExpectCorrupt(const std::string& path, const std::string& file, const std::string& what) {
  const Result<Metadata> metadata = ReadMetadata(path);
  ASSERT_FALSE(metadata.ok()) << path;
  EXPECT_EQ(metadata.status().code(), StatusCode::kDataLoss) << metadata.status().ToString();
  EXPECT_THAT(metadata.status().message(), HasSubstr(file));
  EXPECT_THAT(metadata.status().message(), HasSubstr(what));
  StateDict nothing;
  const Result<LoadReport> loaded = Load(nothing, path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(loaded.status().message(), HasSubstr(metadata.status().message()));
  const Result<VerifyReport> verified = Verify(path);
  ASSERT_FALSE(verified.ok());
  EXPECT_EQ(verified.status().message(), metadata.status().message());
}

TEST(HuggingFaceErrorsTest, AnUnknownDtypeNamesTheTensorAndTheFile) {
  TempDir tmp;
  const std::string file = tmp.Sub("model.safetensors");
  WriteRawSafetensors(file,
                      R"({"ok":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("weird":{"dtype":"C64","shape":[2],"data_offsets":[8,24]}})",
                      std::vector<uint8_t>(24, 1));
  for (const std::string& path : {tmp.path(), file}) {
    const Result<Metadata> metadata = ReadMetadata(path);
    ASSERT_FALSE(metadata.ok()) << path;
    // A dtype of the format tessera lacks: the file is not damaged, tessera cannot read it.
    EXPECT_EQ(metadata.status().code(), StatusCode::kUnimplemented) << metadata.status().ToString();
    EXPECT_THAT(metadata.status().message(), HasSubstr(file));
    EXPECT_THAT(metadata.status().message(),
                HasSubstr("entry \"weird\": dtype \"C64\" is not supported by tessera"));
    StateDict nothing;
    const Result<LoadReport> loaded = Load(nothing, path);
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kUnimplemented);
    const Result<VerifyReport> verified = Verify(path);
    ASSERT_FALSE(verified.ok());
    EXPECT_EQ(verified.status().message(), metadata.status().message());
  }
}

struct BadHeader {
  const char* name;
  std::string header;
  uint64_t data_bytes;
  uint64_t declared;  // header length written in the first 8 bytes; ~0: the true one
  const char* what;
};

std::vector<BadHeader> BadHeaders() {
  const std::string entry = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  return {
      {"LengthPastTheEnd", entry, 8, 1000, "runs past the end of the file"},
      {"NotJson", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, ~0ull,
       "invalid JSON"},
      {"Overlapping",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, ~0ull, "overlap another entry"},
      {"PastTheFile", entry, 4, ~0ull, "entries end at byte 8 of the data section, but it has 4"},
      {"ShapeAndLengthDisagree", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       ~0ull, "do not match 12 bytes of F32 [3]"},
  };
}

class HuggingFaceBadHeaderTest : public ::testing::TestWithParam<BadHeader> {};

// Alone, as a directory's only file, and as a shard the index names: the error names the file.
TEST_P(HuggingFaceBadHeaderTest, NamesTheFile) {
  const BadHeader& bad = GetParam();
  TempDir tmp;
  const std::string single = tmp.Sub("single/model.safetensors");
  std::filesystem::create_directories(tmp.Sub("single"));
  WriteRawSafetensors(single, bad.header, std::vector<uint8_t>(bad.data_bytes, 7), bad.declared);
  ExpectCorrupt(single, single, bad.what);
  ExpectCorrupt(tmp.Sub("single"), single, bad.what);

  const std::string dir = tmp.Sub("sharded");
  Write(
      dir,
      {{"model-00001-of-00002.safetensors", {"good"}}, {"model-00002-of-00002.safetensors", {"a"}}},
      {{"good", "F32", {4}}, {"a", "F32", {2}}}, /*index=*/true);
  const std::string shard = dir + "/model-00002-of-00002.safetensors";
  WriteRawSafetensors(shard, bad.header, std::vector<uint8_t>(bad.data_bytes, 7), bad.declared);
  ExpectCorrupt(dir, shard, bad.what);
}

INSTANTIATE_TEST_SUITE_P(Headers, HuggingFaceBadHeaderTest, ::testing::ValuesIn(BadHeaders()),
                         [](const ::testing::TestParamInfo<BadHeader>& info) {
                           return std::string(info.param.name);
                         });

TEST(HuggingFaceErrorsTest, IndexProblemsNameTheIndexOrTheShard) {
  TempDir tmp;
  const std::vector<TensorSpec> specs = {{"a", "F32", {4}}, {"b", "I8", {3}}};
  auto make = [&](const std::string& name) {
    const std::string dir = tmp.Sub(name);
    Write(
        dir,
        {{"model-00001-of-00002.safetensors", {"a"}}, {"model-00002-of-00002.safetensors", {"b"}}},
        specs, /*index=*/true);
    return dir;
  };
  auto write_index = [](const std::string& dir, const std::string& text) {
    std::ofstream(dir + "/model.safetensors.index.json") << text;
  };
  {
    const std::string dir = make("missing_file");
    std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
    ExpectCorrupt(dir, dir + "/model-00002-of-00002.safetensors", "is missing");
  }
  {
    const std::string dir = make("missing_tensor");
    write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",)"
                     R"( "b": "model-00002-of-00002.safetensors",)"
                     R"( "c": "model-00002-of-00002.safetensors"}})");
    ExpectCorrupt(dir, dir + "/model-00002-of-00002.safetensors",
                  "puts tensor 'c' in " + dir +
                      "/model-00002-of-00002.safetensors, whose header "
                      "does not list it");
  }
  {
    const std::string dir = make("not_json");
    write_index(dir, R"({"weight_map": {"a": "model-00001-of-00002.safetensors",)");
    ExpectCorrupt(dir, dir + "/model.safetensors.index.json", "invalid JSON");
  }
  {
    const std::string dir = make("not_a_name");
    write_index(dir, R"({"weight_map": {"a": 7}})");
    ExpectCorrupt(dir, dir + "/model.safetensors.index.json",
                  "weight_map[\"a\"] is not a file name string");
  }
  {
    // Issue 22, defect 7: "metadata" nested 100,000 deep once overflowed the stack of every
    // reader (a recursive dump of the parsed value). Now refused, naming the index.
    const std::string dir = make("deep_metadata");
    write_index(dir, R"({"metadata": {"deep": )" + std::string(100000, '[') +
                         std::string(100000, ']') +
                         R"(}, "weight_map": {"a": "model-00001-of-00002.safetensors"}})");
    ExpectCorrupt(dir, dir + "/model.safetensors.index.json",
                  "JSON nested more than 1000 levels deep");
  }
  {
    const std::string dir = make("escaping");
    write_index(dir, R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})");
    ExpectCorrupt(dir, dir + "/model.safetensors.index.json", "contains '/'");
  }
  {
    // Without an index, a tensor in two files is ambiguous.
    const std::string dir = tmp.Sub("twice");
    Write(dir, {{"x.safetensors", {"a"}}, {"y.safetensors", {"a", "b"}}}, specs, false);
    ExpectCorrupt(
        dir, dir,
        "tensor 'a' is in two safetensors files of " + dir + ": x.safetensors and y.safetensors");
  }
}

}  // namespace
}  // namespace tessera
