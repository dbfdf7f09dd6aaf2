// Finalize: a rank-local save's rank manifests merged into one committed manifest.
#include <algorithm>

#include "checkpoint/commit.h"
#include "format/checkpoint_index.h"
#include "format/manifest.h"
#include "tessera/checkpoint.h"

namespace tessera {
namespace {

// The rank manifests of save `save_id` in `names`.
std::vector<std::string> PartsOf(const std::vector<std::string>& names,
                                 const std::string& save_id) {
  std::vector<std::string> parts;
  for (const std::string& name : names) {
    std::string id;
    int rank = 0;
    if (ParseRankManifestName(name, &id, &rank) && id == save_id) parts.push_back(name);
  }
  return parts;
}

// After the merged manifest of `merged` is committed: its parts go (durably), then what no
// checkpoint needs. Also what finishes a Finalize that crashed after its commit.
Status RemoveMergedParts(Storage& storage, const std::string& path, const Metadata& merged,
                         const std::vector<std::string>& parts) {
  for (const std::string& name : parts) {
    TESSERA_RETURN_IF_ERROR_CTX(storage.Remove(JoinPath(path, name)),
                                "removing the merged rank manifest " + name);
  }
  TESSERA_RETURN_IF_ERROR(storage.SyncDir(path));
  RemoveStaleFiles(storage, path, merged);
  return Status::Ok();
}

}  // namespace

Result<Metadata> Finalize(const std::string& path, std::shared_ptr<Storage> storage) {
  if (!storage) storage = NewPosixStorage();
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(*storage, path));
  if (!index.rank_local) {
    // A Finalize that crashed between its commit and the removal of the parts left both; they
    // read as the same checkpoint (the merged manifest wins the tie). Finish the removal.
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
    const std::vector<std::string> parts = PartsOf(names, index.metadata.save_id);
    if (index.metadata.format == CheckpointFormat::kTessera && !parts.empty()) {
      TESSERA_RETURN_IF_ERROR(RemoveMergedParts(*storage, path, index.metadata, parts));
      return std::move(index.metadata);
    }
    return FailedPrecondition(path +
                              " holds no rank-local save newer than its committed checkpoint: "
                              "nothing to finalize");
  }
  Metadata merged = std::move(index.metadata);
  merged.part_rank = -1;
  // The merged manifest keeps the save id and the save time of the set (rank 0's part): a reader
  // that finds both (a crash before the parts are removed) prefers the merged manifest at equal
  // times.
  // The save id is the parts', not a new one: the temporary manifest of an earlier Finalize of
  // this save that crashed before its rename would block the exclusive creation of ours.
  storage->Remove(JoinPath(path, TempManifestName(merged.save_id))).IgnoreError();
  bool renamed = false;
  TESSERA_RETURN_IF_ERROR_CTX(CommitManifest(*storage, path, merged, SyncPolicy::kFull, renamed),
                              "committing the merged manifest of " + path);
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
  TESSERA_RETURN_IF_ERROR(
      RemoveMergedParts(*storage, path, merged, PartsOf(names, merged.save_id)));
  return merged;
}

}  // namespace tessera
