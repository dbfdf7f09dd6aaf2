#include "checkpoint/read_once_load.h"

#include <sys/vfs.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>

#include "checkpoint/reader.h"
#include "checkpoint/reader_internal.h"
#include "core/byte_io.h"
#include "core/checksum.h"
#include "format/registry.h"
#include "plan/plan_exchange.h"
#include "plan/read_once.h"

namespace tessera {
namespace {

// The cells of a format without checksum blocks (DCP, Hugging Face, verification off): the
// block size tessera writes, so that an unchecked cell costs what a checked block does.
constexpr uint64_t kCellBytesWithoutBlocks = 256u << 10;

uint64_t CellBytesOf(const Metadata& metadata) {
  return metadata.checksum_block_bytes > 0 ? metadata.checksum_block_bytes
                                           : kCellBytesWithoutBlocks;
}

// How a reader of `chunk` checks it, the same on every rank that needs any of it.
CellCheck CheckOf(const Metadata& metadata, const ChunkInfo& chunk, const LoadOptions& options,
                  uint64_t cell_bytes) {
  if (!options.verify_checksums || !HasChecksum(metadata, chunk)) return CellCheck::kNone;
  if (!chunk.block_checksums.empty() || chunk.location.length <= cell_bytes) {
    return CellCheck::kEachCell;
  }
  return options.verify_partial_chunks ? CellCheck::kWholeChunkAlways : CellCheck::kWholeChunk;
}

// Whether reads of `dir` come from this machine: a filesystem of its own disks or memory (a
// second read of a block then costs about a memory copy: LoadOptions' kAuto reads alone), not
// an object store or a network filesystem. Storage that is not a POSIX filesystem of this
// machine but renames and writes at offsets (an in-memory store) is local too.
bool ReadsAreLocal(Storage& storage, const std::string& dir) {
  const StorageCapabilities caps = storage.capabilities();
  if (!caps.rename || !caps.positional_writes) return false;  // an object store
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) return true;  // no such path here: an in-memory store
  // Network and cluster filesystems (magic numbers of linux/magic.h and their projects).
  constexpr uint64_t kRemote[] = {
      0x6969,      // NFS
      0x0BD00BD0,  // Lustre
      0x47504653,  // GPFS
      0x19830326,  // BeeGFS
      0x00C36400,  // CephFS
      0xFF534D42,  // CIFS
      0xFE534D42,  // SMB2
      0x517B,      // SMB
      0x65735546,  // FUSE (s3fs, gcsfuse, ...)
      0x01021997,  // 9P
      0xAAD7AAEA,  // PanFS
      0x5346414F,  // AFS
      0x013111A8,  // IBRIX
  };
  const uint64_t type = static_cast<uint64_t>(fs.f_type) & 0xFFFFFFFFu;
  for (uint64_t remote : kRemote) {
    if (type == remote) return false;
  }
  return true;
}

// Bytes of the destination that `file_bytes` of a run fill (they differ with a cast).
uint64_t DestinationBytes(const ReadRun& run, uint64_t file_bytes) {
  return run.cast ? file_bytes / DTypeSize(run.cast->from) * DTypeSize(run.cast->to) : file_bytes;
}

std::vector<CellNeed> NeedsOf(const Metadata& metadata, const std::vector<ReadRun>& runs,
                              const LoadOptions& options, uint64_t cell_bytes) {
  std::vector<CellNeed> needs;
  for (const ReadRun& run : runs) {
    if (run.length == 0) continue;
    const ChunkInfo& chunk = metadata.tensors[run.tensor].chunks[run.chunk];
    NeedsOfRun(run.tensor, run.chunk, chunk.location.length,
               run.file_offset - chunk.location.offset, run.length,
               CheckOf(metadata, chunk, options, cell_bytes), cell_bytes, needs);
  }
  CoalesceNeeds(needs, cell_bytes);
  return needs;
}

// What makes two ranks' needs the same: the encoded cell list and the exact byte runs behind it
// (two tensor-parallel slices can need the same number of bytes of the same cells).
Checksum128Value SignNeeds(const Metadata& metadata, const std::vector<ReadRun>& runs,
                           const Bytes& encoded) {
  Bytes exact = encoded;
  ByteWriter writer(&exact);
  for (const ReadRun& run : runs) {
    writer.Put<uint32_t>(run.tensor);
    writer.Put<uint32_t>(run.chunk);
    writer.Put<uint64_t>(run.file_offset -
                         metadata.tensors[run.tensor].chunks[run.chunk].location.offset);
    writer.Put<uint64_t>(run.length);
  }
  return Checksum128(exact.data(), exact.size());
}

// The sizes every rank must plan with alike: its LoadOptions::exchange_bytes, and the largest
// piece its storage asks for (a rank whose S3 options differ would cut other pieces).
struct PlanSizes {
  uint64_t exchange_bytes = 0;
  uint64_t max_piece_bytes = 0;
};

// One all-gather of [the needs' signature][plan sizes][local reads] finds the ranks with the
// same needs and whether all of them read a local filesystem (`all_local`); a second brings one
// list per group. Every rank returns the same lists, groups and `all_local`, or the same error.
Status GatherNeeds(Comm& comm, const Bytes& encoded, const Checksum128Value& hash,
                   const PlanSizes& sizes, bool local, std::vector<Bytes>& gathered,
                   std::vector<std::span<const uint8_t>>& lists, std::vector<int32_t>& group_of,
                   bool& all_local) {
  constexpr size_t kSignatureBytes = 33;
  Bytes signature;
  ByteWriter writer(&signature);
  writer.Put<uint64_t>(hash.low);
  writer.Put<uint64_t>(hash.high);
  writer.Put<uint64_t>(sizes.exchange_bytes);
  writer.Put<uint64_t>(sizes.max_piece_bytes);
  writer.Put<uint8_t>(local ? 1 : 0);
  std::vector<Bytes> all;
  all_local = true;
  TESSERA_RETURN_IF_ERROR(comm.AllGather(signature, &all));
  std::vector<PlanSignature> signatures(all.size());
  PlanSizes first;
  for (size_t r = 0; r < all.size(); ++r) {
    ByteReader reader(all[r]);
    PlanSizes its;
    uint8_t its_local = 0;
    if (all[r].size() != kSignatureBytes || !reader.Get(&signatures[r].low).ok() ||
        !reader.Get(&signatures[r].high).ok() || !reader.Get(&its.exchange_bytes).ok() ||
        !reader.Get(&its.max_piece_bytes).ok() || !reader.Get(&its_local).ok()) {
      return DataLoss("read plan: rank " + std::to_string(r) + " sent a signature of " +
                      std::to_string(all[r].size()) + " bytes, not " +
                      std::to_string(kSignatureBytes));
    }
    all_local = all_local && its_local == 1;
    if (r == 0) first = its;
    auto differ = [&](const char* what, uint64_t zero, uint64_t mine) {
      return InvalidArgument(std::string(what) + " must be the same on every rank: rank 0 has " +
                             std::to_string(zero) + ", rank " + std::to_string(r) + " has " +
                             std::to_string(mine));
    };
    if (its.exchange_bytes != first.exchange_bytes) {
      return differ("LoadOptions::exchange_bytes", first.exchange_bytes, its.exchange_bytes);
    }
    if (its.max_piece_bytes != first.max_piece_bytes) {
      return differ("the storage's read size (coalesce_read_bytes: S3's read_chunk_bytes)",
                    first.max_piece_bytes, its.max_piece_bytes);
    }
  }
  const PlanGroups groups = GroupBySignature(signatures);
  const bool leads = groups.members[groups.group_of[comm.rank()]][0] == comm.rank();
  TESSERA_RETURN_IF_ERROR(comm.AllGather(leads ? encoded : Bytes{}, &gathered));
  lists.clear();
  for (const std::vector<int32_t>& members : groups.members) {
    lists.push_back(gathered[members[0]]);
  }
  group_of = groups.group_of;
  return Status::Ok();
}

// A part of this rank's runs inside one shared piece. `segment.file_offset` holds the part's
// position from the chunk's start (the piece's coordinates), not a file offset.
struct SharedSegment {
  uint32_t piece;
  Segment segment;
};

// Cuts this rank's runs into the parts inside shared pieces and the rest, which it reads
// itself (`own`, still sorted by file and offset).
void SplitRuns(const JobReadPlan& plan, const Metadata& metadata, const std::vector<ReadRun>& runs,
               std::vector<ReadRun>& own, std::vector<SharedSegment>& shared) {
  const std::vector<SharedPiece>& pieces = plan.pieces;
  for (const ReadRun& run : runs) {
    if (run.length == 0) {
      own.push_back(run);
      continue;
    }
    const uint64_t start =
        run.file_offset - metadata.tensors[run.tensor].chunks[run.chunk].location.offset;
    const uint64_t end = start + run.length;
    auto it = std::partition_point(pieces.begin(), pieces.end(), [&](const SharedPiece& p) {
      return std::tie(p.tensor, p.chunk) < std::tie(run.tensor, run.chunk) ||
             (p.tensor == run.tensor && p.chunk == run.chunk && p.end <= start);
    });
    auto in_chunk = [&] {
      return it != pieces.end() && it->tensor == run.tensor && it->chunk == run.chunk;
    };
    for (uint64_t at = start; at < end;) {
      if (in_chunk() && it->begin <= at) {
        const uint64_t n = std::min(it->end, end) - at;
        shared.push_back(
            {static_cast<uint32_t>(it - pieces.begin()),
             Segment{at, n, run.destination + DestinationBytes(run, at - start), run.cast}});
        at += n;
        if (at == it->end) ++it;
        continue;
      }
      const uint64_t n = (in_chunk() ? std::min(it->begin, end) : end) - at;
      ReadRun part = run;
      part.file_offset = run.file_offset + (at - start);
      part.length = n;
      part.destination = run.destination + DestinationBytes(run, at - start);
      own.push_back(part);
      at += n;
    }
  }
  std::sort(shared.begin(), shared.end(), [](const SharedSegment& a, const SharedSegment& b) {
    return a.piece != b.piece ? a.piece < b.piece : a.segment.file_offset < b.segment.file_offset;
  });
}

// The shared pieces' reading and exchange on one rank.
class Exchange {
 public:
  Exchange(Comm& comm, Storage& storage, const std::string& dir, const Metadata& metadata,
           const JobReadPlan& plan, std::vector<SharedSegment> segments, const LoadOptions& options,
           LoadReport& report, DataFileHeaders* headers, ProgressMeter& progress,
           DeviceUploads* uploads)
      : comm_(comm),
        storage_(storage),
        dir_(dir),
        metadata_(metadata),
        plan_(plan),
        segments_(std::move(segments)),
        options_(options),
        report_(report),
        headers_(headers),
        progress_(progress),
        uploads_(uploads),
        me_(comm.rank()) {}

  // Every round. `read_failure` is this rank's storage or checksum failure so far (it then
  // sends nothing); `exchange_failure` becomes the first failure to take bytes in. Returns a
  // failing collective's error.
  Status Run(Status& read_failure, Status& exchange_failure) {
    // Piece indices by (round, reader), plan order within.
    std::vector<uint32_t> order(plan_.pieces.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      const SharedPiece &p = plan_.pieces[a], &q = plan_.pieces[b];
      return std::tie(p.round, p.reader) < std::tie(q.round, q.reader);
    });
    DeviceSink sink(uploads_);
    const Placer placer{uploads_, &sink};
    for (size_t begin = 0; begin < order.size();) {
      const uint32_t round = plan_.pieces[order[begin]].round;
      size_t end = begin;
      while (end < order.size() && plan_.pieces[order[end]].round == round) ++end;
      TESSERA_RETURN_IF_ERROR(RunRound(std::span(order).subspan(begin, end - begin), placer,
                                       read_failure, exchange_failure));
      progress_.Report();
      begin = end;
    }
    Status flushed = sink.Flush();
    if (exchange_failure.ok()) exchange_failure = flushed;
    return Status::Ok();
  }

 private:
  bool Receives(const SharedPiece& p) const {
    if (p.reader == me_) return false;
    for (uint32_t h = p.holders_begin; h < p.holders_end; ++h) {
      if (plan_.holder_groups[h] == plan_.group_of[me_]) return true;
    }
    return false;
  }

  // Puts this rank's parts of piece `i` that lie in [begin, end) (bytes from the chunk's start),
  // whose bytes are at `bytes`.
  Status Deliver(uint32_t i, uint64_t begin, uint64_t end, const std::byte* bytes,
                 const Placer& placer) {
    const SharedPiece& p = plan_.pieces[i];
    auto it = std::partition_point(segments_.begin(), segments_.end(), [&](const SharedSegment& s) {
      return s.piece < i || (s.piece == i && s.segment.file_offset + s.segment.length <= begin);
    });
    for (; it != segments_.end() && it->piece == i && it->segment.file_offset < end; ++it) {
      const Segment& seg = it->segment;
      const uint64_t from = std::max(seg.file_offset, begin);
      const uint64_t to = std::min(seg.file_offset + seg.length, end);
      TESSERA_RETURN_IF_ERROR(
          seg.Deliver(placer, p.tensor, from - seg.file_offset, bytes + (from - begin), to - from));
      progress_.Add(seg.DestinationBytes(to - from));
    }
    return Status::Ok();
  }

  // Opens the file of each piece this rank reads (once) and checks its header.
  Status Open(const SharedPiece& p) {
    const TensorInfo& t = metadata_.tensors[p.tensor];
    const ChunkInfo& c = t.chunks[p.chunk];
    if (files_.empty()) files_.resize(metadata_.files.size());
    std::unique_ptr<ReadableFile>& file = files_[c.location.file_index];
    const std::string what = DescribeChunk(metadata_, p.tensor, p.chunk);
    if (!file) {
      TESSERA_ASSIGN_OR_RETURN(
          file, OpenDataFile(storage_, dir_, metadata_, c.location.file_index, what));
    }
    if (headers_ != nullptr && FormatOf(metadata_.format).DataFilesHaveHeaders() &&
        checked_headers_.insert({p.tensor, p.chunk}).second) {
      TESSERA_RETURN_IF_ERROR(
          headers_->Check(*file, c.location.file_index, c.location, t.dtype, StoredShape(c), what));
    }
    return Status::Ok();
  }

  // One piece this rank reads this round, and where: `at` in the round's send buffer (null
  // when no other rank receives it: it is read cell by cell through a scratch buffer).
  struct Outgoing {
    uint32_t piece;
    std::byte* at = nullptr;
  };

  // Reads piece `out.piece` cell by cell (into the send buffer, or `buffer` when no rank
  // receives it), checks each cell (kEachCell) or adds it to the checksum of the chunk read
  // whole, and puts this rank's parts in place.
  Status ReadPiece(const Outgoing& out, const ReadableFile& file, std::vector<std::byte>& buffer,
                   const Placer& placer, uint64_t& calls) {
    const SharedPiece& p = plan_.pieces[out.piece];
    const ChunkInfo& c = metadata_.tensors[p.tensor].chunks[p.chunk];
    const uint64_t cell = plan_.cell_bytes;
    for (uint64_t cell_begin = p.begin; cell_begin < p.end; cell_begin += cell) {
      const uint64_t cell_end = std::min(cell_begin + cell, p.end);
      const uint64_t length = cell_end - cell_begin;
      std::byte* dst = out.at == nullptr ? buffer.data() : out.at + (cell_begin - p.begin);
      UnitChecksum sum(metadata_.checksum);
      for (uint64_t at = 0; at < length; ++calls) {
        const uint64_t n = std::min<uint64_t>(kCheckedReadPiece, length - at);
        TESSERA_RETURN_IF_ERROR_CTX(file.ReadAt(c.location.offset + cell_begin + at, dst + at, n),
                                    "reading " + DescribeChunk(metadata_, p.tensor, p.chunk));
        if (p.check == CellCheck::kEachCell) sum.Update(dst + at, n);
        at += n;
      }
      if (p.check == CellCheck::kEachCell) {
        const uint64_t k = cell_begin / cell;
        if (k > c.block_checksums.size()) {
          return DataLoss(DescribeChunk(metadata_, p.tensor, p.chunk) + " has " +
                          std::to_string(c.block_checksums.size() + 1) +
                          " block checksums, fewer than its length needs");
        }
        const uint64_t expected = k == 0 ? c.location.checksum : c.block_checksums[k - 1];
        if (sum.Digest() != expected) {
          return ChecksumMismatch(dir_, metadata_, Unit(p, cell_begin, length, expected),
                                  sum.Digest());
        }
      } else if (p.check == CellCheck::kWholeChunk) {  // one thread reads these, in order
        if (cell_begin == 0) whole_sum_.emplace(metadata_.checksum);
        whole_sum_->Update(dst, length);
        if (cell_end == c.location.length && whole_sum_->Digest() != c.location.checksum) {
          return ChecksumMismatch(dir_, metadata_,
                                  Unit(p, 0, c.location.length, c.location.checksum),
                                  whole_sum_->Digest());
        }
      }
      TESSERA_RETURN_IF_ERROR(Deliver(out.piece, cell_begin, cell_end, dst, placer));
    }
    return Status::Ok();
  }

  UnitRead Unit(const SharedPiece& p, uint64_t begin, uint64_t length, uint64_t checksum) const {
    const ChunkInfo& c = metadata_.tensors[p.tensor].chunks[p.chunk];
    UnitRead unit;
    unit.file_index = c.location.file_index;
    unit.offset = c.location.offset + begin;
    unit.length = length;
    unit.checksum = checksum;
    unit.tensor = p.tensor;
    unit.chunk = p.chunk;
    return unit;
  }

  // Reads this rank's pieces of a round (`mine`, with their destinations) on up to
  // num_io_threads threads, in contiguous slices of about equal bytes; the pieces of chunks
  // read whole (checked in order) on the calling thread.
  Status ReadMine(const std::vector<Outgoing>& mine) {
    for (const Outgoing& out : mine) TESSERA_RETURN_IF_ERROR(Open(plan_.pieces[out.piece]));
    std::vector<size_t> parallel, in_order;
    uint64_t total = 0;
    for (size_t k = 0; k < mine.size(); ++k) {
      const SharedPiece& p = plan_.pieces[mine[k].piece];
      (p.check == CellCheck::kWholeChunk ? in_order : parallel).push_back(k);
      total += p.end - p.begin;
    }
    // In file order, so that each thread's slice reads forward through its files (the plan's
    // order is the keys', and a data file holds its small items first): a store's reads then
    // fetch each byte once (CoalescingFile), the page cache reads ahead.
    auto position = [&](size_t k) {
      const SharedPiece& p = plan_.pieces[mine[k].piece];
      const ByteLocation& at = metadata_.tensors[p.tensor].chunks[p.chunk].location;
      return std::make_pair(at.file_index, at.offset + p.begin);
    };
    std::sort(parallel.begin(), parallel.end(),
              [&](size_t a, size_t b) { return position(a) < position(b); });
    // Where each read is a request, no thread takes less than a quarter of a read's size: a
    // round's few small pieces (norms every rank needs) then go to one thread, which fetches
    // those that lie together in one request instead of each thread fetching its share.
    const uint64_t coalesce = storage_.capabilities().coalesce_read_bytes;
    size_t threads = std::min<size_t>(options_.num_io_threads, parallel.size());
    if (coalesce > 0) {
      const uint64_t min_slice = std::max<uint64_t>(1, coalesce / 4);
      threads = std::min<size_t>(threads, std::max<uint64_t>(1, total / min_slice));
    }
    std::vector<size_t> bounds = {0};
    uint64_t acc = 0;
    for (size_t k = 0; k < parallel.size() && bounds.size() < threads; ++k) {
      const SharedPiece& p = plan_.pieces[mine[parallel[k]].piece];
      acc += p.end - p.begin;
      if (acc * threads >= total * bounds.size()) bounds.push_back(k + 1);
    }
    bounds.push_back(parallel.size());
    const size_t slices = bounds.size() - 1;
    std::vector<Status> statuses(slices + 1);
    std::vector<uint64_t> calls(slices + 1, 0);
    auto work = [&](size_t s, const std::vector<size_t>& list, size_t begin, size_t end) {
      std::vector<std::byte> buffer(plan_.cell_bytes);
      DeviceSink sink(uploads_);
      const Placer placer{uploads_, &sink};
      // On an object store, this slice's pieces of each file in requests of up to `coalesce`.
      std::map<uint32_t, std::unique_ptr<CoalescingFile>> coalesced;
      if (coalesce > 0) {
        std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
        for (size_t k = begin; k < end; ++k) {
          const SharedPiece& p = plan_.pieces[mine[list[k]].piece];
          const ByteLocation& at = metadata_.tensors[p.tensor].chunks[p.chunk].location;
          ranges[at.file_index].emplace_back(at.offset + p.begin, at.offset + p.end);
        }
        coalesced = CoalesceThreadReads(files_, std::move(ranges), coalesce);
      }
      for (size_t k = begin; k < end && statuses[s].ok(); ++k) {
        const SharedPiece& p = plan_.pieces[mine[list[k]].piece];
        const uint32_t f = metadata_.tensors[p.tensor].chunks[p.chunk].location.file_index;
        statuses[s] = ReadPiece(mine[list[k]], coalesce > 0 ? *coalesced[f] : *files_[f], buffer,
                                placer, calls[s]);
      }
      if (coalesce > 0) {  // the reads that reached storage
        calls[s] = 0;
        for (const auto& [f, file] : coalesced) calls[s] += file->reads();
      }
      if (statuses[s].ok()) statuses[s] = sink.Flush();
    };
    std::vector<std::thread> pool;
    for (size_t s = 1; s < slices; ++s) {
      pool.emplace_back(work, s, std::cref(parallel), bounds[s], bounds[s + 1]);
    }
    if (slices > 0) work(0, parallel, bounds[0], bounds[1]);
    work(slices, in_order, 0, in_order.size());
    for (std::thread& t : pool) t.join();
    for (uint64_t c : calls) report_.read_calls += c;
    for (const Status& st : statuses) TESSERA_RETURN_IF_ERROR(st);
    report_.bytes_read += total;
    return Status::Ok();
  }

  // One round: this rank reads its pieces into one send buffer, each piece once whatever its
  // receivers, then each sender scatters them: every receiver of a piece is sent the same
  // bytes of that buffer (Comm::ScatterInto), landing in place (Receive).
  Status RunRound(std::span<const uint32_t> round, const Placer& placer, Status& read_failure,
                  Status& exchange_failure) {
    const int n = comm_.size();
    std::vector<std::vector<ConstByteSpan>> send(n);
    std::vector<Outgoing> mine;
    uint64_t size = 0;
    for (uint32_t i : round) {
      const SharedPiece& p = plan_.pieces[i];
      if (p.reader != me_) continue;
      mine.push_back({i, nullptr});
      if (plan_.NumReceivers(p) > 0) size += p.end - p.begin;
    }
    std::vector<std::byte> buffer;
    if (!mine.empty() && read_failure.ok()) {
      buffer.resize(size);
      uint64_t at = 0;
      for (Outgoing& out : mine) {
        const SharedPiece& p = plan_.pieces[out.piece];
        if (plan_.NumReceivers(p) == 0) continue;
        out.at = buffer.data() + at;
        for (int32_t r : plan_.Receivers(p)) send[r].emplace_back(out.at, p.end - p.begin);
        at += p.end - p.begin;
      }
      read_failure = ReadMine(mine);
      if (!read_failure.ok()) send.assign(n, {});  // receivers see an empty message
    }
    for (size_t begin = 0; begin < round.size();) {
      const int32_t root = plan_.pieces[round[begin]].reader;
      size_t end = begin;
      uint64_t sent = 0;
      for (; end < round.size() && plan_.pieces[round[end]].reader == root; ++end) {
        sent += plan_.NumReceivers(plan_.pieces[round[end]]);
      }
      if (sent > 0) {  // else nothing of this sender's goes to another rank this round
        TESSERA_RETURN_IF_ERROR(
            Receive(round.subspan(begin, end - begin), root, send, placer, exchange_failure));
      }
      if (root == me_) {
        for (const std::vector<ConstByteSpan>& ranges : send)
          report_.bytes_sent += TotalBytes(ranges);
        send.assign(n, {});
        buffer = {};
      }
      begin = end;
    }
    return Status::Ok();
  }

  // Where this rank's message from one sender lands: its parts of each piece straight in the
  // destination where they are plain host bytes, the rest (bytes of the piece it does not need,
  // parts converted by a cast or bound for device memory) in `staging`, placed after.
  struct Landing {
    std::vector<MutableByteSpan> ranges;
    std::vector<std::byte> staging;
    struct Staged {
      uint32_t piece;
      uint64_t begin, end;  // of the piece, from the chunk's start
      uint64_t at;          // in staging
    };
    std::vector<Staged> staged;  // parts of pieces to place from staging (gaps are not here)
    uint64_t direct_bytes = 0;   // destination bytes received in place
  };

  // Plans the landing of the pieces `from` (a sender's of this round, in order) that this rank
  // receives. Returns the message's expected length.
  uint64_t PlanLanding(std::span<const uint32_t> from, const Placer& placer, Landing& landing) {
    // First the ranges, with staging positions as offsets; pointers once staging is sized.
    struct Range {
      std::byte* direct;  // null: staging at `at`
      uint64_t at, length;
    };
    std::vector<Range> ranges;
    uint64_t staging = 0, expected = 0;
    auto stage = [&](uint64_t length) {
      ranges.push_back({nullptr, staging, length});
      staging += length;
    };
    for (uint32_t i : from) {
      const SharedPiece& p = plan_.pieces[i];
      if (!Receives(p)) continue;
      expected += p.end - p.begin;
      const auto first = std::partition_point(segments_.begin(), segments_.end(),
                                              [&](const SharedSegment& s) { return s.piece < i; });
      auto last = first;
      bool overlap = false;  // two of this rank's runs need the same bytes of the piece
      for (uint64_t end = 0; last != segments_.end() && last->piece == i; ++last) {
        overlap = overlap || last->segment.file_offset < end;
        end = last->segment.file_offset + last->segment.length;
      }
      if (overlap) {  // the whole piece to staging; Deliver places every segment from there
        landing.staged.push_back({i, p.begin, p.end, staging});
        stage(p.end - p.begin);
        continue;
      }
      uint64_t at = p.begin;  // bytes of the piece planned so far
      for (auto it = first; it != last; ++it) {
        const Segment& seg = it->segment;
        if (seg.file_offset > at) stage(seg.file_offset - at);  // a gap: bytes it does not need
        if (!seg.cast && !placer.OnDevice(p.tensor)) {
          ranges.push_back({seg.destination, 0, seg.length});
          landing.direct_bytes += seg.length;
        } else {
          landing.staged.push_back({i, seg.file_offset, seg.file_offset + seg.length, staging});
          stage(seg.length);
        }
        at = seg.file_offset + seg.length;
      }
      if (p.end > at) stage(p.end - at);
    }
    landing.staging.resize(staging);
    for (const Range& r : ranges) {
      landing.ranges.emplace_back(r.direct ? r.direct : landing.staging.data() + r.at, r.length);
    }
    return expected;
  }

  // This rank's part of `root`'s scatter of the pieces `from`: as root it sends `send`; as a
  // receiver of any of them it lands them (PlanLanding) and places what was staged.
  Status Receive(std::span<const uint32_t> from, int32_t root,
                 const std::vector<std::vector<ConstByteSpan>>& send, const Placer& placer,
                 Status& exchange_failure) {
    Landing landing;
    const uint64_t expected = root == me_ ? 0 : PlanLanding(from, placer, landing);
    uint64_t received = 0;
    TESSERA_RETURN_IF_ERROR(comm_.ScatterInto(send, landing.ranges, &received, root));
    if (expected == 0 || !exchange_failure.ok()) return Status::Ok();
    if (received != expected) {
      exchange_failure = Internal("read-once load: rank " + std::to_string(root) + " sent " +
                                  std::to_string(received) + " bytes of " +
                                  std::to_string(expected) + " planned (it failed)");
      return Status::Ok();
    }
    report_.bytes_received += expected;
    report_.bytes_received_in_place += landing.direct_bytes;
    progress_.Add(landing.direct_bytes);
    for (const Landing::Staged& part : landing.staged) {
      if (!exchange_failure.ok()) break;
      exchange_failure =
          Deliver(part.piece, part.begin, part.end, landing.staging.data() + part.at, placer);
    }
    return Status::Ok();
  }

  Comm& comm_;
  Storage& storage_;
  const std::string& dir_;
  const Metadata& metadata_;
  const JobReadPlan& plan_;
  std::vector<SharedSegment> segments_;
  const LoadOptions& options_;
  LoadReport& report_;
  DataFileHeaders* headers_;
  ProgressMeter& progress_;
  DeviceUploads* uploads_;
  const int me_;
  std::vector<std::unique_ptr<ReadableFile>> files_;
  std::set<std::pair<uint32_t, uint32_t>> checked_headers_;
  std::optional<UnitChecksum>
      whole_sum_;  // of the chunk this rank reads whole, across pieces and rounds
};

}  // namespace

Status ReadOnceAcrossJob(Comm& comm, Storage& storage, const std::string& dir,
                         const Metadata& metadata, const std::vector<ReadRun>& runs,
                         const LoadOptions& options, LoadReport& report, DataFileHeaders* headers,
                         ProgressMeter& progress, DeviceUploads* uploads) {
  const uint64_t cell_bytes = CellBytesOf(metadata);
  // A conversion works on whole elements: cells must not split them.
  Status local;
  for (const ReadRun& run : runs) {
    if (run.cast && cell_bytes % DTypeSize(run.cast->from) != 0) {
      local = InvalidArgument("key '" + metadata.tensors[run.tensor].key + "': cells of " +
                              std::to_string(cell_bytes) + " bytes split elements of " +
                              std::string(DTypeName(run.cast->from)) +
                              ", which cast_dtypes cannot convert piecewise (load it in its "
                              "saved dtype, or with read_sharing kNone)");
      break;
    }
  }
  const Bytes encoded = EncodeNeeds(NeedsOf(metadata, runs, options, cell_bytes));
  std::vector<Bytes> gathered;
  std::vector<std::span<const uint8_t>> lists = {encoded};
  std::vector<int32_t> group_of = {0};
  bool all_local = true;
  // Pieces as large as the storage's reads (S3: read_chunk_bytes), so that a piece is one
  // request where requests cost more than bytes.
  const PlanSizes sizes{.exchange_bytes = options.exchange_bytes,
                        .max_piece_bytes = std::max(kDefaultMaxPieceBytes,
                                                    storage.capabilities().coalesce_read_bytes)};
  if (comm.size() > 1) {
    const bool reads_local =
        options.read_sharing == ReadSharing::kAuto && ReadsAreLocal(storage, dir);
    TESSERA_RETURN_IF_ERROR(GatherNeeds(comm, encoded, SignNeeds(metadata, runs, encoded), sizes,
                                        reads_local, gathered, lists, group_of, all_local));
  }
  TESSERA_ASSIGN_OR_RETURN(const JobReadPlan plan,
                           PlanJobReadsEncoded(lists, group_of, cell_bytes, sizes.exchange_bytes,
                                               sizes.max_piece_bytes));
  gathered.clear();
  report.job_bytes_needed += plan.union_needed_bytes;
  // kAuto on local filesystems, or where reading alone costs under 5% more bytes: every rank
  // reads for itself (the same choice on every rank: the plan is the same).
  const bool little_saved =
      plan.alone_read_bytes < plan.once_read_bytes + plan.once_read_bytes / kReadOnceMinSaving;
  if (options.read_sharing == ReadSharing::kAuto &&
      (all_local || plan.pieces.empty() || little_saved)) {
    report.read_sharing = ReadSharing::kNone;
    return local.ok() ? ExecuteReads(storage, dir, metadata, runs, options, report, headers,
                                     &progress, uploads)
                      : local;
  }
  report.read_sharing = ReadSharing::kReadOnce;
  // Every piece this rank reads lies inside its own manifest's chunk: a reader is a member of a
  // group that listed the chunk (members share one list, by signature), and the plan refuses
  // lists that disagree on a chunk's length.
  std::vector<ReadRun> own;
  std::vector<SharedSegment> shared;
  SplitRuns(plan, metadata, runs, own, shared);
  Status read_failure = local.ok() ? ExecuteReads(storage, dir, metadata, own, options, report,
                                                  headers, &progress, uploads)
                                   : local;
  if (plan.pieces.empty())
    return comm.size() > 1 ? AgreeOnStatus(comm, read_failure) : read_failure;
  Status exchange_failure;
  Exchange exchange(comm, storage, dir, metadata, plan, std::move(shared), options, report, headers,
                    progress, uploads);
  TESSERA_RETURN_IF_ERROR(exchange.Run(read_failure, exchange_failure));
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, read_failure));
  return exchange_failure;
}

}  // namespace tessera
