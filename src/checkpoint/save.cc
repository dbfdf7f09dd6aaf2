// Save: the protocol of ../shared/DESIGN.md, "Save protocol".
//
//   1. every rank: local plan            -> Gather to rank 0 (the coordinator)
//   2. rank 0: global plan, save id      -> Scatter each rank's write list
//   3. every rank: write its data files  -> Gather write results
//   4. rank 0: manifest, committed last  -> Broadcast the outcome
//
// Every message carries its sender's status (envelope.h), so a rank that fails at any step
// still takes part in the remaining collectives and every rank returns the same error.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>

#include "checkpoint/commit.h"
#include "checkpoint/data_files.h"
#include "checkpoint/envelope.h"
#include "checkpoint/rank_local_save.h"
#include "core/byte_io.h"
#include "core/checksum.h"
#include "core/lap_clock.h"
#include "core/status_wire.h"
#include "core/utf8.h"
#include "format/registry.h"
#include "format/tessera/manifest.h"
#include "plan/plan_exchange.h"
#include "plan/save_plan.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;

// How an error from rank `r` is prefixed: "rank r", or nothing in a one-rank run (where
// "rank 0: " would only puzzle).
std::string SenderName(const Comm& comm, int r) {
  return comm.size() > 1 ? "rank " + std::to_string(r) : std::string();
}

// The last successful save's plan, kept with the Comm (Comm::GetOrCreateAttachment). Save on
// one Comm runs on one thread at a time (the Comm contract), so no lock is needed.
struct SavePlanCache {
  bool valid = false;
  uint64_t key = 0;             // hash of this rank's encoded local plan and the options
  std::vector<uint32_t> items;  // this rank's write list
  std::shared_ptr<const GlobalSavePlan> global;  // coordinator only
};

// What the coordinator tells every rank at the end of a save.
struct Outcome {
  Status status;
  // True when the new manifest may be in place (renamed) even though a later step failed:
  // its data files must then be kept.
  bool manifest_renamed = false;
  uint64_t total_bytes = 0;
};

Bytes EncodeOutcome(const Outcome& o) {
  Bytes out;
  ByteWriter w(&out);
  PutStatus(w, o.status);
  w.Put<uint8_t>(o.manifest_renamed ? 1 : 0);
  w.Put<uint64_t>(o.total_bytes);
  return out;
}

Result<Outcome> DecodeOutcome(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  uint8_t renamed = 0;
  Outcome o;
  TESSERA_RETURN_IF_ERROR(GetStatus(r, &o.status));
  TESSERA_RETURN_IF_ERROR(r.Get(&renamed));
  TESSERA_RETURN_IF_ERROR(r.Get(&o.total_bytes));
  o.manifest_renamed = renamed != 0;
  return o;
}

// Step 0 on the coordinator, before any rank writes: the directory, a fresh save id, and the
// marker that protects this save's files from the cleanup of other saves into the directory.
// `writer` (null when its options were refused) says what the directory must not hold.
Result<std::string> PrepareDirectory(Storage& storage, const std::string& path,
                                     const FormatWriter* writer, const SaveOptions& options) {
  if (writer == nullptr) return Internal("preparing " + path + " for a save with no writer");
  const SyncPolicy sync = options.sync;
  TESSERA_RETURN_IF_ERROR(CreateDurableDirs(storage, path, sync));
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
  TESSERA_RETURN_IF_ERROR(writer->CheckTarget(path, names));
  std::string save_id = NewSaveId(names);
  TESSERA_RETURN_IF_ERROR(CreateSaveMarker(storage, path, save_id, sync));
  return save_id;
}

// What every rank knows before writing: whether every rank's plan is the cached one, and the
// save id the coordinator drew.
struct Preamble {
  bool cache_hit = false;
  std::string save_id;
};

// One all-reduce: the minimum of every rank's cache hit, and the coordinator's outcome of
// PrepareDirectory when it ran it (it does when its own plan is the cached one: only then can
// every rank hit). The id travels as two 32-bit halves; other ranks contribute the maximum.
// When the coordinator failed, a broadcast carries its error to every rank. COLLECTIVE.
Result<Preamble> AgreeOnPreamble(Comm& comm, bool cache_hit, const Result<std::string>& prepared) {
  constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> values = {cache_hit ? 1 : 0, kAny, kAny, kAny};
  if (comm.rank() == kCoordinator) {
    const uint64_t id = prepared.ok() ? std::strtoull(prepared->c_str(), nullptr, 16) : 0;
    values[1] = prepared.ok() ? 1 : 0;
    values[2] = static_cast<int64_t>(id >> 32);
    values[3] = static_cast<int64_t>(id & 0xffffffffu);
  }
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(values, ReduceOp::kMin));
  if (values[1] != 1) {
    Bytes error = comm.rank() == kCoordinator ? Seal(prepared.status()) : Bytes();
    TESSERA_RETURN_IF_ERROR(comm.Broadcast(&error, kCoordinator));
    Result<std::span<const uint8_t>> opened = Open(error, "the coordinator (rank 0)");
    return opened.ok() ? Internal("the coordinator failed to prepare the save") : opened.status();
  }
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx",
                static_cast<unsigned long long>((static_cast<uint64_t>(values[2]) << 32) |
                                                static_cast<uint64_t>(values[3])));
  return Preamble{values[0] == 1, id};
}

// Step 2 when the plan cache misses: gather the local plans, plan globally on the coordinator,
// scatter each rank's write list. COLLECTIVE; every rank returns the same error.
// Step 2 when the plan cache misses (plan/plan_exchange.h): every rank learns which ranks hold
// the same boxes (one all-gather of 16-byte signatures, which also carries any rank's local
// error to every rank); one rank of each such group sends the plan, every rank the items it
// holds as the main replica; the coordinator plans and scatters each rank's write ranges with
// the save id. The coordinator prepares the directory after planning (when it has not
// already), so a save whose plan is refused leaves no trace. COLLECTIVE; every rank returns
// the same error.
Result<std::vector<uint32_t>> PlanWrites(Comm& comm, Storage& storage, const std::string& path,
                                         const Result<LocalPlan>& local, const FormatWriter* writer,
                                         const SaveOptions& options,
                                         std::shared_ptr<const GlobalSavePlan>& global,
                                         std::string& save_id) {
  const Bytes holdings = local.ok() ? EncodeHoldings(*local) : Bytes();
  std::vector<Bytes> signatures;
  TESSERA_RETURN_IF_ERROR(
      comm.AllGather(local.ok() ? Seal(Status::Ok(), EncodeSignature(SignHoldings(holdings)))
                                : Seal(local.status()),
                     &signatures));
  std::vector<PlanSignature> signature_of(signatures.size());
  for (size_t r = 0; r < signatures.size(); ++r) {
    TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> body,
                             Open(signatures[r], SenderName(comm, static_cast<int>(r))));
    TESSERA_ASSIGN_OR_RETURN(signature_of[r], DecodeSignature(body));
  }
  signatures.clear();
  const PlanGroups groups = GroupBySignature(signature_of);
  const bool leads = groups.members[groups.group_of[comm.rank()]][0] == comm.rank();
  std::vector<Bytes> gathered;
  TESSERA_RETURN_IF_ERROR(comm.Gather(
      Seal(Status::Ok(), EncodePlanMessage(leads ? &holdings : nullptr, MainItemRanges(*local))),
      &gathered, kCoordinator));
  std::vector<Bytes> assignments;
  if (comm.rank() == kCoordinator) {
    Status status = [&]() -> Status {
      std::vector<PlanMessage> messages(gathered.size());
      for (size_t r = 0; r < gathered.size(); ++r) {
        const std::string who = SenderName(comm, static_cast<int>(r));
        TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> body, Open(gathered[r], who));
        TESSERA_ASSIGN_OR_RETURN(messages[r], DecodePlanMessage(body));
        gathered[r] = Bytes();
      }
      TESSERA_ASSIGN_OR_RETURN(
          GlobalSavePlan plan,
          BuildGroupedSavePlan(groups, messages, {.balance_writes = options.balance_writes}));
      global = std::make_shared<const GlobalSavePlan>(std::move(plan));
      if (save_id.empty()) {
        TESSERA_ASSIGN_OR_RETURN(save_id, PrepareDirectory(storage, path, writer, options));
      }
      return Status::Ok();
    }();
    assignments.resize(comm.size());
    for (int r = 0; r < comm.size(); ++r) {
      Bytes assignment;
      if (status.ok()) {
        ByteWriter(&assignment).PutString(save_id);
        const Bytes ranges = EncodeRanges(ToRanges(global->writes[r]));
        assignment.insert(assignment.end(), ranges.begin(), ranges.end());
      }
      assignments[r] = Seal(status, std::move(assignment));
    }
  }
  Bytes mine;
  TESSERA_RETURN_IF_ERROR(comm.Scatter(assignments, &mine, kCoordinator));
  assignments.clear();
  TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> body, Open(mine, "save planning"));
  ByteReader reader(body);
  TESSERA_RETURN_IF_ERROR(reader.GetString(&save_id));
  TESSERA_ASSIGN_OR_RETURN(ItemRanges ranges, DecodeRanges(body.subspan(reader.position())));
  std::vector<uint32_t> items = FromRanges(ranges);
  for (uint32_t i : items) {
    if (i >= local->items.size()) return Internal("save planning assigned an item out of range");
  }
  return items;
}

// Step 4 on the coordinator: the manifest from every rank's write results, committed, then the
// cleanup.
Outcome CommitOnCoordinator(const Comm& comm, Storage& storage, const std::string& path,
                            const GlobalSavePlan& global, const std::vector<Bytes>& gathered,
                            const std::string& save_id, const FormatWriter& writer,
                            const SaveOptions& options) {
  Outcome outcome;
  outcome.total_bytes = global.total_bytes;
  outcome.status = [&]() -> Status {
    std::vector<WriteResult> results(gathered.size());
    for (size_t r = 0; r < gathered.size(); ++r) {
      TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> result,
                               Open(gathered[r], SenderName(comm, r)));
      TESSERA_ASSIGN_OR_RETURN(results[r], DecodeWriteResult(result));
    }
    TESSERA_ASSIGN_OR_RETURN(Metadata metadata, FinishMetadata(global, results));
    metadata.save_id = save_id;
    metadata.user_metadata = options.user_metadata;
    metadata.checksum_block_bytes = kChecksumBlockBytes;
    metadata.separate_prefixes = SortedUnique(options.separate_prefixes);
    metadata.save_time_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
    TESSERA_RETURN_IF_ERROR_CTX(
        CommitIndex(storage, path, writer, metadata, options.sync, outcome.manifest_renamed),
        "committing the " + std::string(writer.index_description()) + " of " + path);
    if (options.remove_stale_files) {
      RemoveStaleFilesAfterCommit(storage, path, writer, save_id, &metadata);
    }
    return Status::Ok();
  }();
  return outcome;
}

}  // namespace

namespace {

Result<SaveReport> SaveOnce(const StateDict& state, const std::string& path, Comm& comm,
                            const SaveOptions& options);

}  // namespace

Result<SaveReport> Save(const StateDict& state, const std::string& path, Comm& comm,
                        const SaveOptions& options) {
  if (!options.storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    SaveOptions resolved = options;
    resolved.storage = location.first;
    return Save(state, location.second, comm, resolved);
  }
  if (!options.device_staging.on_staged) return SaveOnce(state, path, comm, options);
  // on_staged is called exactly once: by the data file writers once the device tensors are
  // copied, else here (the save failed before copying, or had nothing to copy).
  auto called = std::make_shared<std::atomic<bool>>(false);
  SaveOptions once = options;
  once.device_staging.on_staged = [called, &options](const Status& status) {
    if (!called->exchange(true)) options.device_staging.on_staged(status);
  };
  Result<SaveReport> result = SaveOnce(state, path, comm, once);
  if (!called->exchange(true)) options.device_staging.on_staged(result.status());
  return result;
}

namespace {

// What step 1 gives a rank: its local plan, which carries step 1's first error (a bad option,
// the plan's own, refused user metadata on the coordinator, the writer's refusal), and the
// format's writer.
struct LocalSetup {
  Result<LocalPlan> local;
  Result<std::unique_ptr<FormatWriter>> writer;
};

// Step 1 on every rank, with no collective: errors are kept, not returned, so that the rank
// still reports them through the first collective (a rank that returned would leave its
// peers waiting).
LocalSetup PlanLocally(const StateDict& state, bool coordinator, const SaveOptions& options) {
  Result<LocalPlan> local =
      options.num_io_threads >= 0
          ? BuildLocalPlan(state)
          : Result<LocalPlan>(BadOption("SaveOptions::num_io_threads",
                                        "must be at least 1 (or 0 for the default), got " +
                                            std::to_string(options.num_io_threads)));
  if (local.ok() && coordinator) {
    if (Status text = CheckUserMetadata(options.user_metadata); !text.ok()) local = text;
  }
  // The format's writer: it checks the options the format has no place for.
  const Format* format = FindFormat(options.format);
  Result<std::unique_ptr<FormatWriter>> writer =
      format ? format->NewWriter(options, coordinator)
             : Result<std::unique_ptr<FormatWriter>>(BadOption(
                   "SaveOptions::format", "is not a format tessera knows: value " +
                                              std::to_string(static_cast<int>(options.format)) +
                                              " (formats: " + FormatNames() + ")"));
  if (writer.ok()) {
    const Status format_options =
        format->CheckOptions(options.format_options, "SaveOptions::format_options");
    if (!format_options.ok()) writer = format_options;
  }
  if (local.ok() && !writer.ok()) local = writer.status();
  return LocalSetup{std::move(local), std::move(writer)};
}

// The plan cache's key: this rank's encoded local plan with the options and the comm size that
// shape the global plan. A failed local plan hashes as an empty one (it never hits).
uint64_t PlanKey(const Result<LocalPlan>& local, const SaveOptions& options, int comm_size) {
  const Bytes encoded_plan = local.ok() ? EncodeLocalPlan(*local) : Bytes();
  return Checksum(encoded_plan.data(), encoded_plan.size()) ^
         (options.balance_writes ? 0x9e3779b97f4a7c15ULL : 0) ^ static_cast<uint64_t>(comm_size);
}

// Removes the coordinator's save marker when the save ends, whatever happens; `save_id` is read
// then, so it may be drawn after the guard is made. A null storage (other ranks) does nothing.
struct MarkerGuard {
  Storage* storage;
  const std::string& path;
  const std::string& save_id;
  ~MarkerGuard() {
    if (storage && !save_id.empty()) RemoveSaveMarker(*storage, path, save_id);
  }
};

// Step 3 on every rank: writes the data files of `items`, reporting progress (when asked)
// against their total bytes. `local` and `writer` are the ones planning succeeded with.
Result<WriteResult> WriteRankFiles(Storage& storage, const std::string& path,
                                   const StateDict& state, const LocalPlan& local,
                                   const std::vector<uint32_t>& items, const FormatWriter& writer,
                                   const std::string& save_id, int rank,
                                   const SaveOptions& options) {
  const int threads = SaveIoThreads(options.num_io_threads, storage);
  DataFileWriteOptions write_options;
  write_options.num_threads = threads;
  write_options.sync = options.sync;
  write_options.checksum_block_bytes = kChecksumBlockBytes;
  write_options.device_staging = options.device_staging;
  uint64_t my_bytes = 0;
  for (uint32_t i : items) my_bytes += local.items[i].num_bytes;
  if (options.progress) {
    write_options.on_progress = [&](uint64_t done) { options.progress(done, my_bytes); };
    options.progress(0, my_bytes);  // the start: a bar's clock and total
  }
  const std::vector<DataFilePlan> files =
      PlanDataFiles(local, items, threads, options.separate_prefixes, writer, save_id, rank);
  return WriteDataFiles(storage, path, state, local, files, writer, save_id, write_options);
}

// The end of step 3 and step 4: every rank's write result (or error) gathered to the
// coordinator, which commits the manifest (`global` is its plan, null elsewhere); the outcome
// broadcast, so every rank returns the same one. COLLECTIVE.
Result<Outcome> CommitAndShareOutcome(Comm& comm, Storage& storage, const std::string& path,
                                      const Result<WriteResult>& written,
                                      const GlobalSavePlan* global, const std::string& save_id,
                                      const FormatWriter& writer, const SaveOptions& options) {
  std::vector<Bytes> gathered;
  TESSERA_RETURN_IF_ERROR(comm.Gather(
      written.ok() ? Seal(Status::Ok(), EncodeWriteResult(*written)) : Seal(written.status()),
      &gathered, kCoordinator));
  Bytes outcome_bytes;
  if (comm.rank() == kCoordinator) {
    outcome_bytes = EncodeOutcome(
        CommitOnCoordinator(comm, storage, path, *global, gathered, save_id, writer, options));
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&outcome_bytes, kCoordinator));
  return DecodeOutcome(outcome_bytes);
}

// Keeps this save's plan for the next save on the comm when it succeeded, else forgets the
// cached one. Every rank saw the same outcome, so the caches stay in step.
void UpdatePlanCache(SavePlanCache& cache, const Outcome& outcome, uint64_t plan_key,
                     const std::vector<uint32_t>& items,
                     std::shared_ptr<const GlobalSavePlan> global) {
  cache.valid = outcome.status.ok();
  if (cache.valid) {
    cache.key = plan_key;
    cache.items = items;
    cache.global = std::move(global);
  }
}

// After a failed save: this rank's data files, unless the manifest may already point at them
// (then nothing else refers to them).
void RemoveUncommittedFiles(Storage& storage, const std::string& path,
                            const Result<WriteResult>& written, const Outcome& outcome) {
  if (written.ok() && !outcome.manifest_renamed) {
    for (const FileInfo& f : written->files) {
      storage.Remove(JoinPath(path, f.name)).IgnoreError();
    }
  }
}

// This rank's report of a save that succeeded, its phase timings already in `report`.
SaveReport MakeReport(const std::string& save_id, const Result<WriteResult>& written,
                      bool plan_cache_hit, const Outcome& outcome, SaveReport report) {
  report.save_id = save_id;
  if (written.ok()) {
    report.files_written = static_cast<int>(written->files.size());
    for (const WrittenItem& item : written->items) report.bytes_written += item.length;
  }
  report.plan_cache_hit = plan_cache_hit;
  report.total_bytes = outcome.total_bytes;
  return report;
}

Result<SaveReport> SaveOnce(const StateDict& state, const std::string& path, Comm& comm,
                            const SaveOptions& options) {
  // No collective at all: the comm only says who this rank is.
  if (!options.collective) return SaveRankLocal(state, path, comm.rank(), comm.size(), options);
  std::shared_ptr<Storage> storage = options.storage ? options.storage : NewPosixStorage();
  const bool coordinator = comm.rank() == kCoordinator;
  SaveReport timing;  // the phases' seconds; MakeReport fills in the rest
  LapClock clock;

  // 1. Local plan. When every rank's plan (and the options that shape the global plan) equal
  // those of this comm's previous successful save, one all-reduce replaces the gather, the
  // global planning and the scatter: each rank reuses its write list, the coordinator its
  // global plan.
  LocalSetup setup = PlanLocally(state, coordinator, options);
  const Result<LocalPlan>& local = setup.local;
  const FormatWriter* format_writer = setup.writer.ok() ? setup.writer->get() : nullptr;
  const uint64_t plan_key = PlanKey(local, options, comm.size());
  std::shared_ptr<SavePlanCache> cache = comm.GetOrCreateAttachment<SavePlanCache>(
      "tessera.save_plan_cache", [] { return new SavePlanCache(); });
  const bool my_hit = options.plan_cache && local.ok() && cache->valid && cache->key == plan_key;
  Result<std::string> prepared = coordinator && my_hit
                                     ? PrepareDirectory(*storage, path, format_writer, options)
                                     : Result<std::string>(std::string());
  Result<Preamble> preamble = AgreeOnPreamble(comm, my_hit, prepared);
  std::string save_id = preamble.ok() && preamble->cache_hit ? preamble->save_id : "";
  MarkerGuard marker{coordinator ? storage.get() : nullptr, path, save_id};
  if (coordinator && prepared.ok()) save_id = *prepared;
  if (!preamble.ok()) return preamble.status();

  // 2. Who writes what.
  std::shared_ptr<const GlobalSavePlan> global;
  std::vector<uint32_t> items;
  if (preamble->cache_hit) {
    global = cache->global;  // null except on the coordinator
    items = cache->items;
  } else {
    TESSERA_ASSIGN_OR_RETURN(
        items, PlanWrites(comm, *storage, path, local, format_writer, options, global, save_id));
  }

  // 3. Write this rank's files; 4. the coordinator commits the manifest, then tells everyone
  // the outcome.
  timing.plan_seconds = clock.Lap();
  const Result<WriteResult> written = WriteRankFiles(*storage, path, state, *local, items,
                                                     *format_writer, save_id, comm.rank(), options);
  timing.write_seconds = clock.Lap();
  TESSERA_ASSIGN_OR_RETURN(
      Outcome outcome, CommitAndShareOutcome(comm, *storage, path, written, global.get(), save_id,
                                             *format_writer, options));
  timing.commit_seconds = clock.Lap();
  UpdatePlanCache(*cache, outcome, plan_key, items, coordinator ? global : nullptr);
  if (!outcome.status.ok()) {
    RemoveUncommittedFiles(*storage, path, written, outcome);
    return outcome.status;
  }
  return MakeReport(save_id, written, preamble->cache_hit, outcome, std::move(timing));
}

}  // namespace

Result<SaveReport> Save(const StateDict& state, const std::string& path,
                        const SaveOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Save(state, path, *comm, options);
}

}  // namespace tessera
