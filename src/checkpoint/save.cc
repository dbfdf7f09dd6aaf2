// Save: the protocol of ../shared/DESIGN.md, "Save protocol".
//
//   1. every rank: local plan            -> Gather to rank 0 (the coordinator)
//   2. rank 0: global plan, save id      -> Scatter each rank's write list
//   3. every rank: write its data files  -> Gather write results
//   4. rank 0: manifest, committed last  -> Broadcast the outcome
//
// Every message carries its sender's status (envelope.h), so a rank that fails at any step
// still takes part in the remaining collectives and every rank returns the same error.
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "checkpoint/envelope.h"
#include "core/byte_io.h"
#include "core/utf8.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "format/safetensors.h"
#include "plan/save_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;
// Bytes written and then checksummed per WriteAt: small enough that the bytes the kernel just
// copied into the page cache are still in the CPU's cache when the hash reads them. Hashing
// after the write, not before, lets the kernel's copy (not the hash) pull them from memory,
// which it does faster (build/tessera_bench_io_patterns, page_cache_write_seconds: 1 GiB by 4
// threads, 0.145 s hashed after, 0.168 s hashed before, 0.123 s not hashed).
constexpr size_t kWritePiece = 256u << 10;

// With SyncPolicy::kFull, every this many bytes written to a data file are handed to
// WritableFile::StartWriteback, so the device writes while the rest is being copied instead of
// all at the final fdatasync (tessera_bench_io_patterns, synced_write_seconds: 1 GiB by 4
// threads, 0.44 s against 0.55 s for 64 MiB pwrites and one fdatasync per file).
constexpr uint64_t kWritebackStep = 8u << 20;

// 64 bits from the kernel's random source (getrandom(2)), so that nobody can predict the
// names a save will create from what the directory shows (issue 11: a predictable name lets a
// planted symbolic link wait for the write; creation is exclusive as well, see CreateMode).
uint64_t DrawSaveId() {
  uint64_t x = 0;
  size_t got = 0;
  while (got < sizeof(x)) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(&x) + got, sizeof(x) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (got < sizeof(x)) {  // no getrandom (ENOSYS): the C++ library's nondeterministic source
    std::random_device device;
    x = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  return x;
}

std::string FormatSaveId(uint64_t id) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(id));
  return text;
}

// A fresh random save id that no file in the directory uses yet.
std::string NewSaveId(const std::vector<std::string>& existing_names) {
  while (true) {
    std::string id = FormatSaveId(DrawSaveId());
    std::string prefix = "tsr-" + id;
    bool used = std::any_of(existing_names.begin(), existing_names.end(),
                            [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
    if (!used) return id;
  }
}

// The last successful save's plan, kept with the Comm (Comm::GetOrCreateAttachment). Save on
// one Comm runs on one thread at a time (the Comm contract), so no lock is needed.
struct SavePlanCache {
  bool valid = false;
  uint64_t key = 0;             // hash of this rank's encoded local plan and the options
  std::vector<uint32_t> items;  // this rank's write list
  std::shared_ptr<const GlobalSavePlan> global;  // coordinator only
};

// User metadata is UTF-8 text, keys and values (docs/FORMAT.md): readers hand it to JSON and
// to Python as strings.
Status CheckUserMetadata(const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (!IsValidUtf8(key)) {
      return InvalidArgument("SaveOptions::user_metadata key " + QuoteBytes(key) +
                             " is not valid UTF-8");
    }
    if (!IsValidUtf8(value)) {
      return InvalidArgument("SaveOptions::user_metadata[" + QuoteBytes(key) +
                             "] = " + QuoteBytes(value) + " is not valid UTF-8");
    }
  }
  return Status::Ok();
}

// What rank 0 sends each rank after planning.
struct Assignment {
  std::string save_id;
  std::vector<uint32_t> items;  // indices into the rank's local plan
};

Bytes EncodeAssignment(const Assignment& a) {
  Bytes out;
  ByteWriter w(&out);
  w.PutString(a.save_id);
  w.PutVector(a.items);
  return out;
}

Result<Assignment> DecodeAssignment(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  Assignment a;
  TESSERA_RETURN_IF_ERROR(r.GetString(&a.save_id));
  TESSERA_RETURN_IF_ERROR(r.GetVector(&a.items));
  return a;
}

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
  w.Put<uint32_t>(static_cast<uint32_t>(o.status.code()));
  w.PutString(o.status.message());
  w.Put<uint8_t>(o.manifest_renamed ? 1 : 0);
  w.Put<uint64_t>(o.total_bytes);
  return out;
}

