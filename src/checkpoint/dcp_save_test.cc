// Save with CheckpointFormat::kTorchDist: what it writes is read back by tessera's own DCP
// codecs (ReadDcpMetadata, ReadTorchTensorItem, ReadTorchObjectItem) and by torch 1.13's DCP
// load_state_dict (testdata/load_dcp_with_torch.py, on one rank and sharded over 2 gloo ranks),
// in both metadata flavours; a crash or failure at any storage operation leaves the old or the
// new checkpoint readable; the cleanup never touches torch's own files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/commit.h"
#include "core/dtype_convert.h"
#include "format/tessera/manifest.h"
#include "format/torch_dist/dcp_metadata.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/test_util.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::nlohmann::json;
using ::tessera::testing::TempDir;
using ::testing::HasSubstr;
using torch_dist::DcpFlavor;
using torch_dist::DcpMetadata;

// ---- reading a DCP checkpoint back with tessera's codecs ---------------------------------------

// What a DCP directory holds, read with the format layer only (no Load).
struct DcpContent {
  DcpMetadata metadata;
  std::map<std::string, std::vector<uint8_t>> tensors;  // key -> whole tensor, row-major
  std::map<std::string, torch_dist::TorchObjectItem> objects;
};

// Copies the row-major block `box` (bytes `src`) into the row-major tensor `dst` of `shape`.
void PlaceBox(const Box& box, const Shape& shape, size_t element, const uint8_t* src,
              uint8_t* dst) {
  const size_t rank = shape.size();
  if (box.NumElements() == 0) return;
  if (rank == 0) {
    std::memcpy(dst, src, element);
    return;
  }
  const size_t run = static_cast<size_t>(box.sizes.back()) * element;
  std::vector<int64_t> index(rank, 0);  // within the box; the last dimension stays 0
  for (size_t copied = 0;; copied += run) {
    int64_t at = 0;
    for (size_t d = 0; d < rank; ++d) at = at * shape[d] + box.offsets[d] + index[d];
    std::memcpy(dst + at * element, src + copied, run);
    size_t d = rank - 1;
    while (d-- > 0) {
      if (++index[d] < box.sizes[d]) break;
      index[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

Result<DcpContent> ReadDcp(Storage& storage, const std::string& dir) {
  const std::string meta_path = JoinPath(dir, ".metadata");
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> meta_file,
                           storage.NewReadableFile(meta_path));
  std::vector<uint8_t> meta_bytes(meta_file->size());
  TESSERA_RETURN_IF_ERROR(meta_file->ReadAt(0, meta_bytes.data(), meta_bytes.size()));
  DcpContent content;
  TESSERA_ASSIGN_OR_RETURN(content.metadata, torch_dist::ReadDcpMetadata(meta_bytes, meta_path));
  for (const torch_dist::DcpTensor& t : content.metadata.tensors) {
    const torch_dist::TorchDType* dtype = torch_dist::FindTorchDType(t.torch_dtype);
    if (dtype == nullptr) return DataLoss("unknown dtype " + t.torch_dtype);
    int64_t numel = 1;
    for (int64_t d : t.size) numel *= d;
    std::vector<uint8_t>& whole = content.tensors[t.fqn];
    whole.assign(static_cast<size_t>(numel) * dtype->element_size, 0);
    for (const torch_dist::DcpChunk& chunk : t.chunks) {
      const torch_dist::DcpStorage& s = content.metadata.storage[chunk.storage];
      TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                               storage.NewReadableFile(JoinPath(dir, s.relative_path)));
      TESSERA_ASSIGN_OR_RETURN(torch_dist::TorchTensorItem item,
                               torch_dist::ReadTorchTensorItem(*file, s.offset_in_file, s.length));
      if (item.size != chunk.sizes || item.torch_dtype != t.torch_dtype) {
        return DataLoss(t.fqn + ": an item of another shape or dtype");
      }
      TESSERA_ASSIGN_OR_RETURN(auto range, item.ContiguousRange());
      std::vector<uint8_t> data(range.second);
      TESSERA_RETURN_IF_ERROR(
          file->ReadAt(s.offset_in_file + range.first, data.data(), data.size()));
      if (Crc32(data.data(), data.size()) != item.data_crc32 && range.second == item.data_size) {
        return DataLoss(t.fqn + ": CRC-32 mismatch");
      }
      PlaceBox(Box(chunk.offsets, chunk.sizes), t.size, dtype->element_size, data.data(),
               whole.data());
    }
  }
  for (const torch_dist::DcpBytes& b : content.metadata.bytes) {
    const torch_dist::DcpStorage& s = content.metadata.storage[b.storage];
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                             storage.NewReadableFile(JoinPath(dir, s.relative_path)));
    TESSERA_ASSIGN_OR_RETURN(content.objects[b.fqn],
                             torch_dist::ReadTorchObjectItem(*file, s.offset_in_file, s.length));
  }
  return content;
}

// ---- a state of every kind ---------------------------------------------------------------------

// pickle.dumps({"step": 7, "name": "x", "lr": [0.5, 1]}, protocol=4) by CPython 3.11.
const char kPickledHex[] =
    "8004952d000000000000007d94288c0473746570944b078c046e616d65948c0178948c026c72945d9428473fe0000"
    "0000000004b0165752e";
const json kPickledValue = {{"step", 7}, {"name", "x"}, {"lr", {0.5, 1}}};

struct TensorSpec {
  std::string key;
  DType dtype;
  Shape shape;
};

// Global tensors of several dtypes and shapes, with values that survive any copy (no NaNs,
// bools 0 or 1), and objects of every encoding (see also AddLargeTensor).
struct TestState {
  std::vector<TensorSpec> specs = {
      {"layer.weight", DType::kF32, {6, 5}}, {"layer.bias", DType::kBF16, {7}},
      {"counts", DType::kI64, {4, 3}},       {"mask", DType::kBool, {2, 3, 4}},
      {"scalar", DType::kF32, {}},           {"empty", DType::kF32, {0, 3}},
      {"wide", DType::kF16, {3, 1000}}};
  std::map<std::string, std::vector<uint8_t>> values;  // key -> whole tensor
  struct Object {
    std::string key;
    std::vector<uint8_t> data;
    ObjectEncoding encoding;
    std::vector<uint8_t> loaded;  // the bytes torch.load gives back (not for kPickle)
  };
  std::vector<Object> objects;

  explicit TestState(int generation = 1) {
    for (const TensorSpec& s : specs) {
      int64_t numel = 1;
      for (int64_t d : s.shape) numel *= d;
      std::vector<uint8_t>& v = values[s.key];
      v.resize(static_cast<size_t>(numel) * DTypeSize(s.dtype));
      for (int64_t i = 0; i < numel; ++i) {
        const float f = generation * 100.0f + static_cast<float>(i % 97) * 0.5f - 20.0f;
        uint8_t* p = v.data() + i * DTypeSize(s.dtype);
        switch (s.dtype) {
          case DType::kF32:
            std::memcpy(p, &f, 4);
            break;
          case DType::kBF16:
          case DType::kF16: {  // the high half of an f32 (bf16); for f16 any finite pattern
            uint32_t bits;
            std::memcpy(&bits, &f, 4);
            const uint16_t half = s.dtype == DType::kBF16
                                      ? static_cast<uint16_t>(bits >> 16)
                                      : static_cast<uint16_t>(0x3C00 + (i + generation) % 1024);
            std::memcpy(p, &half, 2);
            break;
          }
          case DType::kI64: {
            const int64_t x = (int64_t{generation} << 40) - i * 1234567;
            std::memcpy(p, &x, 8);
            break;
          }
          case DType::kBool:
            *p = (i + generation) % 3 == 0;
            break;
          default:
            break;
        }
      }
    }
    std::vector<uint8_t> pickled = torch_dist::testing::FromHex(kPickledHex);
    const std::vector<uint8_t> hi = {'h', 'i', static_cast<uint8_t>('0' + generation)};
    const std::vector<uint8_t> raw = {0, 1, 2, 0xFF, 'x', static_cast<uint8_t>(generation)};
    const std::vector<uint8_t> text = {'[', '1', ',', '2', ']'};
    objects = {{"raw", raw, ObjectEncoding::kBytes, raw},
               {"pickled", pickled, ObjectEncoding::kPickle, {}},
               {"saved", torch_dist::MakeTorchBytesItem(hi), ObjectEncoding::kTorchSave, hi},
               {"config", text, ObjectEncoding::kJson, text}};
  }

  // This rank's part: tensors of one dimension or more split along dimension 0 over `ranks`
  // (the last rank takes the rest); 0-d tensors whole on every rank (rank 0 the main replica);
  // objects from rank 0 (the others hold replicas).
  StateDict Dict(int rank = 0, int ranks = 1) {
    StateDict state;
    for (const TensorSpec& s : specs) {
      uint8_t* data = values[s.key].data();
      if (s.shape.empty() || ranks == 1) {
        ShardedTensor t = ShardedTensor::Whole(s.key, TensorView(data, s.dtype, s.shape));
        if (rank > 0) t.replica_id = {rank};
        EXPECT_OK(state.Add(std::move(t)));
        continue;
      }
      const int64_t rows = s.shape[0];
      const int64_t begin = rows * rank / ranks, end = rows * (rank + 1) / ranks;
      Shape local = s.shape;
      local[0] = end - begin;
      const size_t row_bytes = rows ? values[s.key].size() / static_cast<size_t>(rows) : 0;
      std::vector<int64_t> offset(s.shape.size(), 0);
      offset[0] = begin;
      EXPECT_OK(state.Add(ShardedTensor::Shard(
          s.key, TensorView(data + begin * row_bytes, s.dtype, local), s.shape, offset)));
    }
    for (const Object& o : objects) {
      ShardedObject object{o.key, o.data, {}, o.encoding};
      if (rank > 0) object.replica_id = {rank};
      EXPECT_OK(state.Add(std::move(object)));
    }
    return state;
  }

  // What torch must load (load_dcp_with_torch.py's EXPECTED.json).
  json Expected(DcpFlavor flavor, const std::string& save_id) const {
    json out = {{"flavor", flavor == DcpFlavor::kTorch113 ? "1.13" : "2"},
                {"save_id", save_id},
                {"tensors", json::object()},
                {"objects", json::object()}};
    for (const TensorSpec& s : specs) {
      const std::vector<uint8_t>& v = values.at(s.key);
      out["tensors"][s.key] = {{"dtype", std::string(torch_dist::TorchDTypeOf(s.dtype).name)},
                               {"shape", s.shape},
                               {"hex", torch_dist::testing::Hex(v.data(), v.size())}};
    }
    for (const Object& o : objects) {
      out["objects"][o.key] =
          o.encoding == ObjectEncoding::kPickle
              ? json{{"value", kPickledValue}}
              : json{{"bytes_hex", torch_dist::testing::Hex(o.loaded.data(), o.loaded.size())}};
    }
    return out;
  }
};

void ExpectContent(const TestState& want, const DcpContent& got) {
  for (const TensorSpec& s : want.specs) {
    auto it = got.tensors.find(s.key);
    ASSERT_NE(it, got.tensors.end()) << s.key;
    EXPECT_EQ(it->second, want.values.at(s.key)) << s.key;
  }
  for (const TestState::Object& o : want.objects) {
    auto it = got.objects.find(o.key);
    ASSERT_NE(it, got.objects.end()) << o.key;
    ASSERT_TRUE(it->second.is_zip) << o.key;
    // The data.pkl torch.load unpickles: the object's pickle, or a pickled bytes object.
    EXPECT_EQ(it->second.data, o.encoding == ObjectEncoding::kPickle
                                   ? o.data
                                   : torch_dist::PickleBytesObject(o.loaded))
        << o.key;
  }
  EXPECT_EQ(got.tensors.size(), want.specs.size());
  EXPECT_EQ(got.objects.size(), want.objects.size());
}

SaveOptions DcpSaveOptions(TorchDistFlavor flavor, std::shared_ptr<Storage> storage) {
  SaveOptions o;
  o.format = CheckpointFormat::kTorchDist;
  o.format_options = TorchDistOptions{.flavor = flavor};
  o.storage = std::move(storage);
  return o;
}

DcpFlavor FlavorOf(TorchDistFlavor f) {
  return f == TorchDistFlavor::kTorch113 ? DcpFlavor::kTorch113 : DcpFlavor::kTorch2;
}

// Runs load_dcp_with_torch.py on `ckpt` against `expected`; its output in `output`.
int LoadWithTorch(const std::string& ckpt, const json& expected, int ranks, const TempDir& dir,
                  std::string* output) {
  const std::string expected_path = dir.Sub("expected.json");
  std::ofstream(expected_path) << expected.dump();
  const std::string script =
      std::string(TESSERA_SOURCE_DIR) + "/src/checkpoint/testdata/load_dcp_with_torch.py";
  return torch_dist::testing::RunCommand(
      std::string(TESSERA_PYTHON) + " " + torch_dist::testing::ShellQuote(script) + " " +
          torch_dist::testing::ShellQuote(ckpt) + " " +
          torch_dist::testing::ShellQuote(expected_path) + " --ranks " + std::to_string(ranks),
      output);
}

class DcpSaveTest : public ::testing::TestWithParam<TorchDistFlavor> {};

INSTANTIATE_TEST_SUITE_P(Flavors, DcpSaveTest,
                         ::testing::Values(TorchDistFlavor::kTorch2, TorchDistFlavor::kTorch113),
                         [](const auto& info) {
                           return info.param == TorchDistFlavor::kTorch2 ? "Torch2" : "Torch113";
                         });

TEST_P(DcpSaveTest, WritesTorchItemsAndTheMetadataOfItsFlavour) {
  auto memory = std::make_shared<MemoryStorage>();
  TestState state;
  SaveOptions o = DcpSaveOptions(GetParam(), memory);
  o.num_io_threads = 3;
  StateDict dict = state.Dict();
  ASSERT_OK_AND_ASSIGN(SaveReport report, Save(dict, "/ck", o));
  EXPECT_EQ(report.files_written, 3);

  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, memory->ListDir("/ck"));
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*memory, "/ck"));
  int data_files = 0;
  for (const std::string& name : names) {
    if (name == ".metadata") continue;
    ++data_files;
    EXPECT_EQ(torch_dist::DcpDataFileSaveId(name), report.save_id) << name;
    EXPECT_TRUE(name.starts_with("__0_")) << name;
  }
  EXPECT_EQ(data_files, 3) << "only data files and .metadata: the marker is gone";
  ExpectContent(state, got);

  const DcpMetadata& m = got.metadata;
  EXPECT_EQ(m.flavor, FlavorOf(GetParam()));
  ASSERT_EQ(m.tensors.size(), state.specs.size());
  EXPECT_EQ(m.tensors[0].fqn, "counts");  // in key order
  for (const torch_dist::DcpTensor& t : m.tensors) EXPECT_EQ(t.chunks.size(), 1u) << t.fqn;
  uint64_t item_bytes = 0, file_bytes = 0;
  for (const torch_dist::DcpStorage& s : m.storage) item_bytes += s.length;
  for (const std::string& name : names) {
    if (name != ".metadata") file_bytes += memory->GetFileContents("/ck/" + name)->size();
  }
  EXPECT_EQ(item_bytes, file_bytes) << "the items fill the data files";
  EXPECT_EQ(report.bytes_written, item_bytes);
  if (GetParam() == TorchDistFlavor::kTorch2) {
    EXPECT_EQ(m.version, "1.0.0");
    ASSERT_TRUE(m.storage_meta.has_value());
    EXPECT_EQ(m.storage_meta->save_id, report.save_id);
    EXPECT_EQ(m.storage_meta->checkpoint_id, "/ck");
    EXPECT_EQ(m.planner_data_kind, torch_dist::DcpPlannerData::kFlattenMapping);
    ASSERT_EQ(m.planner_data.size(), state.specs.size() + state.objects.size());
    EXPECT_EQ(m.planner_data[0].path, std::vector<torch_dist::DcpPathElement>{"counts"});
  } else {
    EXPECT_FALSE(m.version.has_value());
    EXPECT_FALSE(m.storage_meta.has_value());
    EXPECT_EQ(m.planner_data_kind, torch_dist::DcpPlannerData::kNone);
  }
}

