// Tests of the DCP .metadata reader and writer (dcp_metadata.h) against files written by real
// torch 1.13, torch 2.x's classes (stand-ins), Megatron-Core's, and against torch 1.13's own
// loader reading what tessera writes.
#include "format/torch_dist/dcp_metadata.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/crc32.h"
#include "format/torch_dist/pickle_writer.h"
#include "format/torch_dist/test_util.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"
#include "testing/test_util.h"

namespace tessera::torch_dist {
namespace {

using ::testing::HasSubstr;
using testing::ReadFileBytes;
using testing::TestdataDir;
using json = nlohmann::json;

// DcpMetadata in the JSON shape of make_fixtures.py's describe_metadata, so the expectations
// Python computed and what tessera read (or what Python reads back from tessera) compare directly.
json ToJson(const DcpMetadata& m) {
  json j;
  j["tensors"] = json::array();
  for (const DcpTensor& t : m.tensors) {
    json chunks = json::array();
    for (const DcpChunk& c : t.chunks) chunks.push_back({c.offsets, c.sizes});
    j["tensors"].push_back({{"fqn", t.fqn},
                            {"dtype", t.torch_dtype},
                            {"size", t.size},
                            {"requires_grad", t.requires_grad},
                            {"pin_memory", t.pin_memory},
                            {"memory_format", static_cast<int>(t.memory_format)},
                            {"chunks", chunks}});
  }
  j["bytes"] = json::array();
  for (const DcpBytes& b : m.bytes) j["bytes"].push_back(b.fqn);
  j["storage"] = json::array();
  for (const DcpStorage& s : m.storage) {
    j["storage"].push_back({{"fqn", s.fqn},
                            {"offset", s.offset ? json(*s.offset) : json(nullptr)},
                            {"index", s.index ? json(*s.index) : json(nullptr)},
                            {"relative_path", s.relative_path},
                            {"offset_in_file", s.offset_in_file},
                            {"length", s.length}});
  }
  j["version"] = m.version ? json(*m.version) : json(nullptr);
  j["flavor"] = m.flavor == DcpFlavor::kTorch113 ? "1.13" : "2";
  j["megatron"] = m.megatron_metadata_class;
  j["all_local_plans"] = m.has_all_local_plans;
  if (m.planner_data_kind == DcpPlannerData::kNone) {
    j["planner_data"] = nullptr;
  } else if (m.planner_data_kind == DcpPlannerData::kOther) {
    j["planner_data"] = "other";
  } else {
    j["planner_data"] = json::object();
    for (const DcpPlannerPath& p : m.planner_data) {
      json path = json::array();
      for (const DcpPathElement& e : p.path) {
        if (const std::string* s = std::get_if<std::string>(&e)) {
          path.push_back(*s);
        } else {
          path.push_back(std::get<int64_t>(e));
        }
      }
      j["planner_data"][p.fqn] = path;
    }
  }
  if (!m.storage_meta) {
    j["storage_meta"] = nullptr;
  } else {
    auto opt = [](const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); };
    j["storage_meta"] = {{"checkpoint_id", opt(m.storage_meta->checkpoint_id)},
                         {"save_id", opt(m.storage_meta->save_id)},
                         {"load_id", opt(m.storage_meta->load_id)},
                         {"modules", m.storage_meta->modules}};
  }
  if (!m.has_mcore_data) {
    j["mcore_data"] = nullptr;
  } else {
    j["mcore_data"] = json::object();
    for (const DcpMcoreEntry& e : m.mcore_data) {
      j["mcore_data"][e.key] = e.nd_reformulated_orig_global_shape
                                   ? json(*e.nd_reformulated_orig_global_shape)
                                   : json(nullptr);
    }
  }
  return j;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// Every chunk and bytes item is linked to the storage entry with its fqn (and offsets).
void ExpectLinked(const DcpMetadata& m) {
  for (const DcpTensor& t : m.tensors) {
    for (const DcpChunk& c : t.chunks) {
      ASSERT_LT(c.storage, m.storage.size()) << t.fqn;
      EXPECT_EQ(m.storage[c.storage].fqn, t.fqn);
      EXPECT_EQ(m.storage[c.storage].offset, c.offsets);
    }
  }
  for (const DcpBytes& b : m.bytes) {
    ASSERT_LT(b.storage, m.storage.size()) << b.fqn;
    EXPECT_EQ(m.storage[b.storage].fqn, b.fqn);
    EXPECT_FALSE(m.storage[b.storage].offset.has_value());
  }
}

TEST(DcpMetadataTest, ReadsEveryFixture) {
  const std::string dir = TestdataDir() + "/metadata";
  const json expected = ReadJson(dir + "/expected.json");
  ASSERT_GE(expected.size(), 19u);
  for (const auto& [name, want] : expected.items()) {
    SCOPED_TRACE(name);
    const std::string path = dir + "/" + name + ".metadata";
    const std::vector<uint8_t> bytes = ReadFileBytes(path);
    ASSERT_FALSE(bytes.empty());
    Result<DcpMetadata> m = ReadDcpMetadata(bytes, path);
    if (want.contains("error")) {
      ASSERT_FALSE(m.ok());
      EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
      EXPECT_THAT(m.status().message(), HasSubstr(want["error"].get<std::string>()));
      EXPECT_THAT(m.status().message(), HasSubstr(path));
      continue;
    }
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(ToJson(*m), want) << ToJson(*m).dump();
    ExpectLinked(*m);
  }
}

TEST(DcpMetadataTest, TorchWritesWhatTheStructSays) {
  // The 1.13 fixture in detail: the transposed view is one chunk of its global size, and the
  // object and bytes values are BytesStorageMetadata.
  const std::string path = TestdataDir() + "/dcp113/files/.metadata";
  ASSERT_OK_AND_ASSIGN(DcpMetadata m, ReadDcpMetadata(ReadFileBytes(path), path));
  EXPECT_EQ(m.flavor, DcpFlavor::kTorch113);
  ASSERT_EQ(m.tensors.size(), 6u);
  EXPECT_EQ(m.tensors[0].fqn, "w");
  EXPECT_EQ(m.tensors[0].torch_dtype, "float32");
  EXPECT_EQ(m.tensors[0].size, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(m.tensors[2].fqn, "t");
  EXPECT_EQ(m.tensors[2].size, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(m.tensors[3].size, std::vector<int64_t>{});  // 0-d
  EXPECT_EQ(m.tensors[3].chunks.size(), 1u);
  ASSERT_EQ(m.bytes.size(), 2u);
  EXPECT_EQ(m.bytes[0].fqn, "step");
  EXPECT_EQ(m.storage[m.bytes[1].storage].relative_path, "__0_7.distcp");
}

TEST(DcpMetadataTest, MissingAndWrongAttributesAreNamed) {
  // Built with the writer, then edited: the errors name the attribute path and the class.
  DcpMetadata m;
  m.flavor = DcpFlavor::kTorch113;
  DcpTensor t;
  t.fqn = "layer.w";
  t.torch_dtype = "float32";
  t.size = {4};
  t.chunks = {{{0}, {4}, kNoDcpStorage}};
  m.tensors.push_back(t);
  m.storage.push_back({"layer.w", std::vector<int64_t>{0}, 0, "__0_0.distcp", 0, 100});
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, EncodeDcpMetadata(m));
  auto replace = [&](std::string_view from, std::string_view to) {
    std::string s(bytes.begin(), bytes.end());
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  // "sizes" -> "sizez" (same length): ChunkStorageMetadata lacks sizes.
  Result<DcpMetadata> r = ReadDcpMetadata(replace("sizes", "sizez"), "/c/.metadata");
  EXPECT_THAT(r.status().message(),
              HasSubstr("/c/.metadata: state_dict_metadata['layer.w']: chunks[0]: missing "
                        "attribute 'sizes' of ChunkStorageMetadata"));
  // A dtype torch has but tessera does not read.
  r = ReadDcpMetadata(replace("float32", "qint8\x94\x93"), "/c/.metadata");
  EXPECT_FALSE(r.ok());
  // The root is not a Metadata.
  r = ReadDcpMetadata(replace("\x08Metadata", "\x08Metadatx"), "/c/.metadata");
  EXPECT_THAT(r.status().message(), HasSubstr("not a DCP Metadata"));
  // A non-strided layout.
  r = ReadDcpMetadata(replace("torch.strided", "torch.sparse_"), "/c/.metadata");
  EXPECT_THAT(r.status().message(), HasSubstr("is not supported (only torch.strided)"));
  // The writer's output itself reads back.
  ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(bytes, "/c/.metadata"));
  m.tensors[0].chunks[0].storage = 0;
  EXPECT_EQ(back, m);
}

TEST(DcpMetadataTest, LinkErrors) {
  DcpMetadata m;
  DcpTensor t;
  t.fqn = "w";
  t.torch_dtype = "bfloat16";
  t.size = {4, 4};
  t.chunks = {{{0, 0}, {2, 4}, kNoDcpStorage}, {{2, 0}, {2, 4}, kNoDcpStorage}};
  m.tensors.push_back(t);
  m.bytes.push_back({"obj", kNoDcpStorage});
  m.storage = {{"w", std::vector<int64_t>{2, 0}, 0, "a", 0, 1},  // wrong hint: found by offsets
               {"w", std::vector<int64_t>{0, 0}, 7, "a", 1, 1},
               {"obj", std::nullopt, std::nullopt, "b", 0, 1}};
  ASSERT_OK(LinkDcpStorage(m, "src"));
  EXPECT_EQ(m.tensors[0].chunks[0].storage, 1u);
  EXPECT_EQ(m.tensors[0].chunks[1].storage, 0u);
  EXPECT_EQ(m.bytes[0].storage, 2u);

  struct Case {
    std::function<void(DcpMetadata&)> edit;
    const char* message;
  };
  const Case cases[] = {
      {[](DcpMetadata& x) { x.storage.pop_back(); }, "bytes item 'obj' has no storage_data entry"},
      {[](DcpMetadata& x) { x.storage[0].fqn = "v"; }, "names 'v', which is not in"},
      {[](DcpMetadata& x) {
         x.storage[0].offset = {1, 0};
       },
       "at offset (1, 0) matches no chunk"},
      {[](DcpMetadata& x) {
         x.storage[0].offset = {0, 0};
       },
       "two storage_data entries for 'w'"},
      {[](DcpMetadata& x) { x.storage[0].offset.reset(); }, "tensor 'w' has no offset"},
      {[](DcpMetadata& x) { x.storage[2].offset = std::vector<int64_t>{}; },
       "bytes item 'obj' has an offset"},
      {[](DcpMetadata& x) {
         x.tensors[0].chunks[1].sizes = {3, 4};
       },
       "is not inside the tensor"},
      {[](DcpMetadata& x) { x.tensors[0].chunks[1].sizes = {2}; }, "do not match the tensor's 2"},
      {[](DcpMetadata& x) { x.bytes[0].fqn = "w"; }, "fqn 'w' appears twice"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    DcpMetadata x = m;
    c.edit(x);
    Status s = LinkDcpStorage(x, "src");
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_THAT(s.message(), ::testing::StartsWith("src: "));
    EXPECT_FALSE(EncodeDcpMetadata(x).ok());
  }
}

// A random metadata with consistent storage (seeded; the seed is in the failure message).
DcpMetadata RandomMetadata(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  const char* dtypes[] = {"float32", "bfloat16", "float16",       "int64",
                          "bool",    "uint8",    "float8_e4m3fn", "complex64"};
  DcpMetadata m;
  m.flavor = pick(2) ? DcpFlavor::kTorch2 : DcpFlavor::kTorch113;
  const int n_tensors = static_cast<int>(pick(6));
  for (int i = 0; i < n_tensors; ++i) {
    DcpTensor t;
    t.fqn = "model.layers." + std::to_string(i) + (pick(2) ? ".weight" : ".é");
    t.torch_dtype = dtypes[pick(8)];
    t.requires_grad = pick(2);
    t.pin_memory = pick(2);
    t.memory_format = static_cast<DcpMemoryFormat>(pick(3));
    const int rank = static_cast<int>(pick(5));
    for (int d = 0; d < rank; ++d) t.size.push_back(pick(2) ? pick(5) : pick(int64_t{1} << 40));
    // Chunks: split dim 0 (if any) into pieces.
    const int64_t rows = rank ? t.size[0] : 1;
    int64_t at = 0;
    while (at < rows || (rows == 0 && t.chunks.empty())) {
      DcpChunk c;
      const int64_t n = rows == 0 ? 0 : 1 + pick(rows - at);
      for (int d = 0; d < rank; ++d) {
        c.offsets.push_back(d == 0 ? at : 0);
        c.sizes.push_back(d == 0 ? n : t.size[d]);
      }
      t.chunks.push_back(c);
      at += std::max<int64_t>(n, 1);
    }
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      DcpStorage s;
      s.fqn = t.fqn;
      s.offset = t.chunks[c].offsets;
      s.index = pick(3) ? std::optional<int64_t>(static_cast<int64_t>(c)) : std::nullopt;
      s.relative_path = "__" + std::to_string(pick(3)) + "_0.distcp";
      s.offset_in_file = static_cast<uint64_t>(pick(int64_t{1} << 50));
      s.length = static_cast<uint64_t>(pick(int64_t{1} << 40));
      m.storage.push_back(s);
    }
    m.tensors.push_back(std::move(t));
  }
  for (int i = 0; i < pick(3); ++i) {
    m.bytes.push_back({"optimizer.step" + std::to_string(i), kNoDcpStorage});
    m.storage.push_back({"optimizer.step" + std::to_string(i), std::nullopt, std::nullopt,
                         "__0_0.distcp", static_cast<uint64_t>(pick(1000)), 431});
  }
  std::shuffle(m.storage.begin(), m.storage.end(), rng);
  if (pick(2)) {
    m.planner_data_kind = DcpPlannerData::kFlattenMapping;
    for (const DcpTensor& t : m.tensors) {
      DcpPlannerPath p{t.fqn, {}};
      for (int k = 0; k < pick(6); ++k) {
        p.path.push_back(pick(2) ? DcpPathElement(std::string("k") + std::to_string(k))
                                 : DcpPathElement(pick(100) - 50));
      }
      m.planner_data.push_back(p);
    }
  }
  if (m.flavor == DcpFlavor::kTorch2) {
    if (pick(2)) m.version = "1.0.0";
    if (pick(2)) m.storage_meta = DcpStorageMeta{"/ckpt", "id-" + std::to_string(seed), {}, {"m"}};
  }
  if (pick(2)) {
    m.has_mcore_data = true;
    for (const DcpTensor& t : m.tensors) {
      DcpMcoreEntry e{t.fqn, std::nullopt};
      if (pick(2)) e.nd_reformulated_orig_global_shape = std::vector<int64_t>{pick(9), pick(9)};
      m.mcore_data.push_back(e);
    }
  }
  EXPECT_OK(LinkDcpStorage(m, "random"));
  return m;
}

TEST(DcpMetadataTest, RoundTripOfRandomMetadata) {
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const DcpMetadata m = RandomMetadata(seed);
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, EncodeDcpMetadata(m));
    ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(bytes, "roundtrip"));
    ASSERT_EQ(back, m) << ToJson(back).dump() << "\n" << ToJson(m).dump();
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> again, EncodeDcpMetadata(back));
    EXPECT_EQ(again, bytes);  // deterministic
  }
}