Result<Outcome> DecodeOutcome(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  uint32_t code = 0;
  std::string message;
  uint8_t renamed = 0;
  Outcome o;
  TESSERA_RETURN_IF_ERROR(r.Get(&code));
  TESSERA_RETURN_IF_ERROR(r.GetString(&message));
  TESSERA_RETURN_IF_ERROR(r.Get(&renamed));
  TESSERA_RETURN_IF_ERROR(r.Get(&o.total_bytes));
  o.status = Status(static_cast<StatusCode>(code), std::move(message));
  o.manifest_renamed = renamed != 0;
  return o;
}

// The bytes of one local item.
const std::byte* ItemData(const StateDict& state, const LocalItem& item) {
  const StateEntry& entry = state.entries()[item.entry_index];
  if (const auto* object = std::get_if<ShardedObject>(&entry)) {
    return reinterpret_cast<const std::byte*>(object->data.data());
  }
  return std::get<ShardedTensor>(entry).data.bytes() + item.byte_offset;
}

struct FilePlan {
  std::string name;
  std::vector<uint32_t> items;  // indices into the local plan
  std::vector<SafetensorsEntry> entries;
  Bytes header;
  uint64_t data_bytes = 0;
};

// Splits this rank's items over up to `num_files` files, balancing bytes: largest first to the
// least-loaded file; within a file, items keep ascending order.
std::vector<FilePlan> PlanFiles(const LocalPlan& plan, const std::vector<uint32_t>& items,
                                int num_files, const std::string& save_id, int rank) {
  num_files = std::max(1, std::min<int>(num_files, static_cast<int>(items.size())));
  if (items.empty()) return {};
  std::vector<uint32_t> by_size = items;
  std::stable_sort(by_size.begin(), by_size.end(), [&](uint32_t a, uint32_t b) {
    return plan.items[a].num_bytes > plan.items[b].num_bytes;
  });
  std::vector<FilePlan> files(num_files);
  std::vector<uint64_t> load(num_files, 0);
  for (uint32_t i : by_size) {
    size_t f = std::min_element(load.begin(), load.end()) - load.begin();
    files[f].items.push_back(i);
    load[f] += plan.items[i].num_bytes;
  }
  for (int f = 0; f < num_files; ++f) {
    FilePlan& file = files[f];
    file.name = DataFileName(save_id, rank, f);
    std::sort(file.items.begin(), file.items.end());
    for (uint32_t i : file.items) {
      const LocalItem& item = plan.items[i];
      SafetensorsEntry e;
      if (item.kind == ItemKind::kObject) {
        e.name = item.key;
        e.dtype = DType::kU8;
        e.shape = {static_cast<int64_t>(item.num_bytes)};
      } else {
        e.name = ChunkEntryName(item.key, item.box, item.global_shape);
        e.dtype = item.dtype;
        e.shape = item.box.sizes;
      }
      file.entries.push_back(std::move(e));
    }
    file.data_bytes = LayOutEntries(file.entries);
  }
  return files;
}

// Writes one data file: header, then every item, checksumming each piece just after writing
// it, while it is in cache. The file is created exclusively (a name that exists is an error,
// never a target); `created` says whether this call created it.
Status WriteDataFile(Storage& storage, const std::string& dir, const StateDict& state,
                     const LocalPlan& plan, uint32_t file_index, const FilePlan& file,
                     SyncPolicy sync, WriteResult& result, uint8_t& created) {
  const std::string path = JoinPath(dir, file.name);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                           storage.NewWritableFile(path, CreateMode::kExclusive));
  created = 1;
  TESSERA_RETURN_IF_ERROR(out->WriteAt(0, file.header.data(), file.header.size()));
  const uint64_t data_start = file.header.size();
  // With kFull, bytes up to here have been handed to StartWriteback.
  uint64_t writeback_begin = 0;
  for (size_t k = 0; k < file.items.size(); ++k) {
    const LocalItem& item = plan.items[file.items[k]];
    const SafetensorsEntry& entry = file.entries[k];
    const std::byte* data = ItemData(state, item);
    ChecksumStream checksum;
    for (uint64_t done = 0; done < item.num_bytes;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kWritePiece, item.num_bytes - done));
      const uint64_t at = data_start + entry.begin + done;
      TESSERA_RETURN_IF_ERROR(out->WriteAt(at, data + done, n));
      checksum.Update(data + done, n);
      done += n;
      if (sync == SyncPolicy::kFull && at + n - writeback_begin >= kWritebackStep) {
        TESSERA_RETURN_IF_ERROR(out->StartWriteback(writeback_begin, at + n - writeback_begin));
        writeback_begin = at + n;
      }
    }
    result.items.push_back(WrittenItem{file.items[k], file_index, data_start + entry.begin,
                                       item.num_bytes, checksum.Digest()});
  }
  if (sync == SyncPolicy::kFull) TESSERA_RETURN_IF_ERROR(out->Sync());
  TESSERA_RETURN_IF_ERROR(out->Close());
  return Status::Ok();
}