TEST_P(DcpSaveTest, TorchLoadsItOnOneRank) {
  TempDir dir;
  TestState state;
  StateDict dict = state.Dict();
  const std::string ckpt = dir.Sub("ck");
  ASSERT_OK_AND_ASSIGN(SaveReport report, Save(dict, ckpt, DcpSaveOptions(GetParam(), nullptr)));
  std::string output;
  EXPECT_EQ(
      LoadWithTorch(ckpt, state.Expected(FlavorOf(GetParam()), report.save_id), 1, dir, &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("OK 1 rank(s): 7 tensors, 4 objects")) << output;

  // The checker notices a wrong value.
  json wrong = state.Expected(FlavorOf(GetParam()), report.save_id);
  wrong["objects"]["raw"]["bytes_hex"] = "00";
  output.clear();
  EXPECT_EQ(LoadWithTorch(ckpt, wrong, 1, dir, &output), 1) << output;
  EXPECT_THAT(output, HasSubstr("MISMATCH rank 0 rows: object raw")) << output;
}

// Saved by 2 tessera ranks (rows split, objects and 0-d tensors replicated, balance_writes),
// loaded by 2 torch processes into ShardedTensors split by rows (the same boxes) and by
// columns (different ones).
TEST_P(DcpSaveTest, TorchLoadsItShardedOverTwoGlooRanks) {
  TempDir dir;
  const std::string ckpt = dir.Sub("ck");
  std::vector<TestState> states(2);
  std::vector<std::string> save_ids(2);
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    StateDict dict = states[comm.rank()].Dict(comm.rank(), 2);
    SaveOptions o = DcpSaveOptions(GetParam(), nullptr);
    o.balance_writes = true;
    TESSERA_ASSIGN_OR_RETURN(SaveReport report, Save(dict, ckpt, comm, o));
    save_ids[comm.rank()] = report.save_id;
    return Status::Ok();
  });
  ASSERT_OK(FirstError(statuses));
  EXPECT_EQ(save_ids[0], save_ids[1]);
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*NewPosixStorage(), ckpt));
  ExpectContent(states[0], got);
  const torch_dist::DcpTensor& weight = got.metadata.tensors[3];
  ASSERT_EQ(weight.fqn, "layer.weight");
  ASSERT_EQ(weight.chunks.size(), 2u);  // one box per rank
  std::set<std::string> writers;
  for (const torch_dist::DcpStorage& s : got.metadata.storage) {
    writers.insert(s.relative_path.substr(0, 4));
  }
  EXPECT_EQ(writers, (std::set<std::string>{"__0_", "__1_"}));

  std::string output;
  EXPECT_EQ(
      LoadWithTorch(ckpt, states[0].Expected(FlavorOf(GetParam()), save_ids[0]), 2, dir, &output),
      0)
      << output;
  EXPECT_THAT(output, HasSubstr("OK 2 rank(s)")) << output;
}