TEST(DcpMetadataTest, WriterRefusesWhatTheFlavourCannotHold) {
  DcpMetadata m;
  m.flavor = DcpFlavor::kTorch113;
  m.version = "1.0.0";
  EXPECT_THAT(EncodeDcpMetadata(m).status().message(), HasSubstr("no version or storage_meta"));
  m.flavor = DcpFlavor::kTorch2;
  m.planner_data_kind = DcpPlannerData::kOther;
  EXPECT_THAT(EncodeDcpMetadata(m).status().message(), HasSubstr("planner_data"));
}

TEST(DcpMetadataTest, ManyChunksStayCompact) {
  // 100000 chunks of one tensor in 100 files: a few tens of bytes per chunk, like torch's own.
  DcpMetadata m;
  DcpTensor t;
  t.fqn = "decoder.layers.mlp.linear_fc1.weight";
  t.torch_dtype = "bfloat16";
  const int64_t n = 100000;
  t.size = {n * 8, 4096};
  for (int64_t i = 0; i < n; ++i) {
    t.chunks.push_back({{i * 8, 0}, {8, 4096}, kNoDcpStorage});
    m.storage.push_back({t.fqn, std::vector<int64_t>{i * 8, 0}, i,
                         "__" + std::to_string(i % 100) + "_0.distcp",
                         static_cast<uint64_t>(i / 100) * 66496, 66496});
  }
  m.tensors.push_back(t);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, EncodeDcpMetadata(m));
  EXPECT_LT(bytes.size(), static_cast<size_t>(n) * 160) << bytes.size() / n << " bytes per chunk";
  ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(bytes, "big"));
  EXPECT_EQ(back.tensors[0].chunks.size(), static_cast<size_t>(n));
  EXPECT_EQ(back.tensors[0].chunks[n - 1].storage, static_cast<size_t>(n - 1));
}

