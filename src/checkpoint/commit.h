// The coordinator's side of a save's commit protocol (docs/FORMAT.md, section 4): the
// directory, the save id, and the commit of the manifest. The in-progress marker is marker.h's,
// the order of commits sequence.h's, the cleanup after a commit cleanup.h's.
#ifndef TESSERA_CHECKPOINT_COMMIT_H_
#define TESSERA_CHECKPOINT_COMMIT_H_

#include <map>
#include <string>
#include <vector>

#include "checkpoint/cleanup.h"
#include "checkpoint/marker.h"
#include "tessera/checkpoint.h"
#include "tessera/metadata.h"
#include "tessera/storage.h"

namespace tessera {

// User metadata is UTF-8 text, keys and values (docs/FORMAT.md): readers hand it to JSON and
// to Python as strings. kInvalidArgument naming the key otherwise.
Status CheckUserMetadata(const std::map<std::string, std::string>& metadata);

// `v` sorted, without duplicates (Metadata::separate_prefixes).
std::vector<std::string> SortedUnique(std::vector<std::string> v);

// Creates `path` and the missing directories above it. With kFull, syncs the parent of each
// one created, so the checkpoint directory itself survives a crash, not only its contents.
Status CreateDurableDirs(Storage& storage, const std::string& path, SyncPolicy sync);

// A save id no file in `existing_names` carries: 16 lowercase hex digits from a random source
// that does not depend on the directory's contents (so the next id cannot be predicted).
std::string NewSaveId(const std::vector<std::string>& existing_names);

// Commits `metadata` as the newest checkpoint of `dir` (docs/FORMAT.md, section 4): checks that
// the manifest decodes (everything the writer writes must pass the reader's validation) and that
// every data file it lists is in the directory, syncs the directory, publishes it create-only as
// the next commit "tessera.manifest.<n>" (sequence.h: PublishNewestCommit, which sets
// metadata.commit_seq), reads it back, and replaces the sequence hint. `visible` becomes true
// once the new manifest may be visible (its data files must then be kept whatever happens).
Status CommitManifest(Storage& storage, const std::string& dir, Metadata& metadata, SyncPolicy sync,
                      bool& visible);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_COMMIT_H_