TEST(DcpSaveOptionsTest, Torch2FlavourWritesTheNewerDtypesAndTorch113RefusesThem) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<uint8_t> f8(12, 0x38), u16(8, 7);
  auto make = [&] {
    StateDict state;
    EXPECT_OK(state.Add(ShardedTensor::Whole("f8", TensorView(f8.data(), DType::kF8E4M3, {3, 4}))));
    EXPECT_OK(state.Add(ShardedTensor::Whole("u16", TensorView(u16.data(), DType::kU16, {4}))));
    return state;
  };
  StateDict state = make();
  ASSERT_OK(Save(state, "/v2", DcpSaveOptions(TorchDistFlavor::kTorch2, memory)));
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*memory, "/v2"));
  EXPECT_EQ(got.metadata.tensors[0].torch_dtype, "float8_e4m3fn");
  EXPECT_EQ(got.tensors["f8"], f8);
  EXPECT_EQ(got.tensors["u16"], u16);

  Result<SaveReport> refused =
      Save(state, "/v113", DcpSaveOptions(TorchDistFlavor::kTorch113, memory));
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("key 'f8': torch 1.13 has no dtype float8"));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> left, memory->ListDir("/v113"));
  EXPECT_TRUE(left.empty()) << left.size() << " files left, first " << left[0];
}

