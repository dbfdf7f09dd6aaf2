// A rank-local save: the four steps of Save (save.cc) on one rank, with nothing exchanged.
// The rank plans alone over the items it holds as the main replica, takes its marker (refusing
// another live job's), writes its data files, and commits the manifest of its part; rank 0
// places the save in the directory's order first (docs/FORMAT.md, section 4.2).
#include "checkpoint/rank_local_save.h"
#include "core/lap_clock.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <set>

#include "checkpoint/commit.h"
#include "checkpoint/data_files.h"
#include "checkpoint/sequence.h"
#include "core/checksum.h"
#include "format/registry.h"
#include "format/tessera/manifest.h"
#include "format/tessera/tessera_writer.h"
#include "plan/save_plan.h"

namespace tessera {
namespace {

Status CheckRankLocalOptions(const SaveOptions& options, int rank, int num_ranks) {
  if (options.save_tag.empty()) {
    return InvalidArgument(
               "SaveOptions::save_tag is required when SaveOptions::collective is false: it "
               "names the save on every rank without a message (e.g. \"step-1000\")")
        .WithDetail({.kind = StatusDetail::Kind::kBadOption,
                     .options = {"SaveOptions::save_tag", "SaveOptions::collective"}});
  }
  if (options.format != CheckpointFormat::kTessera) {
    return BadOption("SaveOptions::collective",
                     "false writes the tessera format only (rank manifests)");
  }
  TESSERA_RETURN_IF_ERROR(
      FormatOf(options.format).CheckOptions(options.format_options, "SaveOptions::format_options"));
  if (options.num_io_threads < 0) {
    return BadOption(
        "SaveOptions::num_io_threads",
        "must be at least 1 (or 0 for the default), got " + std::to_string(options.num_io_threads));
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
    info.global_shape = item->global_shape.ToVector();
    info.partial = item->partial;
    metadata.tensors.push_back(std::move(info));
  }
  std::sort(metadata.tensors.begin(), metadata.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.key < b.key; });
}

// Refuses (kAlreadyExists, naming the tag and the file) a tag this rank already saved: its rank
// manifest is there (from this job or an earlier one). One Stat, no listing: at tens of
// thousands of ranks, every rank listing a directory of their files would cost
// O(ranks x files) metadata operations.
Status CheckTagNotSaved(Storage& storage, const std::string& path, int rank, const std::string& tag,
                        const std::string& part_name) {
  TESSERA_ASSIGN_OR_RETURN(FileType existing, storage.Stat(JoinPath(path, part_name)));
  if (existing == FileType::kNotFound) return Status::Ok();
  return Status(StatusCode::kAlreadyExists,
                "rank " + std::to_string(rank) + " already saved tag '" + tag + "' into " + path +
                    " (" + part_name + "): each rank-local save needs a new SaveOptions::save_tag");
}

// This rank's in-progress marker for the save, with its attempt id. An existing one is taken
// over when it is a leftover (of this process, an attempt that ended; or of a process that
// died, on this host); it is refused (kAlreadyExists, naming its owner and the way past it)
// when its owner runs or cannot be checked (another host): two jobs saving one tag at once
// would otherwise mix their ranks' parts.
Status AcquireRankMarker(Storage& storage, const std::string& path, const std::string& marker_id,
                         const std::string& tag, int rank, const std::string& attempt,
                         SyncPolicy sync) {
  const std::string key = JoinPath(path, MarkerName(marker_id));
  for (int tries = 0; tries < 3; ++tries) {
    Status created = CreateSaveMarker(storage, path, marker_id, sync, attempt);
    if (created.ok() || created.code() != StatusCode::kAlreadyExists) return created;
    if (MarkerHeldHere(path, marker_id)) {
      return Status(StatusCode::kAlreadyExists,
                    "rank " + std::to_string(rank) + " of tag '" + tag + "' is being saved into " +
                        path + " by another thread of this process; save each tag once");
    }
    Result<MarkerContent> marker = ReadSaveMarker(storage, path, marker_id);
    if (!marker.ok() && marker.status().code() == StatusCode::kNotFound) continue;  // just went
    // Does not parse: no running operation wrote it (one publishes its marker whole).
    const OwnerState state =
        marker.ok() ? StateOfMarker(path, marker_id, marker->owner) : OwnerState::kDead;
    if (state != OwnerState::kDead) {
      return Status(
          StatusCode::kAlreadyExists,
          "rank " + std::to_string(rank) + " of tag '" + tag + "' is already being saved into " +
              path + " by " + DescribeOwner(marker->owner) + " (its marker " + key + ")" +
              (state == OwnerState::kUnknowable ? ", which cannot be checked from this host" : "") +
              ": two jobs must not save one tag; if that process is gone (its node crashed), "
              "remove " +
              key + " and save again");
    }
    // A leftover: its files are its own (attempt ids), garbage for the next cleanup.
    RemoveSaveMarker(storage, path, marker_id);
  }
  return Status(StatusCode::kAlreadyExists, "rank " + std::to_string(rank) + " of tag '" + tag +
                                                "': another process keeps "
                                                "taking over " +
                                                key + "; two jobs must not save one tag");
}

// After the data files and before the part: the marker is still this attempt's (another job
// that took it over, e.g. after it was removed by hand, would now mix its part into the save).
Status CheckMarkerStillOurs(Storage& storage, const std::string& path, const std::string& marker_id,
                            const std::string& attempt) {
  Result<MarkerContent> marker = ReadSaveMarker(storage, path, marker_id);
  if (marker.ok() && marker->attempt == attempt &&
      StateOf(marker->owner) == OwnerState::kThisProcess) {
    return Status::Ok();
  }
  return Status(
      StatusCode::kAlreadyExists,
      "the in-progress marker " + JoinPath(path, MarkerName(marker_id)) +
          " is no longer this save's (" +
          (marker.ok() ? "now " + DescribeOwner(marker->owner) : marker.status().message()) +
          "): another job saves the same tag; nothing was committed");
}

// An attempt id: kAttemptHexDigits hex digits from the kernel's random source.
std::string NewAttemptId() {
  std::random_device device;
  char id[kAttemptHexDigits + 1];
  std::snprintf(id, sizeof(id), "%08x", static_cast<unsigned>(device()));
  return id;
}

// Rank 0 places the save in the directory's order: a reference, the next commit number.
Status PublishReference(Storage& storage, const std::string& path, const Metadata& part,
                        SyncPolicy sync) {
  Metadata reference;
  reference.save_id = part.save_id;
  reference.num_ranks = part.num_ranks;
  reference.save_time_unix_ms = part.save_time_unix_ms;
  reference.checksum_block_bytes = part.checksum_block_bytes;
  reference.rank_local_reference = true;
  TESSERA_ASSIGN_OR_RETURN(uint64_t highest, FindHighestCommit(storage, path));
  bool visible = false;
  TESSERA_ASSIGN_OR_RETURN(uint64_t seq, PublishNewestCommit(storage, path, reference, highest,
                                                             sync == SyncPolicy::kFull, &visible));
  WriteSequenceHint(storage, path, seq);
  return Status::Ok();
}

// Publishes the part's manifest create-only: the part is there whole or not at all. What is
// written must read back as a part.
Status CommitRankManifest(Storage& storage, const std::string& path, const Metadata& part,
                          SyncPolicy sync) {
  const std::string name = RankManifestName(part.save_id, part.part_rank);
  const Bytes bytes = EncodeManifest(part);
  if (Result<Metadata> check = DecodeManifest(bytes, JoinPath(path, name)); !check.ok()) {
    return InvalidArgument("the rank manifest would not be readable, nothing was committed: " +
                           check.status().message());
  }
  return storage.Publish(JoinPath(path, name), std::as_bytes(std::span(bytes)),
                         PublishMode::kCreateOnly, sync == SyncPolicy::kFull);
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
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
  LapClock clock;
  SaveReport report;
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
  const std::string part_name = RankManifestName(save_id, rank);
  TESSERA_RETURN_IF_ERROR(CheckTagNotSaved(*storage, path, rank, options.save_tag, part_name));
  // Every attempt writes files of its own names: nothing an earlier attempt (or another job)
  // wrote is ever removed or overwritten here, so no part can describe bytes it did not write.
  const std::string attempt = NewAttemptId();
  const std::unique_ptr<FormatWriter> writer =
      NewTesseraWriter();  // rank-local saves are tessera's
  const std::string marker_id = save_id + ".r" + std::to_string(rank);
  TESSERA_RETURN_IF_ERROR(
      AcquireRankMarker(*storage, path, marker_id, options.save_tag, rank, attempt, options.sync));
  struct MarkerGuard {
    Storage& storage;
    const std::string& path;
    const std::string& id;
    ~MarkerGuard() { RemoveSaveMarker(storage, path, id); }
  } marker{*storage, path, marker_id};
  const int threads = SaveIoThreads(options.num_io_threads, *storage);
  const std::vector<DataFilePlan> files =
      PlanDataFiles(split.main, plan.writes[0], threads, options.separate_prefixes, *writer,
                    save_id, rank, attempt);

  DataFileWriteOptions write_options;
  write_options.num_threads = threads;
  write_options.sync = options.sync;
  write_options.checksum_block_bytes = kChecksumBlockBytes;
  write_options.device_staging = options.device_staging;
  uint64_t my_bytes = 0;
  for (uint32_t i : plan.writes[0]) my_bytes += split.main.items[i].num_bytes;
  if (options.progress) {
    write_options.on_progress = [&](uint64_t done) { options.progress(done, my_bytes); };
    options.progress(0, my_bytes);
  }
  report.plan_seconds = clock.Lap();
  TESSERA_ASSIGN_OR_RETURN(
      WriteResult written,
      WriteDataFiles(*storage, path, state, split.main, files, *writer, save_id, write_options));
  report.write_seconds = clock.Lap();
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
    part->save_time_unix_ms = NowUnixMs();  // informational: the order is rank 0's commit's
    committed = CheckMarkerStillOurs(*storage, path, marker_id, attempt);
  }
  // Rank 0 places the save in the order before its own part, so that a complete set always
  // has its place (a rank 0 that dies between the two leaves the set incomplete; its retry
  // places it again, higher).
  if (committed.ok() && rank == 0) {
    committed = PublishReference(*storage, path, *part, options.sync);
  }
  if (committed.ok()) committed = CommitRankManifest(*storage, path, *part, options.sync);
  if (!committed.ok()) {
    for (const FileInfo& f : written.files) storage->Remove(JoinPath(path, f.name)).IgnoreError();
    return committed;
  }
  report.commit_seconds = clock.Lap();
  report.save_id = save_id;
  report.files_written = static_cast<int>(written.files.size());
  for (const WrittenItem& item : written.items) report.bytes_written += item.length;
  report.total_bytes = report.bytes_written;
  return report;
}

}  // namespace tessera
