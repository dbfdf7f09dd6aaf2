#include "checkpoint/reader.h"

#include "checkpoint/reader_internal.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "core/checksum.h"
#include "core/crc32.h"
#include "core/dtype_convert.h"
#include "core/hex.h"
#include "format/registry.h"
#include "format/tessera/manifest.h"

namespace tessera {

Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage& storage, const std::string& dir,
                                                   const Metadata& metadata, uint32_t file_index,
                                                   const std::string& needed_by) {
  const FileInfo& info = metadata.files[file_index];
  const std::string path = JoinPath(dir, info.name);
  // The header is read next (DataFileHeaders); on S3 the open and that read are then one GET.
  Result<std::unique_ptr<ReadableFile>> file =
      FormatOf(metadata.format).DataFilesHaveHeaders()
          ? storage.NewReadableFileWithPrefix(path, kDataFileHeadPrefixBytes)
          : storage.NewReadableFile(path);
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

std::string ChecksumMismatchText(const std::string& dir, const Metadata& metadata,
                                 const UnitRead& unit, uint64_t actual) {
  const ChunkInfo& chunk = metadata.tensors[unit.tensor].chunks[unit.chunk];
  if (metadata.checksum == ChecksumKind::kCrc32) {
    char crcs[64];
    std::snprintf(crcs, sizeof(crcs),
                  "its zip record says %08" PRIx64 ", the bytes give %08" PRIx64, unit.checksum,
                  actual);
    return "CRC-32 mismatch in " + DescribeChunk(metadata, unit.tensor, unit.chunk) +
           " (the elements of a torch.save item) of file " +
           JoinPath(dir, metadata.files[unit.file_index].name) + " at offset " +
           std::to_string(unit.offset) + ": " + crcs;
  }
  std::string where = "checksum mismatch in " + DescribeChunk(metadata, unit.tensor, unit.chunk);
  if (unit.length != chunk.location.length) {
    where += " (block of " + std::to_string(unit.length) + " bytes at chunk byte " +
             std::to_string(unit.offset - chunk.location.offset) + ")";
  }
  return where + " of file " + JoinPath(dir, metadata.files[unit.file_index].name) + " at offset " +
         std::to_string(unit.offset) + ": expected " + Hex64(unit.checksum) + ", got " +
         Hex64(actual);
}

}  // namespace

// kDataLoss naming the chunk, the file and the offset of the unit whose bytes do not match, as
// text and as a kCorruption detail.
Status ChecksumMismatch(const std::string& dir, const Metadata& metadata, const UnitRead& unit,
                        uint64_t actual) {
  return DataLoss(ChecksumMismatchText(dir, metadata, unit, actual))
      .WithDetail({.kind = StatusDetail::Kind::kCorruption,
                   .keys = {metadata.tensors[unit.tensor].key},
                   .file = JoinPath(dir, metadata.files[unit.file_index].name),
                   .offset = static_cast<int64_t>(unit.offset)});
}

