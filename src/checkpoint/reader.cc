#include "checkpoint/reader.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <thread>

#include "format/checksum.h"
#include "format/manifest.h"

namespace tessera {
namespace {

// Bytes per read call. A run that is checksummed is read in pieces small enough to stay in the
// CPU's cache between the kernel's copy and the hash (bench/checksum_bench.cc: the hash then
// adds ~20% to the copy, against ~100% when it reads the bytes back from memory); others in
// large pieces.
constexpr uint64_t kCheckedReadPiece = 256u << 10;
constexpr uint64_t kReadPiece = 8u << 20;
// Bytes per read call of a manifest.
constexpr uint64_t kManifestPiece = 8u << 20;

std::string Hex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

std::string DescribeChunk(const Metadata& metadata, uint32_t tensor, uint32_t chunk) {
  const TensorInfo& t = metadata.tensors[tensor];
  return "key '" + t.key + "' chunk " + std::to_string(chunk) + " " +
         t.chunks[chunk].box.ToString();
}

}  // namespace

Result<Bytes> ReadManifestBytes(Storage& storage, const std::string& dir) {
  TESSERA_ASSIGN_OR_RETURN(FileType dir_type, storage.Stat(dir));
  if (dir_type == FileType::kNotFound) {
    return NotFound("checkpoint directory " + dir + " does not exist");
  }
  if (dir_type != FileType::kDirectory) {
    return FailedPrecondition(dir + " is not a directory");
  }
  const std::string path = JoinPath(dir, kManifestFileName);
  Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(path);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return FailedPrecondition(dir + " holds no committed checkpoint (no " +
                                std::string(kManifestFileName) +
                                "; a save that did not finish leaves none)");
    }
    return file.status();
  }
  // Nothing is allocated from a length the file claims until it is checked: the header first
  // (the file must have exactly the size it declares, within kMaxManifestBytes), then the
  // checksum, streamed through a small buffer, and only then the manifest's own buffer. A
  // corrupt or hostile manifest (e.g. sparse, 64 GiB) costs a short error, not its size in memory.
  const ReadableFile& in = **file;
  Bytes prefix(std::min<uint64_t>(in.size(), kManifestHeaderBytes));
  TESSERA_RETURN_IF_ERROR(in.ReadAt(0, prefix.data(), prefix.size()));
  TESSERA_ASSIGN_OR_RETURN(const uint64_t total, CheckManifestHeader(prefix, in.size(), path));
  const uint64_t covered = total - kManifestTrailerBytes;  // bytes the checksum covers
  std::vector<uint8_t> piece(std::min<uint64_t>(covered, kManifestPiece));
  ChecksumStream checksum;
  for (uint64_t done = 0; done < covered;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(piece.size(), covered - done));
    TESSERA_RETURN_IF_ERROR(in.ReadAt(done, piece.data(), n));
    checksum.Update(piece.data(), n);
    done += n;
  }
  uint64_t stored = 0;
  TESSERA_RETURN_IF_ERROR(in.ReadAt(covered, &stored, sizeof(stored)));  // little-endian host
  if (checksum.Digest() != stored) return ManifestChecksumMismatch(path);
  Bytes bytes(total);
  for (uint64_t done = 0; done < total;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kManifestPiece, total - done));
    TESSERA_RETURN_IF_ERROR(in.ReadAt(done, bytes.data() + done, n));
    done += n;
  }
  return bytes;
}

Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage& storage, const std::string& dir,
                                                   const Metadata& metadata, uint32_t file_index,
                                                   const std::string& needed_by) {
  const FileInfo& info = metadata.files[file_index];
  const std::string path = JoinPath(dir, info.name);
  Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(path);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return DataLoss("data file " + path + " listed in the manifest is missing (" + needed_by +
                      " is stored in it)");
    }
    return file.status().WithContext(needed_by);
  }
  if ((*file)->size() != info.size) {
    return DataLoss("data file " + path + " is " + std::to_string((*file)->size()) +
                    " bytes, the manifest says " + std::to_string(info.size) +
                    ((*file)->size() < info.size ? " (truncated)" : "") + "; " + needed_by +
                    " is stored in it");
  }
  return file;
}

