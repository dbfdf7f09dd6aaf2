// The reader's building blocks, shared by ExecuteReads (reader.cc) and the job-wide read-once
// load (read_once_load.cc): how bytes are checked, put in place and described in errors.
#ifndef TESSERA_CHECKPOINT_READER_INTERNAL_H_
#define TESSERA_CHECKPOINT_READER_INTERNAL_H_

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/device_uploads.h"
#include "core/checksum.h"
#include "core/crc32.h"
#include "core/dtype_convert.h"
#include "format/tessera/manifest.h"
#include "plan/load_plan.h"

namespace tessera {

// Bytes per read call. A run that is checksummed is read in pieces small enough to stay in the
// CPU's cache between the kernel's copy and the hash (bench/checksum_bench.cc: the hash then
// adds ~20% to the copy, against ~100% when it reads the bytes back from memory); others in
// large pieces.
inline constexpr uint64_t kCheckedReadPiece = 256u << 10;
inline constexpr uint64_t kReadPiece = 8u << 20;

// The checksum of a unit's bytes, of the kind the index says: XXH3-64 (tessera), or CRC-32
// (the zip records of a PyTorch DCP checkpoint's items, ChecksumKind::kCrc32).
class UnitChecksum {
 public:
  explicit UnitChecksum(ChecksumKind kind) : crc_(kind == ChecksumKind::kCrc32) {}
  void Update(const void* data, size_t n) {
    if (crc_) {
      crc32_ = Crc32(data, n, crc32_);
    } else {
      xxh3_.Update(data, n);
    }
  }
  uint64_t Digest() const { return crc_ ? crc32_ : xxh3_.Digest(); }

 private:
  bool crc_;
  uint32_t crc32_ = 0;
  ChecksumStream xxh3_;
};

// Whether `chunk` has a checksum to check: every chunk of a checksummed index, but a DCP chunk
// that is only part of its zip record (ChecksumKind::kCrc32).
inline bool HasChecksum(const Metadata& metadata, const ChunkInfo& chunk) {
  if (metadata.checksum == ChecksumKind::kNone) return false;
  return metadata.checksum != ChecksumKind::kCrc32 || chunk.location.checksum < kUncheckedCrc32;
}

inline std::string DescribeChunk(const Metadata& metadata, uint32_t tensor, uint32_t chunk) {
  const TensorInfo& t = metadata.tensors[tensor];
  return "key '" + t.key + "' chunk " + std::to_string(chunk) + " " +
         t.chunks[chunk].box.ToString();
}

// Puts bytes in place: straight into host memory, or, for tensors in device memory, into the
// thread's pinned buffer (DeviceSink), from which they are copied to the device.
struct Placer {
  DeviceUploads* uploads = nullptr;  // null when nothing is loaded into device memory
  DeviceSink* sink = nullptr;        // this thread's, with `uploads`

  bool OnDevice(uint32_t tensor) const { return uploads && uploads->OnDevice(tensor); }

  // The most file bytes of one read that fit one pinned buffer once converted by `cast`.
  uint64_t MaxPart(const std::optional<DTypeCast>& cast) const {
    const uint64_t capacity = uploads->piece_bytes();
    return cast ? capacity / DTypeSize(cast->to) * DTypeSize(cast->from) : capacity;
  }

  // `n` bytes bound for `dst` (of metadata tensor `tensor`), converted from `cast->from` when
  // there is a cast (then `n` counts source bytes, whole elements).
  Status Put(uint32_t tensor, std::byte* dst, const std::byte* bytes, uint64_t n,
             const std::optional<DTypeCast>& cast) const {
    auto put = [&](std::byte* into, const std::byte* from, uint64_t m) {
      if (cast) {
        ConvertFloats(cast->from, from, cast->to, into,
                      static_cast<size_t>(m / DTypeSize(cast->from)));
      } else {
        std::memcpy(into, from, m);
      }
    };
    auto dest_bytes = [&](uint64_t m) {
      return cast ? m / DTypeSize(cast->from) * DTypeSize(cast->to) : m;
    };
    if (!OnDevice(tensor)) {
      put(dst, bytes, n);
      return Status::Ok();
    }
    const uint64_t step = MaxPart(cast);
    for (uint64_t done = 0; done < n;) {
      const uint64_t m = std::min(step, n - done);
      TESSERA_ASSIGN_OR_RETURN(std::byte * into,
                               sink->Reserve(tensor, dst + dest_bytes(done), dest_bytes(m)));
      put(into, bytes + done, m);
      done += m;
    }
    return Status::Ok();
  }
};

// A piece of a run that lies inside one checksum unit. `length` bytes of the file; with a
// cast, `destination` receives them converted (DestinationBytes of them).
struct Segment {
  uint64_t file_offset = 0;
  uint64_t length = 0;
  std::byte* destination = nullptr;
  std::optional<DTypeCast> cast;

