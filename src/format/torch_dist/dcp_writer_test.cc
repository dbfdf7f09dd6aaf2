#include "format/torch_dist/dcp_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "format/torch_dist/test_util.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera::torch_dist {
namespace {

using ::testing::HasSubstr;

TEST(DcpWriterTest, FileNamesCarryTheSaveIdAndOnlyTheyAreRecognised) {
  const std::string id = "0123456789abcdef";
  EXPECT_EQ(DcpDataFileName(id, 12, 3), "__12_3.tsr-0123456789abcdef.distcp");
  EXPECT_EQ(DcpDataFileSaveId(DcpDataFileName(id, 12, 3)), id);
  EXPECT_EQ(TempDcpMetadataName(id), ".metadata.tsr-0123456789abcdef.tmp");
  EXPECT_EQ(TempDcpMetadataSaveId(TempDcpMetadataName(id)), id);
  for (const char* other :
       {"__0_0.distcp", ".metadata", ".metadata.tmp", "__0_0.tsr-0123456789ABCDEF.distcp",
        "__0_0.tsr-0123456789abcde.distcp", "__x_0.tsr-0123456789abcdef.distcp",
        "__0_.tsr-0123456789abcdef.distcp", "__0_0.tsr-0123456789abcdef.distcp.tmp",
        "tsr-0123456789abcdef-r00000-f000.safetensors"}) {
    EXPECT_EQ(DcpDataFileSaveId(other), "") << other;
    EXPECT_EQ(TempDcpMetadataSaveId(other), "") << other;
  }
}

TEST(DcpWriterTest, StreamedItemEqualsTheWholeItemAndChecksItsLength) {
  MemoryStorage memory;
  ASSERT_OK(memory.CreateDirs("/d"));
  const std::vector<uint8_t> data = ::tessera::testing::RandomBytes(3 * 1000 * 4, 7);
  const TorchTensorSpec spec{"float32", {3, 1000}, false};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> out, memory.NewWritableFile("/d/f"));
  ASSERT_OK(out->WriteAt(0, "xyz", 3));  // the item starts at offset 3
  ASSERT_OK_AND_ASSIGN(TorchTensorItemWriter writer, TorchTensorItemWriter::Begin(*out, 3, spec));
  EXPECT_THAT(writer.Finish().status().message(), HasSubstr("finished after 0 of its 12000"));
  for (size_t at = 0; at < data.size(); at += 5000) {
    ASSERT_OK(writer.Append(data.data() + at, std::min<size_t>(5000, data.size() - at)));
  }
  EXPECT_EQ(writer.position(), 3 + writer.layout().data_offset + data.size());
  const Status past = writer.Append(data.data(), 1);
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.message(), HasSubstr("12001 data bytes appended, the tensor has 12000"));
  ASSERT_OK_AND_ASSIGN(uint64_t length, writer.Finish());
  ASSERT_OK(out->Close());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> whole, MakeTorchTensorItem(spec, data));
  EXPECT_EQ(length, whole.size());
  // About 1 KiB of zip records and pickle around the data.
  EXPECT_LT(length - data.size(), 1100u);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> file, memory.GetFileContents("/d/f"));
  EXPECT_EQ(std::vector<uint8_t>(file.begin() + 3, file.end()), whole);
}

TEST(DcpWriterTest, ObjectItemsAreWhatTorchLoadReads) {
  MemoryStorage memory;
  ASSERT_OK(memory.CreateDirs("/d"));
  const std::vector<uint8_t> data = {'a', 0, 0xFF};
  struct Case {
    ObjectEncoding encoding;
    std::vector<uint8_t> item;
  };
  const std::vector<Case> cases = {{ObjectEncoding::kBytes, MakeTorchBytesItem(data)},
                                   {ObjectEncoding::kJson, MakeTorchBytesItem(data)},
                                   {ObjectEncoding::kPickle, MakeTorchObjectItem(data)},
                                   {ObjectEncoding::kTorchSave, data}};
  for (const Case& c : cases) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> out,
                         memory.NewWritableFile("/d/f", CreateMode::kTruncate));
    ASSERT_OK_AND_ASSIGN(uint64_t length, WriteDcpObjectItem(*out, 0, data, c.encoding));
    ASSERT_OK(out->Close());
    EXPECT_EQ(length, c.item.size());
    EXPECT_EQ(*memory.GetFileContents("/d/f"), c.item) << static_cast<int>(c.encoding);
  }
}

Metadata TwoChunks() {
  Metadata m;
  m.save_id = "0123456789abcdef";
  m.files = {{"__0_0.tsr-0123456789abcdef.distcp", 100}};
  TensorInfo t;
  t.key = "w";
  t.dtype = DType::kBF16;
  t.global_shape = {4, 2};
  t.chunks.push_back(ChunkInfo{Box({0, 0}, {2, 2}), {0, 0, 40, 7}});
  t.chunks.push_back(ChunkInfo{Box({2, 0}, {2, 2}), {0, 40, 40, 8}});
  m.tensors.push_back(t);
  m.objects.push_back(ObjectInfo{"o", {0, 80, 20, 9}, ObjectEncoding::kPickle});
  MarkDcpItems(m);
  return m;
}