namespace {

// The checksum units of a chunk: blocks of `block` bytes (the last one shorter), or the whole
// chunk when it has no block checksums.
struct ChunkUnits {
  const ByteLocation* location;
  const std::vector<uint64_t>* blocks;
  uint64_t block;
  uint64_t UnitOf(uint64_t file_offset) const {
    return blocks->empty() ? 0 : (file_offset - location->offset) / block;
  }
  uint64_t Begin(uint64_t unit) const { return location->offset + unit * block; }
  uint64_t Length(uint64_t unit) const {
    if (blocks->empty()) return location->length;
    return std::min(block, location->length - unit * block);
  }
  uint64_t Checksum(uint64_t unit) const {
    return unit == 0 ? location->checksum : (*blocks)[unit - 1];
  }
};

// Turns runs (sorted by file and offset) into unit reads. A unit the runs cover whole is read
// straight into place; a unit they cover in part is read whole through a buffer when it can be
// checked (a block of a chunk, or a whole chunk with verify_partial_chunks), else its segments
// are read unchecked.
void PlanUnitReads(const Metadata& metadata, const std::vector<ReadRun>& runs,
                   const LoadOptions& options, std::vector<UnitRead>& units,
                   std::vector<Segment>& segments) {
  const bool verify = options.verify_checksums && metadata.checksum != ChecksumKind::kNone;
  for (const ReadRun& run : runs) {
    const ChunkInfo& chunk = metadata.tensors[run.tensor].chunks[run.chunk];
    const ChunkUnits chunk_units{&chunk.location, &chunk.block_checksums,
                                 metadata.checksum_block_bytes};
    for (uint64_t done = 0; done < run.length || run.length == 0;) {
      const uint64_t at = run.file_offset + done;
      const uint64_t unit = verify ? chunk_units.UnitOf(at) : 0;
      const uint64_t unit_end = verify ? chunk_units.Begin(unit) + chunk_units.Length(unit)
                                       : run.file_offset + run.length;
      const uint64_t n = std::min(run.length - done, unit_end - at);
      UnitRead* last = units.empty() ? nullptr : &units.back();
      const bool same_unit = verify && last && last->tensor == run.tensor &&
                             last->chunk == run.chunk && last->offset == chunk_units.Begin(unit);
      if (!same_unit) {
        UnitRead read;
        read.file_index = run.file_index;
        read.tensor = run.tensor;
        read.chunk = run.chunk;
        read.check = verify && HasChecksum(metadata, chunk);
        read.offset = verify ? chunk_units.Begin(unit) : at;
        read.length = verify ? chunk_units.Length(unit) : n;
        read.checksum = verify ? chunk_units.Checksum(unit) : 0;
        read.segments_begin = read.segments_end = static_cast<uint32_t>(segments.size());
        units.push_back(read);
        last = &units.back();
      }
      const uint64_t into =
          run.cast ? done / DTypeSize(run.cast->from) * DTypeSize(run.cast->to) : done;
      segments.push_back(Segment{at, n, run.destination + into, run.cast});
      last->segments_end = static_cast<uint32_t>(segments.size());
      done += n;
      if (run.length == 0) break;
    }
  }
  for (UnitRead& unit : units) {
    uint64_t covered = 0;
    for (uint32_t s = unit.segments_begin; s < unit.segments_end; ++s)
      covered += segments[s].length;
    unit.direct = covered == unit.length;
    const ChunkInfo& chunk = metadata.tensors[unit.tensor].chunks[unit.chunk];
    // A part of a chunk that has one checksum for all of it is checked only on request, by
    // reading all of it (checkpoints of format version 1, or with no block size).
    const bool whole_chunk_unit = chunk.block_checksums.empty() && unit.length > 0 &&
                                  unit.length == chunk.location.length &&
                                  metadata.checksum_block_bytes < unit.length;
    if (!unit.direct && whole_chunk_unit && !options.verify_partial_chunks) unit.check = false;
    if (!unit.check && !unit.direct) unit.direct = true;  // read only what is needed, unchecked
  }
}

// Performs one unit read. `buffer` holds kCheckedReadPiece bytes.
Status ReadUnit(const ReadableFile& file, const std::string& dir, const Metadata& metadata,
                const UnitRead& unit, const std::vector<Segment>& segments,
                std::vector<std::byte>& buffer, const Placer& placer, uint64_t& bytes_read,
                uint64_t& calls, ProgressMeter* progress) {
  auto context = [&] { return "reading " + DescribeChunk(metadata, unit.tensor, unit.chunk); };
  UnitChecksum checksum(metadata.checksum);
  if (unit.direct) {
    // In pieces, each checksummed right after it is read, while it is in cache. Through
    // pread, not a mapping (ReadableFile::Map): copying out of a mapping and hashing the copy
    // measured no faster (build/tessera_bench_io_patterns, page_cache_read_seconds) and
    // slower in `tessera bench io`.
    // A segment that converts goes through the buffer, piece by piece: each piece is
    // converted into place right after it is read (and checksummed).
    // In device memory, an uncast segment is read straight into the pinned buffer that is
    // copied to it, in parts that fit one.
    const bool device = placer.OnDevice(unit.tensor);
    for (uint32_t s = unit.segments_begin; s < unit.segments_end; ++s) {
      const Segment& seg = segments[s];
      uint64_t piece = unit.check || seg.cast ? kCheckedReadPiece : kReadPiece;
      if (device) piece = std::min(piece, placer.MaxPart(seg.cast));
      for (uint64_t done = 0; done < seg.length; ++calls) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(piece, seg.length - done));
        std::byte* into = seg.cast ? buffer.data() : seg.destination + done;
        if (device && !seg.cast) {
          TESSERA_ASSIGN_OR_RETURN(into, placer.sink->Reserve(unit.tensor, into, n));
        }
        TESSERA_RETURN_IF_ERROR_CTX(file.ReadAt(seg.file_offset + done, into, n), context());
        if (unit.check) checksum.Update(into, n);
        if (seg.cast) TESSERA_RETURN_IF_ERROR(seg.Deliver(placer, unit.tensor, done, into, n));
        if (progress) progress->Add(seg.DestinationBytes(n));
        done += n;
      }
      bytes_read += seg.length;
    }
  } else {
    // The whole unit through the buffer, checked, copying out the segments it needs.
    uint32_t next = unit.segments_begin;  // first segment not yet wholly before the piece
    for (uint64_t done = 0; done < unit.length; ++calls) {
      const uint64_t n = std::min<uint64_t>(kCheckedReadPiece, unit.length - done);
      const uint64_t piece_begin = unit.offset + done, piece_end = piece_begin + n;
      TESSERA_RETURN_IF_ERROR_CTX(file.ReadAt(piece_begin, buffer.data(), n), context());
      checksum.Update(buffer.data(), n);
      for (uint32_t s = next; s < unit.segments_end && segments[s].file_offset < piece_end; ++s) {
        const Segment& seg = segments[s];
        const uint64_t from = std::max(seg.file_offset, piece_begin);
        const uint64_t to = std::min(seg.file_offset + seg.length, piece_end);
        if (from < to) {
          TESSERA_RETURN_IF_ERROR(seg.Deliver(placer, unit.tensor, from - seg.file_offset,
                                              buffer.data() + (from - piece_begin), to - from));
          if (progress) progress->Add(seg.DestinationBytes(to - from));
        }
        if (seg.file_offset + seg.length <= piece_end) next = s + 1;
      }
      done += n;
    }
    bytes_read += unit.length;
  }
  if (unit.check && checksum.Digest() != unit.checksum) {
    return ChecksumMismatch(dir, metadata, unit, checksum.Digest());
  }
  return Status::Ok();
}

