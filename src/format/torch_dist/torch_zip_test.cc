// Tests of the torch.save zip item reader and writer (torch_zip.h) against items written by
// real torch 1.13, DCP checkpoints written by its save_state_dict, and torch.load.
#include "format/torch_dist/torch_zip.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/crc32.h"
#include "format/torch_dist/dcp_metadata.h"
#include "format/torch_dist/pickle.h"
#include "format/torch_dist/test_util.h"
#include "format/torch_dist/torch_dtype.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera::torch_dist {
namespace {

using testing::FromHex;
using ::testing::HasSubstr;
using testing::Hex;
using testing::ReadFileBytes;
using testing::TestdataDir;
using json = nlohmann::json;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// An ItemReadFn over bytes in memory that counts its calls.
struct CountingReader {
  const std::vector<uint8_t>& bytes;
  ItemReadStats stats;
  ItemReadFn Fn() {
    return [this](uint64_t offset, void* dst, size_t n) -> Status {
      EXPECT_LE(offset + n, bytes.size()) << "the reader asked for bytes past the item";
      std::memcpy(dst, bytes.data() + offset, n);
      return Status();
    };
  }
};

TEST(TorchZipTest, ReadsEveryItemTorchWrote) {
  const std::string dir = TestdataDir() + "/items";
  const json expected = ReadJson(dir + "/expected.json");
  int tensors = 0, objects = 0;
  for (const auto& [name, want] : expected.items()) {
    if (want["kind"] == "big") continue;
    SCOPED_TRACE(name);
    const std::vector<uint8_t> bytes = ReadFileBytes(dir + "/" + name + ".pt");
    ASSERT_EQ(bytes.size(), want["length"].get<size_t>());
    CountingReader reader{bytes, {}};
    if (want["kind"] == "object") {
      ++objects;
      ASSERT_OK_AND_ASSIGN(TorchObjectItem o,
                           ReadTorchObjectItem(bytes.size(), reader.Fn(), name, &reader.stats));
      EXPECT_TRUE(o.is_zip);
      EXPECT_EQ(Hex(o.data.data(), o.data.size()), want["data_pkl_hex"]);
      EXPECT_EQ(o.archive_name, "archive");
      EXPECT_EQ(o.records.size(), want["records"].size());
      if (want.contains("bytes_hex")) {
        ASSERT_OK_AND_ASSIGN(PickleTree tree, ParsePickle(o.data, name));
        ASSERT_OK_AND_ASSIGN(std::string b, DecodePickledBytes(tree.root()));
        EXPECT_EQ(Hex(reinterpret_cast<const uint8_t*>(b.data()), b.size()), want["bytes_hex"]);
      }
      EXPECT_EQ(reader.stats.reads, 1);  // small items: one read
      continue;
    }
    ++tensors;
    ASSERT_OK_AND_ASSIGN(TorchTensorItem t,
                         ReadTorchTensorItem(bytes.size(), reader.Fn(), name, &reader.stats));
    EXPECT_EQ(t.torch_dtype, want["dtype"]);
    EXPECT_EQ(t.size, want["size"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.stride, want["stride"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.storage_offset, want["storage_offset"].get<int64_t>());
    EXPECT_EQ(t.storage_elements, want["storage_elements"].get<uint64_t>());
    EXPECT_EQ(t.requires_grad, want["requires_grad"].get<bool>());
    EXPECT_EQ(t.storage_key, want["storage_key"]);
    EXPECT_EQ(t.data_offset, want["data_offset"].get<uint64_t>());
    // torch aligns record data to 64 bytes; Python's zipfile (the zipfile_layout item) does not.
    const bool python_zipfile = name.rfind("zipfile_", 0) == 0;
    if (!python_zipfile) {
      EXPECT_EQ(t.data_offset % 64, 0u);
    }
    EXPECT_EQ(t.archive_name, python_zipfile ? "tensor" : "archive");
    EXPECT_EQ(t.data_size, want["data_size"].get<uint64_t>());
    EXPECT_EQ(t.data_crc32, want["data_crc32"].get<uint32_t>());
    EXPECT_EQ(t.rebuild_version, 2);
    EXPECT_EQ(Hex(bytes.data() + t.data_offset, t.data_size), want["storage_hex"]);
    EXPECT_EQ(Crc32(bytes.data() + t.data_offset, t.data_size), t.data_crc32);
    EXPECT_EQ(t.IsContiguous(), want["contiguous"].get<bool>());
    if (t.IsContiguous()) {
      ASSERT_OK_AND_ASSIGN(auto range, t.ContiguousRange());
      EXPECT_EQ(Hex(bytes.data() + range.first, range.second), want["values_hex"]);
    } else {
      EXPECT_THAT(t.ContiguousRange().status().message(),
                  HasSubstr("size (3, 2) and stride (1, 3) is not row-major contiguous"));
    }
    EXPECT_EQ(reader.stats.reads, 1);
    EXPECT_EQ(reader.stats.bytes, bytes.size());
  }
  EXPECT_EQ(tensors, 15);
  EXPECT_EQ(objects, 3);
}

TEST(TorchZipTest, WriterMatchesTorchByteForByte) {
  const std::string dir = TestdataDir() + "/items";
  const json expected = ReadJson(dir + "/expected.json");
  int compared = 0;
  for (const auto& [name, want] : expected.items()) {
    SCOPED_TRACE(name);
    if (want["kind"] == "big" || name.rfind("zipfile_", 0) == 0) continue;
    const std::vector<uint8_t> bytes = ReadFileBytes(dir + "/" + name + ".pt");
    std::vector<uint8_t> ours;
    if (want["kind"] == "object") {
      if (want.contains("bytes_hex")) {
        ours = MakeTorchBytesItem(FromHex(want["bytes_hex"]));
      } else {
        ours = MakeTorchObjectItem(FromHex(want["data_pkl_hex"]));
      }
    } else {
      // torch.save of a contiguous tensor that owns its whole storage is what the writer makes.
      if (!want["contiguous"].get<bool>() || want["storage_offset"] != 0) continue;
      TorchTensorSpec spec{want["dtype"], want["size"].get<std::vector<int64_t>>(),
                           want["requires_grad"].get<bool>()};
      ASSERT_OK_AND_ASSIGN(TorchItemLayout layout, LayOutTorchTensorItem(spec));
      EXPECT_EQ(layout.total_size, bytes.size());
      EXPECT_EQ(layout.data_offset, want["data_offset"].get<uint64_t>());
      ASSERT_OK_AND_ASSIGN(ours, MakeTorchTensorItem(spec, FromHex(want["storage_hex"])));
    }
    EXPECT_EQ(Hex(ours.data(), ours.size()), Hex(bytes.data(), bytes.size()));
    ++compared;
  }
  EXPECT_EQ(compared, 15);
}

// torch.save of a 4 GiB + 100 byte uint8 tensor: zip64 extra fields in the data record's local
// header and central directory entry, 24-byte descriptors, the version record past 4 GiB. The
// fixture keeps torch's first and last 4 KiB; everything between is the tensor's zeros.
TEST(TorchZipTest, Zip64ItemLikeTorch) {
  const std::string dir = TestdataDir() + "/items";
  const json want = ReadJson(dir + "/expected.json")["big_uint8"];
  const uint64_t length = want["length"];
  const uint64_t numel = want["numel"];
  const std::vector<uint8_t> head = ReadFileBytes(dir + "/big_uint8.head");
  const std::vector<uint8_t> tail = ReadFileBytes(dir + "/big_uint8.tail");
  ASSERT_EQ(head.size(), 4096u);
  ASSERT_EQ(tail.size(), 4096u);

  ItemReadStats stats;
  auto read = [&](uint64_t offset, void* dst, size_t n) -> Status {
    auto* out = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t at = offset + i;
      out[i] = at < head.size()             ? head[at]
               : at >= length - tail.size() ? tail[at - (length - tail.size())]
                                            : 0;
    }
    return Status();
  };
  ASSERT_OK_AND_ASSIGN(TorchTensorItem t, ReadTorchTensorItem(length, read, "big", &stats));
  EXPECT_EQ(stats.reads, 2);
  EXPECT_EQ(stats.bytes, 8192u);
  EXPECT_EQ(t.torch_dtype, "uint8");
  EXPECT_EQ(t.size, std::vector<int64_t>{static_cast<int64_t>(numel)});
  EXPECT_EQ(t.data_size, numel);
  EXPECT_EQ(t.data_offset, 320u);

  // The CRC-32 of numel zero bytes, without 4 GiB of memory: combine a 1 MiB block.
  const std::vector<uint8_t> zeros(1 << 20, 0);
  const uint32_t block = Crc32(zeros.data(), zeros.size());
  Crc32Stream crc;
  for (uint64_t done = 0; done < numel;) {
    const uint64_t n = std::min<uint64_t>(zeros.size(), numel - done);
    n == zeros.size() ? crc.Append(block, n) : crc.Update(zeros.data(), n);
    done += n;
  }
  EXPECT_EQ(crc.value(), t.data_crc32);

  ASSERT_OK_AND_ASSIGN(TorchItemLayout layout,
                       LayOutTorchTensorItem({"uint8", {static_cast<int64_t>(numel)}, false}));
  EXPECT_EQ(layout.total_size, length);
  EXPECT_EQ(layout.data_offset, 320u);
  EXPECT_EQ(Hex(layout.prefix.data(), layout.prefix.size()),
            Hex(head.data(), layout.prefix.size()));
  const std::vector<uint8_t> suffix = TorchItemSuffix(layout, crc.value());
  ASSERT_EQ(suffix.size(), layout.suffix_size);
  ASSERT_LE(suffix.size(), tail.size());
  EXPECT_EQ(Hex(suffix.data(), suffix.size()),
            Hex(tail.data() + tail.size() - suffix.size(), suffix.size()));
}

// Every tensor and object item of the two checkpoints torch 1.13's save_state_dict wrote,
// located through the .metadata: the raw bytes are the saved values.
TEST(TorchZipTest, ReadsTheItemsOfTorchCheckpoints) {
  for (const char* name : {"files", "sharded"}) {
    SCOPED_TRACE(name);
    const std::string ckpt = TestdataDir() + "/dcp113/" + name;
    const json expected = ReadJson(ckpt + ".expected.json")["state_dict"];
    ASSERT_OK_AND_ASSIGN(DcpMetadata m,
                         ReadDcpMetadata(ReadFileBytes(ckpt + "/.metadata"), ckpt + "/.metadata"));
    std::map<std::string, std::vector<uint8_t>> files;
    auto file = [&](const std::string& rel) -> const std::vector<uint8_t>& {
      auto it = files.find(rel);
      if (it == files.end()) it = files.emplace(rel, ReadFileBytes(ckpt + "/" + rel)).first;
      return it->second;
    };
    for (const DcpTensor& t : m.tensors) {
      SCOPED_TRACE(t.fqn);
      const std::vector<uint8_t> values = FromHex(expected[t.fqn]["values_hex"]);
      const size_t elem = FindTorchDType(t.torch_dtype)->element_size;
      for (const DcpChunk& c : t.chunks) {
        const DcpStorage& s = m.storage[c.storage];
        const std::vector<uint8_t>& f = file(s.relative_path);
        ASSERT_LE(s.offset_in_file + s.length, f.size());
        const uint8_t* base = f.data() + s.offset_in_file;
        ItemReadStats stats;
        ASSERT_OK_AND_ASSIGN(TorchTensorItem item, ReadTorchTensorItem(
                                                       s.length,
                                                       [&](uint64_t offset, void* dst, size_t n) {
                                                         std::memcpy(dst, base + offset, n);
                                                         return Status();
                                                       },
                                                       s.relative_path, &stats));
        EXPECT_EQ(item.torch_dtype, t.torch_dtype);
        EXPECT_EQ(item.size, c.sizes);
        EXPECT_EQ(Crc32(base + item.data_offset, item.data_size), item.data_crc32);
        // The chunk's values, gathered through size/stride from the storage (the transposed
        // view is not contiguous), equal the state dict's rows at the chunk's offset.
        const int64_t numel = item.numel();
        std::vector<uint8_t> gathered;
        std::vector<int64_t> index(item.size.size(), 0);
        for (int64_t i = 0; i < numel; ++i) {
          int64_t at = item.storage_offset;
          for (size_t d = 0; d < index.size(); ++d) at += index[d] * item.stride[d];
          const uint8_t* e = base + item.data_offset + at * elem;
          gathered.insert(gathered.end(), e, e + elem);
          for (size_t d = index.size(); d-- > 0;) {
            if (++index[d] < item.size[d]) break;
            index[d] = 0;
          }
        }
        const size_t row_bytes = t.size.empty() || t.size[0] == 0 ? 0 : values.size() / t.size[0];
        const size_t start = c.offsets.empty() ? 0 : c.offsets[0] * row_bytes;
        ASSERT_LE(start + gathered.size(), values.size());
        EXPECT_EQ(Hex(gathered.data(), gathered.size()),
                  Hex(values.data() + start, gathered.size()));
      }
    }
    for (const DcpBytes& b : m.bytes) {
      SCOPED_TRACE(b.fqn);
      const DcpStorage& s = m.storage[b.storage];
      const std::vector<uint8_t>& f = file(s.relative_path);
      const std::span<const uint8_t> item(f.data() + s.offset_in_file, s.length);
      ASSERT_OK_AND_ASSIGN(TorchObjectItem o, ParseTorchObjectItem(item, s.relative_path));
      EXPECT_TRUE(o.is_zip);
      ASSERT_OK_AND_ASSIGN(PickleTree tree, ParsePickle(o.data, b.fqn));
      if (expected[b.fqn]["kind"] == "bytes") {
        ASSERT_OK_AND_ASSIGN(std::string got, DecodePickledBytes(tree.root()));
        EXPECT_EQ(Hex(reinterpret_cast<const uint8_t*>(got.data()), got.size()),
                  expected[b.fqn]["bytes_hex"]);
      } else {
        EXPECT_TRUE(tree.root().is(PickleKind::kDict));
      }
    }
  }
}

TEST(TorchZipTest, ReadsItemsThroughAReadableFile) {
  const std::string ckpt = TestdataDir() + "/dcp113/sharded";
  MemoryStorage storage;
  storage.SetFileContents("/ckpt/__0_0.distcp", ReadFileBytes(ckpt + "/__0_0.distcp"));
  ASSERT_OK_AND_ASSIGN(auto file, storage.NewReadableFile("/ckpt/__0_0.distcp"));
  ASSERT_OK_AND_ASSIGN(DcpMetadata m, ReadDcpMetadata(ReadFileBytes(ckpt + "/.metadata"), "m"));
  const DcpStorage& s = m.storage[m.tensors[0].chunks[1].storage];
  ASSERT_GT(s.offset_in_file, 0u);
  ASSERT_OK_AND_ASSIGN(TorchTensorItem t, ReadTorchTensorItem(*file, s.offset_in_file, s.length));
  EXPECT_EQ(t.size, m.tensors[0].chunks[1].sizes);
  const DcpStorage& b = m.storage[m.bytes[0].storage];
  ASSERT_OK_AND_ASSIGN(TorchObjectItem o, ReadTorchObjectItem(*file, b.offset_in_file, b.length));
  EXPECT_TRUE(o.is_zip);
  EXPECT_THAT(ReadTorchTensorItem(*file, s.offset_in_file, file->size()).status().message(),
              HasSubstr("/ckpt/__0_0.distcp: item at " + std::to_string(s.offset_in_file)));
  // Errors inside the item name the file and the item's offset.
  EXPECT_THAT(ReadTorchTensorItem(*file, b.offset_in_file, b.length).status().message(),
              ::testing::StartsWith("/ckpt/__0_0.distcp item at " +
                                    std::to_string(b.offset_in_file) + ": "));
}

TEST(TorchZipTest, StorageOrderOfViews) {
  // The transposed view torch saved: size (3, 2), stride (1, 3): its storage is the (2, 3)
  // row-major array, dimension 1 outermost.
  const std::vector<uint8_t> bytes =
      ReadFileBytes(TestdataDir() + "/items/transposed_int64_3x2.pt");
  ASSERT_OK_AND_ASSIGN(TorchTensorItem t, ParseTorchTensorItem(bytes, "t"));
  EXPECT_EQ(*t.StorageOrder(), (std::vector<int>{1, 0}));
  // Element (i, j) of the view is storage element j * 3 + i.
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      int64_t v;
      std::memcpy(&v, bytes.data() + t.data_offset + (j * 3 + i) * 8, 8);
      EXPECT_EQ(v, i * 1 + j * 3);  // torch.arange(6).reshape(2, 3).t()
    }
  }
  TorchTensorItem u;
  u.size = {2, 1, 3, 4};
  u.stride = {1, 99, 8, 2};  // a permutation of (3, 4, 2) row-major, with a size-1 dimension
  EXPECT_EQ(*u.StorageOrder(), (std::vector<int>{1, 2, 3, 0}));
  u.size = {2, 3};
  u.stride = {3, 1};
  EXPECT_EQ(*u.StorageOrder(), (std::vector<int>{0, 1}));
  u.stride = {0, 1};  // expanded
  EXPECT_THAT(u.StorageOrder().status().message(),
              HasSubstr("size (2, 3) and stride (0, 1) is not a permutation"));
  u.stride = {6, 2};  // every other element
  EXPECT_FALSE(u.StorageOrder().ok());
}

