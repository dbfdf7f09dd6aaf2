#include "checkpoint/convert_copy.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <utility>

#include "checkpoint/reader.h"
#include "core/checksum.h"
#include "core/hex.h"
#include "format/registry.h"

namespace tessera {
namespace {

// Source bytes per step of a checked span whose checksum blocks are no longer than this: read
// into the thread's buffer, hashed and written from it while they are still in the CPU's
// cache (two copies, both from cache; `cp` copies this way too, through 128 KiB). Measured
// against copying each checked step with CopyFrom (copy_file_range: one copy, in the kernel),
// `tessera bench convert --size 1GiB --layout dp2` on ext4 (kernel 6.18, 2 shared cores):
// this path 0.34-0.44 s, CopyFrom 0.55-0.80 s (the source hashed where it lies in a mapping,
// or read through 256 KiB), the load path 0.44-0.86 s; 1 MiB steps 0.34 s against 0.44 s for
// 256 KiB (fewer writes contending for the output file's lock).
constexpr uint64_t kBufferedStep = 1u << 20;
// Longer blocks (a chunk with one checksum) are hashed first, then copied with CopyFrom: a
// window of this size at a time where they lie in a mapping (verify.cc's kVerifyPiece), or
// read through kReadStep bytes.
constexpr uint64_t kMapWindow = 16u << 20;
constexpr uint64_t kReadStep = 256u << 10;
// Without checks, bytes per CopyFrom: progress advances between the calls.
constexpr uint64_t kUncheckedStep = 8u << 20;
// Ranges shorter than this are read, not mapped: one system call costs less than mapping and
// unmapping (verify.cc's kMinMappedPiece).
constexpr uint64_t kMinMappedBytes = 1u << 20;

// The first element and the number of elements of `box` in the row-major order of `shape`
// when they are one run of it; nullopt otherwise.
std::optional<std::pair<int64_t, int64_t>> RowMajorRun(const Box& box, const Shape& shape) {
  if (box.rank() != shape.size()) return std::nullopt;
  size_t k = 0;  // the first dimension that is not 1: every later one must be full
  while (k < box.rank() && box.sizes[k] == 1) ++k;
  for (size_t d = k + 1; d < box.rank(); ++d) {
    if (box.offsets[d] != 0 || box.sizes[d] != shape[d]) return std::nullopt;
  }
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  int64_t first = 0;
  for (size_t d = 0; d < box.rank(); ++d) first += box.offsets[d] * strides[d];
  return std::make_pair(first, box.NumElements());
}

bool RowMajorOrder(const std::vector<uint8_t>& order) {
  for (size_t d = 0; d < order.size(); ++d) {
    if (order[d] != d) return false;
  }
  return true;
}

std::string DescribeChunk(const TensorInfo& t, uint32_t chunk) {
  return "key '" + t.key + "' chunk " + std::to_string(chunk) + " " +
         t.chunks[chunk].box.ToString();
}

// Checks the checksum blocks of one chunk in order, as their bytes arrive.
class BlockChecker {
 public:
  BlockChecker(const TensorInfo& tensor, uint32_t chunk, uint64_t block, uint64_t first_block,
               const std::string& path)
      : tensor_(tensor),
        chunk_index_(chunk),
        chunk_(tensor.chunks[chunk]),
        block_(block),
        index_(first_block),
        path_(path) {}

  // Hashes `n` bytes at file offset `at` (right after the ones before), checking every block
  // they complete.
  Status Add(const std::byte* data, uint64_t at, uint64_t n) {
    while (n > 0) {
      const uint64_t end = BlockBegin(index_) + BlockLength(index_);
      const uint64_t take = std::min(n, end - at);
      stream_.Update(data, take);
      data += take, at += take, n -= take;
      if (at < end) break;
      const uint64_t expected =
          index_ == 0 ? chunk_.location.checksum : chunk_.block_checksums[index_ - 1];
      if (stream_.Digest() != expected) return Mismatch(expected, stream_.Digest());
      stream_.Reset();
      ++index_;
    }
    return Status::Ok();
  }
  // File offset before which every byte has been checked.
  uint64_t checked_end() const { return BlockBegin(index_); }

 private:
  uint64_t BlockBegin(uint64_t i) const {
    return chunk_.location.offset + std::min(i * block_, chunk_.location.length);
  }
  uint64_t BlockLength(uint64_t i) const {
    return std::min(block_, chunk_.location.length - i * block_);
  }
  // The load path's message (reader.cc, ChecksumMismatch).
  Status Mismatch(uint64_t expected, uint64_t actual) const {
    std::string where = "checksum mismatch in " + DescribeChunk(tensor_, chunk_index_);
    if (BlockLength(index_) != chunk_.location.length) {
      where += " (block of " + std::to_string(BlockLength(index_)) + " bytes at chunk byte " +
               std::to_string(index_ * block_) + ")";
    }
    return DataLoss(where + " of file " + path_ + " at offset " +
                    std::to_string(BlockBegin(index_)) + ": expected " + Hex64(expected) +
                    ", got " + Hex64(actual));
  }