TEST(DcpSaveOptionsTest, RefusesUserMetadataSafetensorsAndADirectoryHoldingATesseraCheckpoint) {
  auto memory = std::make_shared<MemoryStorage>();
  TestState state;
  StateDict dict = state.Dict();
  SaveOptions o = DcpSaveOptions(TorchDistFlavor::kTorch2, memory);
  o.user_metadata = {{"step", "10"}};
  Result<SaveReport> saved = Save(dict, "/a", o);
  EXPECT_EQ(saved.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(saved.status().message(), HasSubstr("user_metadata must be empty"));
  EXPECT_THAT(saved.status().message(), HasSubstr("key 'step'"));
  EXPECT_EQ(*memory->Stat("/a"), FileType::kNotFound);

  o.user_metadata.clear();
  o.format = CheckpointFormat::kSafetensors;
  saved = Save(dict, "/a", o);
  EXPECT_EQ(saved.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(saved.status().message(), HasSubstr("safetensors cannot be written"));

  SaveOptions tessera_format;
  tessera_format.storage = memory;
  ASSERT_OK(Save(dict, "/t", tessera_format));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> before, memory->ListDir("/t"));
  saved = Save(dict, "/t", DcpSaveOptions(TorchDistFlavor::kTorch2, memory));
  EXPECT_EQ(saved.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(saved.status().message(), HasSubstr("/t holds a tessera checkpoint"));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> after, memory->ListDir("/t"));
  EXPECT_EQ(before, after);
}

// A torch-written DCP directory: `__0_0.distcp` (one tensor item) and `.metadata` (1.13).
void PlantTorchCheckpoint(MemoryStorage& memory, const std::string& dir) {
  const std::vector<uint8_t> values(16, 1);
  Result<std::vector<uint8_t>> item =
      torch_dist::MakeTorchTensorItem({"float32", {4}, false}, values);
  ASSERT_OK(item);
  DcpMetadata m;
  m.flavor = DcpFlavor::kTorch113;
  m.tensors.push_back({"old", "float32", {4}, {{{0}, {4}}}});
  m.storage.push_back({"old", std::vector<int64_t>{0}, 0, "__0_0.distcp", 0, item->size()});
  ASSERT_OK(torch_dist::LinkDcpStorage(m, "planted"));
  Result<std::vector<uint8_t>> meta = torch_dist::EncodeDcpMetadata(m);
  ASSERT_OK(meta);
  memory.SetFileContents(dir + "/__0_0.distcp", *item);
  memory.SetFileContents(dir + "/.metadata", *meta);
  memory.SetFileContents(dir + "/.metadata.tmp", {1, 2, 3});  // torch's temporary name
}

TEST(DcpResaveTest, KeepsTorchsFilesAndRemovesOnlyTesseraFilesNoLiveSaveNeeds) {
  auto memory = std::make_shared<MemoryStorage>();
  PlantTorchCheckpoint(*memory, "/ck");
  // Left by a save that died (no marker), and by one still running (its marker, this process).
  const std::string dead = "0123456789abcdef", running = "fedcba9876543210";
  memory->SetFileContents("/ck/" + torch_dist::DcpDataFileName(dead, 3, 0), {1});
  memory->SetFileContents("/ck/" + torch_dist::TempDcpMetadataName(dead), {1});
  memory->SetFileContents("/ck/" + torch_dist::DcpDataFileName(running, 0, 0), {1});
  ASSERT_OK(CreateSaveMarker(*memory, "/ck", running, SyncPolicy::kNone));

  TestState g1(1), g2(2);
  StateDict d1 = g1.Dict(), d2 = g2.Dict();
  const SaveOptions o = DcpSaveOptions(TorchDistFlavor::kTorch2, memory);
  std::unique_ptr<Comm> comm = NewSingleRankComm();  // the plan cache lives with it
  ASSERT_OK_AND_ASSIGN(SaveReport first, Save(d1, "/ck", *comm, o));
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*memory, "/ck"));
  ExpectContent(g1, got);
  auto names = [&] {
    Result<std::vector<std::string>> n = memory->ListDir("/ck");
    return n.ok() ? std::set<std::string>(n->begin(), n->end()) : std::set<std::string>();
  };
  std::set<std::string> present = names();
  for (const std::string& kept : {std::string("__0_0.distcp"), std::string(".metadata.tmp"),
                                  torch_dist::DcpDataFileName(running, 0, 0)}) {
    EXPECT_TRUE(present.count(kept)) << kept;
  }
  EXPECT_FALSE(present.count(torch_dist::DcpDataFileName(dead, 3, 0)));
  EXPECT_FALSE(present.count(torch_dist::TempDcpMetadataName(dead)));

  // The second save (a plan cache hit) replaces the first; the first's files go.
  ASSERT_OK_AND_ASSIGN(SaveReport second, Save(d2, "/ck", *comm, o));
  EXPECT_TRUE(second.plan_cache_hit);
  EXPECT_NE(second.save_id, first.save_id);
  ASSERT_OK_AND_ASSIGN(got, ReadDcp(*memory, "/ck"));
  ExpectContent(g2, got);
  present = names();
  EXPECT_TRUE(present.count("__0_0.distcp"));
  for (const std::string& name : present) {
    EXPECT_NE(torch_dist::DcpDataFileSaveId(name), first.save_id) << name;
  }
}