// ---- memo references (issue 22, defect 6) -------------------------------------------------------

// A torch 2.x .metadata whose state_dict_metadata maps `tensors` keys to ONE
// TensorStorageMetadata (a memo reference each) holding `chunks` chunks, and whose storage_data
// is empty. Python would unpickle it into one shared object; read as plain structs, every key
// would copy the chunks: `tensors` * `chunks` of them from a file of a few bytes per key.
std::vector<uint8_t> SharedChunkListMetadata(int tensors, int chunks) {
  constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata";
  PickleWriter w(4);
  auto object = [&](std::string_view name, auto&& fields) {
    w.GlobalMemo(kMeta, name);
    w.EmptyTuple();
    w.NewObj();
    w.EmptyDict();
    w.Mark();
    fields();
    w.SetItems();
    w.Build();
  };
  auto size = [&](std::vector<int64_t> v) {
    w.GlobalMemo("torch", "Size");
    w.IntTuple(v);
    w.Tuple1();
    w.Reduce();
  };
  object("Metadata", [&] {
    w.StrMemo("state_dict_metadata");
    w.EmptyDict();
    uint32_t shared = 0;
    for (int i = 0; i < tensors; ++i) {
      if (i % 1000 == 0) w.Mark();
      w.Str("t" + std::to_string(i));
      if (i > 0) {
        w.Get(shared);
      } else {
        object("TensorStorageMetadata", [&] {
          w.StrMemo("properties");
          w.GlobalMemo(kMeta, "TensorProperties");
          w.EmptyTuple();
          w.NewObj();
          w.Mark();
          w.GlobalMemo("torch", "float32");
          w.GlobalMemo("torch", "strided");
          w.Bool(false);
          w.GlobalMemo(kMeta, "_MEM_FORMAT_ENCODING");
          w.Int(0);
          w.Tuple1();
          w.Reduce();
          w.Bool(false);
          w.Tuple();
          w.Build();
          w.StrMemo("size");
          size({chunks, 4});
          w.StrMemo("chunks");
          w.EmptyList();
          w.Mark();
          for (int c = 0; c < chunks; ++c) {
            object("ChunkStorageMetadata", [&] {
              w.StrMemo("offsets");
              size({c, 0});
              w.StrMemo("sizes");
              size({1, 4});
            });
          }
          w.Appends();
        });
        shared = w.Memoize();
      }
      if (i % 1000 == 999 || i == tensors - 1) w.SetItems();
    }
    w.StrMemo("storage_data");
    w.EmptyDict();
  });
  w.Stop();
  return w.Take();
}

