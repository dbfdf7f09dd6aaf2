#include "checkpoint/convert_writer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "checkpoint/convert_copy.h"
#include "checkpoint/load_internal.h"
#include "core/checksum.h"
#include "core/crc32.h"
#include "core/dtype_convert.h"
#include "format/tessera/manifest.h"

namespace tessera {
namespace {

constexpr auto kProgressInterval = std::chrono::milliseconds(100);

// What every thread of the rank shares. Each thread writes disjoint entries of the checksum
// tables (the blocks of the units and the objects it took), sized before the threads start.
struct Shared {
  Storage& storage;  // the source's
  Storage& output;   // the output's
  const std::string& dir;
  const CheckpointIndex& index;
  const std::string& source;
  const ConvertPlan& plan;
  const OutputLayout& layout;
  const RankWriteOptions& options;
  LoadOptions load_options;
  std::vector<std::unique_ptr<WritableFile>> files;  // by plan file; null when not ours
  // By plan tensor, per block: tessera's checksum (layout.engine_checksums) and the CRC-32
  // (layout.framing_crc32).
  std::vector<std::vector<uint64_t>> tensor_checksums;
  std::vector<std::vector<uint32_t>> tensor_crcs;
  std::vector<uint64_t> object_checksums;  // by plan object (engine checksums)
  std::vector<uint64_t> object_lengths;    // by plan object: its item's stored length
  std::atomic<uint64_t> written{0};
  std::atomic<uint64_t> read{0};
};

// One thread's tools: a Comm of its own for the loads, the source files it copies from, and
// its buffers, which grow to the largest unit it takes and are reused.
class Worker {
 public:
  Worker(Storage& storage, const CheckpointIndex& index)
      : comm_(NewSingleRankComm()), sources_(storage, index) {}
  Comm& comm() { return *comm_; }
  SourceFiles& sources() { return sources_; }
  std::byte* Out(size_t n) { return Grow(out_, out_size_, n); }
  std::byte* Src(size_t n) { return Grow(src_, src_size_, n); }

 private:
  static std::byte* Grow(std::unique_ptr<std::byte[]>& buffer, size_t& size, size_t n) {
    if (n > size) {
      buffer.reset();  // the old one first: never both in memory
      buffer = std::make_unique_for_overwrite<std::byte[]>(n);
      size = n;
    }
    return buffer.get();
  }