namespace {

// Reads, with options.num_io_threads threads, every chunk that `runs` (sorted by file and
// offset, none of them covering its chunk whole) touch, whole and in pieces through one small
// buffer per thread: checks each chunk's checksum and copies out the parts the runs need.
// Hashing the chunks where they lie in a mapping of the file, copying only the needed parts,
// measured slower (tessera_bench_io_patterns: partial_chunk_load_mapped).
Status ReadPartialChunksChecked(const std::vector<std::unique_ptr<ReadableFile>>& files,
                                const std::string& dir, const Metadata& metadata,
                                const std::vector<ReadRun>& runs, const LoadOptions& options,
                                LoadReport& report) {
  // Groups of consecutive runs of one chunk (CoalesceRuns never merges across chunks).
  std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) into runs
  uint64_t total = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (i == 0 || runs[i].tensor != runs[i - 1].tensor || runs[i].chunk != runs[i - 1].chunk) {
      groups.emplace_back(i, i);
      total += metadata.tensors[runs[i].tensor].chunks[runs[i].chunk].location.length;
    }
    groups.back().second = i + 1;
  }
  // Contiguous ranges of groups of about equal bytes, one per thread.
  const size_t num_threads =
      std::min<size_t>(static_cast<size_t>(options.num_io_threads), groups.size());
  std::vector<size_t> bounds = {0};
  uint64_t acc = 0;
  for (size_t g = 0; g < groups.size() && bounds.size() < num_threads; ++g) {
    const ReadRun& first = runs[groups[g].first];
    acc += metadata.tensors[first.tensor].chunks[first.chunk].location.length;
    if (acc * num_threads >= total * bounds.size()) bounds.push_back(g + 1);
  }
  bounds.push_back(groups.size());
  std::vector<Status> statuses(bounds.size() - 1);
  std::vector<uint64_t> calls(bounds.size() - 1, 0);
  auto work = [&](size_t slice) {
    std::vector<std::byte> buffer(kCheckedReadPiece);
    for (size_t g = bounds[slice]; g < bounds[slice + 1]; ++g) {
      const auto [begin, end] = groups[g];
      const ReadRun& first = runs[begin];
      const ByteLocation& where = metadata.tensors[first.tensor].chunks[first.chunk].location;
      const ReadableFile& file = *files[first.file_index];
      ChecksumStream checksum;
      size_t next = begin;  // first run not yet wholly before the current piece
      for (uint64_t done = 0; done < where.length; ++calls[slice]) {
        const uint64_t n = std::min<uint64_t>(kCheckedReadPiece, where.length - done);
        const uint64_t piece_begin = where.offset + done, piece_end = piece_begin + n;
        Status s = file.ReadAt(piece_begin, buffer.data(), n);
        if (!s.ok()) {
          statuses[slice] =
              s.WithContext("reading " + DescribeChunk(metadata, first.tensor, first.chunk));
          return;
        }
        checksum.Update(buffer.data(), n);
        for (size_t r = next; r < end && runs[r].file_offset < piece_end; ++r) {
          const ReadRun& run = runs[r];
          const uint64_t from = std::max(run.file_offset, piece_begin);
          const uint64_t to = std::min(run.file_offset + run.length, piece_end);
          if (from < to) {
            std::memcpy(run.destination + (from - run.file_offset),
                        buffer.data() + (from - piece_begin), to - from);
          }
          if (run.file_offset + run.length <= piece_end) next = r + 1;
        }
        done += n;
      }
      if (checksum.Digest() != where.checksum) {
        statuses[slice] =
            DataLoss("checksum mismatch in " + DescribeChunk(metadata, first.tensor, first.chunk) +
                     " of file " + JoinPath(dir, metadata.files[first.file_index].name) +
                     " at offset " + std::to_string(where.offset) + ": expected " +
                     Hex(where.checksum) + ", got " + Hex(checksum.Digest()));
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t s = 1; s < statuses.size(); ++s) threads.emplace_back(work, s);
  if (!statuses.empty()) work(0);
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  report.bytes_read += total;
  for (uint64_t c : calls) report.read_calls += c;
  return Status::Ok();
}

}  // namespace