TEST(DcpMetadataTest, MemoReferencesDoNotExpandWithoutBound) {
  // 2,000 references to a tensor of 2,000 chunks: ~60 KB that would become 4 million chunks
  // (~500 MB) before this reader bounded what it copies by the size of its input.
  const std::vector<uint8_t> bytes = SharedChunkListMetadata(2000, 2000);
  ASSERT_LT(bytes.size(), 100u << 10);
  const Result<DcpMetadata> m = ReadDcpMetadata(bytes, "ckpt/.metadata");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("ckpt/.metadata: "));
  EXPECT_THAT(m.status().message(), HasSubstr("state_dict_metadata['t"));
  EXPECT_THAT(m.status().message(), HasSubstr("expand to more than"));
  EXPECT_THAT(m.status().message(), HasSubstr("at offset "));
  EXPECT_THAT(m.status().message(), HasSubstr("referenced again and again"));
  // A few references are what real files hold (a shared TensorProperties, the fqn strings):
  // they read, and fail later for what is really wrong (no storage_data entries here).
  const Result<DcpMetadata> few = ReadDcpMetadata(SharedChunkListMetadata(3, 2000), "few");
  EXPECT_THAT(few.status().message(), HasSubstr("has no storage_data entry"));
}

// ---- torch reads what tessera writes ------------------------------------------------------------