  std::unique_ptr<Comm> comm_;
  SourceFiles sources_;
  std::unique_ptr<std::byte[]> out_, src_;
  size_t out_size_ = 0, src_size_ = 0;
};

std::string OutputPath(const Shared& s, uint32_t file) {
  return JoinPath(s.dir, s.layout.names[file]);
}

// Loads `pieces` (of one unit) from the source: pieces that keep their dtype straight into the
// output buffer, the others into the source buffer.
Status LoadPieces(Shared& s, Worker& w, const std::vector<UnitPiece>& pieces, std::byte* out,
                  std::byte* src) {
  StateDict state;
  for (const UnitPiece& p : pieces) {
    const TensorInfo& info = s.index.metadata.tensors[s.plan.tensors[p.tensor].source];
    std::byte* dst = p.converted ? src + p.src_offset : out + p.out_offset;
    const bool whole = p.begin == 0 && p.end == Box::Whole(info.global_shape).NumElements();
    TESSERA_RETURN_IF_ERROR(state.Add(
        whole ? ShardedTensor::Shard(info.key, TensorView(dst, info.dtype, info.global_shape),
                                     info.global_shape, {})
              : ShardedTensor::FlatShard(info.key, TensorView(dst, info.dtype, {p.end - p.begin}),
                                         info.global_shape, {}, info.global_shape, p.begin)));
  }
  TESSERA_ASSIGN_OR_RETURN(LoadReport report,
                           LoadFromIndex(state, s.index, s.source, w.comm(), s.storage,
                                         s.load_options, /*list_unexpected=*/false));
  s.read.fetch_add(report.bytes_read, std::memory_order_relaxed);
  return Status::Ok();
}

// Writes `n` bytes at `at` of output file `file`, handing them to writeback when durable.
Status WriteOut(Shared& s, uint32_t file, uint64_t at, const std::byte* data, uint64_t n) {
  WritableFile& out = *s.files[file];
  TESSERA_RETURN_IF_ERROR(out.WriteAt(at, data, n));
  if (s.options.sync == SyncPolicy::kFull) TESSERA_RETURN_IF_ERROR(out.StartWriteback(at, n));
  s.written.fetch_add(n, std::memory_order_relaxed);
  return Status::Ok();
}

// Where piece `p`'s first byte lies in its output file.
uint64_t PieceAt(const Shared& s, const UnitPiece& p) {
  const OutputTensor& t = s.plan.tensors[p.tensor];
  return s.layout.tensor_places[p.tensor].data_offset +
         static_cast<uint64_t>(p.begin) * DTypeSize(t.dtype);
}

uint64_t PieceBytes(const Shared& s, const UnitPiece& p) {
  return static_cast<uint64_t>(p.end - p.begin) * DTypeSize(s.plan.tensors[p.tensor].dtype);
}

// Writes `pieces` of a unit of `file` from `out` (the unit's output buffer), one write per run
// of pieces that lie back to back both in the buffer and in the file (all of a unit, where the
// format stores tensors raw and adjacent).
Status WriteRuns(Shared& s, uint32_t file, const std::byte* out,
                 const std::vector<const UnitPiece*>& pieces) {
  uint64_t run_at = 0, run_from = 0, run_bytes = 0;
  for (const UnitPiece* p : pieces) {
    const uint64_t at = PieceAt(s, *p), bytes = PieceBytes(s, *p);
    if (run_bytes > 0 && run_at + run_bytes == at && run_from + run_bytes == p->out_offset) {
      run_bytes += bytes;
      continue;
    }
    if (run_bytes > 0)
      TESSERA_RETURN_IF_ERROR(WriteOut(s, file, run_at, out + run_from, run_bytes));
    run_at = at, run_from = p->out_offset, run_bytes = bytes;
  }
  if (run_bytes > 0) return WriteOut(s, file, run_at, out + run_from, run_bytes);
  return Status::Ok();
}

bool VerifySource(const Shared& s) {
  return s.options.verify_checksums && s.index.metadata.checksum != ChecksumKind::kNone;
}

// For each piece of `unit`, its source spans when it is copied file to file (convert_copy.h),
// or nullopt when it is loaded. Only outputs without checksums of their own copy (Hugging
// Face): the checksums and CRC-32s of the others are computed from the bytes they write.
std::vector<std::optional<std::vector<ChunkSpan>>> CopiedPieces(const Shared& s,
                                                                const ConvertUnit& unit) {
  std::vector<std::optional<std::vector<ChunkSpan>>> spans(unit.pieces.size());
  if (s.layout.engine_checksums || s.layout.framing_crc32) return spans;
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    const UnitPiece& p = unit.pieces[i];
    if (p.converted) continue;
    spans[i] = CopySpans(s.index.metadata, s.plan.tensors[p.tensor].source, p.begin, p.end,
                         VerifySource(s));
  }
  return spans;
}

// Converts the dtype of `pieces` that change it, from the source buffer into the output one.
void ConvertPieces(const Shared& s, const std::vector<const UnitPiece*>& pieces, std::byte* out,
                   const std::byte* src) {
  for (const UnitPiece* p : pieces) {
    if (!p->converted) continue;
    const OutputTensor& t = s.plan.tensors[p->tensor];
    ConvertFloats(t.source_dtype, src + p->src_offset, t.dtype, out + p->out_offset,
                  static_cast<size_t>(p->end - p->begin));
  }
}

// A unit of an output without checksums, some of its pieces copied file to file: the others
// are loaded (all at once) and written run by run.
Status RunCopiedUnit(Shared& s, Worker& w, const ConvertUnit& unit,
                     const std::vector<std::optional<std::vector<ChunkSpan>>>& spans) {
  std::vector<UnitPiece> loaded;
  std::vector<const UnitPiece*> loaded_pieces;
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    if (!spans[i]) loaded.push_back(unit.pieces[i]), loaded_pieces.push_back(&unit.pieces[i]);
  }
  if (!loaded.empty()) {
    std::byte* out = w.Out(unit.out_bytes);
    std::byte* src = unit.src_bytes > 0 ? w.Src(unit.src_bytes) : nullptr;
    TESSERA_RETURN_IF_ERROR(LoadPieces(s, w, loaded, out, src));
    ConvertPieces(s, loaded_pieces, out, src);
    TESSERA_RETURN_IF_ERROR(WriteRuns(s, unit.file, out, loaded_pieces));
  }
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    if (!spans[i]) continue;
    const UnitPiece& p = unit.pieces[i];
    const CopyTarget target{s.files[unit.file].get(), PieceAt(s, p),
                            s.options.sync == SyncPolicy::kFull};
    TESSERA_RETURN_IF_ERROR(CopyPiece(
        w.sources(), s.index, s.plan.tensors[p.tensor].source, *spans[i], VerifySource(s), target,
        [&](uint64_t n) { s.written.fetch_add(n, std::memory_order_relaxed); },
        [&](uint64_t n) { s.read.fetch_add(n, std::memory_order_relaxed); }));
  }
  return Status::Ok();
}

