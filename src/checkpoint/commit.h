// The coordinator's side of a save's commit protocol (docs/FORMAT.md, section 4): the
// directory, the in-progress marker that protects a running save's files from other saves'
// cleanup, the atomic manifest commit, and the cleanup after it.
#ifndef TESSERA_CHECKPOINT_COMMIT_H_
#define TESSERA_CHECKPOINT_COMMIT_H_

#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

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

// Marks save `save_id` as in progress in `dir`: the file "tessera.saving.<save_id>", created
// before any data file of the save and removed after its cleanup. It records who runs the save
// (host, process id and start time) so that another save's cleanup can tell a running save
// (whose files it must keep) from one that died (whose files are garbage). Fails when the
// marker exists. Each rank of a rank-local save passes "<save_id>.r<rank>": the marker protects
// the files of save_id all the same.
Status CreateSaveMarker(Storage& storage, const std::string& dir, const std::string& save_id,
                        SyncPolicy sync);
void RemoveSaveMarker(Storage& storage, const std::string& dir, const std::string& save_id);

// The in-progress markers found among `names` (the entries of `dir`): the saves that may still
// be running (marker there, owner alive; `own_save_id` always counts as running), and the
// markers of saves whose owner died. A save keeps its marker from before its first file until
// after its cleanup, so a save found without a live marker has finished or died. Used by every
// format's cleanup.
struct SaveMarkers {
  std::set<std::string> running;
  std::vector<std::string> dead_markers;  // names
};
SaveMarkers FindSaveMarkers(Storage& storage, const std::string& dir,
                            const std::vector<std::string>& names, const std::string& own_save_id);

// An owner record: "key=value" lines naming this process (host, boot id, pid, the pid's start
// time) and the time, as every in-progress marker holds them. Other files whose owner must be
// checked the same way (the checkpoint manager's read leases and deletion tombstones) hold one
// too.
std::string ThisProcessOwnerRecord();
// Whether the owner an owner record names may still be running: the same process of this host
// and boot (pid and start time equal), or a record of another host younger than 24 hours (its
// processes cannot be checked from here). A record that does not parse: false.
bool OwnerRecordMayBeAlive(std::string_view text);
// "process 123 on host h", for messages.
std::string DescribeOwnerRecord(std::string_view text);

// Creates `path` exclusively, writes `bytes`, syncs when `sync`, closes.
Status WriteWholeFile(Storage& storage, const std::string& path, const Bytes& bytes, bool sync);

// Commits `metadata` as the checkpoint of `dir`: checks that the manifest decodes (everything
// the writer writes must pass the reader's validation) and that every data file it lists is in
// the directory, writes it under a temporary name, syncs, renames it into place, syncs the
// directory, and reads it back. `renamed` becomes true once the new manifest may be visible.
Status CommitManifest(Storage& storage, const std::string& dir, const Metadata& metadata,
                      SyncPolicy sync, bool& renamed);

// After a commit: removes tessera data files, temporary manifests and the rank manifests of
// rank-local saves that neither `committed` nor the checkpoint now in place lists, unless they
// belong to a save that may still be running (its marker is there and its owner alive), and markers
// of saves whose owner died. Best effort: what cannot be removed now is removed by a later save.
void RemoveStaleFiles(Storage& storage, const std::string& dir, const Metadata& committed);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_COMMIT_H_