TEST(TorchZipTest, RawObjectItems) {
  const std::vector<uint8_t> raw = {'h', 'i', 0, 1};
  ASSERT_OK_AND_ASSIGN(TorchObjectItem o, ParseTorchObjectItem(raw, "raw"));
  EXPECT_FALSE(o.is_zip);
  EXPECT_EQ(o.data, raw);
  ASSERT_OK_AND_ASSIGN(TorchObjectItem empty, ParseTorchObjectItem({}, "raw"));
  EXPECT_FALSE(empty.is_zip);
}

TEST(TorchZipTest, LargeItemsNeedTwoSmallReads) {
  // A 1 MiB tensor: the reader asks for 4 KiB at each end and nothing else.
  const std::vector<uint8_t> data = tessera::testing::RandomBytes(1 << 20, 5);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> item,
                       MakeTorchTensorItem({"float32", {256, 1024}, false}, data));
  CountingReader reader{item, {}};
  ASSERT_OK_AND_ASSIGN(TorchTensorItem t,
                       ReadTorchTensorItem(item.size(), reader.Fn(), "x", &reader.stats));
  EXPECT_EQ(reader.stats.reads, 2);
  EXPECT_EQ(reader.stats.bytes, 2 * kItemProbeBytes);
  EXPECT_EQ(t.data_crc32, Crc32(data.data(), data.size()));
  EXPECT_EQ(0, std::memcmp(item.data() + t.data_offset, data.data(), data.size()));
  EXPECT_EQ(ItemProbeRanges(item.size()).size(), 2u);
  EXPECT_EQ(ItemProbeRanges(8192).size(), 1u);
}

