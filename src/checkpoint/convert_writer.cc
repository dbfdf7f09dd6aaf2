#include "checkpoint/convert_writer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
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
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"

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
  // By plan tensor: per block, the checksum (tessera) or the zip CRC-32 (DCP).
  std::vector<std::vector<uint64_t>> tensor_checksums;
  std::vector<uint64_t> object_checksums;  // by plan object (tessera)
  std::vector<uint64_t> object_lengths;    // by plan object: the item's length (DCP)
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

bool VerifySource(const Shared& s) {
  return s.options.verify_checksums && s.index.metadata.checksum != ChecksumKind::kNone;
}

// For each piece of `unit`, its source spans when it is copied file to file (convert_copy.h),
// or nullopt when it is loaded. Only outputs without checksums of their own copy (Hugging
// Face): the checksums of a tessera or DCP output are computed from the bytes it writes.
std::vector<std::optional<std::vector<ChunkSpan>>> CopiedPieces(const Shared& s,
                                                                const ConvertUnit& unit) {
  std::vector<std::optional<std::vector<ChunkSpan>>> spans(unit.pieces.size());
  if (s.layout.dcp() || s.options.checksum_block_bytes != 0) return spans;
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    const UnitPiece& p = unit.pieces[i];
    if (p.converted) continue;
    spans[i] = CopySpans(s.index.metadata, s.plan.tensors[p.tensor].source, p.begin, p.end,
                         VerifySource(s));
  }
  return spans;
}