TEST(DcpWriterTest, MetadataOfWrittenItems) {
  const Metadata m = TwoChunks();
  EXPECT_EQ(m.format, CheckpointFormat::kTorchDist);
  EXPECT_EQ(m.checksum, ChecksumKind::kNone);
  EXPECT_EQ(m.tensors[0].chunks[1].encoding, ChunkEncoding::kTorchSaveItem);
  EXPECT_EQ(m.tensors[0].chunks[1].location.checksum, 0u);
  EXPECT_EQ(m.objects[0].encoding, ObjectEncoding::kTorchSave);

  ASSERT_OK_AND_ASSIGN(DcpMetadata v2, ToDcpMetadata(m, {.checkpoint_id = "/ck"}));
  ASSERT_EQ(v2.tensors.size(), 1u);
  EXPECT_EQ(v2.tensors[0].torch_dtype, "bfloat16");
  EXPECT_EQ(v2.tensors[0].chunks[1].offsets, (std::vector<int64_t>{2, 0}));
  ASSERT_EQ(v2.storage.size(), 3u);
  EXPECT_EQ(v2.storage[1].index, 1);
  EXPECT_EQ(v2.storage[1].offset_in_file, 40u);
  EXPECT_EQ(v2.storage[2].fqn, "o");
  EXPECT_FALSE(v2.storage[2].offset.has_value());
  EXPECT_EQ(v2.storage_meta->checkpoint_id, "/ck");
  EXPECT_EQ(v2.storage_meta->save_id, "0123456789abcdef");
  EXPECT_EQ(v2.version, "1.0.0");
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> pickle, EncodeDcpMetadata(v2));
  ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(pickle, "test"));
  EXPECT_EQ(back, v2);

  // Without paths, planner_data maps every fqn to itself (a flat state dict).
  EXPECT_EQ(v2.planner_data_kind, DcpPlannerData::kFlattenMapping);
  EXPECT_EQ(v2.planner_data,
            (std::vector<DcpPlannerPath>{{"w", {std::string("w")}}, {"o", {std::string("o")}}}));

  ASSERT_OK_AND_ASSIGN(DcpMetadata v113, ToDcpMetadata(m, {.flavor = DcpFlavor::kTorch113}));
  EXPECT_EQ(v113.planner_data_kind, DcpPlannerData::kNone);
  EXPECT_FALSE(v113.storage_meta.has_value());
  ASSERT_OK(EncodeDcpMetadata(v113));
}

// The caller's nesting (TorchDistOptions::key_paths) becomes planner_data, with str keys
// and int list indices as torch's flatten_state_dict records them; unlisted keys map to
// themselves. It survives the pickle.
TEST(DcpWriterTest, PlannerDataTakesTheCallersPaths) {
  const Metadata m = TwoChunks();
  const std::map<std::string, std::vector<DcpPathElement>> paths = {
      {"w", {std::string("layers"), int64_t{0}, std::string("w")}}, {"other", {int64_t{1}}}};
  ASSERT_OK_AND_ASSIGN(DcpMetadata v2, ToDcpMetadata(m, {.key_paths = &paths}));
  EXPECT_EQ(v2.planner_data, (std::vector<DcpPlannerPath>{
                                 {"w", {std::string("layers"), int64_t{0}, std::string("w")}},
                                 {"o", {std::string("o")}}}));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> pickle, EncodeDcpMetadata(v2));
  ASSERT_OK_AND_ASSIGN(DcpMetadata back, ReadDcpMetadata(pickle, "test"));
  EXPECT_EQ(back.planner_data, v2.planner_data);
}

TEST(DcpWriterTest, MetadataRefusesWhatDcpCannotDescribe) {
  Metadata m = TwoChunks();
  m.tensors[0].chunks[1].encoding = ChunkEncoding::kRaw;
  Result<DcpMetadata> r = ToDcpMetadata(m, {});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("key 'w' box [2:4, 0:2]: not stored as a whole row-major tensor item"));

  m = TwoChunks();
  m.tensors[0].chunks[0].location.file_index = 3;
  EXPECT_THAT(ToDcpMetadata(m, {}).status().message(), HasSubstr("file index 3 of 1 files"));

  m = TwoChunks();
  m.tensors[0].dtype = DType::kF8E5M2;
  EXPECT_OK(ToDcpMetadata(m, {}));
  EXPECT_THAT(ToDcpMetadata(m, {.flavor = DcpFlavor::kTorch113}).status().message(),
              HasSubstr("key 'w': torch 1.13 has no dtype float8_e5m2"));

  m = TwoChunks();
  m.tensors[0].chunks[1].box = Box({3, 0}, {2, 2});  // reaches past row 4
  EXPECT_EQ(ToDcpMetadata(m, {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::torch_dist