// Corruptions are errors that name the offset and what was expected, never crashes.
TEST(TorchZipTest, CorruptItems) {
  const std::vector<uint8_t> data(24, 7);
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> good,
                       MakeTorchTensorItem({"int32", {2, 3}, false}, data));
  ASSERT_OK(ParseTorchTensorItem(good, "good").status());
  auto find = [&](std::string_view s) -> size_t {
    auto it = std::search(good.begin(), good.end(), s.begin(), s.end());
    EXPECT_NE(it, good.end()) << s;
    return static_cast<size_t>(it - good.begin());
  };
  struct Case {
    std::function<void(std::vector<uint8_t>&)> edit;
    const char* message;
  };
  const size_t cd = find(std::string_view("PK\x01\x02", 4));
  const size_t pkl = 64;  // data.pkl's data
  const Case cases[] = {
      {[](std::vector<uint8_t>& b) { b.pop_back(); }, "no zip end of central directory"},
      {[](std::vector<uint8_t>& b) { b.resize(10); }, "no zip end record: the item is too short"},
      {[&](std::vector<uint8_t>& b) { b[pkl + 5] ^= 1; }, "data.pkl has CRC-32"},
      {[&](std::vector<uint8_t>& b) { b[cd + 10] = 8; }, "uses compression method 8"},
      {[&](std::vector<uint8_t>& b) { b[cd + 8] |= 1; }, "is encrypted"},
      {[&](std::vector<uint8_t>& b) { b[cd] = 'Q'; }, "expected central directory header 0"},
      {[&](std::vector<uint8_t>& b) { b[0] = 'Q'; },
       "expected the local header of archive/data.pkl"},
      {[&](std::vector<uint8_t>& b) { b[find("archive/data/0") + 13] = '1'; },
       "local header names 'archive/data/1', the central directory 'archive/data/0'"},
      {[&](std::vector<uint8_t>& b) {
         const size_t at = find(std::string_view("PK\x06\x06", 4));
         b[at + 48] += 1;  // central directory offset
       },
       "central directory at 467 (183 bytes) overlaps the end records at 649"},
      {[&](std::vector<uint8_t>& b) {
         const size_t at = find(std::string_view("PK\x06\x07", 4));
         b[at + 8] = 0xF0;
       },
       "zip64 end locator points to offset"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<uint8_t> bad = good;
    c.edit(bad);
    Result<TorchTensorItem> r = ParseTorchTensorItem(bad, "/ckpt/__0_0.distcp[100]");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
    EXPECT_THAT(r.status().message(), ::testing::StartsWith("/ckpt/__0_0.distcp[100]: "));
  }
  // The storage record smaller than the pickle says.
  const std::vector<uint8_t> bytes_item = MakeTorchBytesItem(data);
  EXPECT_THAT(ParseTorchTensorItem(bytes_item, "obj").status().message(),
              HasSubstr("not torch._utils._rebuild_tensor_v2/_v3"));
  // A read error is passed on with the item's name.
  Result<TorchTensorItem> failed = ReadTorchTensorItem(
      good.size(), [](uint64_t, void*, size_t) { return IOError("disk on fire"); }, "item");
  EXPECT_THAT(failed.status().message(), HasSubstr("item: disk on fire"));
}