// ---- crash consistency -------------------------------------------------------------------------

// Which generation of TestState the DCP checkpoint at `dir` holds, read with the format layer:
// -1 when it cannot be read, -2 when it reads as neither (torn).
int DcpGeneration(Storage& storage, const std::string& dir, Status* error) {
  Result<DcpContent> got = ReadDcp(storage, dir);
  *error = got.status();
  if (!got.ok()) return -1;
  for (int gen : {1, 2}) {
    TestState want(gen);
    bool same = got->tensors.size() == want.specs.size();
    for (const TensorSpec& s : want.specs) same = same && got->tensors[s.key] == want.values[s.key];
    for (const TestState::Object& o : want.objects) {
      const std::vector<uint8_t> pkl =
          o.encoding == ObjectEncoding::kPickle ? o.data : torch_dist::PickleBytesObject(o.loaded);
      same = same && got->objects.count(o.key) && got->objects[o.key].data == pkl;
    }
    if (same) return gen;
  }
  return -2;
}

// Saves generation 1 (torch_dist) into a fresh MemoryStorage, then generation 2 over it through
// a FaultInjectingStorage with `plan`.
struct DcpSaveOverExisting {
  std::shared_ptr<MemoryStorage> memory = std::make_shared<MemoryStorage>();
  std::shared_ptr<FaultInjectingStorage> faulty;
  Status first, second;