  uint64_t DestinationBytes(uint64_t file_bytes) const {
    return cast ? file_bytes / DTypeSize(cast->from) * DTypeSize(cast->to) : file_bytes;
  }
  // Puts `n` file bytes of the segment, starting `at` bytes into it, in place: copied, or
  // converted while they are still in cache. With a cast, `at` and `n` are whole elements.
  Status Deliver(const Placer& placer, uint32_t tensor, uint64_t at, const std::byte* bytes,
                 uint64_t n) const {
    return placer.Put(tensor, destination + DestinationBytes(at), bytes, n, cast);
  }
};

// One read task: a checksum unit (a block of a chunk, or a whole chunk) and the segments of it
// the load needs, or, without verification, one run.
struct UnitRead {
  uint32_t file_index = 0;
  uint64_t offset = 0;  // of the unit in the file
  uint64_t length = 0;
  uint64_t checksum = 0;
  bool check = false;   // compare the unit's checksum
  bool direct = false;  // the segments are the whole unit: read them straight into place
  uint32_t tensor = 0;  // for error messages
  uint32_t chunk = 0;
  uint32_t segments_begin = 0;  // into the segment array
  uint32_t segments_end = 0;
};

// One thread's reads of a file of a storage where each read is a request
// (StorageCapabilities::coalesce_read_bytes): the ranges the thread will read that touch each
// other are fetched together, and so are ranges at most max_bytes / kMaxGapFraction apart, the
// smallest gaps first, while the gaps fetched stay within 1 / kMaxGapShare of the bytes the
// ranges hold (a load moves at most 5% more than it needs); at most `max_bytes` a read. Its own
// reads (pieces of 256 KiB) are served from memory. A read
// outside the planned ranges, or of `max_bytes` or more, goes to the file as it is. Not
// thread-safe: one per thread.
class CoalescingFile final : public ReadableFile {
 public:
  // Why fetch a gap: an object store's request costs its latency (10-50 ms to the first byte),
  // about what 1-5 MB take at one connection's 100 MB/s; a gap of up to 1/32 of a read (1 MiB
  // of 32 MiB reads) costs less to fetch than a request of its own. Small items a rank needs
  // lie near each other (the writer places items under kSmallItemBytes first in each file).
  static constexpr uint64_t kMaxGapFraction = 32;
  static constexpr uint64_t kMaxGapShare = 20;
  // `ranges`: [begin, end) byte ranges of `file`, in any order. `gap_budget`: the gap bytes
  // this file may fetch, spent from (a thread's files share one: GapBudget of all their
  // ranges); null: GapBudget of this file's ranges.
  CoalescingFile(const ReadableFile& file, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                 uint64_t max_bytes, uint64_t* gap_budget = nullptr);
  // The gap bytes ranges of `needed_bytes` in all may fetch.
  static uint64_t GapBudget(uint64_t needed_bytes) { return needed_bytes / kMaxGapShare; }
  Status ReadAt(uint64_t offset, void* dst, size_t n) const override;
  uint64_t size() const override { return file_.size(); }
  const std::string& path() const override { return file_.path(); }
  // Reads issued to the file so far.
  uint64_t reads() const { return reads_; }

 private:
  const ReadableFile& file_;
  std::vector<std::pair<uint64_t, uint64_t>> spans_;  // the ranges merged where they touch
  const uint64_t max_bytes_;
  mutable std::vector<std::byte> buffer_;
  mutable uint64_t begin_ = 0, end_ = 0;  // the file bytes buffer_ holds
  mutable uint64_t reads_ = 0;
};

// One thread's CoalescingFiles: for each file index of `ranges` (the byte ranges the thread
// will read there), a CoalescingFile over files[index], all of them spending one gap budget
// (GapBudget of every range): a thread's few reads of one file may bridge their gaps on the
// strength of its many reads of others (rank 1's reads of the small items rank 0 saved for all).
std::map<uint32_t, std::unique_ptr<CoalescingFile>> CoalesceThreadReads(
    const std::vector<std::unique_ptr<ReadableFile>>& files,
    std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges, uint64_t max_bytes);

// kDataLoss naming the chunk, the file and the offset of the unit whose bytes do not match, as
// text and as a kCorruption detail. Only the unit's file_index, offset, length, checksum,
// tensor and chunk are used.
Status ChecksumMismatch(const std::string& dir, const Metadata& metadata, const UnitRead& unit,
                        uint64_t actual);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_READER_INTERNAL_H_