  const TensorInfo& tensor_;
  const uint32_t chunk_index_;
  const ChunkInfo& chunk_;
  const uint64_t block_;
  uint64_t index_;  // the block being hashed
  const std::string& path_;
  ChecksumStream stream_;
};

// Copies [from, to) of `src` to the target, where `span_begin` goes to `out`.
Status CopyRange(const ReadableFile& src, uint64_t from, uint64_t to, uint64_t span_begin,
                 uint64_t out, const CopyTarget& target,
                 const std::function<void(uint64_t)>& copied) {
  if (from >= to) return Status::Ok();
  const uint64_t at = out + (from - span_begin);
  TESSERA_RETURN_IF_ERROR(target.file->CopyFrom(src, from, at, to - from));
  if (target.writeback) TESSERA_RETURN_IF_ERROR(target.file->StartWriteback(at, to - from));
  if (copied) copied(to - from);
  return Status::Ok();
}

// Writes the part of [at, at + n) of the source (in `data`) that lies in `span`.
Status WriteSpanPart(const std::byte* data, uint64_t at, uint64_t n, const ChunkSpan& span,
                     uint64_t out, const CopyTarget& target,
                     const std::function<void(uint64_t)>& copied) {
  const uint64_t from = std::max(at, span.file_offset);
  const uint64_t to = std::min(at + n, span.file_offset + span.length);
  if (from >= to) return Status::Ok();
  const uint64_t dst = out + (from - span.file_offset);
  TESSERA_RETURN_IF_ERROR(target.file->WriteAt(dst, data + (from - at), to - from));
  if (target.writeback) TESSERA_RETURN_IF_ERROR(target.file->StartWriteback(dst, to - from));
  if (copied) copied(to - from);
  return Status::Ok();
}

// A span whose blocks are at most kBufferedStep long: whole blocks read into `buffer` a step
// at a time, checked, and the span's part of them written from the buffer.
Status CopyBufferedSpan(const ReadableFile& src, BlockChecker& checker, uint64_t block,
                        uint64_t begin, uint64_t end, const ChunkSpan& span, uint64_t out,
                        const CopyTarget& target, std::vector<std::byte>& buffer,
                        const std::function<void(uint64_t)>& copied,
                        const std::function<void(uint64_t)>& read) {
  const uint64_t step = kBufferedStep / block * block;
  if (buffer.size() < step) buffer.resize(step);
  for (uint64_t pos = begin; pos < end;) {
    const uint64_t n = std::min(step, end - pos);
    TESSERA_RETURN_IF_ERROR(src.ReadAt(pos, buffer.data(), static_cast<size_t>(n)));
    if (read) read(n);
    TESSERA_RETURN_IF_ERROR(checker.Add(buffer.data(), pos, n));
    if (checker.checked_end() != pos + n) {  // steps are whole blocks, or end the chunk
      return Internal("bytes of the source read but not checked at offset " + std::to_string(pos) +
                      " of " + src.path());
    }
    TESSERA_RETURN_IF_ERROR(WriteSpanPart(buffer.data(), pos, n, span, out, target, copied));
    pos += n;
  }
  return Status::Ok();
}

// One span, its blocks checked step by step, each step copied once checked: through the
// buffer when its blocks are short, else hashed (mapped, or read through the buffer) and then
// copied by CopyFrom.
Status CopyCheckedSpan(const ReadableFile& src, const Metadata& metadata, const TensorInfo& t,
                       const ChunkSpan& span, uint64_t out, const CopyTarget& target,
                       std::vector<std::byte>& buffer, const std::function<void(uint64_t)>& copied,
                       const std::function<void(uint64_t)>& read) {
  const ChunkInfo& c = t.chunks[span.chunk];
  const bool one_checksum = c.block_checksums.empty() || metadata.checksum_block_bytes == 0;
  const uint64_t block =
      one_checksum ? std::max<uint64_t>(c.location.length, 1) : metadata.checksum_block_bytes;
  const uint64_t first = (span.file_offset - c.location.offset) / block;
  const uint64_t last = (span.file_offset + span.length - 1 - c.location.offset) / block;
  const uint64_t begin = c.location.offset + first * block;
  const uint64_t end = c.location.offset + std::min((last + 1) * block, c.location.length);
  BlockChecker checker(t, span.chunk, block, first, src.path());
  if (block <= kBufferedStep) {
    return CopyBufferedSpan(src, checker, block, begin, end, span, out, target, buffer, copied,
                            read);
  }
  const uint64_t span_end = span.file_offset + span.length;
  uint64_t copied_to = span.file_offset;
  for (uint64_t pos = begin; pos < end;) {
    // A window of the file mapped (bounded: a chunk may be gigabytes), or one read piece.
    const uint64_t window = std::min(kMapWindow, end - pos);
    std::optional<FileMapping> mapping;
    if (window >= kMinMappedBytes) {
      Result<FileMapping> mapped = src.Map(pos, static_cast<size_t>(window));
      if (mapped.ok()) mapping = std::move(*mapped);  // else ReadAt reports what is wrong
    }
    const uint64_t n = mapping ? window : std::min(kReadStep, end - pos);
    const std::byte* data;
    if (mapping) {
      data = mapping->bytes().data();
    } else {
      if (buffer.size() < kReadStep) buffer.resize(kReadStep);
      TESSERA_RETURN_IF_ERROR(src.ReadAt(pos, buffer.data(), static_cast<size_t>(n)));
      data = buffer.data();
    }
    TESSERA_RETURN_IF_ERROR(checker.Add(data, pos, n));
    if (read) read(n);
    pos += n;
    const uint64_t copy_end = std::min(checker.checked_end(), span_end);
    TESSERA_RETURN_IF_ERROR(
        CopyRange(src, copied_to, copy_end, span.file_offset, out, target, copied));
    copied_to = std::max(copied_to, copy_end);
  }
  if (copied_to != span_end) {
    return Internal("copying " + DescribeChunk(t, span.chunk) + ": " +
                    std::to_string(span_end - copied_to) + " bytes were never checked");
  }
  return Status::Ok();
}

}  // namespace

std::optional<std::vector<ChunkSpan>> CopySpans(const Metadata& metadata, uint32_t tensor,
                                                int64_t begin, int64_t end, bool verify) {
  const TensorInfo& t = metadata.tensors[tensor];
  const uint64_t size = DTypeSize(t.dtype);
  struct Run {
    int64_t first, count;
    uint32_t chunk;
  };
  std::vector<Run> runs;
  for (uint32_t i = 0; i < t.chunks.size(); ++i) {
    const ChunkInfo& c = t.chunks[i];
    if (c.box.empty()) continue;
    if (c.encoding != ChunkEncoding::kRaw || !RowMajorOrder(c.storage_order)) continue;
    const std::optional<std::pair<int64_t, int64_t>> run = RowMajorRun(c.box, t.global_shape);
    if (!run || c.location.length != static_cast<uint64_t>(run->second) * size) continue;
    runs.push_back(Run{run->first, run->second, i});
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.first < b.first; });
  std::vector<ChunkSpan> spans;
  for (int64_t at = begin; at < end;) {
    auto after = std::upper_bound(runs.begin(), runs.end(), at,
                                  [](int64_t v, const Run& r) { return v < r.first; });
    if (after == runs.begin()) return std::nullopt;
    const Run& run = *(after - 1);
    if (at >= run.first + run.count) return std::nullopt;  // a gap, or a chunk not a run
    const int64_t stop = std::min(end, run.first + run.count);
    const ChunkInfo& c = t.chunks[run.chunk];
    ChunkSpan span{run.chunk, c.location.offset + static_cast<uint64_t>(at - run.first) * size,
                   static_cast<uint64_t>(stop - at) * size};
    const bool one_checksum =
        c.block_checksums.empty() && c.location.length > metadata.checksum_block_bytes;
    if (verify && one_checksum && span.length != c.location.length) return std::nullopt;
    spans.push_back(span);
    at = stop;
  }
  if (spans.empty()) return std::nullopt;
  return spans;
}

