// A rank-local save: the four steps of Save (save.cc) on one rank, with nothing exchanged.
// The rank plans alone over the items it holds as the main replica, writes its data files,
// and commits the manifest of its part (docs/FORMAT.md, section 4.2).
#include "checkpoint/rank_local_save.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <thread>

#include "checkpoint/commit.h"
#include "checkpoint/data_files.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "plan/save_plan.h"

namespace tessera {
namespace {

Status CheckRankLocalOptions(const SaveOptions& options, int rank, int num_ranks) {
  if (options.save_tag.empty()) {
    return InvalidArgument(
        "SaveOptions::save_tag is required when SaveOptions::collective is false: it names the "
        "save on every rank without a message (e.g. \"step-1000\")");
  }
  if (options.format != CheckpointFormat::kTessera) {
    return InvalidArgument(
        "SaveOptions::collective false writes the tessera format only (rank manifests)");
  }
  if (options.num_io_threads < 1) {
    return InvalidArgument("SaveOptions::num_io_threads must be at least 1, got " +
                           std::to_string(options.num_io_threads));
  }
  if (rank < 0 || rank >= num_ranks) {
    return InvalidArgument("rank " + std::to_string(rank) + " is not one of " +
                           std::to_string(num_ranks) + " ranks");
  }
  return CheckUserMetadata(options.user_metadata);
}

// The items this rank writes: those it holds as the main replica. The rest are listed only so
// that the part names every tensor the rank holds (a tensor whose main replica no rank holds is
// then a gap the readers report, not a key that silently vanished).
struct RankItems {
  LocalPlan main;
  std::vector<const LocalItem*> replicas;
};

RankItems SplitMainReplicas(const LocalPlan& plan) {
  RankItems split;
  for (const LocalItem& item : plan.items) {
    if (IsMainReplica(item.replica_id)) {
      split.main.items.push_back(item);
    } else {
      split.replicas.push_back(&item);
    }
  }
  return split;
}

// Adds an empty TensorInfo for every tensor held only as a replica; keeps tensors by key.
void AddReplicaOnlyTensors(const std::vector<const LocalItem*>& replicas, Metadata& metadata) {
  std::set<std::string> known;
  for (const TensorInfo& t : metadata.tensors) known.insert(t.key);
  for (const ObjectInfo& o : metadata.objects) known.insert(o.key);
  for (const LocalItem* item : replicas) {
    if (item->kind != ItemKind::kTensor || !known.insert(item->key).second) continue;
    TensorInfo info;
    info.key = item->key;
    info.dtype = item->dtype;
    info.global_shape = item->global_shape;
    info.partial = item->partial;
    metadata.tensors.push_back(std::move(info));
  }
  std::sort(metadata.tensors.begin(), metadata.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.key < b.key; });
}

// Files a crashed earlier attempt of this rank at the same save left behind would block the
// exclusive creation of this attempt's: the names it is about to write are removed. No
// directory listing: at tens of thousands of ranks, every rank listing a directory of their
// files would cost O(ranks x files) metadata operations.
void RemoveOwnLeftovers(Storage& storage, const std::string& path,
                        const std::vector<DataFilePlan>& files, const std::string& manifest_name) {
  for (const DataFilePlan& f : files) storage.Remove(JoinPath(path, f.name)).IgnoreError();
  storage.Remove(JoinPath(path, manifest_name + ".tmp")).IgnoreError();
}

// The first of `files` that exists in `path`, or "".
Result<std::string> FirstExisting(Storage& storage, const std::string& path,
                                  const std::vector<DataFilePlan>& files) {
  for (const DataFilePlan& f : files) {
    TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(JoinPath(path, f.name)));
    if (type != FileType::kNotFound) return f.name;
  }
  return std::string();
}

// Refuses (kAlreadyExists, naming the tag and the file) a tag this rank already saved: its rank
// manifest is there, or data files of this rank at the tag with no marker of this rank beside
// them. Those are not what an attempt that died left (it dies with its marker in place; a
// cleanup that removes a dead marker removes its files too, unless a checkpoint lists them):
// they are a committed checkpoint's, e.g. the tag saved and finalized before a job restarted
// from an older step. Stats of the names this attempt will write, rather than a listing (see
// RemoveOwnLeftovers).
Status CheckTagNotSaved(Storage& storage, const std::string& path, int rank, const std::string& tag,
                        const std::string& manifest_name, const std::string& marker_id,
                        const std::vector<DataFilePlan>& files) {
  const std::string saved =
      "rank " + std::to_string(rank) + " already saved tag '" + tag + "' into " + path + " (";
  const std::string advice = "each rank-local save needs a new SaveOptions::save_tag";
  TESSERA_ASSIGN_OR_RETURN(FileType existing, storage.Stat(JoinPath(path, manifest_name)));
  if (existing != FileType::kNotFound) {
    return Status(StatusCode::kAlreadyExists, saved + manifest_name + "): " + advice);
  }
  TESSERA_ASSIGN_OR_RETURN(std::string own_file, FirstExisting(storage, path, files));
  if (own_file.empty()) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(FileType own_marker,
                           storage.Stat(JoinPath(path, "tessera.saving." + marker_id)));
  if (own_marker != FileType::kNotFound) return Status::Ok();
  return Status(StatusCode::kAlreadyExists,
                saved + own_file +
                    " is there and no interrupted attempt of this rank left it; the tag was "
                    "finalized or another job saved it): " +
                    advice);
}

