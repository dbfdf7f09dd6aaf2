// The coordinator's side of a save in the PyTorch DCP format (SaveFormat::kTorchDist;
// docs/FORMAT_TORCH_DIST.md, "What tessera writes"): the same protocol as tessera's own
// (commit.h: marker, data first, index last and atomically, cleanup), with the `.metadata`
// pickle as the index.
//
// Files: DCP data files carry the save id in their names (torch_dist::DcpDataFileName), so a
// save never overwrites a file of the checkpoint it replaces; `.metadata` is published over the
// old one (Storage::Publish, kReplace: DCP has one index name, so the last commit wins). The
// cleanup removes only files whose names carry a tessera save id, and temporaries of a killed
// Publish of `.metadata`: a DCP directory written by torch keeps every file torch wrote
// (`__0_0.distcp`, `.metadata.tmp`), whether the new `.metadata` references it or not.
#ifndef TESSERA_CHECKPOINT_DCP_COMMIT_H_
#define TESSERA_CHECKPOINT_DCP_COMMIT_H_

#include <map>
#include <string>
#include <vector>

#include "format/torch_dist/dcp_metadata.h"
#include "tessera/checkpoint.h"
#include "tessera/metadata.h"
#include "tessera/storage.h"

namespace tessera {

struct DcpCommitOptions {
  torch_dist::DcpFlavor flavor = torch_dist::DcpFlavor::kTorch2;
  SyncPolicy sync = SyncPolicy::kFull;
  // planner_data's path of each key (SaveOptions::torch_dist_key_paths). Not owned; may be null.
  const std::map<std::string, std::vector<TorchDistPathElement>>* key_paths = nullptr;
};

// Commits `metadata` as the DCP checkpoint of `dir`. `metadata` describes what was written as
// torch_dist::MarkDcpItems leaves it: its files are the data files, its locations whole items,
// save_id set. Converts it (torch_dist::ToDcpMetadata, checkpoint_id `dir`), then
// CommitDcpMetadata.
Status CommitDcpCheckpoint(Storage& storage, const std::string& dir, const Metadata& metadata,
                           const DcpCommitOptions& options, bool& renamed);

// Commits `dcp` as `dir`/.metadata, for any writer of DCP directories: checks that the pickle
// reads back (ReadDcpMetadata) equal to `dcp`, that every data file it names is in `dir` and that
// no tessera manifest is; syncs the directory (kFull); publishes it as `.metadata` (kReplace,
// synced with kFull); reads it back. `renamed` becomes true once the new `.metadata` may be
// visible (the data files must then be kept). Nothing is published when a check fails. A
// `.metadata` that reads back different and references no file of `save_id` was committed by
// a later save: success.
Status CommitDcpMetadata(Storage& storage, const std::string& dir,
                         const torch_dist::DcpMetadata& dcp, const std::string& save_id,
                         SyncPolicy sync, bool& renamed);

// After a commit of save `save_id`: removes from `dir` the files of earlier or interrupted
// tessera DCP saves (data files named by DcpDataFileName, temporary `.metadata` names) that the
// `.metadata` in place does not reference and whose save is not running (commit.h,
// FindSaveMarkers), and the markers of dead saves. Nothing when the `.metadata` in place cannot
// be read. Never a file without a tessera save id in its name. Best effort.
void RemoveStaleDcpFiles(Storage& storage, const std::string& dir, const std::string& save_id);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_DCP_COMMIT_H_