// A run that converts is cut into pieces of whole elements: at checksum block boundaries
// (PlanUnitReads) and every kCheckedReadPiece bytes from a block's start (ReadUnit). Blocks
// of a size that splits an element (no writer makes them) cannot be converted piecewise.
Status CheckCastAlignment(const Metadata& metadata, const std::vector<ReadRun>& runs,
                          const LoadOptions& options) {
  const uint64_t block = metadata.checksum_block_bytes;
  if (!options.verify_checksums || metadata.checksum == ChecksumKind::kNone || block == 0) {
    return Status::Ok();
  }
  for (const ReadRun& run : runs) {
    if (run.cast && block % DTypeSize(run.cast->from) != 0) {
      return InvalidArgument("key '" + metadata.tensors[run.tensor].key +
                             "': its checksum blocks of " + std::to_string(block) +
                             " bytes split elements of " + std::string(DTypeName(run.cast->from)) +
                             ", which cast_dtypes cannot convert piecewise (load it without "
                             "checksums or in its saved dtype)");
    }
  }
  return Status::Ok();
}

}  // namespace

CoalescingFile::CoalescingFile(const ReadableFile& file,
                               std::vector<std::pair<uint64_t, uint64_t>> ranges,
                               uint64_t max_bytes, uint64_t* gap_budget)
    : file_(file), max_bytes_(max_bytes) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> touching;
  uint64_t needed = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin >= end) continue;
    if (!touching.empty() && begin <= touching.back().second) {
      const uint64_t old_end = touching.back().second;
      touching.back().second = std::max(old_end, end);
      needed += touching.back().second - old_end;
    } else {
      touching.emplace_back(begin, end);
      needed += end - begin;
    }
  }
  // The gaps worth a fetch: at most max_bytes / kMaxGapFraction each, the smallest first, at
  // most kMaxGapShare of the needed bytes in all.
  const uint64_t max_gap = max_bytes / kMaxGapFraction;
  std::vector<std::pair<uint64_t, size_t>> gaps;  // (bytes, the span the gap follows)
  for (size_t i = 0; i + 1 < touching.size(); ++i) {
    const uint64_t gap = touching[i + 1].first - touching[i].second;
    if (gap <= max_gap) gaps.emplace_back(gap, i);
  }
  std::sort(gaps.begin(), gaps.end());
  std::vector<bool> bridged(touching.size(), false);
  uint64_t own_budget = GapBudget(needed);
  uint64_t& budget = gap_budget != nullptr ? *gap_budget : own_budget;
  for (const auto& [gap, i] : gaps) {
    if (gap > budget) break;
    budget -= gap;
    bridged[i] = true;
  }
  for (size_t i = 0; i < touching.size(); ++i) {
    if (i > 0 && bridged[i - 1]) {
      spans_.back().second = touching[i].second;
    } else {
      spans_.push_back(touching[i]);
    }
  }
}

