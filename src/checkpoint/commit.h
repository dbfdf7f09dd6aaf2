// The coordinator's side of a save's commit protocol (docs/FORMAT.md, section 4): the
// directory, the save id, and the commit of the index, in any format (the format's
// FormatWriter supplies the bytes). The in-progress marker is marker.h's, the order of numbered
// commits sequence.h's, the cleanup after a tessera commit cleanup.h's.
#ifndef TESSERA_CHECKPOINT_COMMIT_H_
#define TESSERA_CHECKPOINT_COMMIT_H_

#include <map>
#include <string>
#include <vector>

#include "checkpoint/cleanup.h"
#include "checkpoint/marker.h"
#include "tessera/checkpoint.h"
#include "tessera/format_writer.h"
#include "tessera/metadata.h"
#include "tessera/storage.h"

namespace tessera {

// User metadata is UTF-8 text, keys and values (docs/FORMAT.md): readers hand it to JSON and
// to Python as strings. kInvalidArgument naming the key otherwise.
Status CheckUserMetadata(const std::map<std::string, std::string>& metadata);

// `v` sorted, without duplicates (Metadata::separate_prefixes).
std::vector<std::string> SortedUnique(std::vector<std::string> v);

// Creates `path` and the missing directories above it. With kFull, syncs the parent of each
// one created, so the checkpoint directory itself survives a crash, not only its contents. On a
// store with implicit_directories, only CreateDirs(path): no parent is checked.
Status CreateDurableDirs(Storage& storage, const std::string& path, SyncPolicy sync);

// A save id no file in `existing_names` carries: 16 lowercase hex digits from a random source
// that does not depend on the directory's contents (so the next id cannot be predicted).
std::string NewSaveId(const std::vector<std::string>& existing_names);

// The one commit of an index, for every format (docs/FORMAT.md, section 4): completes
// `metadata` (FormatWriter::FinishIndex), encodes it checked to read back
// (FormatWriter::EncodeIndex: InvalidArgument "the checkpoint would not be readable, nothing was
// committed" otherwise), checks the directory (FormatWriter::CheckTarget; every data file of
// metadata.files still there, else DataLoss), syncs the directory (kFull), publishes the index
// and reads it back:
//   - numbered commits: create-only as the next "tessera.manifest.<n>" (sequence.h:
//     PublishNewestCommit, which sets metadata.commit_seq), then the sequence hint. Gone when
//     read back is fine: a newer commit superseded it and its cleanup ran;
//   - one index name: replaced (the last commit wins). Read back different is fine when a later
//     save's index replaced it (FormatWriter::ReplacedByLaterSave).
// `location` (empty: `dir`) is where the checkpoint will be read, when it is committed in
// another directory first. `visible` becomes true once the new index may be visible (its data
// files must then be kept whatever happens). Nothing is published when a check fails.
Status CommitIndex(Storage& storage, const std::string& dir, const FormatWriter& writer,
                   Metadata& metadata, SyncPolicy sync, bool& visible,
                   const std::string& location = "");

// After a commit of `writer`'s format by the operation `own_id`, best effort: RemoveStaleFiles
// (cleanup.h) for numbered commits; for a format with one index name, the files that carry a
// save id in its names (FormatWriter::SaveIdOfFile), that the index in place does not reference
// and whose save is not running (marker.h, FindSaveMarkers), the temporaries of a killed publish
// of the index when no other save runs, and the markers of dead saves. Nothing when the index in
// place cannot be read; never a file without a save id in its name. `own_commit` is the
// metadata CommitIndex committed (RemoveStaleFiles takes it as read).
void RemoveStaleFilesAfterCommit(Storage& storage, const std::string& dir,
                                 const FormatWriter& writer, const std::string& own_id,
                                 const Metadata* own_commit = nullptr);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_COMMIT_H_