TEST(TorchZipTest, TorchLoadsWhatTesseraWrites) {
  tessera::testing::TempDir dir;
  struct Spec {
    std::string dtype;
    std::vector<int64_t> size;
    bool requires_grad;
  };
  const std::vector<Spec> specs = {
      {"float32", {3, 4}, false},    {"bfloat16", {5}, false},  {"float16", {2, 2, 2, 2, 2}, false},
      {"float64", {}, true},         {"int64", {0, 7}, false},  {"int32", {1000}, false},
      {"int16", {3, 1}, false},      {"int8", {9}, false},      {"uint8", {300}, false},
      {"bool", {2, 3, 4, 5}, false}, {"complex64", {2}, false}, {"float32", {70000}, false}};
  json items = json::array();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    int64_t numel = 1;
    for (int64_t d : s.size) numel *= d;
    std::vector<uint8_t> data = tessera::testing::RandomBytes(
        static_cast<size_t>(numel) * FindTorchDType(s.dtype)->element_size, 100 + i);
    if (s.dtype == "bool") {
      for (uint8_t& b : data) b &= 1;
    } else if (s.dtype.find("float") != std::string::npos || s.dtype == "complex64") {
      const size_t e = s.dtype == "complex64" ? 4 : FindTorchDType(s.dtype)->element_size;
      for (size_t k = e - 1; k < data.size(); k += e) data[k] &= 0x3F;  // finite, no NaN
    }
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> item,
                         MakeTorchTensorItem({s.dtype, s.size, s.requires_grad}, data));
    const std::string path = dir.Sub("t" + std::to_string(i) + ".pt");
    testing::WriteFileBytes(path, item);
    items.push_back({{"path", path},
                     {"kind", "tensor"},
                     {"dtype", s.dtype},
                     {"size", s.size},
                     {"requires_grad", s.requires_grad},
                     {"values_hex", Hex(data.data(), data.size())}});
  }
  for (const std::vector<uint8_t>& raw :
       {std::vector<uint8_t>{}, std::vector<uint8_t>{0, 0x80, 0xFF, 'a'},
        tessera::testing::RandomBytes(5000, 9)}) {
    const std::string path = dir.Sub("b" + std::to_string(items.size()) + ".pt");
    testing::WriteFileBytes(path, MakeTorchBytesItem(raw));
    items.push_back(
        {{"path", path}, {"kind", "bytes"}, {"bytes_hex", Hex(raw.data(), raw.size())}});
  }
  std::ofstream(dir.Sub("expected.json")) << json{{"items", items}}.dump();
  std::string output;
  EXPECT_EQ(testing::RunPython("check_torch_items.py", {dir.Sub("expected.json")}, &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("OK " + std::to_string(items.size()) + " items")) << output;

  // The checker can fail: a flipped data byte breaks the record's CRC-32 and the values.
  std::vector<uint8_t> item = ReadFileBytes(items[0]["path"]);
  ASSERT_OK_AND_ASSIGN(TorchTensorItem t0, ParseTorchTensorItem(item, "t0"));
  item[t0.data_offset + 5] ^= 0x10;
  testing::WriteFileBytes(items[0]["path"], item);
  output.clear();
  EXPECT_EQ(testing::RunPython("check_torch_items.py", {dir.Sub("expected.json")}, &output), 1)
      << output;
  EXPECT_THAT(output, HasSubstr("MISMATCH")) << output;
}