// Step 3 on one rank: writes its files, one thread each.
Result<WriteResult> WriteLocalFiles(Storage& storage, const std::string& dir,
                                    const StateDict& state, const LocalPlan& plan,
                                    const Assignment& assignment, int rank,
                                    const SaveOptions& options) {
  std::vector<FilePlan> files =
      PlanFiles(plan, assignment.items, options.num_io_threads, assignment.save_id, rank);
  std::map<std::string, std::string> header_metadata = {{"format", "pt"},
                                                        {"tessera_save_id", assignment.save_id}};
  for (FilePlan& file : files) {
    TESSERA_ASSIGN_OR_RETURN(file.header, EncodeSafetensorsHeader(file.entries, header_metadata));
  }
  std::vector<WriteResult> partial(files.size());
  std::vector<Status> statuses(files.size());
  std::vector<uint8_t> created(files.size(), 0);  // bytes, not vector<bool>: one per thread
  std::vector<std::thread> threads;
  for (size_t f = 0; f + 1 < files.size(); ++f) {
    threads.emplace_back([&, f] {
      statuses[f] = WriteDataFile(storage, dir, state, plan, static_cast<uint32_t>(f), files[f],
                                  options.sync, partial[f], created[f]);
    });
  }
  if (!files.empty()) {  // the calling thread writes the last file
    size_t f = files.size() - 1;
    statuses[f] = WriteDataFile(storage, dir, state, plan, static_cast<uint32_t>(f), files[f],
                                options.sync, partial[f], created[f]);
  }
  for (std::thread& t : threads) t.join();
  for (size_t f = 0; f < files.size(); ++f) {
    if (!statuses[f].ok()) {
      // Leave nothing behind (no manifest will refer to these files), but only what this save
      // created: a name that was already taken belongs to someone else.
      for (size_t g = 0; g < files.size(); ++g) {
        if (created[g]) storage.Remove(JoinPath(dir, files[g].name)).IgnoreError();
      }
      return statuses[f].WithContext("writing " + JoinPath(dir, files[f].name));
    }
  }
  WriteResult result;
  for (size_t f = 0; f < files.size(); ++f) {
    result.files.push_back(FileInfo{files[f].name, files[f].header.size() + files[f].data_bytes});
    result.items.insert(result.items.end(), partial[f].items.begin(), partial[f].items.end());
  }
  return result;
}

std::string ParentDir(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  size_t parent_end = path.find_last_not_of('/', slash);
  return parent_end == std::string::npos ? "/" : path.substr(0, parent_end + 1);
}

// Creates `path` and the missing directories above it. With kFull, syncs the parent of each
// one created, so the checkpoint directory itself survives a crash, not only its contents.
Status CreateDurableDirs(Storage& storage, const std::string& path, SyncPolicy sync) {
  std::vector<std::string> missing;  // deepest first
  for (std::string dir = path;;) {
    TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(dir));
    if (type == FileType::kDirectory) break;
    if (type == FileType::kFile) {
      return FailedPrecondition("cannot create checkpoint directory " + path + ": " + dir +
                                " is a file");
    }
    missing.push_back(dir);
    std::string parent = ParentDir(dir);
    if (parent == dir) break;
    dir = std::move(parent);
  }
  if (missing.empty()) return Status::Ok();
  TESSERA_RETURN_IF_ERROR_CTX(storage.CreateDirs(path), "creating checkpoint directory");
  if (sync == SyncPolicy::kFull) {
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      TESSERA_RETURN_IF_ERROR(storage.SyncDir(ParentDir(*it)));
    }
  }
  return Status::Ok();
}

