// Finalize: a rank-local save's rank manifests merged into one manifest (docs/FORMAT.md, 4.2).
//
// The merged manifest takes the place of the save's reference: the same commit number, replaced.
// Finalize changes which file holds the checkpoint, not the checkpoint nor its place in the
// directory's order, so it never races the saves around it: a save that commits meanwhile is
// newer before and after. A version 2 save (no reference) becomes commit 1, create-only.
#include <algorithm>

#include "checkpoint/commit.h"
#include "checkpoint/sequence.h"
#include "format/checkpoint_index.h"
#include "format/tessera/manifest.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"

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

// After the merged manifest of `merged` is in place: its parts go (durably), then what no
// checkpoint needs. Also what finishes a Finalize that crashed after its commit.
Status RemoveMergedParts(Storage& storage, const std::string& path, const Metadata& merged,
                         const std::string& own_id) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
  for (const std::string& name : PartsOf(names, merged.save_id)) {
    Status removed = storage.Remove(JoinPath(path, name));
    if (!removed.ok() && removed.code() != StatusCode::kNotFound) {
      return removed.WithContext("removing the merged rank manifest " + name);
    }
  }
  TESSERA_RETURN_IF_ERROR(storage.SyncDir(path));
  RemoveStaleFiles(storage, path, own_id);
  return Status::Ok();
}

// The merged manifest, in the reference's place (kReplace), or as commit 1 for a version 2
// save.
Status CommitMerged(Storage& storage, const std::string& path, Metadata& merged) {
  const uint64_t seq = merged.commit_seq;
  if (seq == 0) {
    merged.commit_seq = 1;
    Status published = PublishCommitAt(storage, path, 1, EncodeManifest(merged), true);
    if (published.code() == StatusCode::kAlreadyExists) {
      return FailedPrecondition("cannot finalize the version 2 rank-local save " + merged.save_id +
                                " in " + path + ": the directory holds commits of version 3 (" +
                                DescribeCommit(storage, path, 1) +
                                "), which place every version 2 save below them");
    }
    TESSERA_RETURN_IF_ERROR(published);
    WriteSequenceHint(storage, path, 1);
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(FileType reference, storage.Stat(JoinPath(path, CommitName(seq))));
  if (reference == FileType::kNotFound) {
    return FailedPrecondition("the rank-local save " + merged.save_id + " in " + path +
                              " was superseded by a newer checkpoint while it was finalized; "
                              "nothing to finalize");
  }
  const Bytes bytes = EncodeManifest(merged);
  return storage.Publish(JoinPath(path, CommitName(seq)), std::as_bytes(std::span(bytes)),
                         PublishMode::kReplace, /*sync=*/true);
}

}  // namespace

Result<Metadata> Finalize(const std::string& path, std::shared_ptr<Storage> storage) {
  if (!storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    return Finalize(location.second, location.first);
  }
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(*storage, path));
  const std::string own_id = NewSaveId({});
  if (!index.rank_local) {
    // A Finalize that crashed between its commit and the removal of the parts left both; they
    // read as the same checkpoint (the merged manifest is in the reference's place). Finish.
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
    if (index.metadata.format == CheckpointFormat::kTessera &&
        !PartsOf(names, index.metadata.save_id).empty()) {
      TESSERA_RETURN_IF_ERROR(RemoveMergedParts(*storage, path, index.metadata, own_id));
      return std::move(index.metadata);
    }
    return FailedPrecondition(path +
                              " holds no rank-local save newer than its committed checkpoint: "
                              "nothing to finalize");
  }
  Metadata merged = std::move(index.metadata);
  merged.part_rank = -1;
  merged.rank_local_reference = false;
  // The marker protects no file of its own: while it runs, no cleanup removes a commit, so the
  // reference stays in place until the merged manifest replaces it.
  TESSERA_RETURN_IF_ERROR(CreateSaveMarker(*storage, path, own_id, SyncPolicy::kFull));
  struct MarkerGuard {
    Storage& storage;
    const std::string& path;
    const std::string& id;
    ~MarkerGuard() { RemoveSaveMarker(storage, path, id); }
  } marker{*storage, path, own_id};
  TESSERA_RETURN_IF_ERROR_CTX(CommitMerged(*storage, path, merged),
                              "committing the merged manifest of " + path);
  TESSERA_RETURN_IF_ERROR(RemoveMergedParts(*storage, path, merged, own_id));
  return merged;
}

}  // namespace tessera
