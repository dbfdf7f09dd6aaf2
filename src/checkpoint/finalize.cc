// Finalize: a rank-local save's rank manifests merged into one committed manifest.
#include <algorithm>

#include "checkpoint/commit.h"
#include "format/checkpoint_index.h"
#include "format/manifest.h"
#include "tessera/checkpoint.h"

namespace tessera {

Result<Metadata> Finalize(const std::string& path, std::shared_ptr<Storage> storage) {
  if (!storage) storage = NewPosixStorage();
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(*storage, path));
  if (!index.rank_local) {
    return FailedPrecondition(path +
                              " holds no rank-local save newer than its committed checkpoint: "
                              "nothing to finalize");
  }
  Metadata merged = std::move(index.metadata);
  merged.part_rank = -1;
  // The merged manifest keeps the save id and save time of the parts: a reader that finds both
  // (a crash before the parts are removed) prefers the merged manifest at equal times.
  bool renamed = false;
  TESSERA_RETURN_IF_ERROR_CTX(CommitManifest(*storage, path, merged, SyncPolicy::kFull, renamed),
                              "committing the merged manifest of " + path);
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
  for (const std::string& name : names) {
    std::string id;
    int rank = 0;
    if (ParseRankManifestName(name, &id, &rank) && id == merged.save_id) {
      TESSERA_RETURN_IF_ERROR_CTX(storage->Remove(JoinPath(path, name)),
                                  "removing the merged rank manifest " + name);
    }
  }
  TESSERA_RETURN_IF_ERROR(storage->SyncDir(path));
  RemoveStaleFiles(*storage, path, merged);
  return merged;
}

}  // namespace tessera