// Writes the part's manifest under a temporary name and renames it into place: the part is
// there whole or not at all. What is written must read back as a part.
Status CommitRankManifest(Storage& storage, const std::string& path, const Metadata& part,
                          SyncPolicy sync) {
  const std::string name = RankManifestName(part.save_id, part.part_rank);
  const Bytes bytes = EncodeManifest(part);
  if (Result<Metadata> check = DecodeManifest(bytes, JoinPath(path, name)); !check.ok()) {
    return InvalidArgument("the rank manifest would not be readable, nothing was committed: " +
                           check.status().message());
  }
  const bool durable = sync == SyncPolicy::kFull;
  const std::string temp = JoinPath(path, name + ".tmp");
  TESSERA_RETURN_IF_ERROR(WriteWholeFile(storage, temp, bytes, durable));
  TESSERA_RETURN_IF_ERROR(storage.Rename(temp, JoinPath(path, name)));
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(path));
  return Status::Ok();
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Readers order saves by save time in milliseconds, and a committed manifest wins a tie. A save
// that committed before this rank listed the directory took its time no later than `listed_ms`:
// this part's time is strictly later, so a rank-local save right after a collective one (or
// after this rank's previous part) is the newer one. It waits for the clock rather than adding
// to it, so that a save committed after this part gets a time no earlier than the part's (and
// wins the tie). Waits at most a millisecond, and only when the save took less; if the clock
// was set back meanwhile, it gives up after 5 ms and takes listed_ms + 1.
int64_t SaveTimeAfter(int64_t listed_ms) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
  int64_t now = NowUnixMs();
  while (now <= listed_ms) {
    if (std::chrono::steady_clock::now() > give_up) return listed_ms + 1;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    now = NowUnixMs();
  }
  return now;
}

}  // namespace

std::string RankLocalSaveId(const std::string& tag) {
  const uint64_t hash = Checksum(tag.data(), tag.size());
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(hash));
  return id;
}

Result<SaveReport> SaveRankLocal(const StateDict& state, const std::string& path, int rank,
                                 int num_ranks, const SaveOptions& options) {
  TESSERA_RETURN_IF_ERROR(CheckRankLocalOptions(options, rank, num_ranks));
  std::shared_ptr<Storage> storage = options.storage ? options.storage : NewPosixStorage();
  TESSERA_ASSIGN_OR_RETURN(LocalPlan local, BuildLocalPlan(state));
  RankItems split = SplitMainReplicas(local);
  SavePlanOptions plan_options;
  plan_options.num_ranks = num_ranks;
  plan_options.require_coverage = false;
  plan_options.ranks_of = [rank](int32_t) { return std::vector<int32_t>{rank}; };
  TESSERA_ASSIGN_OR_RETURN(GlobalSavePlan plan,
                           BuildGlobalSavePlan(std::span(&split.main, 1), plan_options));

  const std::string save_id = RankLocalSaveId(options.save_tag);
  TESSERA_RETURN_IF_ERROR(CreateDurableDirs(*storage, path, options.sync));
  const int64_t listed_ms = NowUnixMs();  // before anything of the directory is looked at
  const std::string manifest_name = RankManifestName(save_id, rank);
  const std::vector<DataFilePlan> files = PlanDataFiles(
      split.main, plan.writes[0], options.num_io_threads, options.separate_prefixes, save_id, rank);
  const std::string marker_id = save_id + ".r" + std::to_string(rank);
  TESSERA_RETURN_IF_ERROR(
      CheckTagNotSaved(*storage, path, rank, options.save_tag, manifest_name, marker_id, files));
  RemoveSaveMarker(*storage, path, marker_id);  // a crashed earlier attempt's
  RemoveOwnLeftovers(*storage, path, files, manifest_name);
  TESSERA_RETURN_IF_ERROR(CreateSaveMarker(*storage, path, marker_id, options.sync));
  struct MarkerGuard {
    Storage& storage;
    const std::string& path;
    const std::string& id;
    ~MarkerGuard() { RemoveSaveMarker(storage, path, id); }
  } marker{*storage, path, marker_id};

  DataFileWriteOptions write_options;
  write_options.num_threads = options.num_io_threads;
  write_options.sync = options.sync;
  write_options.checksum_block_bytes = kChecksumBlockBytes;
  write_options.device_staging = options.device_staging;
  uint64_t my_bytes = 0;
  for (uint32_t i : plan.writes[0]) my_bytes += split.main.items[i].num_bytes;
  if (options.progress) {
    write_options.on_progress = [&](uint64_t done) { options.progress(done, my_bytes); };
    options.progress(0, my_bytes);
  }
  TESSERA_ASSIGN_OR_RETURN(WriteResult written, WriteDataFiles(*storage, path, state, split.main,
                                                               files, save_id, write_options));
  Result<Metadata> part = FinishMetadata(plan, std::span(&written, 1));
  Status committed = part.status();
  if (part.ok()) {
    AddReplicaOnlyTensors(split.replicas, *part);
    part->save_id = save_id;
    part->part_rank = rank;
    part->num_ranks = num_ranks;
    part->user_metadata = options.user_metadata;
    part->checksum_block_bytes = kChecksumBlockBytes;
    part->separate_prefixes = SortedUnique(options.separate_prefixes);
    part->save_time_unix_ms = SaveTimeAfter(listed_ms);
    committed = CommitRankManifest(*storage, path, *part, options.sync);
  }
  if (!committed.ok()) {
    for (const FileInfo& f : written.files) storage->Remove(JoinPath(path, f.name)).IgnoreError();
    return committed;
  }
  SaveReport report;
  report.save_id = save_id;
  report.files_written = static_cast<int>(written.files.size());
  for (const WrittenItem& item : written.items) report.bytes_written += item.length;
  report.total_bytes = report.bytes_written;
  return report;
}

}  // namespace tessera