  explicit DcpSaveOverExisting(FaultPlan plan, SyncPolicy sync = SyncPolicy::kFull) {
    TestState g1(1), g2(2);
    StateDict d1 = g1.Dict(), d2 = g2.Dict();
    SaveOptions o = DcpSaveOptions(TorchDistFlavor::kTorch2, memory);
    o.sync = sync;
    o.num_io_threads = 2;
    first = Save(d1, "/ck", o).status();
    faulty = std::make_shared<FaultInjectingStorage>(memory, std::move(plan));
    o.storage = faulty;
    second = Save(d2, "/ck", o).status();
  }
};

// Every file of `dir` is `.metadata`, a file it references, a marker, or a tessera DCP file of a
// save whose marker is there (a save that may still be running).
void ExpectOnlyLiveFiles(MemoryStorage& memory, const std::string& dir) {
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, memory.ListDir(dir));
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(memory, dir));
  std::set<std::string> live, markers;
  for (const torch_dist::DcpStorage& s : got.metadata.storage) live.insert(s.relative_path);
  for (const std::string& name : names) {
    if (name.starts_with("tessera.saving.")) markers.insert(name.substr(15));
  }
  for (const std::string& name : names) {
    if (name == ".metadata" || live.count(name) || name.starts_with("tessera.saving.")) continue;
    std::string id = torch_dist::DcpDataFileSaveId(name);
    if (id.empty()) id = torch_dist::TempDcpMetadataSaveId(name);
    EXPECT_TRUE(!id.empty() && markers.count(id)) << "stale file " << name;
  }
}