Result<const ReadableFile*> SourceFiles::Get(uint32_t file_index, const std::string& needed_by) {
  std::unique_ptr<ReadableFile>& file = open_[file_index];
  if (!file) {
    TESSERA_ASSIGN_OR_RETURN(
        file, OpenDataFile(storage_, index_.root, index_.metadata, file_index, needed_by));
  }
  return file.get();
}

Status CopyPiece(SourceFiles& files, const CheckpointIndex& index, uint32_t tensor,
                 const std::vector<ChunkSpan>& spans, bool verify, const CopyTarget& target,
                 const std::function<void(uint64_t)>& copied,
                 const std::function<void(uint64_t)>& read) {
  const Metadata& metadata = index.metadata;
  const TensorInfo& t = metadata.tensors[tensor];
  std::vector<std::byte>& buffer = files.buffer();
  uint64_t out = target.offset;
  for (const ChunkSpan& span : spans) {
    const std::string what = DescribeChunk(t, span.chunk);
    const ChunkInfo& c = t.chunks[span.chunk];
    Result<const ReadableFile*> src = files.Get(c.location.file_index, what);
    if (!src.ok()) return src.status();
    if (FormatOf(metadata.format)
            .DataFilesHaveHeaders()) {  // what Verify and loads check of the file
      TESSERA_RETURN_IF_ERROR(index.headers->Check(**src, c.location.file_index, c.location,
                                                   t.dtype, StoredShape(c), what));
    }
    Status status;
    if (verify) {
      status = CopyCheckedSpan(**src, metadata, t, span, out, target, buffer, copied, read);
    } else {
      for (uint64_t done = 0; status.ok() && done < span.length; done += kUncheckedStep) {
        const uint64_t n = std::min(kUncheckedStep, span.length - done);
        const uint64_t from = span.file_offset + done;
        status = CopyRange(**src, from, from + n, span.file_offset, out, target, copied);
        if (status.ok() && read) read(n);
      }
    }
    if (!status.ok()) {
      if (status.code() == StatusCode::kDataLoss &&
          status.message().starts_with("checksum mismatch")) {
        return status;
      }
      return status.WithContext("reading " + what);
    }
    out += span.length;
  }
  return Status::Ok();
}

}  // namespace tessera