Status RunUnit(Shared& s, Worker& w, const ConvertUnit& unit) {
  const std::vector<std::optional<std::vector<ChunkSpan>>> spans = CopiedPieces(s, unit);
  if (std::any_of(spans.begin(), spans.end(), [](const auto& p) { return p.has_value(); })) {
    return RunCopiedUnit(s, w, unit, spans);
  }
  std::vector<const UnitPiece*> pieces;
  for (const UnitPiece& p : unit.pieces) pieces.push_back(&p);
  std::byte* out = w.Out(unit.out_bytes);
  std::byte* src = unit.src_bytes > 0 ? w.Src(unit.src_bytes) : nullptr;
  TESSERA_RETURN_IF_ERROR(LoadPieces(s, w, unit.pieces, out, src));
  ConvertPieces(s, pieces, out, src);
  const bool engine = s.layout.engine_checksums, framing = s.layout.framing_crc32;
  if (!engine && !framing) return WriteRuns(s, unit.file, out, pieces);
  // Block by block: each checksummed right after it is written, while it is in cache.
  constexpr uint64_t block = kChecksumBlockBytes;
  for (const UnitPiece& p : unit.pieces) {
    const uint64_t first =
        static_cast<uint64_t>(p.begin) * DTypeSize(s.plan.tensors[p.tensor].dtype);
    const uint64_t bytes = PieceBytes(s, p), at = PieceAt(s, p);
    for (uint64_t done = 0; done < bytes; done += block) {
      const uint64_t n = std::min(block, bytes - done);
      const std::byte* data = out + p.out_offset + done;
      TESSERA_RETURN_IF_ERROR(WriteOut(s, unit.file, at + done, data, n));
      const size_t b = (first + done) / block;  // `first` lies on a block (PlanUnits)
      if (engine) s.tensor_checksums[p.tensor][b] = Checksum(data, n);
      if (framing) s.tensor_crcs[p.tensor][b] = Crc32(data, n);
    }
  }
  return Status::Ok();
}