TEST(DcpCrashConsistencyTest, CrashAtEveryStepOfASaveOverAnExistingCheckpoint) {
  DcpSaveOverExisting clean{FaultPlan{}};
  ASSERT_OK(clean.first);
  ASSERT_OK(clean.second);
  const int64_t total_ops = clean.faulty->operation_count();
  ASSERT_GT(total_ops, 10);
  int old_seen = 0, new_seen = 0;
  for (int64_t n = 0; n <= total_ops; ++n) {
    SCOPED_TRACE("crash at operation " + std::to_string(n));
    DcpSaveOverExisting run{FaultPlan{.fail_at = n, .crash = true, .path_filter = ""}};
    ASSERT_OK(run.first);
    run.memory->SimulateCrash();
    Status error;
    const int gen = DcpGeneration(*run.memory, "/ck", &error);
    ASSERT_TRUE(gen == 1 || gen == 2) << "generation " << gen << ": " << error.ToString();
    if (run.second.ok()) {
      EXPECT_EQ(gen, 2) << "a save that reported success must be durable";
    }
    (gen == 1 ? old_seen : new_seen)++;
    // After the crash a new save succeeds.
    TestState g1(1);
    StateDict d1 = g1.Dict();
    ASSERT_OK(Save(d1, "/ck", DcpSaveOptions(TorchDistFlavor::kTorch2, run.memory)));
    EXPECT_EQ(DcpGeneration(*run.memory, "/ck", &error), 1) << error.ToString();
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

TEST(DcpCrashConsistencyTest, FailureAtEveryStepLeavesTheOldCheckpointOrTheNew) {
  int64_t n = 0;
  for (;; ++n) {
    SCOPED_TRACE("failure at operation " + std::to_string(n));
    DcpSaveOverExisting run{FaultPlan{.fail_at = n, .crash = false, .path_filter = ""}};
    ASSERT_OK(run.first);
    Status error;
    const int gen = DcpGeneration(*run.memory, "/ck", &error);
    if (run.second.ok()) {
      if (!run.faulty->fault_fired()) break;  // past the last operation
      EXPECT_EQ(gen, 2);
    } else {
      EXPECT_THAT(run.second.message(), HasSubstr("injected fault"));
      EXPECT_TRUE(gen == 1 || gen == 2) << error.ToString();
    }
    // A later save leaves only what the checkpoint or a possibly running save needs.
    TestState g2(2);
    StateDict d2 = g2.Dict();
    ASSERT_OK(Save(d2, "/ck", DcpSaveOptions(TorchDistFlavor::kTorch2, run.memory)));
    ExpectOnlyLiveFiles(*run.memory, "/ck");
  }
  EXPECT_GT(n, 10);
}

TEST(DcpCrashConsistencyTest, CrashDuringAFirstSaveLeavesNoCheckpoint) {
  for (int64_t n : {2, 5, 8}) {
    auto memory = std::make_shared<MemoryStorage>();
    TestState g1(1);
    StateDict d1 = g1.Dict();
    SaveOptions o = DcpSaveOptions(
        TorchDistFlavor::kTorch2,
        std::make_shared<FaultInjectingStorage>(memory, FaultPlan{.fail_at = n, .crash = true}));
    EXPECT_FALSE(Save(d1, "/ck", o).ok());
    memory->SimulateCrash();
    Status error;
    EXPECT_EQ(DcpGeneration(*memory, "/ck", &error), -1);
  }
}

// ---- Convert to torch_dist --------------------------------------------------------------------

// Adds "large": 700 x 500 F32 (1.4 MB: six 256 KiB CRC blocks, two 1 MiB conversion units).
void AddLargeTensor(TestState& state) {
  state.specs.push_back({"large", DType::kF32, {700, 500}});
  std::vector<uint8_t>& v = state.values["large"];
  v.resize(700 * 500 * 4);
  for (size_t i = 0; i < 700 * 500; ++i) {
    const float f = static_cast<float>(i) * 0.25f - 1000.0f;
    std::memcpy(v.data() + i * 4, &f, 4);
  }
}

class DcpConvertTest : public ::testing::TestWithParam<TorchDistFlavor> {};

INSTANTIATE_TEST_SUITE_P(Flavors, DcpConvertTest,
                         ::testing::Values(TorchDistFlavor::kTorch2, TorchDistFlavor::kTorch113),
                         [](const auto& info) {
                           return info.param == TorchDistFlavor::kTorch2 ? "Torch2" : "Torch113";
                         });

// A tessera checkpoint saved by 2 ranks (rows split), converted to torch_dist by 2 ranks with 3
// threads each, small files and the smallest units (the large tensor's blocks and units are
// written by different threads): tessera's codecs read back every value and CRC-32; torch
// 1.13's DCP loads it on one rank and sharded over 2 gloo ranks.
TEST_P(DcpConvertTest, TesseraCheckpointConvertsToWhatTorchLoads) {
  TempDir dir;
  const std::string src = dir.Sub("src"), dst = dir.Sub("out/dcp");
  TestState state;
  AddLargeTensor(state);
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    StateDict dict = state.Dict(comm.rank(), 2);
    return Save(dict, src, comm).status();
  })));
  ConvertOptions options;
  options.to = CheckpointFormat::kTorchDist;
  options.format_options = TorchDistOptions{.flavor = GetParam()};
  options.num_threads = 3;
  options.buffer_bytes = 1 << 20;    // units of 1 MiB, the least
  options.max_file_bytes = 1 << 20;  // several files: "large" alone in one
  std::vector<ConvertReport> reports(2);
  std::vector<std::pair<uint64_t, uint64_t>> last_progress(2);
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    ConvertOptions mine = options;
    mine.progress = [&, r = comm.rank()](uint64_t done, uint64_t total) {
      last_progress[r] = {done, total};
    };
    TESSERA_ASSIGN_OR_RETURN(reports[comm.rank()], Convert(src, dst, mine, comm));
    return Status::Ok();
  })));
  const ConvertReport& report = reports[0];
  EXPECT_EQ(report.tensors, state.specs.size());
  EXPECT_EQ(report.objects, state.objects.size());
  ASSERT_GE(report.files.size(), 3u);
  EXPECT_EQ(report.files.back(), ".metadata");
  EXPECT_GT(reports[0].files_written, 0);
  EXPECT_GT(reports[1].files_written, 0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(last_progress[r].first, last_progress[r].second) << "rank " << r;
    EXPECT_EQ(last_progress[r].first, reports[r].bytes_written) << "rank " << r;
  }
  const std::string save_id = torch_dist::DcpDataFileSaveId(report.files[0]);
  ASSERT_FALSE(save_id.empty()) << report.files[0];
  std::vector<std::string> listed;
  for (const auto& entry : std::filesystem::directory_iterator(dst)) {
    listed.push_back(entry.path().filename().string());
  }
  std::sort(listed.begin(), listed.end());
  std::vector<std::string> expected_files = report.files;
  std::sort(expected_files.begin(), expected_files.end());
  EXPECT_EQ(listed, expected_files) << "nothing but the data files and .metadata";
  std::vector<std::string> beside;
  for (const auto& entry : std::filesystem::directory_iterator(dir.Sub("out"))) {
    beside.push_back(entry.path().filename().string());
  }
  EXPECT_EQ(beside, std::vector<std::string>{"dcp"}) << "the temporary directory was renamed";

  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*NewPosixStorage(), dst));
  ExpectContent(state, got);
  EXPECT_EQ(got.metadata.flavor, FlavorOf(GetParam()));
  for (const torch_dist::DcpTensor& t : got.metadata.tensors) {
    EXPECT_EQ(t.chunks.size(), 1u) << t.fqn << " is written whole";
  }
  if (GetParam() == TorchDistFlavor::kTorch2) {
    ASSERT_TRUE(got.metadata.storage_meta.has_value());
    EXPECT_EQ(got.metadata.storage_meta->checkpoint_id, dst) << "not the temporary name";
  }

  const json expected = state.Expected(FlavorOf(GetParam()), save_id);
  for (int ranks : {1, 2}) {
    std::string output;
    EXPECT_EQ(LoadWithTorch(dst, expected, ranks, dir, &output), 0) << output;
    EXPECT_THAT(output, HasSubstr("OK " + std::to_string(ranks) + " rank(s): 8 tensors, 4 objects"))
        << output;
  }
}

