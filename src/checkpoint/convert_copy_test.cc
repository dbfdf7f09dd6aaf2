// The copy path of Convert on hand-made metadata: which element ranges are runs of chunks
// (CopySpans), and CopyPiece on a chunk with one checksum longer than the copy buffer (hashed
// where it lies when the storage maps, read through the buffer when not, then CopyFrom).
#include "checkpoint/convert_copy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/checksum.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

ChunkInfo Chunk(Box box, uint64_t offset, uint64_t length) {
  ChunkInfo c;
  c.box = std::move(box);
  c.location = ByteLocation{0, offset, length, 0};
  return c;
}

// An [8, 4] F32 tensor whose chunks are `chunks`.
Metadata EightByFour(std::vector<ChunkInfo> chunks) {
  Metadata m;
  m.checksum = ChecksumKind::kNone;
  m.files = {FileInfo{"data", 1024}};
  m.tensors = {TensorInfo{"w", DType::kF32, {8, 4}, std::move(chunks)}};
  return m;
}

TEST(CopySpansTest, RowRunsAreSpansAndColumnSplitsAreNot) {
  const Metadata rows =
      EightByFour({Chunk(Box({4, 0}, {4, 4}), 512, 64), Chunk(Box({0, 0}, {4, 4}), 0, 64)});
  std::optional<std::vector<ChunkSpan>> spans = CopySpans(rows, 0, 8, 24, false);
  ASSERT_TRUE(spans.has_value());
  ASSERT_EQ(spans->size(), 2u);
  EXPECT_EQ((*spans)[0].chunk, 1u);
  EXPECT_EQ((*spans)[0].file_offset, 32u);  // element 8 is row 2 of the first rows
  EXPECT_EQ((*spans)[0].length, 32u);
  EXPECT_EQ((*spans)[1].chunk, 0u);
  EXPECT_EQ((*spans)[1].file_offset, 512u);
  EXPECT_EQ((*spans)[1].length, 32u);
  // A part of one row ([3, 1:3]) is a run; a column split is not; nor is a gap.
  const Metadata part = EightByFour({Chunk(Box({3, 1}, {1, 2}), 100, 8)});
  spans = CopySpans(part, 0, 13, 15, false);
  ASSERT_TRUE(spans.has_value());
  EXPECT_EQ((*spans)[0].file_offset, 100u);
  EXPECT_FALSE(CopySpans(part, 0, 12, 15, false).has_value());
  const Metadata cols =
      EightByFour({Chunk(Box({0, 0}, {8, 2}), 0, 64), Chunk(Box({0, 2}, {8, 2}), 64, 64)});
  EXPECT_FALSE(CopySpans(cols, 0, 0, 32, false).has_value());
  // Another dimension order, or a stored length that does not match: not copied.
  Metadata order = rows;
  order.tensors[0].chunks[0].storage_order = {1, 0};
  EXPECT_FALSE(CopySpans(order, 0, 0, 32, false).has_value());
  Metadata length = rows;
  length.tensors[0].chunks[0].location.length = 63;
  EXPECT_FALSE(CopySpans(length, 0, 0, 32, false).has_value());
  // Checked: part of a chunk with one checksum for more than a block is left to the load path.
  Metadata one = rows;
  one.checksum = ChecksumKind::kXxh3_64;
  one.checksum_block_bytes = 16;
  EXPECT_FALSE(CopySpans(one, 0, 0, 8, true).has_value());
  EXPECT_TRUE(CopySpans(one, 0, 0, 16, true).has_value());
}

// One chunk of 3 MiB with one checksum: longer than the copy buffer.
void CopyOneLongBlock(Storage& storage, const std::string& dir) {
  const std::vector<uint8_t> bytes = testing::RandomBytes(3 << 20, 5);
  const std::string path = dir + "/data";
  {
    Result<std::unique_ptr<WritableFile>> out = storage.NewWritableFile(path);
    ASSERT_OK(out.status());
    ASSERT_OK((*out)->WriteAt(0, "hdr!", 4));
    ASSERT_OK((*out)->WriteAt(4, bytes.data(), bytes.size()));
    ASSERT_OK((*out)->Close());
  }
  CheckpointIndex index;
  index.root = dir;
  Metadata& m = index.metadata;
  // "data" is no safetensors file (4 bytes of "header"): an index of a format whose data files
  // have no header for the copy to check (HasSafetensorsDataFiles), as a DCP checkpoint's.
  m.format = CheckpointFormat::kTorchDist;
  m.checksum = ChecksumKind::kXxh3_64;
  m.checksum_block_bytes = 0;  // one checksum per chunk
  m.files = {FileInfo{"data", bytes.size() + 4}};
  ChunkInfo chunk = Chunk(Box({0, 0}, {768, 1024}), 4, bytes.size());
  chunk.location.checksum = Checksum(bytes.data(), bytes.size());
  m.tensors = {TensorInfo{"w", DType::kF32, {768, 1024}, {chunk}}};
  std::optional<std::vector<ChunkSpan>> spans = CopySpans(m, 0, 0, 768 * 1024, true);
  ASSERT_TRUE(spans.has_value());
  for (bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupt" : "intact");
    if (corrupt) m.tensors[0].chunks[0].location.checksum ^= 1;
    const std::string copy = dir + (corrupt ? "/bad" : "/copy");
    Result<std::unique_ptr<WritableFile>> out = storage.NewWritableFile(copy);
    ASSERT_OK(out.status());
    SourceFiles files(storage, index);
    uint64_t copied = 0, read = 0;
    const Status status = CopyPiece(
        files, index, 0, *spans, true, CopyTarget{out->get(), 10, false},
        [&](uint64_t n) { copied += n; }, [&](uint64_t n) { read += n; });
    ASSERT_OK((*out)->Close());
    if (corrupt) {
      EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.ToString();
      EXPECT_THAT(status.message(), HasSubstr("checksum mismatch in key 'w' chunk 0 [0:768, "
                                              "0:1024] of file " +
                                              path + " at offset 4"));
      EXPECT_EQ(copied, 0u);  // nothing written before its block is checked
      continue;
    }
    ASSERT_OK(status);
    EXPECT_EQ(copied, bytes.size());
    EXPECT_EQ(read, bytes.size());
    Result<std::unique_ptr<ReadableFile>> back = storage.NewReadableFile(copy);
    ASSERT_OK(back.status());
    ASSERT_EQ((*back)->size(), bytes.size() + 10);
    std::vector<uint8_t> got(bytes.size());
    ASSERT_OK((*back)->ReadAt(10, got.data(), got.size()));
    EXPECT_TRUE(got == bytes);
  }
}

TEST(CopyPieceTest, ALongBlockIsCheckedWhereItLiesThenCopied) {
  TempDir tmp;
  std::shared_ptr<Storage> posix = NewPosixStorage();  // maps
  CopyOneLongBlock(*posix, tmp.path());
}

TEST(CopyPieceTest, ALongBlockIsReadThroughTheBufferWhereTheStorageDoesNotMap) {
  MemoryStorage memory;
  ASSERT_OK(memory.CreateDirs("/ckpt"));
  CopyOneLongBlock(memory, "/ckpt");
}

}  // namespace
}  // namespace tessera