// Loads object `index` of the plan whole.
Result<std::vector<uint8_t>> LoadObject(Shared& s, Worker& w, uint32_t index) {
  const OutputObject& o = s.plan.objects[index];
  const ObjectInfo& info = s.index.metadata.objects[o.source];
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedObject{info.key, {}, {}, info.encoding}));
  TESSERA_ASSIGN_OR_RETURN(LoadReport report,
                           LoadFromIndex(state, s.index, s.source, w.comm(), s.storage,
                                         s.load_options, /*list_unexpected=*/false));
  s.read.fetch_add(report.bytes_read, std::memory_order_relaxed);
  std::vector<uint8_t> data = std::move(std::get<ShardedObject>(state.entries()[0]).data);
  if (data.size() != o.bytes) {
    return Internal("object '" + info.key + "' loaded " + std::to_string(data.size()) +
                    " bytes, its index says " + std::to_string(o.bytes));
  }
  return data;
}

// Writes the objects of output file `f`, in order, each through its format's item writer
// (an object's stored length may be known only once written, so one thread writes a file's
// objects one after the other from OutputLayout::objects_begin).
Status RunObjects(Shared& s, Worker& w, uint32_t f) {
  const OutputFile& file = s.plan.files[f];
  const DataFileEncoder& encoder = *s.layout.files[f];
  uint64_t at = s.layout.objects_begin[f];
  for (size_t i = 0; i < file.objects.size(); ++i) {
    const uint32_t index = file.objects[i];
    TESSERA_ASSIGN_OR_RETURN(const std::vector<uint8_t> data, LoadObject(s, w, index));
    const size_t k = file.tensors.size() + i;
    const uint64_t offset = encoder.ItemOffset(k, at);
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ItemWriter> item,
                             encoder.BeginItem(*s.files[f], k, offset));
    TESSERA_RETURN_IF_ERROR(
        item->Append(reinterpret_cast<const std::byte*>(data.data()), data.size()));
    TESSERA_ASSIGN_OR_RETURN(const uint64_t length, item->Finish());
    if (s.layout.engine_checksums) s.object_checksums[index] = Checksum(data.data(), data.size());
    if (s.options.sync == SyncPolicy::kFull) {
      TESSERA_RETURN_IF_ERROR(s.files[f]->StartWriteback(offset, length));
    }
    s.object_lengths[index] = length;
    s.written.fetch_add(data.size(), std::memory_order_relaxed);  // the plan counts raw bytes
    at = offset + length;
  }
  return Status::Ok();
}

// Once every unit is written: each tensor's framing around its data (nothing for a format
// that stores tensors raw), with the CRC-32 of its data combined from its blocks' (computed
// by whichever threads wrote them).
Status WriteFramings(Shared& s, const std::vector<uint32_t>& mine) {
  for (uint32_t f : mine) {
    const std::vector<uint32_t>& tensors = s.plan.files[f].tensors;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const uint32_t ti = tensors[k];
      Crc32Stream crc;
      for (size_t b = 0; s.layout.framing_crc32 && b < s.tensor_crcs[ti].size(); ++b) {
        const uint64_t n = std::min<uint64_t>(kChecksumBlockBytes,
                                              s.plan.tensors[ti].bytes - b * kChecksumBlockBytes);
        crc.Append(s.tensor_crcs[ti][b], n);
      }
      TESSERA_RETURN_IF_ERROR_CTX(
          s.layout.files[f]->WriteFraming(*s.files[f], k, s.layout.tensor_offsets[ti], crc.value()),
          "writing " + OutputPath(s, f));
    }
  }
  return Status::Ok();
}

// Creates this rank's files and writes their headers.
Status OpenFiles(Shared& s, const std::vector<uint32_t>& mine) {
  for (uint32_t f : mine) {
    const std::string path = OutputPath(s, f);
    TESSERA_ASSIGN_OR_RETURN(s.files[f], s.output.NewWritableFile(path, CreateMode::kExclusive));
    const Bytes& header = s.layout.files[f]->header();
    TESSERA_RETURN_IF_ERROR_CTX(s.files[f]->WriteAt(0, header.data(), header.size()),
                                "writing " + path);
  }
  return Status::Ok();
}

// Syncs (when durable and all went well) and closes every open file; the first error.
Status CloseFiles(Shared& s, bool sync) {
  Status first;
  for (size_t f = 0; f < s.files.size(); ++f) {
    if (!s.files[f]) continue;
    Status status = sync ? s.files[f]->Sync() : Status::Ok();
    Status closed = s.files[f]->Close();
    if (status.ok()) status = closed;
    if (first.ok() && !status.ok()) first = status.WithContext("writing " + OutputPath(s, f));
  }
  return first;
}

// Runs the work items (units, then objects) on up to num_threads threads while the calling
// thread reports progress. Returns the first error (of the lowest item that failed).
Status RunItems(Shared& s, const std::vector<ConvertUnit>& units,
                const std::vector<uint32_t>& objects, uint64_t total) {
  const size_t count = units.size() + objects.size();
  std::vector<Status> statuses(count);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<size_t> running{0};
  std::mutex mutex;
  std::condition_variable finished;
  auto work = [&] {
    Worker worker(s.storage, s.index);
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < count;) {
      statuses[i] = i < units.size() ? RunUnit(s, worker, units[i])
                                     : RunObjects(s, worker, objects[i - units.size()]);
      if (!statuses[i].ok()) {
        const uint32_t file = i < units.size() ? units[i].file : objects[i - units.size()];
        statuses[i] = statuses[i].WithContext("converting into " + OutputPath(s, file));
        failed = true;
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (--running == 0) finished.notify_all();
  };
  const size_t threads =
      std::min<size_t>(static_cast<size_t>(std::max(s.options.num_threads, 1)), count);
  running = threads;
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) pool.emplace_back(work);
  {
    std::unique_lock<std::mutex> lock(mutex);
    while (!finished.wait_for(lock, kProgressInterval, [&] { return running.load() == 0; })) {
      if (s.options.progress) s.options.progress(s.written.load(), total);
    }
  }
  for (std::thread& t : pool) t.join();
  if (s.options.progress) s.options.progress(s.written.load(), total);
  for (const Status& status : statuses) TESSERA_RETURN_IF_ERROR(status);
  return Status::Ok();
}

}  // namespace

Result<OutputLayout> LayOutOutput(const ConvertPlan& plan, const Metadata& source,
                                  const FormatWriter& writer, const std::string& save_id) {
  OutputLayout layout;
  layout.engine_checksums = writer.EngineChecksums();
  const ChecksumKind framing = writer.FramingChecksum();
  if (framing != ChecksumKind::kNone && framing != ChecksumKind::kCrc32) {
    return Unimplemented(
        "a conversion computes only CRC-32s for an item's framing, not checksum "
        "kind " +
        std::to_string(static_cast<int>(framing)));
  }
  layout.framing_crc32 = framing == ChecksumKind::kCrc32;
  layout.tensor_offsets.resize(plan.tensors.size());
  layout.tensor_places.resize(plan.tensors.size());
  std::map<int, int> per_rank;  // the next file number of each rank
  const int count = static_cast<int>(plan.files.size());
  for (int f = 0; f < count; ++f) {
    const OutputFile& file = plan.files[f];
    layout.names.push_back(
        writer.ConversionFileName(save_id, file.rank, per_rank[file.rank]++, f, count));
    std::vector<ItemToWrite> items;
    for (uint32_t t : file.tensors) {
      const OutputTensor& out = plan.tensors[t];
      items.push_back(
          ItemToWrite{out.name, false, out.dtype, out.shape, Box::Whole(out.shape), out.bytes});
    }
    for (uint32_t o : file.objects) {
      const OutputObject& out = plan.objects[o];
      ItemToWrite item{out.name, true};
      item.num_bytes = out.bytes;
      item.object_encoding = source.objects[out.source].encoding;
      items.push_back(std::move(item));
    }
    Result<std::unique_ptr<DataFileEncoder>> encoder = writer.NewDataFile(items, save_id);
    if (!encoder.ok()) return encoder.status().WithContext("laying out " + layout.names.back());
    uint64_t end = (*encoder)->header().size();
    for (size_t k = 0; k < file.tensors.size(); ++k) {
      const uint32_t t = file.tensors[k];
      const uint64_t offset = (*encoder)->ItemOffset(k, end);
      const std::optional<ItemPlacement> place = (*encoder)->PlaceItem(k, offset);
      if (!place) {
        return Internal("key '" + plan.tensors[t].name + "': its format cannot place it in " +
                        layout.names.back() + " before writing it");
      }
      layout.tensor_offsets[t] = offset;
      layout.tensor_places[t] = *place;
      end = offset + place->stored_length;
    }
    layout.objects_begin.push_back(end);
    layout.files.push_back(std::move(*encoder));
  }
  return layout;
}

Result<RankWriteResult> WriteRankFiles(Storage& storage, Storage& output, const std::string& dir,
                                       const CheckpointIndex& index, const std::string& source,
                                       const ConvertPlan& plan, const OutputLayout& layout,
                                       int rank, const RankWriteOptions& options) {
  Shared s{storage, output, dir, index, source, plan, layout, options};
  s.load_options.unexpected_keys = KeyPolicy::kSkip;
  s.load_options.verify_checksums = options.verify_checksums;
  s.load_options.num_io_threads = 1;  // the threads here are the parallelism
  s.files.resize(plan.files.size());
  s.tensor_checksums.resize(plan.tensors.size());
  s.tensor_crcs.resize(plan.tensors.size());
  s.object_checksums.resize(plan.objects.size());
  s.object_lengths.resize(plan.objects.size());
  std::vector<uint32_t> mine;
  std::vector<uint32_t> objects;  // work items: the files of ours that hold objects
  uint64_t total = 0;
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    if (plan.files[f].rank != rank) continue;
    mine.push_back(f);
    total += plan.files[f].data_bytes;
    if (!plan.files[f].objects.empty()) objects.push_back(f);
    // Per block of every tensor of ours: tessera's checksums (a tensor without bytes has the
    // one checksum of nothing, as Save writes it) and CRC-32s (of nothing: 0).
    for (uint32_t t : plan.files[f].tensors) {
      const uint64_t blocks = NumChecksumBlocks(plan.tensors[t].bytes, kChecksumBlockBytes);
      if (layout.engine_checksums) s.tensor_checksums[t].assign(blocks, Checksum(nullptr, 0));
      if (layout.framing_crc32) s.tensor_crcs[t].assign(blocks, 0);
    }
  }
  // Units are cut on multiples of 256 KiB of each tensor (the output's checksum blocks when
  // it has them) and hold at least 1 MiB. A load checks a source's checksums block by block
  // (256 KiB for tessera sources), reading a block whole when it needs part of it: smaller
  // units would read the blocks at their edges again and again (16 KiB units: 16 times the
  // bytes); cuts on the same grid keep a source's blocks whole wherever its chunks start on it.
  const std::vector<ConvertUnit> units = PlanUnits(
      plan, rank, std::max(options.unit_bytes, 4 * kChecksumBlockBytes), kChecksumBlockBytes);
  Status status = OpenFiles(s, mine);
  if (status.ok()) status = RunItems(s, units, objects, total);
  if (status.ok()) status = WriteFramings(s, mine);
  Status closed = CloseFiles(s, status.ok() && options.sync == SyncPolicy::kFull);
  if (status.ok()) status = closed;
  TESSERA_RETURN_IF_ERROR(status);
  RankWriteResult result;
  for (uint32_t f : mine) {
    for (uint32_t t : plan.files[f].tensors) {
      result.checksums.insert(result.checksums.end(), s.tensor_checksums[t].begin(),
                              s.tensor_checksums[t].end());
    }
    for (uint32_t o : plan.files[f].objects) {
      if (layout.engine_checksums) result.checksums.push_back(s.object_checksums[o]);
      result.object_lengths.push_back(s.object_lengths[o]);
    }
  }
  result.bytes_written = s.written.load();
  result.bytes_read = s.read.load();
  result.files_written = static_cast<int>(mine.size());
  return result;
}

}  // namespace tessera