TEST(TorchZipTest, LayoutIsKnownBeforeTheData) {
  for (const TorchTensorSpec& spec :
       {TorchTensorSpec{"bfloat16", {4096, 4096}, false},
        TorchTensorSpec{"float8_e5m2", {3}, false}, TorchTensorSpec{"int64", {}, false},
        TorchTensorSpec{"uint16", {0}, false}}) {
    SCOPED_TRACE(spec.torch_dtype);
    ASSERT_OK_AND_ASSIGN(TorchItemLayout layout, LayOutTorchTensorItem(spec));
    EXPECT_EQ(layout.data_offset, layout.prefix.size());
    EXPECT_EQ(layout.data_offset % 64, 0u);
    EXPECT_EQ(layout.total_size, layout.prefix.size() + layout.data_size + layout.suffix_size);
    const std::vector<uint8_t> suffix = TorchItemSuffix(layout, 0x12345678);
    EXPECT_EQ(suffix.size(), layout.suffix_size);
    if (layout.data_size <= (1 << 20)) {
      // Reads back, including the v3 form (untyped storage + dtype) of torch 2.x's new dtypes.
      std::vector<uint8_t> data(layout.data_size, 1);
      ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> item, MakeTorchTensorItem(spec, data));
      ASSERT_OK_AND_ASSIGN(TorchTensorItem t, ParseTorchTensorItem(item, "x"));
      EXPECT_EQ(t.torch_dtype, FindTorchDType(spec.torch_dtype)->name);
      EXPECT_EQ(t.size, spec.size);
      EXPECT_EQ(t.rebuild_version, FindTorchDType(spec.torch_dtype)->storage_class.empty() ? 3 : 2);
    }
  }
  EXPECT_FALSE(LayOutTorchTensorItem({"qint8", {1}, false}).ok());
  EXPECT_FALSE(LayOutTorchTensorItem({"float32", {-1}, false}).ok());
  EXPECT_FALSE(MakeTorchTensorItem({"float32", {2}, false}, std::vector<uint8_t>(7)).ok());
}

}  // namespace
}  // namespace tessera::torch_dist
