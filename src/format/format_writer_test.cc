// The write side of the registered formats as the write engine (src/checkpoint/data_files.h)
// uses it: file names, layouts, item framing, and what each codec refuses before any byte is
// written. Whole saves in each format are checkpoint_test's and dcp_save_test's.
#include "tessera/format_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "core/crc32.h"
#include "format/registry.h"
#include "format/safetensors.h"
#include "format/tessera/manifest.h"
#include "format/tessera/names.h"
#include "format/torch_dist/dcp_writer.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/memory_storage.h"
#include "tessera/testing/gtest_status.h"

namespace tessera {
namespace {

constexpr char kSaveId[] = "00ab00ab00ab00ab";

ItemToWrite Chunk(const std::string& key, DType dtype, Shape global, Box box) {
  ItemToWrite item;
  item.key = key;
  item.dtype = dtype;
  item.global_shape = std::move(global);
  item.num_bytes = static_cast<uint64_t>(box.NumElements()) * DTypeSize(dtype);
  item.box = std::move(box);
  return item;
}

ItemToWrite Object(const std::string& key, uint64_t num_bytes) {
  ItemToWrite item;
  item.key = key;
  item.object = true;
  item.num_bytes = num_bytes;
  return item;
}

std::unique_ptr<FormatWriter> WriterOf(CheckpointFormat id, const SaveOptions& options = {}) {
  Result<std::unique_ptr<FormatWriter>> writer = FormatOf(id).NewWriter(options, true);
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  return writer.ok() ? std::move(*writer) : nullptr;
}

// Writes `items` as `writer` lays them out into `path`, each item's bytes its index repeated;
// returns where each item starts.
std::vector<uint64_t> WriteFile(Storage& storage, const std::string& path,
                                const FormatWriter& writer, const std::vector<ItemToWrite>& items) {
  std::vector<uint64_t> offsets;
  Result<std::unique_ptr<DataFileEncoder>> layout = writer.NewDataFile(items, kSaveId);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  if (!layout.ok()) return offsets;
  Result<std::unique_ptr<WritableFile>> out = storage.NewWritableFile(path);
  EXPECT_TRUE(out.ok());
  if (!out.ok()) return offsets;
  const Bytes& header = (*layout)->header();
  EXPECT_TRUE((*out)->WriteAt(0, header.data(), header.size()).ok());
  uint64_t end = header.size();
  for (size_t k = 0; k < items.size(); ++k) {
    const uint64_t at = (*layout)->ItemOffset(k, end);
    Result<std::unique_ptr<ItemWriter>> item = (*layout)->BeginItem(**out, k, at);
    EXPECT_TRUE(item.ok()) << item.status().ToString();
    if (!item.ok()) return offsets;
    const std::vector<std::byte> bytes(items[k].num_bytes, std::byte(k + 1));
    // Two pieces, as the engine hands them.
    const size_t half = bytes.size() / 2;
    EXPECT_TRUE((*item)->Append(bytes.data(), half).ok());
    EXPECT_TRUE((*item)->Append(bytes.data() + half, bytes.size() - half).ok());
    Result<uint64_t> length = (*item)->Finish();
    EXPECT_TRUE(length.ok()) << length.status().ToString();
    offsets.push_back(at);
    end = at + (length.ok() ? *length : 0);
  }
  EXPECT_TRUE((*out)->Close().ok());
  return offsets;
}

TEST(FormatWriterTest, OnlyTesseraAndTorchDistAreWritten) {
  for (const Format* format : RegisteredFormats()) {
    Result<std::unique_ptr<FormatWriter>> writer = format->NewWriter(SaveOptions{}, true);
    EXPECT_EQ(writer.ok(), format->CanWrite()) << format->name();
  }
  Result<std::unique_ptr<FormatWriter>> hf =
      FormatOf(CheckpointFormat::kSafetensors).NewWriter(SaveOptions{}, true);
  EXPECT_EQ(hf.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(hf.status().message(),
            "SaveOptions::format safetensors cannot be written: save as tessera or torch_dist");
}

TEST(FormatWriterTest, TesseraFilesAreSafetensorsWithRawItems) {
  const std::unique_ptr<FormatWriter> writer = WriterOf(CheckpointFormat::kTessera);
  ASSERT_NE(writer, nullptr);
  EXPECT_TRUE(writer->EngineChecksums());
  EXPECT_EQ(writer->DataFileName(kSaveId, 3, 1, ""), DataFileName(kSaveId, 3, 1));
  MemoryStorage storage;
  const std::vector<ItemToWrite> items = {Chunk("w", DType::kF32, {4, 3}, Box{{2, 0}, {2, 3}}),
                                          Object("step", 5)};
  const std::vector<uint64_t> offsets = WriteFile(storage, "/f.safetensors", *writer, items);
  ASSERT_EQ(offsets.size(), 2u);
  TESSERA_ASSIGN_OR_FAIL(std::unique_ptr<ReadableFile> file,
                         storage.NewReadableFile("/f.safetensors"));
  TESSERA_ASSIGN_OR_FAIL(SafetensorsHeader header, ReadSafetensorsHeader(*file));
  ASSERT_EQ(header.entries.size(), 2u);
  EXPECT_EQ(header.metadata.at("tessera_save_id"), kSaveId);
  EXPECT_EQ(header.entries[0].name, ChunkEntryName("w", items[0].box, items[0].global_shape));
  EXPECT_EQ(header.data_start + header.entries[0].begin, offsets[0]);
  EXPECT_EQ(header.data_start + header.entries[1].begin, offsets[1]);
  EXPECT_EQ(file->size(), offsets[1] + 5);
  uint8_t first = 0;
  TESSERA_ASSERT_OK(file->ReadAt(offsets[1], &first, 1));
  EXPECT_EQ(first, 2);  // the object's bytes, raw
}

TEST(FormatWriterTest, TorchDistFilesAreTorchSaveItemsBackToBack) {
  const std::unique_ptr<FormatWriter> writer = WriterOf(CheckpointFormat::kTorchDist);
  ASSERT_NE(writer, nullptr);
  EXPECT_FALSE(writer->EngineChecksums());
  EXPECT_EQ(writer->DataFileName(kSaveId, 3, 1, ""), torch_dist::DcpDataFileName(kSaveId, 3, 1));
  MemoryStorage storage;
  const std::vector<ItemToWrite> items = {Chunk("w", DType::kBF16, {8}, Box{{0}, {8}}),
                                          Object("step", 3)};
  const std::vector<uint64_t> offsets = WriteFile(storage, "/f.distcp", *writer, items);
  ASSERT_EQ(offsets.size(), 2u);
  EXPECT_EQ(offsets[0], 0u);   // no header
  EXPECT_GT(offsets[1], 16u);  // after the whole first item, framing included
  TESSERA_ASSIGN_OR_FAIL(std::unique_ptr<ReadableFile> file, storage.NewReadableFile("/f.distcp"));
  char magic[2] = {};
  TESSERA_ASSERT_OK(file->ReadAt(0, magic, 2));
  EXPECT_EQ(std::string(magic, 2), "PK");  // a zip archive
  TESSERA_ASSERT_OK(file->ReadAt(offsets[1], magic, 2));
  EXPECT_EQ(std::string(magic, 2), "PK");
}

TEST(FormatWriterTest, TorchDistRefusesWhatItCannotHoldBeforeWriting) {
  SaveOptions options;
  options.user_metadata = {{"step", "10"}};
  Result<std::unique_ptr<FormatWriter>> coordinator =
      FormatOf(CheckpointFormat::kTorchDist).NewWriter(options, true);
  ASSERT_FALSE(coordinator.ok());
  ASSERT_NE(coordinator.status().detail(), nullptr);
  EXPECT_EQ(coordinator.status().detail()->kind, StatusDetail::Kind::kBadOption);
  EXPECT_EQ(coordinator.status().detail()->options.at(0), "SaveOptions::user_metadata");
  // Only the coordinator's user_metadata is saved.
  EXPECT_TRUE(FormatOf(CheckpointFormat::kTorchDist).NewWriter(options, false).ok());

  options = SaveOptions{};
  options.format_options = TorchDistOptions{.flavor = TorchDistFlavor::kTorch113};
  const std::unique_ptr<FormatWriter> old = WriterOf(CheckpointFormat::kTorchDist, options);
  ASSERT_NE(old, nullptr);
  Result<std::unique_ptr<DataFileEncoder>> layout =
      old->NewDataFile({Chunk("scale", DType::kU32, {2}, Box{{0}, {2}})}, kSaveId);
  EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("key 'scale'"), std::string::npos)
      << layout.status().ToString();
  EXPECT_TRUE(WriterOf(CheckpointFormat::kTorchDist)
                  ->NewDataFile({Chunk("scale", DType::kU32, {2}, Box{{0}, {2}})}, kSaveId)
                  .ok());
}

TEST(FormatWriterTest, TorchDistRefusesASaveBesideATesseraCommit) {
  const std::unique_ptr<FormatWriter> writer = WriterOf(CheckpointFormat::kTorchDist);
  ASSERT_NE(writer, nullptr);
  const Status status = writer->CheckTarget("/ckpt", {".metadata", NumberedManifestName(2)});
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find(NumberedManifestName(2)), std::string::npos);
  TESSERA_EXPECT_OK(writer->CheckTarget("/ckpt", {".metadata", "__0_0.distcp"}));
  TESSERA_EXPECT_OK(
      WriterOf(CheckpointFormat::kTessera)->CheckTarget("/ckpt", {NumberedManifestName(2)}));
}

// A one-tensor Metadata as the ranks' write results leave it, in file `file`.
Metadata WrittenMetadata(const std::string& file) {
  Metadata m;
  m.save_id = kSaveId;
  m.num_ranks = 1;
  m.files = {{file, 64}};
  ChunkInfo chunk;
  chunk.box = Box::Whole({4});
  chunk.location = ByteLocation{0, 0, 16, 0};
  m.tensors = {TensorInfo{"w", DType::kF32, {4}, {chunk}}};
  return m;
}

TEST(FormatWriterTest, TesseraIndexIsANumberedManifestThatReadsBack) {
  const std::unique_ptr<FormatWriter> writer = WriterOf(CheckpointFormat::kTessera);
  ASSERT_NE(writer, nullptr);
  EXPECT_TRUE(writer->NumberedCommits());
  Metadata m = WrittenMetadata(DataFileName(kSaveId, 0, 0));
  writer->FinishIndex(m);
  m.commit_seq = 7;
  TESSERA_ASSIGN_OR_FAIL(Bytes bytes, writer->EncodeIndex(m, "/ckpt"));
  TESSERA_ASSIGN_OR_FAIL(Metadata back, DecodeManifest(bytes, "/ckpt/manifest"));
  EXPECT_EQ(back.commit_seq, 7u);
  ASSERT_EQ(back.tensors.size(), 1u);
  // A chunk outside its tensor would not read back: refused before anything is published.
  m.tensors[0].chunks[0].box = Box({2}, {4});
  EXPECT_FALSE(writer->EncodeIndex(m, "/ckpt").ok());
}

TEST(FormatWriterTest, TorchDistIndexIsOneMetadataAndItsCleanupKnowsItsFiles) {
  const std::unique_ptr<FormatWriter> writer = WriterOf(CheckpointFormat::kTorchDist);
  ASSERT_NE(writer, nullptr);
  EXPECT_FALSE(writer->NumberedCommits());
  EXPECT_EQ(writer->IndexFileName(), ".metadata");
  const std::string file = torch_dist::DcpDataFileName(kSaveId, 0, 0);
  Metadata m = WrittenMetadata(file);
  writer->FinishIndex(m);
  EXPECT_EQ(m.format, CheckpointFormat::kTorchDist);
  TESSERA_ASSIGN_OR_FAIL(Bytes bytes, writer->EncodeIndex(m, "/ckpt"));
  TESSERA_ASSIGN_OR_FAIL(std::set<std::string> files,
                         writer->FilesOfIndex(bytes, "/ckpt/.metadata"));
  EXPECT_EQ(files, std::set<std::string>{file});
  // Our own index in place is not "a later save's"; another save's is; damage is neither.
  EXPECT_FALSE(writer->ReplacedByLaterSave(bytes, kSaveId, "/ckpt/.metadata"));
  EXPECT_TRUE(writer->ReplacedByLaterSave(bytes, "ffffffffffffffff", "/ckpt/.metadata"));
  const Bytes damaged(bytes.begin(), bytes.begin() + bytes.size() / 2);
  EXPECT_FALSE(writer->ReplacedByLaterSave(damaged, "ffffffffffffffff", "/ckpt/.metadata"));
  EXPECT_FALSE(writer->FilesOfIndex(damaged, "/ckpt/.metadata").ok());
  // The cleanup removes only names that carry a save id: never torch's own files.
  EXPECT_EQ(writer->SaveIdOfFile(file), kSaveId);
  EXPECT_EQ(writer->SaveIdOfFile(torch_dist::TempDcpMetadataName(kSaveId)), kSaveId);
  EXPECT_EQ(writer->SaveIdOfFile("__0_0.distcp"), "");
  EXPECT_EQ(writer->SaveIdOfFile(".metadata"), "");
}

TEST(FormatWriterTest, RawItemsHoldExactlyTheirBytes) {
  MemoryStorage storage;
  TESSERA_ASSIGN_OR_FAIL(std::unique_ptr<WritableFile> out, storage.NewWritableFile("/raw"));
  RawItemWriter item(*out, 10, 4);
  const std::byte bytes[6] = {};
  TESSERA_ASSERT_OK(item.Append(bytes, 3));
  EXPECT_EQ(item.position(), 13u);
  EXPECT_EQ(item.Finish().status().code(), StatusCode::kFailedPrecondition);  // one missing
  EXPECT_EQ(item.Append(bytes, 2).code(), StatusCode::kInvalidArgument);      // one too many
  TESSERA_ASSERT_OK(item.Append(bytes, 1));
  TESSERA_ASSIGN_OR_FAIL(uint64_t length, item.Finish());
  EXPECT_EQ(length, 4u);
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

Bytes ReadAll(Storage& storage, const std::string& path) {
  Result<std::unique_ptr<ReadableFile>> in = storage.NewReadableFile(path);
  EXPECT_TRUE(in.ok());
  if (!in.ok()) return {};
  Bytes all((*in)->size());
  EXPECT_TRUE((*in)->ReadAt(0, all.data(), all.size()).ok());
  return all;
}

// Writes the tensors of `items` by position, as a conversion does (the data of each placed
// item in two pieces, the second first, then its framing with the CRC-32 of its data), then
// the objects in order through BeginItem; returns the file's bytes.
Bytes WriteFileByPosition(Storage& storage, const std::string& path, const FormatWriter& writer,
                          const std::vector<ItemToWrite>& items) {
  Result<std::unique_ptr<DataFileEncoder>> layout = writer.NewDataFile(items, kSaveId);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  if (!layout.ok()) return {};
  Result<std::unique_ptr<WritableFile>> out = storage.NewWritableFile(path);
  EXPECT_TRUE(out.ok());
  if (!out.ok()) return {};
  const Bytes& header = (*layout)->header();
  EXPECT_TRUE((*out)->WriteAt(0, header.data(), header.size()).ok());
  uint64_t end = header.size();
  for (size_t k = 0; k < items.size(); ++k) {
    const uint64_t at = (*layout)->ItemOffset(k, end);
    const std::vector<std::byte> bytes(items[k].num_bytes, std::byte(k + 1));
    const std::optional<ItemPlacement> place = (*layout)->PlaceItem(k, at);
    if (!place) {  // written in order, as a conversion writes objects
      EXPECT_TRUE(items[k].object) << items[k].key;
      Result<std::unique_ptr<ItemWriter>> item = (*layout)->BeginItem(**out, k, at);
      EXPECT_TRUE(item.ok());
      if (!item.ok()) return {};
      EXPECT_TRUE((*item)->Append(bytes.data(), bytes.size()).ok());
      Result<uint64_t> length = (*item)->Finish();
      EXPECT_TRUE(length.ok());
      end = at + length.value_or(0);
      continue;
    }
    const size_t half = bytes.size() / 2;
    EXPECT_TRUE(
        (*out)->WriteAt(place->data_offset + half, bytes.data() + half, bytes.size() - half).ok());
    EXPECT_TRUE((*out)->WriteAt(place->data_offset, bytes.data(), half).ok());
    const uint32_t crc =
        writer.FramingChecksum() == ChecksumKind::kCrc32 ? Crc32(bytes.data(), bytes.size()) : 0;
    EXPECT_TRUE((*layout)->WriteFraming(**out, k, at, crc).ok());
    end = at + place->stored_length;
  }
  EXPECT_TRUE((*out)->Close().ok());
  return ReadAll(storage, path);
}

// What a conversion writes by position is byte for byte what a save writes in order, for
// every format tessera converts into.
TEST(FormatWriterTest, ItemsWrittenByPositionEqualItemsWrittenInOrder) {
  ConvertOptions options;
  for (const Format* format : RegisteredFormats()) {
    if (!format->CanConvertInto()) continue;
    SCOPED_TRACE(format->name());
    options.to = format->id();
    TESSERA_ASSIGN_OR_FAIL(const std::unique_ptr<FormatWriter> writer,
                           format->NewConversionWriter(options));
    std::vector<ItemToWrite> items = {Chunk("a", DType::kBF16, {300}, Box{{0}, {300}}),
                                      Chunk("b", DType::kF32, {}, Box{{}, {}}),
                                      Chunk("c", DType::kI64, {2, 5}, Box{{0, 0}, {2, 5}})};
    if (writer->StoresObjects()) {
      items.push_back(Object("step", 7));
      items.push_back(Object("rng", 0));
    }
    MemoryStorage storage;
    const std::vector<uint64_t> offsets = WriteFile(storage, "/in_order", *writer, items);
    ASSERT_EQ(offsets.size(), items.size());
    const Bytes in_order = ReadAll(storage, "/in_order");
    EXPECT_EQ(WriteFileByPosition(storage, "/by_position", *writer, items), in_order);
  }
}

TEST(FormatWriterTest, HuggingFaceFilesAreTheCheckpointAndHoldWholeTensorsOnly) {
  ConvertOptions options;
  options.to = CheckpointFormat::kSafetensors;
  TESSERA_ASSIGN_OR_FAIL(const std::unique_ptr<FormatWriter> writer,
                         FormatOf(CheckpointFormat::kSafetensors).NewConversionWriter(options));
  EXPECT_TRUE(writer->FilesAreTheCheckpoint());
  EXPECT_FALSE(writer->StoresObjects());
  EXPECT_FALSE(writer->NeedsIndex(1));
  EXPECT_TRUE(writer->NeedsIndex(2));
  EXPECT_EQ(writer->ConversionFileName(kSaveId, 0, 0, 0, 1), "model.safetensors");
  EXPECT_EQ(writer->ConversionFileName(kSaveId, 1, 0, 1, 3), "model-00002-of-00003.safetensors");
  EXPECT_EQ(writer->NewDataFile({Object("step", 3)}, kSaveId).status().code(),
            StatusCode::kInvalidArgument);
  const Result<std::unique_ptr<DataFileEncoder>> part =
      writer->NewDataFile({Chunk("w", DType::kF32, {4}, Box{{2}, {2}})}, kSaveId);
  EXPECT_EQ(part.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(part.status().message().find("key 'w'"), std::string::npos);

  // The index maps each tensor to its file, with the bytes of every tensor.
  Metadata m;
  m.files = {FileInfo{"model-00001-of-00002.safetensors", 1},
             FileInfo{"model-00002-of-00002.safetensors", 1}};
  TensorInfo a{"a", DType::kF32, {2, 3}, {}};
  a.chunks.push_back(ChunkInfo{});
  a.chunks[0].box = Box::Whole({2, 3});
  a.chunks[0].location.file_index = 1;
  m.tensors.push_back(a);
  TESSERA_ASSIGN_OR_FAIL(const Bytes index, writer->EncodeIndex(m, "/out"));
  const std::string text(index.begin(), index.end());
  EXPECT_NE(text.find("\"total_size\": 24"), std::string::npos) << text;
  EXPECT_NE(text.find("\"a\": \"model-00002-of-00002.safetensors\""), std::string::npos) << text;
}

}  // namespace
}  // namespace tessera