// A unit of an output without checksums, some of its pieces copied file to file: the others
// are loaded (all at once) and written run by run of consecutive loaded pieces.
Status RunCopiedUnit(Shared& s, Worker& w, const ConvertUnit& unit,
                     const std::vector<std::optional<std::vector<ChunkSpan>>>& spans) {
  std::vector<UnitPiece> loaded;
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    if (!spans[i]) loaded.push_back(unit.pieces[i]);
  }
  std::byte* out = loaded.empty() ? nullptr : w.Out(unit.out_bytes);
  std::byte* src = !loaded.empty() && unit.src_bytes > 0 ? w.Src(unit.src_bytes) : nullptr;
  if (!loaded.empty()) TESSERA_RETURN_IF_ERROR(LoadPieces(s, w, loaded, out, src));
  const uint64_t at = s.layout.headers[unit.file].size() + unit.offset;
  uint64_t run_begin = 0, run_end = 0;  // the loaded bytes not yet written
  for (size_t i = 0; i <= unit.pieces.size(); ++i) {
    const bool copied = i < unit.pieces.size() && spans[i];
    if ((i == unit.pieces.size() || copied) && run_end > run_begin) {
      TESSERA_RETURN_IF_ERROR(
          WriteOut(s, unit.file, at + run_begin, out + run_begin, run_end - run_begin));
    }
    if (i == unit.pieces.size()) break;
    const UnitPiece& p = unit.pieces[i];
    const OutputTensor& t = s.plan.tensors[p.tensor];
    const uint64_t bytes = static_cast<uint64_t>(p.end - p.begin) * DTypeSize(t.dtype);
    if (!copied) {
      if (p.converted) {
        ConvertFloats(t.source_dtype, src + p.src_offset, t.dtype, out + p.out_offset,
                      static_cast<size_t>(p.end - p.begin));
      }
      if (run_end <= run_begin) run_begin = p.out_offset;
      run_end = p.out_offset + bytes;
      continue;
    }
    run_begin = run_end = 0;
    const CopyTarget target{s.files[unit.file].get(), at + p.out_offset,
                            s.options.sync == SyncPolicy::kFull};
    TESSERA_RETURN_IF_ERROR(CopyPiece(
        w.sources(), s.index, t.source, *spans[i], VerifySource(s), target,
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
  std::byte* out = w.Out(unit.out_bytes);
  std::byte* src = unit.src_bytes > 0 ? w.Src(unit.src_bytes) : nullptr;
  TESSERA_RETURN_IF_ERROR(LoadPieces(s, w, unit.pieces, out, src));
  for (const UnitPiece& p : unit.pieces) {
    if (!p.converted) continue;
    const OutputTensor& t = s.plan.tensors[p.tensor];
    ConvertFloats(t.source_dtype, src + p.src_offset, t.dtype, out + p.out_offset,
                  static_cast<size_t>(p.end - p.begin));
  }
  const uint64_t data_start = s.layout.headers[unit.file].size();
  const bool dcp = s.layout.dcp();
  const uint64_t block = dcp ? kChecksumBlockBytes : s.options.checksum_block_bytes;
  if (block == 0) {
    return WriteOut(s, unit.file, data_start + unit.offset, out, unit.out_bytes);
  }
  // Block by block: each checksummed right after it is written, while it is in cache. A DCP
  // tensor's data lies inside its item, and a unit's tensors are not back to back there.
  for (const UnitPiece& p : unit.pieces) {
    const OutputTensor& t = s.plan.tensors[p.tensor];
    const uint64_t size = DTypeSize(t.dtype);
    const uint64_t first = static_cast<uint64_t>(p.begin) * size;  // tensor byte, on a block
    const uint64_t bytes = static_cast<uint64_t>(p.end - p.begin) * size;
    const uint64_t at = dcp ? s.layout.dcp_tensors[p.tensor].data_offset : data_start + t.offset;
    for (uint64_t done = 0; done < bytes; done += block) {
      const uint64_t n = std::min(block, bytes - done);
      const std::byte* data = out + p.out_offset + done;
      TESSERA_RETURN_IF_ERROR(WriteOut(s, unit.file, at + first + done, data, n));
      s.tensor_checksums[p.tensor][(first + done) / block] =
          dcp ? Crc32(data, n) : Checksum(data, n);
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

// Writes the objects `group` (tessera: one; DCP: all objects of one file, in order, as byte
// items back to back from the file's dcp_objects_begin).
Status RunObjects(Shared& s, Worker& w, const std::vector<uint32_t>& group) {
  uint64_t at = 0;
  for (size_t i = 0; i < group.size(); ++i) {
    const uint32_t index = group[i];
    const OutputObject& o = s.plan.objects[index];
    TESSERA_ASSIGN_OR_RETURN(const std::vector<uint8_t> data, LoadObject(s, w, index));
    if (!s.layout.dcp()) {
      if (s.options.checksum_block_bytes > 0) {
        s.object_checksums[index] = Checksum(data.data(), data.size());
      }
      TESSERA_RETURN_IF_ERROR(WriteOut(s, o.file, s.layout.headers[o.file].size() + o.offset,
                                       reinterpret_cast<const std::byte*>(data.data()),
                                       data.size()));
      continue;
    }
    if (i == 0) at = s.layout.dcp_objects_begin[o.file];
    const ObjectEncoding encoding = s.index.metadata.objects[o.source].encoding;
    TESSERA_ASSIGN_OR_RETURN(const uint64_t length,
                             torch_dist::WriteDcpObjectItem(*s.files[o.file], at, data, encoding));
    if (s.options.sync == SyncPolicy::kFull) {
      TESSERA_RETURN_IF_ERROR(s.files[o.file]->StartWriteback(at, length));
    }
    s.object_lengths[index] = length;
    s.written.fetch_add(data.size(), std::memory_order_relaxed);  // the plan counts raw bytes
    at += length;
  }
  return Status::Ok();
}

// The torch.save item layout of a DCP output tensor (as ConvertDcpLayout computed it).
Result<torch_dist::TorchItemLayout> ItemLayout(const OutputTensor& t) {
  return torch_dist::LayOutTorchTensorItem(
      torch_dist::TorchTensorSpec{std::string(torch_dist::TorchDTypeOf(t.dtype).name), t.shape});
}

// DCP: every item's prefix, before its data.
Status WriteItemPrefixes(Shared& s, const std::vector<uint32_t>& mine) {
  for (uint32_t f : mine) {
    for (uint32_t ti : s.plan.files[f].tensors) {
      const OutputTensor& t = s.plan.tensors[ti];
      const DcpTensorPlace& place = s.layout.dcp_tensors[ti];
      TESSERA_ASSIGN_OR_RETURN(const torch_dist::TorchItemLayout item, ItemLayout(t));
      if (place.item_offset + item.data_offset != place.data_offset ||
          item.total_size != place.item_length) {
        return Internal("tensor '" + t.name + "': its item's layout changed after planning");
      }
      TESSERA_RETURN_IF_ERROR_CTX(
          s.files[f]->WriteAt(place.item_offset, item.prefix.data(), item.prefix.size()),
          "writing " + OutputPath(s, f));
    }
  }
  return Status::Ok();
}

// DCP, once every unit is written: each item's suffix, with the CRC-32 of its data combined
// from the CRC-32s of its blocks (computed by whichever threads wrote them).
Status WriteItemSuffixes(Shared& s, const std::vector<uint32_t>& mine) {
  for (uint32_t f : mine) {
    for (uint32_t ti : s.plan.files[f].tensors) {
      const OutputTensor& t = s.plan.tensors[ti];
      Crc32Stream crc;
      const std::vector<uint64_t>& blocks = s.tensor_checksums[ti];
      for (size_t b = 0; b < blocks.size(); ++b) {
        const uint64_t n =
            std::min<uint64_t>(kChecksumBlockBytes, t.bytes - b * kChecksumBlockBytes);
        crc.Append(static_cast<uint32_t>(blocks[b]), n);
      }
      TESSERA_ASSIGN_OR_RETURN(const torch_dist::TorchItemLayout item, ItemLayout(t));
      const std::vector<uint8_t> suffix = torch_dist::TorchItemSuffix(item, crc.value());
      const uint64_t at = s.layout.dcp_tensors[ti].data_offset + t.bytes;
      TESSERA_RETURN_IF_ERROR_CTX(s.files[f]->WriteAt(at, suffix.data(), suffix.size()),
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
    const Bytes& header = s.layout.headers[f];
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
                const std::vector<std::vector<uint32_t>>& objects, uint64_t total) {
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
        const uint32_t file = i < units.size()
                                  ? units[i].file
                                  : s.plan.objects[objects[i - units.size()].front()].file;
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

Result<RankWriteResult> WriteRankFiles(Storage& storage, Storage& output, const std::string& dir,
                                       const CheckpointIndex& index, const std::string& source,
                                       const ConvertPlan& plan, const OutputLayout& layout,
                                       int rank, const RankWriteOptions& options) {
  Shared s{storage, output, dir, index, source, plan, layout, options};
  s.load_options.unexpected_keys = KeyPolicy::kSkip;
  s.load_options.verify_checksums = options.verify_checksums;
  s.load_options.num_io_threads = 1;  // the threads here are the parallelism
  s.files.resize(plan.files.size());
  const bool dcp = layout.dcp();
  const uint64_t block = dcp ? 0 : options.checksum_block_bytes;
  std::vector<uint32_t> mine;
  std::vector<std::vector<uint32_t>> objects;  // work items: one object, or a DCP file's
  uint64_t total = 0;
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    if (plan.files[f].rank != rank) continue;
    mine.push_back(f);
    total += plan.files[f].data_bytes;
    const std::vector<uint32_t>& of_file = plan.files[f].objects;
    if (dcp && !of_file.empty()) objects.push_back(of_file);
    for (uint32_t o : of_file) {
      if (!dcp) objects.push_back({o});
    }
  }
  if (block > 0 || dcp) {
    // Per block of every tensor of ours: tessera's checksums (a tensor without bytes has the
    // one checksum of nothing, as Save writes it) or, for DCP, CRC-32s (of nothing: 0).
    const uint64_t unit = dcp ? kChecksumBlockBytes : block;
    s.tensor_checksums.resize(plan.tensors.size());
    s.object_checksums.resize(plan.objects.size());
    s.object_lengths.resize(plan.objects.size());
    for (uint32_t f : mine) {
      for (uint32_t t : plan.files[f].tensors) {
        s.tensor_checksums[t].assign(NumChecksumBlocks(plan.tensors[t].bytes, unit),
                                     dcp ? 0 : Checksum(nullptr, 0));
      }
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
  if (status.ok() && dcp) status = WriteItemPrefixes(s, mine);
  if (status.ok()) status = RunItems(s, units, objects, total);
  if (status.ok() && dcp) status = WriteItemSuffixes(s, mine);
  Status closed = CloseFiles(s, status.ok() && options.sync == SyncPolicy::kFull);
  if (status.ok()) status = closed;
  TESSERA_RETURN_IF_ERROR(status);
  RankWriteResult result;
  for (uint32_t f = 0; block > 0 && f < plan.files.size(); ++f) {
    if (plan.files[f].rank != rank) continue;
    for (uint32_t t : plan.files[f].tensors) {
      result.checksums.insert(result.checksums.end(), s.tensor_checksums[t].begin(),
                              s.tensor_checksums[t].end());
    }
    for (uint32_t o : plan.files[f].objects) result.checksums.push_back(s.object_checksums[o]);
  }
  for (uint32_t f = 0; dcp && f < plan.files.size(); ++f) {
    if (plan.files[f].rank != rank) continue;
    for (uint32_t o : plan.files[f].objects) result.object_lengths.push_back(s.object_lengths[o]);
  }
  result.bytes_written = s.written.load();
  result.bytes_read = s.read.load();
  result.files_written = static_cast<int>(mine.size());
  return result;
}

}  // namespace tessera