// Step 4 on the coordinator: the manifest under a temporary name, synced, renamed into place,
// directory synced. Before it, the directory is synced so the data files' entries are durable
// before anything can point at them.
Status CommitManifest(Storage& storage, const std::string& dir, const Metadata& metadata,
                      SyncPolicy sync, bool& renamed) {
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));
  Bytes bytes = EncodeManifest(metadata);
  const std::string temp = JoinPath(dir, TempManifestName(metadata.save_id));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                           storage.NewWritableFile(temp, CreateMode::kExclusive));
  TESSERA_RETURN_IF_ERROR(out->WriteAt(0, bytes.data(), bytes.size()));
  if (durable) TESSERA_RETURN_IF_ERROR(out->Sync());
  TESSERA_RETURN_IF_ERROR(out->Close());
  renamed = true;  // from here on the new manifest may be visible, even if Rename reports failure
  TESSERA_RETURN_IF_ERROR(storage.Rename(temp, JoinPath(dir, kManifestFileName)));
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));
  return Status::Ok();
}

// After a commit: removes tessera-named data files the new manifest does not list (the previous
// save's, and those of interrupted saves) and stray temporary manifests. Best effort: a file
// that cannot be removed now is removed by a later save.
void RemoveStaleFiles(Storage& storage, const std::string& dir, const Metadata& metadata) {
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return;
  std::set<std::string> live;
  for (const FileInfo& f : metadata.files) live.insert(f.name);
  for (const std::string& name : *names) {
    if ((IsTesseraDataFileName(name) && !live.count(name)) || IsTempManifestName(name)) {
      storage.Remove(JoinPath(dir, name)).IgnoreError();
    }
  }
}

}  // namespace