TEST(DcpMetadataTest, Torch2StandInsUnpickleTheTorch2Flavour) {
  tessera::testing::TempDir dir;
  for (uint64_t seed : {3, 4, 5, 6}) {
    DcpMetadata m = RandomMetadata(seed * 1000 + 17);
    m.flavor = DcpFlavor::kTorch2;
    m.version = "1.0.0";
    m.storage_meta = DcpStorageMeta{"/ckpt/step_1", "save-1", std::nullopt, {"model"}};
    for (DcpTensor& t : m.tensors) {
      if (t.torch_dtype == "float8_e4m3fn") t.torch_dtype = "float64";  // torch 1.13 lacks it
    }
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, EncodeDcpMetadata(m));
    const std::string meta = dir.Sub("meta" + std::to_string(seed));
    testing::WriteFileBytes(meta, bytes);
    std::ofstream(meta + ".json") << ToJson(m).dump();
    std::string output;
    EXPECT_EQ(testing::RunPython("check_dcp2_metadata.py", {meta, meta + ".json"}, &output), 0)
        << output;
    EXPECT_THAT(output, HasSubstr("OK")) << output;
  }
  // The checker can fail.
  DcpMetadata m = RandomMetadata(99);
  m.flavor = DcpFlavor::kTorch2;
  for (DcpTensor& t : m.tensors) t.torch_dtype = "float32";
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, EncodeDcpMetadata(m));
  testing::WriteFileBytes(dir.Sub("x"), bytes);
  json wrong = ToJson(m);
  wrong["version"] = "9.9.9";
  std::ofstream(dir.Sub("x.json")) << wrong.dump();
  std::string output;
  EXPECT_EQ(
      testing::RunPython("check_dcp2_metadata.py", {dir.Sub("x"), dir.Sub("x.json")}, &output), 1)
      << output;
}