TEST(DcpConvertOptionsTest, Torch113RefusesItsMissingDtypesBeforeWritingAndConvertsDtypes) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<uint8_t> f8(12, 0x38);
  std::vector<float> f32 = {1.0f, -2.5f, 3.0e-3f, 65536.0f};
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("f8", TensorView(f8.data(), DType::kF8E4M3, {3, 4}))));
  ASSERT_OK(state.Add(ShardedTensor::Whole("w", TensorView(f32.data(), DType::kF32, {4}))));
  SaveOptions save;
  save.storage = memory;
  ASSERT_OK(Save(state, "/src", save));
  ConvertOptions options;
  options.to = CheckpointFormat::kTorchDist;
  options.format_options = TorchDistOptions{.flavor = TorchDistFlavor::kTorch113};
  options.storage = memory;
  Status status = Convert("/src", "/dst", options).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::AllOf(HasSubstr("'f8'"), HasSubstr("torch 1.13"),
                                                 HasSubstr("float8_e4m3fn")));
  ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat("/dst"));
  EXPECT_EQ(type, FileType::kNotFound);
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> root, memory->ListDir("/"));
  EXPECT_EQ(root, std::vector<std::string>{"src"}) << "no temporary directory either";

  // torch 2.x has float8; --dtype bf16 converts the float32 tensor (float8 keeps its dtype).
  options.format_options = TorchDistOptions{};  // torch 2.x
  options.dtype = DType::kBF16;
  ASSERT_OK(Convert("/src", "/dst", options).status());
  ASSERT_OK_AND_ASSIGN(DcpContent got, ReadDcp(*memory, "/dst"));
  EXPECT_EQ(got.tensors["f8"], f8);
  std::vector<uint8_t> bf16(8);
  ConvertFloats(DType::kF32, f32.data(), DType::kBF16, bf16.data(), 4);
  EXPECT_EQ(got.tensors["w"], bf16);
  EXPECT_EQ(got.metadata.tensors[1].torch_dtype, "bfloat16");
}

// format_options holds the options of the format written; the deprecated torch_dist_flavor
// and torch_dist_key_paths still work alone, and beside TorchDistOptions are refused by name;
// options of another format are refused, never ignored. Nothing is written when refused.
TEST(FormatOptionsTest, TorchDistOptionsGoWithTorchDistAndTheDeprecatedFieldsStillWork) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<float> w = {1.0f, 2.0f, 3.0f};
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("w", TensorView(w.data(), DType::kF32, {3}))));
  auto option_named = [](const Status& status, const std::string& option) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    ASSERT_NE(status.detail(), nullptr) << status.ToString();
    EXPECT_EQ(status.detail()->kind, StatusDetail::Kind::kBadOption);
    EXPECT_EQ(status.detail()->options.at(0), option);
  };

  // The new field, then the deprecated one alone: each writes torch 1.13's class paths.
  SaveOptions save = DcpSaveOptions(TorchDistFlavor::kTorch113, memory);
  save.format_options = TorchDistOptions{.flavor = TorchDistFlavor::kTorch113};
  ASSERT_OK(Save(state, "/new", save));
  save.format_options = {};
  save.torch_dist_flavor = TorchDistFlavor::kTorch113;
  ASSERT_OK(Save(state, "/old", save));
  for (const char* dir : {"/new", "/old"}) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                         memory->GetFileContents(std::string(dir) + "/.metadata"));
    const std::string text(bytes.begin(), bytes.end());
    EXPECT_NE(text.find("torch.distributed._shard.checkpoint"), std::string::npos) << dir;
  }

  // Both: refused, naming the deprecated field; nothing written.
  save.format_options = TorchDistOptions{};
  option_named(Save(state, "/both", save).status(), "SaveOptions::torch_dist_flavor");
  save.torch_dist_flavor = TorchDistFlavor::kTorch2;
  save.torch_dist_key_paths = {{"w", {std::string("w")}}};
  option_named(Save(state, "/both", save).status(), "SaveOptions::torch_dist_key_paths");
  // TorchDistOptions with another format: refused, naming format_options.
  save = SaveOptions{};
  save.storage = memory;
  save.format_options = TorchDistOptions{};
  const Status tessera = Save(state, "/tessera", save).status();
  option_named(tessera, "SaveOptions::format_options");
  EXPECT_THAT(tessera.message(), HasSubstr("holds TorchDistOptions, options the format tessera "
                                           "does not take"));
  save.collective = false;
  save.save_tag = "one";
  option_named(Save(state, "/tessera", save).status(), "SaveOptions::format_options");
  for (const char* dir : {"/both", "/tessera"}) {
    ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat(dir));
    EXPECT_EQ(type, FileType::kNotFound) << dir;
  }

  // Convert: the same rules, before anything is written.
  ConvertOptions convert;
  convert.storage = memory;
  convert.format_options = TorchDistOptions{};
  for (CheckpointFormat to : {CheckpointFormat::kSafetensors, CheckpointFormat::kTessera}) {
    convert.to = to;
    option_named(Convert("/new", "/converted", convert).status(), "ConvertOptions::format_options");
  }
  convert.to = CheckpointFormat::kTorchDist;
  convert.torch_dist_flavor = TorchDistFlavor::kTorch113;
  option_named(Convert("/new", "/converted", convert).status(),
               "ConvertOptions::torch_dist_flavor");
  ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat("/converted"));
  EXPECT_EQ(type, FileType::kNotFound);
  convert.format_options = {};  // the deprecated field alone
  ASSERT_OK(Convert("/new", "/converted", convert).status());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, memory->GetFileContents("/converted/.metadata"));
  EXPECT_NE(std::string(bytes.begin(), bytes.end()).find("torch.distributed._shard.checkpoint"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera
