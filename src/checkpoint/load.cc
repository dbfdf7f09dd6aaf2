// Load: the protocol of ../shared/DESIGN.md, "Load protocol".
//
//   1. rank 0 reads the manifest           -> Broadcast; every rank decodes it
//   2. every rank plans its reads (no I/O) -> AllReduce of which keys anyone asked for
//   3. agree that every rank's plan is good, then read, then agree on the outcome
//
// Nothing in the caller's memory is touched unless every rank's request is valid.
#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "checkpoint/envelope.h"
#include "checkpoint/load_internal.h"
#include "checkpoint/progress.h"
#include "checkpoint/read_once_load.h"
#include "checkpoint/reader.h"
#include "checkpoint/wrapped_chunks.h"
#include "core/byte_io.h"
#include "core/checksum.h"
#include "format/checkpoint_index.h"
#include "format/tessera/manifest.h"
#include "plan/load_plan.h"
#include "plan/plan_exchange.h"
#include "plan/read_sharing.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;

}  // namespace

// Rank 0 reads the index and broadcasts it: [root][EncodeCarriedIndex of the metadata]; every
// rank decodes it. One read of storage for the whole job. COLLECTIVE.
Result<CheckpointIndex> ReadAndShareIndex(Comm& comm, Storage& storage, const std::string& path) {
  Bytes message;
  if (comm.rank() == kCoordinator) {
    Result<CheckpointIndex> index = ReadCheckpointIndex(storage, path);
    if (index.ok()) {
      Bytes payload;
      ByteWriter(&payload).PutString(index->root);
      const Bytes encoded = EncodeCarriedIndex(index->metadata);
      payload.insert(payload.end(), encoded.begin(), encoded.end());
      message = Seal(Status::Ok(), std::move(payload));
    } else {
      message = Seal(index.status());
    }
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&message, kCoordinator));
  TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> payload, Open(message, "rank 0"));
  CheckpointIndex index;
  ByteReader reader(payload);
  TESSERA_RETURN_IF_ERROR(reader.GetString(&index.root));
  TESSERA_ASSIGN_OR_RETURN(index.metadata,
                           DecodeCarriedIndex(payload.subspan(reader.position()),
                                              "the index of " + path + " sent by rank 0"));
  return index;
}

namespace {

// Where the distinct runs of a read-sharing group land in this rank's memory, and how bytes
// get out of and into it: memcpy for host memory, through `uploads` for device memory.
struct RunDestinations {
  std::vector<std::byte*> at;    // per distinct run; null when this rank does not need it
  std::vector<uint32_t> tensor;  // per distinct run: its metadata tensor
  DeviceUploads* uploads = nullptr;

  bool OnDevice(uint32_t u) const { return uploads && uploads->OnDevice(tensor[u]); }
  // Appends `n` bytes of run `u` from byte `begin` to `out`.
  Status Append(uint32_t u, uint64_t begin, uint64_t n, Bytes& out) const {
    const size_t size = out.size();
    out.resize(size + n);
    if (OnDevice(u)) {
      return uploads->CopyBack(tensor[u], reinterpret_cast<std::byte*>(out.data() + size),
                               at[u] + begin, n);
    }
    std::memcpy(out.data() + size, at[u] + begin, n);
    return Status::Ok();
  }
  // Puts `n` bytes at byte `begin` of run `u`.
  Status Put(DeviceSink& sink, uint32_t u, uint64_t begin, const uint8_t* bytes, uint64_t n) const {
    const auto* from = reinterpret_cast<const std::byte*>(bytes);
    if (!OnDevice(u)) {
      std::memcpy(at[u] + begin, from, n);
      return Status::Ok();
    }
    for (uint64_t done = 0; done < n;) {
      const uint64_t m = std::min<uint64_t>(uploads->piece_bytes(), n - done);
      TESSERA_ASSIGN_OR_RETURN(std::byte * into, sink.Reserve(tensor[u], at[u] + begin + done, m));
      std::memcpy(into, from + done, m);
      done += m;
    }
    return Status::Ok();
  }
};

// The exchange of read runs between the ranks of `comm`: the same schedule on every rank. A
// rank that fails to take its bytes out of or put them into its memory (a device copy) goes on
// taking part in every round, sending nothing, and returns its failure at the end; the others
// see the short message and fail too. A failing collective returns at once (every rank's does).
Status ExchangeWithinGroup(Comm& comm, const ReadAssignment& assignment,
                           const RunDestinations& destinations, const LoadOptions& options,
                           LoadReport& report, ProgressMeter& progress) {
  DeviceSink sink(destinations.uploads);
  const int me = comm.rank();
  const std::vector<std::vector<ExchangePiece>> rounds =
      ScheduleExchange(assignment, comm.size(), options.exchange_bytes);
  auto needs = [&](const ExchangePiece& p) {
    return destinations.at[p.unique_run] != nullptr && assignment.reader[p.unique_run] != me;
  };
  Status local;  // the first failure of this rank's own copies
  auto short_message = [&](int sender, uint64_t size) {
    return Internal("read sharing: rank " + std::to_string(sender) + " sent " +
                    std::to_string(size) + " bytes, fewer than planned (it failed)");
  };
  for (const std::vector<ExchangePiece>& round : rounds) {
    if (options.read_sharing == ReadSharing::kBroadcast) {
      for (const ExchangePiece& p : round) {
        const int sender = assignment.reader[p.unique_run];
        Bytes bytes;
        if (sender == me && local.ok()) {
          local = destinations.Append(p.unique_run, p.begin, p.length, bytes);
          if (!local.ok()) bytes.clear();
        }
        TESSERA_RETURN_IF_ERROR(comm.Broadcast(&bytes, sender));
        if (!needs(p) || !local.ok()) continue;
        local = bytes.size() == p.length
                    ? destinations.Put(sink, p.unique_run, p.begin, bytes.data(), p.length)
                    : short_message(sender, bytes.size());
        report.bytes_received += p.length;
        progress.Add(p.length);
      }
      continue;
    }
    // All-gather: each rank contributes the pieces it read, in schedule order.
    Bytes contribution;
    for (const ExchangePiece& p : round) {
      if (assignment.reader[p.unique_run] != me || !local.ok()) continue;
      local = destinations.Append(p.unique_run, p.begin, p.length, contribution);
    }
    if (!local.ok()) contribution.clear();
    std::vector<Bytes> received;
    TESSERA_RETURN_IF_ERROR(comm.AllGather(contribution, &received));
    std::vector<uint64_t> cursor(comm.size(), 0);
    for (const ExchangePiece& p : round) {
      const int sender = assignment.reader[p.unique_run];
      if (needs(p) && local.ok()) {
        local = cursor[sender] + p.length <= received[sender].size()
                    ? destinations.Put(sink, p.unique_run, p.begin,
                                       received[sender].data() + cursor[sender], p.length)
                    : short_message(sender, received[sender].size());
        report.bytes_received += p.length;
        progress.Add(p.length);
      }
      cursor[sender] += p.length;
    }
    progress.Report();
  }
  Status flushed = sink.Flush();
  return local.ok() ? flushed : local;
}

// Reads `runs` with read sharing. Ranks that need the same runs (data-parallel replicas of the
// load layout) are found by one all-gather of 16-byte signatures of their run lists (without
// the runs of flat ranges: a distributed optimizer's shards differ between replicas and are
// read by their own rank); each such group gets its own communicator, reads every distinct run
// once between its members, and exchanges them within the group only. No rank learns any other
// rank's run list. COLLECTIVE over `comm`; within a group every rank returns the same status.
Status ReadShared(Comm& comm, Storage& storage, const std::string& path, const Metadata& metadata,
                  const std::vector<ReadRun>& all_runs, const LoadOptions& options,
                  LoadReport& report, DataFileHeaders* headers, ProgressMeter& progress,
                  DeviceUploads* uploads) {
  std::vector<ReadRun> runs, own;
  for (const ReadRun& run : all_runs) (run.flat ? own : runs).push_back(run);
  const Bytes keys = EncodeRunKeys(runs);
  const Checksum128Value hash = Checksum128(keys.data(), keys.size());
  std::vector<Bytes> all;
  TESSERA_RETURN_IF_ERROR(comm.AllGather(EncodeSignature({hash.low, hash.high}), &all));
  std::vector<PlanSignature> signatures(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    TESSERA_ASSIGN_OR_RETURN(signatures[r], DecodeSignature(all[r]));
  }
  all.clear();
  const PlanGroups groups = GroupBySignature(signatures);
  const std::vector<int32_t>& members = groups.members[groups.group_of[comm.rank()]];
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> group_comm, comm.Split(members[0], comm.rank()));
  Comm& group = *group_comm;
  if (group.size() == 1) {
    return ExecuteReads(storage, path, metadata, all_runs, options, report, headers, &progress,
                        uploads);
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<RunKey> my_keys, DecodeRunKeys(keys));
  const ReadAssignment assignment = AssignIdenticalReads(my_keys, group.size());
  const int me = group.rank();
  // Where each distinct run lands in this rank's memory.
  RunDestinations destinations;
  destinations.at.assign(assignment.unique.size(), nullptr);
  destinations.tensor.assign(assignment.unique.size(), 0);
  destinations.uploads = uploads;
  std::vector<ReadRun> to_read = std::move(own);
  for (size_t i = 0; i < runs.size(); ++i) {
    const uint32_t u = static_cast<uint32_t>(
        std::lower_bound(assignment.unique.begin(), assignment.unique.end(), my_keys[i]) -
        assignment.unique.begin());
    destinations.at[u] = runs[i].destination;
    destinations.tensor[u] = runs[i].tensor;
    if (assignment.reader[u] == me) to_read.push_back(runs[i]);
  }
  std::sort(to_read.begin(), to_read.end(), [](const ReadRun& a, const ReadRun& b) {
    return a.file_index != b.file_index ? a.file_index < b.file_index
                                        : a.file_offset < b.file_offset;
  });
  TESSERA_RETURN_IF_ERROR(
      AgreeOnStatus(group, ExecuteReads(storage, path, metadata, to_read, options, report, headers,
                                        &progress, uploads)));
  return AgreeOnStatus(
      group, ExchangeWithinGroup(group, assignment, destinations, options, report, progress));
}

// Bytes of tensor data and objects in `metadata`.
uint64_t DataBytes(const Metadata& metadata) {
  uint64_t bytes = 0;
  for (const TensorInfo& t : metadata.tensors) {
    for (const ChunkInfo& c : t.chunks) bytes += c.location.length;
  }
  for (const ObjectInfo& o : metadata.objects) bytes += o.location.length;
  return bytes;
}

// The job's storage reads and exchange (summed over the ranks), and the objects any rank asked
// for added to the union of needed bytes. COLLECTIVE.
Status AddJobFigures(Comm& comm, const Metadata& metadata, const std::vector<int64_t>& asked,
                     LoadReport& report) {
  for (size_t o = 0; o < metadata.objects.size(); ++o) {
    if (asked[metadata.tensors.size() + o])
      report.job_bytes_needed += metadata.objects[o].location.length;
  }
  std::vector<int64_t> totals = {static_cast<int64_t>(report.bytes_read),
                                 static_cast<int64_t>(report.bytes_sent)};
  if (comm.size() > 1) TESSERA_RETURN_IF_ERROR(comm.AllReduce(totals, ReduceOp::kSum));
  report.job_bytes_read = static_cast<uint64_t>(totals[0]);
  report.job_bytes_exchanged = static_cast<uint64_t>(totals[1]);
  return Status::Ok();
}

}  // namespace

Result<LoadReport> Load(StateDict& state, const std::string& path, Comm& comm,
                        const LoadOptions& options) {
  if (!options.storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    LoadOptions resolved = options;
    resolved.storage = location.first;
    return Load(state, location.second, comm, resolved);
  }
  std::shared_ptr<Storage> storage = options.storage;
  // 1. The index, read once (in whatever format) and shared in the manifest encoding.
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadAndShareIndex(comm, *storage, path));
  return LoadFromIndex(state, index, path, comm, *storage, options);
}

Result<LoadReport> LoadFromIndex(StateDict& state, const CheckpointIndex& index,
                                 const std::string& path, Comm& comm, Storage& storage,
                                 const LoadOptions& options, bool list_unexpected) {
  const std::string& root = index.root;

  // 2. Plan this rank's reads; learn which keys any rank asked for. Chunks wrapped in another
  // format's items (PyTorch DCP) are resolved first, only those this rank touches.
  // A bad option is reported through the collectives below, like a bad request.
  ResolvedIndex resolved;
  Result<RankReadPlan> planned =
      options.num_io_threads >= 1
          ? PlanRankReadsResolving(storage, root, index.metadata, state, path,
                                   options.missing_keys == KeyPolicy::kSkip, options.cast_dtypes,
                                   options.num_io_threads, resolved)
          : Result<RankReadPlan>(BadOption("LoadOptions::num_io_threads",
                                           "must be at least "
                                           "1, got " +
                                               std::to_string(options.num_io_threads)));
  const Metadata& metadata = resolved.metadata ? *resolved.metadata : index.metadata;
  const size_t num_keys = metadata.tensors.size() + metadata.objects.size();
  std::vector<int64_t> asked = planned.ok() ? planned->asked : std::vector<int64_t>(num_keys, 0);
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(asked, ReduceOp::kMax));
  LoadReport report;
  report.bytes_read = resolved.bytes_read;
  report.read_calls = resolved.read_calls;
  Status plan_status = planned.status();
  if (plan_status.ok()) {
    report.missing_keys = planned->missing_keys;
    report.shape_mismatched_keys = planned->shape_mismatched_keys;
    report.bytes_needed = planned->bytes_needed;
    for (size_t k = 0; k < num_keys && list_unexpected; ++k) {
      if (asked[k]) continue;
      report.unexpected_keys.push_back(k < metadata.tensors.size()
                                           ? metadata.tensors[k].key
                                           : metadata.objects[k - metadata.tensors.size()].key);
    }
    const auto& unexpected = report.unexpected_keys;
    if (!unexpected.empty() && options.unexpected_keys == KeyPolicy::kError) {
      std::string list;
      for (size_t i = 0; i < unexpected.size() && i < 10; ++i) {
        list += (i ? ", '" : "'") + unexpected[i] + "'";
      }
      if (unexpected.size() > 10) list += ", ... (" + std::to_string(unexpected.size()) + " keys)";
      StatusDetail detail{.kind = StatusDetail::Kind::kUnexpectedKeys,
                          .keys = unexpected,
                          .options = {"LoadOptions::unexpected_keys"},
                          .advice = "set LoadOptions::unexpected_keys = kSkip to ignore"};
      plan_status =
          InvalidArgument("the checkpoint at " + path + " has keys no rank asked for: " + list +
                          " (" + detail.advice + ")")
              .WithDetail(std::move(detail));
    }
  }
  // Tensors in device memory are filled through pinned buffers (checkpoint/device_uploads.h);
  // setting that up is part of the plan every rank agrees on.
  std::unique_ptr<DeviceUploads> uploads;
  if (plan_status.ok()) {
    Result<std::unique_ptr<DeviceUploads>> started =
        DeviceUploads::Start(state, metadata, options.device_staging, options.num_io_threads);
    if (started.ok()) {
      uploads = std::move(*started);
    } else {
      plan_status = started.status();
    }
  }
  // 3. Read only if every rank's plan is good; then agree on the outcome.
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, plan_status));
  const RankReadPlan& plan = *planned;
  ProgressMeter progress(options.progress, plan.bytes_needed);
  DataFileHeaders* headers = index.headers.get();
  // ReadOnceAcrossJob and ReadShared are collective and fail alike on every rank; ExecuteReads
  // is local.
  const bool read_once =
      options.read_sharing == ReadSharing::kReadOnce || options.read_sharing == ReadSharing::kAuto;
  report.read_sharing = options.read_sharing;
  Status read_status;
  if (read_once) {
    read_status = ReadOnceAcrossJob(comm, storage, root, metadata, plan.runs, options, report,
                                    headers, progress, uploads.get());
  } else if (options.read_sharing != ReadSharing::kNone && comm.size() > 1) {
    read_status = ReadShared(comm, storage, root, metadata, plan.runs, options, report, headers,
                             progress, uploads.get());
  } else {
    read_status = ExecuteReads(storage, root, metadata, plan.runs, options, report, headers,
                               &progress, uploads.get());
  }
  if (read_status.ok()) {
    read_status = ExecutePermutedCopies(storage, root, metadata, plan.permuted, options, report,
                                        headers, uploads.get());
    for (const PermutedCopy& copy : plan.permuted) {
      const DType dtype = copy.cast ? copy.cast->to : metadata.tensors[copy.tensor].dtype;
      progress.Add(copy.part.NumElements() * DTypeSize(dtype));
    }
    progress.Report();
  }
  for (const ObjectRead& read : plan.objects) {
    if (!read_status.ok()) break;
    read_status = ReadObject(storage, root, metadata, *read.info, options, read.destination->data,
                             report, headers);
    read.destination->encoding = read.info->encoding;
    progress.Add(read.info->location.length);
  }
  if (uploads) {
    // Every copy to the device done, and the tensors' streams ordered after them.
    Status copied = uploads->Finish();
    if (read_status.ok()) read_status = copied;
  }
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, read_status));
  progress.Finish();
  report.checkpoint_bytes = DataBytes(index.metadata);
  if (read_once) TESSERA_RETURN_IF_ERROR(AddJobFigures(comm, metadata, asked, report));
  return report;
}

Result<LoadReport> Load(StateDict& state, const std::string& path, const LoadOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Load(state, path, *comm, options);
}

}  // namespace tessera