std::map<uint32_t, std::unique_ptr<CoalescingFile>> CoalesceThreadReads(
    const std::vector<std::unique_ptr<ReadableFile>>& files,
    std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges, uint64_t max_bytes) {
  uint64_t needed = 0;
  for (const auto& [f, list] : ranges) {
    for (const auto& [begin, end] : list) needed += end - begin;
  }
  uint64_t gap_budget = CoalescingFile::GapBudget(needed);
  std::map<uint32_t, std::unique_ptr<CoalescingFile>> out;
  for (auto& [f, list] : ranges) {
    out[f] = std::make_unique<CoalescingFile>(*files[f], std::move(list), max_bytes, &gap_budget);
  }
  return out;
}

Status CoalescingFile::ReadAt(uint64_t offset, void* dst, size_t n) const {
  if (n == 0) return Status::Ok();
  if (offset >= begin_ && offset + n <= end_) {
    std::memcpy(dst, buffer_.data() + (offset - begin_), n);
    return Status::Ok();
  }
  // The span holding the read: the last one that begins at or before it.
  auto it = std::upper_bound(spans_.begin(), spans_.end(), std::make_pair(offset, UINT64_MAX));
  ++reads_;
  if (n >= max_bytes_ || it == spans_.begin() || std::prev(it)->second < offset + n) {
    return file_.ReadAt(offset, dst, n);
  }
  const uint64_t end = std::min(std::prev(it)->second, offset + max_bytes_);
  buffer_.resize(end - offset);
  begin_ = end_ = 0;
  TESSERA_RETURN_IF_ERROR(file_.ReadAt(offset, buffer_.data(), buffer_.size()));
  begin_ = offset;
  end_ = end;
  std::memcpy(dst, buffer_.data(), n);
  return Status::Ok();
}