// Element i of every tensor: a byte pattern from (fqn, i), valid for every dtype (bools 0/1).
std::vector<uint8_t> Pattern(const std::string& fqn, const std::string& dtype, size_t numel) {
  const TorchDType* t = FindTorchDType(dtype);
  std::vector<uint8_t> v =
      tessera::testing::RandomBytes(numel * t->element_size, Crc32(fqn.data(), fqn.size()));
  if (dtype == "bool") {
    for (uint8_t& b : v) b &= 1;
  }
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "float32" || dtype == "float64") {
    // Keep values finite and NaN-free so torch compares them bit for bit: clear the top
    // exponent bit of each element.
    for (size_t i = t->element_size - 1; i < v.size(); i += t->element_size) v[i] &= 0x3F;
  }
  return v;
}

// A whole DCP checkpoint written by tessera's pieces (items, layout + streamed CRC, metadata),
// loaded by torch 1.13's load_state_dict.
TEST(DcpMetadataTest, Torch113LoadsACheckpointTesseraWrote) {
  tessera::testing::TempDir dir;
  struct Spec {
    std::string fqn, dtype;
    std::vector<int64_t> size;
    int chunks;  // row chunks
  };
  const std::vector<Spec> specs = {
      {"w", "float32", {4, 6}, 2}, {"b", "bfloat16", {5}, 1},          {"s", "float64", {}, 1},
      {"e", "float16", {0, 3}, 1}, {"flags", "bool", {2, 3, 4, 5}, 2}, {"i", "int64", {3}, 3},
      {"big", "int32", {70000}, 2}};
  DcpMetadata m;
  m.flavor = DcpFlavor::kTorch113;
  json state = json::object();
  std::map<std::string, std::vector<uint8_t>> files;
  size_t item_count = 0;
  for (const Spec& s : specs) {
    DcpTensor t;
    t.fqn = s.fqn;
    t.torch_dtype = s.dtype;
    t.size = s.size;
    int64_t numel = 1;
    for (int64_t d : s.size) numel *= d;
    const std::vector<uint8_t> values = Pattern(s.fqn, s.dtype, static_cast<size_t>(numel));
    state[s.fqn] = {{"kind", "tensor"},
                    {"dtype", s.dtype},
                    {"size", s.size},
                    {"values_hex", testing::Hex(values.data(), values.size())}};
    const int64_t rows = s.size.empty() ? 1 : s.size[0];
    const size_t row_bytes = rows ? values.size() / static_cast<size_t>(rows) : 0;
    for (int c = 0; c < s.chunks; ++c) {
      const int64_t r0 = rows * c / s.chunks, r1 = rows * (c + 1) / s.chunks;
      DcpChunk chunk;
      TorchTensorSpec spec{s.dtype, s.size, false};
      if (!s.size.empty()) {
        chunk.offsets.assign(s.size.size(), 0);
        chunk.offsets[0] = r0;
        chunk.sizes = s.size;
        chunk.sizes[0] = r1 - r0;
        spec.size = chunk.sizes;
      }
      t.chunks.push_back(chunk);
      const std::span<const uint8_t> data(values.data() + r0 * row_bytes, (r1 - r0) * row_bytes);
      // Items alternate between two files; every other item is laid out and streamed.
      const std::string file = "__" + std::to_string(item_count % 2) + "_0.distcp";
      std::vector<uint8_t>& f = files[file];
      const uint64_t offset = f.size();
      if (item_count % 2 == 0) {
        ASSERT_OK_AND_ASSIGN(TorchItemLayout layout, LayOutTorchTensorItem(spec));
        f.insert(f.end(), layout.prefix.begin(), layout.prefix.end());
        Crc32Stream crc;
        for (size_t at = 0; at < data.size(); at += 1000) {
          const size_t n = std::min<size_t>(1000, data.size() - at);
          f.insert(f.end(), data.begin() + at, data.begin() + at + n);
          crc.Update(data.data() + at, n);
        }
        const std::vector<uint8_t> suffix = TorchItemSuffix(layout, crc.value());
        ASSERT_EQ(suffix.size(), layout.suffix_size);
        f.insert(f.end(), suffix.begin(), suffix.end());
        ASSERT_EQ(f.size() - offset, layout.total_size);
      } else {
        ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> item, MakeTorchTensorItem(spec, data));
        f.insert(f.end(), item.begin(), item.end());
      }
      m.storage.push_back({s.fqn, chunk.offsets, c, file, offset, f.size() - offset});
      ++item_count;
    }
    m.tensors.push_back(std::move(t));
  }
  const std::vector<uint8_t> blob = {0, 1, 2, 0xFF, 'x'};
  const std::vector<uint8_t> blob_item = MakeTorchBytesItem(blob);
  std::vector<uint8_t>& f = files["__2_0.distcp"];
  m.bytes.push_back({"blob", kNoDcpStorage});
  m.storage.push_back({"blob", std::nullopt, std::nullopt, "__2_0.distcp", 0, blob_item.size()});
  f = blob_item;
  state["blob"] = {{"kind", "bytes"}, {"bytes_hex", testing::Hex(blob.data(), blob.size())}};
  ASSERT_OK(LinkDcpStorage(m, "test"));

  const std::string ckpt = dir.Sub("ckpt");
  ASSERT_EQ(mkdir(ckpt.c_str(), 0755), 0);
  for (const auto& [name, bytes] : files) testing::WriteFileBytes(ckpt + "/" + name, bytes);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> meta, EncodeDcpMetadata(m));
  testing::WriteFileBytes(ckpt + "/.metadata", meta);
  const json expected = {{"metadata", ToJson(m)}, {"state_dict", state}};
  std::ofstream(dir.Sub("expected.json")) << expected.dump();

  std::string output;
  EXPECT_EQ(
      testing::RunPython("check_dcp_checkpoint.py", {ckpt, dir.Sub("expected.json")}, &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("OK " + std::to_string(specs.size() + 1) + " entries")) << output;

  // tessera reads its own checkpoint back, and the checker notices a changed value.
  ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(meta, ckpt + "/.metadata"));
  EXPECT_EQ(back, m);
  json bad = expected;
  std::string hex = bad["state_dict"]["w"]["values_hex"];
  hex[0] = hex[0] == '0' ? '1' : '0';
  bad["state_dict"]["w"]["values_hex"] = hex;
  std::ofstream(dir.Sub("bad.json")) << bad.dump();
  output.clear();
  EXPECT_EQ(testing::RunPython("check_dcp_checkpoint.py", {ckpt, dir.Sub("bad.json")}, &output), 1)
      << output;
  EXPECT_THAT(output, HasSubstr("MISMATCH w")) << output;
}

}  // namespace
}  // namespace tessera::torch_dist