Result<SaveReport> Save(const StateDict& state, const std::string& path, Comm& comm,
                        const SaveOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : NewPosixStorage();
  const int rank = comm.rank();
  const bool coordinator = rank == kCoordinator;

  // 1. Local plan. When every rank's plan (and the options that shape the global plan) equal
  // those of this comm's previous successful save, one all-reduce replaces the gather, the
  // global planning and the scatter: each rank reuses its write list, the coordinator its
  // global plan.
  // A bad option is reported through the first collective like a bad state: a rank that
  // returned here would leave its peers waiting.
  Result<LocalPlan> local =
      options.num_io_threads >= 1
          ? BuildLocalPlan(state)
          : Result<LocalPlan>(InvalidArgument("SaveOptions::num_io_threads must be at least 1, "
                                              "got " +
                                              std::to_string(options.num_io_threads)));
  if (local.ok() && coordinator) {
    if (Status text = CheckUserMetadata(options.user_metadata); !text.ok()) local = text;
  }
  Bytes encoded_plan = local.ok() ? EncodeLocalPlan(*local) : Bytes();
  const uint64_t plan_key = Checksum(encoded_plan.data(), encoded_plan.size()) ^
                            (options.balance_writes ? 0x9e3779b97f4a7c15ULL : 0) ^
                            static_cast<uint64_t>(comm.size());
  std::shared_ptr<SavePlanCache> cache = comm.GetOrCreateAttachment<SavePlanCache>(
      "tessera.save_plan_cache", [] { return new SavePlanCache(); });
  // One all-reduce, a sum: the number of ranks that miss the cache, and the coordinator's
  // freshly drawn save id (every other rank adds 0), so that a cached save's id is as random
  // as any other's.
  const bool hit_here = options.plan_cache && local.ok() && cache->valid && cache->key == plan_key;
  std::vector<int64_t> vote = {hit_here ? 0 : 1,
                               coordinator ? static_cast<int64_t>(DrawSaveId()) : 0};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(vote, ReduceOp::kSum));
  const bool cache_hit = vote[0] == 0;

  std::shared_ptr<const GlobalSavePlan> global;
  Assignment assignment;
  if (cache_hit) {
    global = cache->global;  // null except on the coordinator
    assignment = {FormatSaveId(static_cast<uint64_t>(vote[1])), cache->items};
    TESSERA_RETURN_IF_ERROR(CreateDurableDirs(*storage, path, options.sync));
  } else {
    // 2. Gather the local plans; the coordinator plans; each rank receives its assignment.
    std::vector<Bytes> gathered;
    TESSERA_RETURN_IF_ERROR(
        comm.Gather(local.ok() ? Seal(Status::Ok(), std::move(encoded_plan)) : Seal(local.status()),
                    &gathered, kCoordinator));
    std::vector<Bytes> assignments;
    if (coordinator) {
      std::string save_id;
      Status status = [&]() -> Status {
        std::vector<std::span<const uint8_t>> bodies(gathered.size());
        for (size_t r = 0; r < gathered.size(); ++r) {
          TESSERA_ASSIGN_OR_RETURN(bodies[r], Open(gathered[r], "rank " + std::to_string(r)));
        }
        TESSERA_ASSIGN_OR_RETURN(std::vector<LocalPlan> plans,
                                 DecodeLocalPlans(bodies, options.num_io_threads));
        gathered.clear();
        TESSERA_ASSIGN_OR_RETURN(
            GlobalSavePlan plan,
            BuildGlobalSavePlan(plans, {.balance_writes = options.balance_writes}));
        global = std::make_shared<const GlobalSavePlan>(std::move(plan));
        TESSERA_RETURN_IF_ERROR(CreateDurableDirs(*storage, path, options.sync));
        TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
        save_id = NewSaveId(names);
        return Status::Ok();
      }();
      assignments.resize(comm.size());
      for (int r = 0; r < comm.size(); ++r) {
        assignments[r] = status.ok() ? Seal(status, EncodeAssignment({save_id, global->writes[r]}))
                                     : Seal(status);
      }
    }
    Bytes mine;
    TESSERA_RETURN_IF_ERROR(comm.Scatter(assignments, &mine, kCoordinator));
    assignments.clear();
    Result<std::span<const uint8_t>> body = Open(mine, "save planning");
    if (!body.ok()) return body.status();  // the same error on every rank
    TESSERA_ASSIGN_OR_RETURN(assignment, DecodeAssignment(*body));
  }

  // 3. Write this rank's files.
  Result<WriteResult> written =
      WriteLocalFiles(*storage, path, state, *local, assignment, rank, options);
  SaveReport report;
  report.save_id = assignment.save_id;
  if (written.ok()) {
    report.files_written = static_cast<int>(written->files.size());
    for (const WrittenItem& item : written->items) report.bytes_written += item.length;
  }
  std::vector<Bytes> gathered;
  TESSERA_RETURN_IF_ERROR(comm.Gather(
      written.ok() ? Seal(Status::Ok(), EncodeWriteResult(*written)) : Seal(written.status()),
      &gathered, kCoordinator));

  // 4. The coordinator commits the manifest, then tells everyone the outcome.
  Bytes outcome_bytes;
  if (coordinator) {
    Outcome outcome;
    outcome.total_bytes = global->total_bytes;
    outcome.status = [&]() -> Status {
      std::vector<WriteResult> results(gathered.size());
      for (size_t r = 0; r < gathered.size(); ++r) {
        const std::string who = "rank " + std::to_string(r);
        TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> result, Open(gathered[r], who));
        TESSERA_ASSIGN_OR_RETURN(results[r], DecodeWriteResult(result));
      }
      TESSERA_ASSIGN_OR_RETURN(Metadata metadata, FinishMetadata(*global, results));
      metadata.save_id = assignment.save_id;
      metadata.user_metadata = options.user_metadata;
      TESSERA_RETURN_IF_ERROR_CTX(
          CommitManifest(*storage, path, metadata, options.sync, outcome.manifest_renamed),
          "committing the manifest of " + path);
      if (options.remove_stale_files) RemoveStaleFiles(*storage, path, metadata);
      return Status::Ok();
    }();
    outcome_bytes = EncodeOutcome(outcome);
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&outcome_bytes, kCoordinator));
  TESSERA_ASSIGN_OR_RETURN(Outcome outcome, DecodeOutcome(outcome_bytes));
  // Every rank saw the same outcome, so the caches stay in step.
  cache->valid = outcome.status.ok();
  if (cache->valid) {
    cache->key = plan_key;
    cache->items = assignment.items;
    cache->global = coordinator ? global : nullptr;
  }
  report.plan_cache_hit = cache_hit;
  if (!outcome.status.ok()) {
    // Unless the manifest may already point at them, nothing refers to this save's files.
    if (written.ok() && !outcome.manifest_renamed) {
      for (const FileInfo& f : written->files) {
        storage->Remove(JoinPath(path, f.name)).IgnoreError();
      }
    }
    return outcome.status;
  }
  report.total_bytes = outcome.total_bytes;
  return report;
}

Result<SaveReport> Save(const StateDict& state, const std::string& path,
                        const SaveOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Save(state, path, *comm, options);
}

}  // namespace tessera