Status ExecuteReads(Storage& storage, const std::string& dir, const Metadata& metadata,
                    const std::vector<ReadRun>& runs, const LoadOptions& options,
                    LoadReport& report, DataFileHeaders* headers, ProgressMeter* progress,
                    DeviceUploads* uploads) {
  if (runs.empty()) return Status::Ok();
  TESSERA_RETURN_IF_ERROR(CheckCastAlignment(metadata, runs, options));
  std::vector<UnitRead> units;
  std::vector<Segment> segments;
  PlanUnitReads(metadata, runs, options, units, segments);
  // Open every file once, up front.
  std::vector<std::unique_ptr<ReadableFile>> files(metadata.files.size());
  uint64_t total = 0;
  for (const UnitRead& unit : units) {
    total += unit.direct ? 0 : unit.length;
    for (uint32_t s = unit.segments_begin; unit.direct && s < unit.segments_end; ++s) {
      total += segments[s].length;
    }
    if (!files[unit.file_index]) {
      TESSERA_ASSIGN_OR_RETURN(files[unit.file_index],
                               OpenDataFile(storage, dir, metadata, unit.file_index,
                                            DescribeChunk(metadata, unit.tensor, unit.chunk)));
    }
  }
  // What Verify checks of each file read from: its header describes every chunk read.
  if (headers != nullptr && FormatOf(metadata.format).DataFilesHaveHeaders()) {
    for (size_t i = 0; i < units.size(); ++i) {
      const UnitRead& unit = units[i];
      if (i > 0 && units[i - 1].tensor == unit.tensor && units[i - 1].chunk == unit.chunk) {
        continue;  // blocks of one chunk come one after another
      }
      const TensorInfo& t = metadata.tensors[unit.tensor];
      const ChunkInfo& c = t.chunks[unit.chunk];
      TESSERA_RETURN_IF_ERROR(headers->Check(*files[unit.file_index], unit.file_index, c.location,
                                             t.dtype, StoredShape(c),
                                             DescribeChunk(metadata, unit.tensor, unit.chunk)));
    }
  }
  // Contiguous slices of the (file, offset)-sorted units, of about equal bytes, one per
  // thread: each thread reads sequentially.
  const size_t num_threads =
      std::min<size_t>(static_cast<size_t>(options.num_io_threads), units.size());
  std::vector<size_t> bounds = {0};
  uint64_t acc = 0;
  for (size_t i = 0; i < units.size() && bounds.size() < num_threads; ++i) {
    acc += units[i].length;
    if (acc * num_threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  bounds.push_back(units.size());
  const size_t slices = bounds.size() - 1;
  std::vector<Status> statuses(slices);
  std::vector<uint64_t> bytes(slices, 0), calls(slices, 0);
  const uint64_t coalesce = storage.capabilities().coalesce_read_bytes;
  auto work = [&](size_t slice) {
    std::vector<std::byte> buffer(kCheckedReadPiece);
    DeviceSink sink(uploads);
    const Placer placer{uploads, &sink};
    // On an object store, the slice's reads of each file in requests of up to `coalesce`.
    std::map<uint32_t, std::unique_ptr<CoalescingFile>> coalesced;
    if (coalesce > 0) {
      std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
      for (size_t i = bounds[slice]; i < bounds[slice + 1]; ++i) {
        const UnitRead& u = units[i];
        if (!u.direct) ranges[u.file_index].emplace_back(u.offset, u.offset + u.length);
        for (uint32_t s = u.segments_begin; u.direct && s < u.segments_end; ++s) {
          ranges[u.file_index].emplace_back(segments[s].file_offset,
                                            segments[s].file_offset + segments[s].length);
        }
      }
      coalesced = CoalesceThreadReads(files, std::move(ranges), coalesce);
    }
    for (size_t i = bounds[slice]; i < bounds[slice + 1] && statuses[slice].ok(); ++i) {
      const uint32_t f = units[i].file_index;
      const ReadableFile& file = coalesce > 0 ? *coalesced[f] : *files[f];
      statuses[slice] = ReadUnit(file, dir, metadata, units[i], segments, buffer, placer,
                                 bytes[slice], calls[slice], progress);
    }
    if (coalesce > 0) {  // the reads that reached storage
      calls[slice] = 0;
      for (const auto& [f, file] : coalesced) calls[slice] += file->reads();
    }
    if (statuses[slice].ok()) statuses[slice] = sink.Flush();
  };
  if (progress) {
    progress->ParallelFor(slices, work);  // the calling thread reports
  } else {
    std::vector<std::thread> threads;
    for (size_t s = 1; s < slices; ++s) threads.emplace_back(work, s);
    if (slices > 0) work(0);
    for (std::thread& t : threads) t.join();
  }
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  for (size_t s = 0; s < slices; ++s) {
    report.bytes_read += bytes[s];
    report.read_calls += calls[s];
  }
  return Status::Ok();
}

Status ExecutePermutedCopies(Storage& storage, const std::string& dir, const Metadata& metadata,
                             const std::vector<PermutedCopy>& copies, const LoadOptions& options,
                             LoadReport& report, DataFileHeaders* headers, DeviceUploads* uploads) {
  std::vector<std::byte> chunk_bytes;
  DeviceSink sink(uploads);  // appends while destinations are contiguous
  const Placer placer{uploads, &sink};
  for (const PermutedCopy& copy : copies) {
    const TensorInfo& tensor = metadata.tensors[copy.tensor];
    const ChunkInfo& chunk = tensor.chunks[copy.chunk];
    // The chunk whole, checked block by block like any other read of it.
    chunk_bytes.resize(chunk.location.length);
    ReadRun whole{chunk.location.file_index, chunk.location.offset, chunk.location.length,
                  chunk_bytes.data(),        copy.tensor,           copy.chunk};
    TESSERA_RETURN_IF_ERROR(
        ExecuteReads(storage, dir, metadata, {whole}, options, report, headers));
    // Strides of the stored layout, in elements, per global dimension.
    const size_t rank = chunk.box.rank();
    std::vector<int64_t> stride(rank, 0);
    int64_t step = 1;
    for (size_t i = rank; i-- > 0;) {
      stride[chunk.storage_order[i]] = step;
      step *= chunk.box.sizes[chunk.storage_order[i]];
    }
    const size_t element = DTypeSize(tensor.dtype);
    const size_t dst_element = copy.cast ? DTypeSize(copy.cast->to) : element;
    const std::vector<int64_t> dst_strides = RowMajorStrides(copy.layout.sizes);
    std::vector<int64_t> index(rank, 0);  // within copy.part, last fastest
    const int64_t count = copy.part.NumElements();
    for (int64_t n = 0; n < count; ++n) {
      int64_t src = 0, dst = 0;
      for (size_t d = 0; d < rank; ++d) {
        const int64_t at = copy.part.offsets[d] + index[d];
        src += (at - chunk.box.offsets[d]) * stride[d];
        dst += (at - copy.layout.offsets[d]) * dst_strides[d];
      }
      TESSERA_RETURN_IF_ERROR(placer.Put(copy.tensor, copy.destination + dst * dst_element,
                                         chunk_bytes.data() + src * element, element, copy.cast));
      for (size_t d = rank; d-- > 0;) {
        if (++index[d] < copy.part.sizes[d]) break;
        index[d] = 0;
      }
    }
  }
  return sink.Flush();
}

namespace {

// The checks of an object's bytes read whole: the format's own (DCP: the CRC-32 of every zip
// record of a torch.save item), else tessera's XXH3 of the object.
Status CheckObjectBytes(const Format& format, const std::string& dir, const Metadata& metadata,
                        const ObjectInfo& object, const std::vector<uint8_t>& bytes,
                        const std::string& what) {
  const std::string file = JoinPath(dir, metadata.files[object.location.file_index].name);
  TESSERA_ASSIGN_OR_RETURN(
      const bool checked,
      format.CheckObjectBytes(
          object, bytes,
          file + " item at " + std::to_string(object.location.offset) + " (" + what + ")"));
  if (checked || metadata.checksum != ChecksumKind::kXxh3_64) return Status::Ok();
  const uint64_t actual = Checksum(bytes.data(), bytes.size());
  if (actual != object.location.checksum) {
    return DataLoss("checksum mismatch in " + what + " of file " + file + ": expected " +
                    Hex64(object.location.checksum) + ", got " + Hex64(actual))
        .WithDetail({.kind = StatusDetail::Kind::kCorruption,
                     .keys = {object.key},
                     .file = file,
                     .offset = static_cast<int64_t>(object.location.offset)});
  }
  return Status::Ok();
}

}  // namespace

Status ReadObject(Storage& storage, const std::string& dir, const Metadata& metadata,
                  const ObjectInfo& object, const LoadOptions& options, std::vector<uint8_t>& out,
                  LoadReport& report, DataFileHeaders* headers) {
  const std::string what = "object '" + object.key + "'";
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                           OpenDataFile(storage, dir, metadata, object.location.file_index, what));
  const Format& format = FormatOf(metadata.format);
  if (headers != nullptr && format.DataFilesHaveHeaders()) {
    TESSERA_RETURN_IF_ERROR(
        headers->Check(*file, object.location.file_index, object.location, DType::kU8,
                       Shape{static_cast<int64_t>(object.location.length)}, what));
  }
  std::vector<uint8_t> bytes(object.location.length);
  TESSERA_RETURN_IF_ERROR_CTX(file->ReadAt(object.location.offset, bytes.data(), bytes.size()),
                              "reading " + what);
  if (options.verify_checksums) {
    TESSERA_RETURN_IF_ERROR(CheckObjectBytes(format, dir, metadata, object, bytes, what));
  }
  out = std::move(bytes);
  report.bytes_read += object.location.length;
  report.read_calls += 1;
  return Status::Ok();
}

}  // namespace tessera
