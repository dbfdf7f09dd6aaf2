// RemoveKeys: drops tensors and objects from a committed tessera checkpoint and frees their
// bytes (e.g. the optimizer state of old checkpoints), crash-safely.
//
// Not collective: one process calls it (on a shared file system, one rank, then a barrier).
// A concurrent Load of the same checkpoint may fail once the old files are removed; a save of
// any kind that commits into the same directory while RemoveKeys runs wins: RemoveKeys commits
// exactly the commit after the one it read (docs/FORMAT.md, 4.1), so it then fails with
// kAborted naming that save, removes only the files it wrote, and the newer save is what loads.
#ifndef TESSERA_REMOVE_KEYS_H_
#define TESSERA_REMOVE_KEYS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// The user-metadata entry in which RemoveKeys records the prefixes it removed keys of: a JSON
// array of strings, sorted, unique, accumulated over removals. Readers that hold their own
// list of the saved keys (the Python package's structure record) tell removed keys from
// missing ones by it.
inline constexpr char kRemovedKeyPrefixesKey[] = "tessera.removed_key_prefixes";

struct RemoveKeysOptions {
  // Plan only: report what would be removed, copied and freed; touch nothing. Default false.
  bool dry_run = false;
  // Default kFull: the rewritten data files, the manifest and the directory are synced before
  // the old files go. kNone: no syncs (a machine crash may lose the checkpoint).
  SyncPolicy sync = SyncPolicy::kFull;
  // Data files rewritten at once, one thread each. Default 2.
  int num_io_threads = 2;
  // Called with the bytes copied so far and the bytes to copy (the kept chunks of data files
  // that also hold removed ones), from the calling thread only, every 100 ms while files are
  // rewritten and once at the end (then with done == total, which may be 0). Default none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Where the checkpoint is. Default null: `path` is a local path or a URI (s3://, msc://,
  // file://; see ResolveStorage in storage_uri.h).
  std::shared_ptr<Storage> storage;
};

struct RemoveKeysReport {
  std::vector<std::string> removed_tensors;  // sorted
  std::vector<std::string> removed_objects;  // sorted
  // Parallel to the prefixes given: how many keys (tensors and objects) each one matched.
  std::vector<uint64_t> matches_per_prefix;
  int files_before = 0;       // data files of the checkpoint before
  int files_after = 0;        // and after
  int files_dropped = 0;      // held removed chunks only: deleted, nothing copied
  int files_rewritten = 0;    // held kept and removed chunks: the kept ones copied to a new file
  uint64_t bytes_before = 0;  // data file bytes before
  uint64_t bytes_after = 0;   // and after; bytes_before - bytes_after are freed
  uint64_t bytes_copied = 0;  // kept chunks copied out of rewritten files
  // The save id of the manifest now in place: a new one once keys were removed; the old one
  // when nothing matched (nothing is then written).
  std::string save_id;
  bool dry_run = false;
};

// Removes from the tessera checkpoint at `path` every tensor and object whose key starts with
// one of `prefixes`, and frees their bytes:
//   1. data files that hold only removed chunks are left out of the new manifest; data files
//      that hold kept and removed chunks are rewritten under a new save id, the kept chunks
//      copied with their checksums, each checksum block verified as it is copied (a mismatch
//      is kDataLoss naming key, chunk and file, and nothing changes); files with no removed
//      chunk are kept as they are;
//   2. the new manifest is committed atomically as the commit right after the one read
//      (docs/FORMAT.md, section 4.1), keeping the user metadata (the prefixes that removed keys
//      added to kRemovedKeyPrefixesKey), the save time and the separate prefixes;
//   3. the files no longer listed are removed.
// A crash at any step leaves the old checkpoint or the new one. Saving with
// SaveOptions::separate_prefixes = {prefix} makes removing that prefix copy nothing.
// Nothing matching is not an error: the report says so and nothing is written.
// Errors: kInvalidArgument for no prefix or an empty one (it would match every key);
// kFailedPrecondition for a checkpoint in another format (naming it) or no checkpoint;
// kDataLoss for a corrupt chunk met while copying; kAborted when another save committed first.
Result<RemoveKeysReport> RemoveKeys(const std::string& path,
                                    const std::vector<std::string>& prefixes,
                                    const RemoveKeysOptions& options = {});

}  // namespace tessera

#endif  // TESSERA_REMOVE_KEYS_H_