Status ExecuteReads(Storage& storage, const std::string& dir, const Metadata& metadata,
                    const std::vector<ReadRun>& runs, const LoadOptions& options,
                    LoadReport& report) {
  if (runs.empty()) return Status::Ok();
  if (options.verify_partial_chunks && options.verify_checksums) {
    // Runs of chunks needed whole go the usual way; the others through whole-chunk reads.
    std::vector<ReadRun> whole, partial;
    for (const ReadRun& run : runs) (run.whole_chunk ? whole : partial).push_back(run);
    if (!partial.empty()) {
      LoadOptions usual = options;
      usual.verify_partial_chunks = false;
      TESSERA_RETURN_IF_ERROR(ExecuteReads(storage, dir, metadata, whole, usual, report));
      std::vector<std::unique_ptr<ReadableFile>> files(metadata.files.size());
      for (const ReadRun& run : partial) {
        if (files[run.file_index]) continue;
        TESSERA_ASSIGN_OR_RETURN(files[run.file_index],
                                 OpenDataFile(storage, dir, metadata, run.file_index,
                                              DescribeChunk(metadata, run.tensor, run.chunk)));
      }
      return ReadPartialChunksChecked(files, dir, metadata, partial, options, report);
    }
  }
  // Open every file once, up front.
  std::vector<std::unique_ptr<ReadableFile>> files(metadata.files.size());
  uint64_t total = 0;
  for (const ReadRun& run : runs) {
    total += run.length;
    if (files[run.file_index]) continue;
    TESSERA_ASSIGN_OR_RETURN(files[run.file_index],
                             OpenDataFile(storage, dir, metadata, run.file_index,
                                          DescribeChunk(metadata, run.tensor, run.chunk)));
  }
  // Contiguous slices of the (file, offset)-sorted runs, of about equal bytes, one per thread:
  // each thread reads sequentially.
  const size_t num_threads =
      std::min<size_t>(static_cast<size_t>(options.num_io_threads), runs.size());
  std::vector<size_t> bounds = {0};
  uint64_t acc = 0;
  for (size_t i = 0; i < runs.size() && bounds.size() < num_threads; ++i) {
    acc += runs[i].length;
    // Never split the runs of one checksummed chunk between two threads.
    const bool inside_chunk = runs[i].whole_chunk && !runs[i].chunk_last;
    if (!inside_chunk && acc * num_threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  bounds.push_back(runs.size());
  std::vector<Status> statuses(bounds.size() - 1);
  std::vector<uint64_t> calls(bounds.size() - 1, 0);
  auto work = [&](size_t slice) {
    ChecksumStream checksum;  // of the whole chunk whose runs are being read
    for (size_t i = bounds[slice]; i < bounds[slice + 1]; ++i) {
      const ReadRun& run = runs[i];
      const bool check = run.whole_chunk && options.verify_checksums;
      if (check && run.chunk_first) checksum.Reset();
      // In pieces, each checksummed right after it is read, while it is in cache. Through
      // pread, not a mapping (ReadableFile::Map): copying out of a mapping and hashing the copy
      // measured no faster (build/tessera_bench_io_patterns, page_cache_read_seconds) and
      // slower in `tessera bench io`.
      const uint64_t piece = check ? kCheckedReadPiece : kReadPiece;
      for (uint64_t done = 0; done < run.length; ++calls[slice]) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(piece, run.length - done));
        Status s = files[run.file_index]->ReadAt(run.file_offset + done, run.destination + done, n);
        if (!s.ok()) {
          statuses[slice] =
              s.WithContext("reading " + DescribeChunk(metadata, run.tensor, run.chunk));
          return;
        }
        if (check) checksum.Update(run.destination + done, n);
        done += n;
      }
      if (!check || !run.chunk_last) continue;
      const ByteLocation& where = metadata.tensors[run.tensor].chunks[run.chunk].location;
      const uint64_t actual = checksum.Digest();
      if (actual != where.checksum) {
        statuses[slice] =
            DataLoss("checksum mismatch in " + DescribeChunk(metadata, run.tensor, run.chunk) +
                     " of file " + JoinPath(dir, metadata.files[run.file_index].name) +
                     " at offset " + std::to_string(where.offset) + ": expected " +
                     Hex(where.checksum) + ", got " + Hex(actual));
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t s = 1; s < statuses.size(); ++s) threads.emplace_back(work, s);
  work(0);
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  report.bytes_read += total;
  for (uint64_t c : calls) report.read_calls += c;
  return Status::Ok();
}

Status ReadObject(Storage& storage, const std::string& dir, const Metadata& metadata,
                  const ObjectInfo& object, const LoadOptions& options, std::vector<uint8_t>& out,
                  LoadReport& report) {
  const std::string what = "object '" + object.key + "'";
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                           OpenDataFile(storage, dir, metadata, object.location.file_index, what));
  std::vector<uint8_t> bytes(object.location.length);
  TESSERA_RETURN_IF_ERROR_CTX(file->ReadAt(object.location.offset, bytes.data(), bytes.size()),
                              "reading " + what);
  if (options.verify_checksums) {
    uint64_t actual = Checksum(bytes.data(), bytes.size());
    if (actual != object.location.checksum) {
      return DataLoss("checksum mismatch in " + what + " of file " +
                      JoinPath(dir, metadata.files[object.location.file_index].name) +
                      ": expected " + Hex(object.location.checksum) + ", got " + Hex(actual));
    }
  }
  out = std::move(bytes);
  report.bytes_read += object.location.length;
  report.read_calls += 1;
  return Status::Ok();
}

}  // namespace tessera
