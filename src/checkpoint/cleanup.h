// The cleanup after a commit (docs/FORMAT.md, section 4, step 5): what no checkpoint of the
// directory needs any more, removed, and nothing that a running operation or a newer commit
// needs.
#ifndef TESSERA_CHECKPOINT_CLEANUP_H_
#define TESSERA_CHECKPOINT_CLEANUP_H_

#include <string>

#include "tessera/metadata.h"
#include "tessera/storage.h"

namespace tessera {

// The save id a tessera file name carries (a data file, a rank manifest, a version 2 temporary
// manifest, an in-progress marker), or "".
std::string SaveIdOf(const std::string& name);

// After a commit by the operation `own_id` (whose files always stay), best effort:
//   1. lists `dir` once: only what that listing holds is ever removed;
//   2. reads the in-progress markers of that listing: operations that may still run keep all
//      their files (marker.h, FindSaveMarkers);
//   3. only then finds the newest commit: from the highest number listed, up through every
//      number that exists now. A commit made after the listing is found, and so is one whose
//      marker was already gone in step 2 (an operation commits before it removes its marker);
//   4. walks the commits from the newest down to the newest loadable one, N: the files N lists
//      (for a reference, every file of its rank-local save) stay, and so do the rank-local
//      saves referenced above N (not complete yet), and those whose rank 0 has not committed
//      (younger than 24 hours by their own save time; older ones died before it);
//   5. removes the rest of tessera's names of the listing: data files, rank manifests, the
//      commits below N (from the lowest up, stopping at the first that cannot be removed, and
//      only when no other operation runs: it may be deriving its commit from one of them),
//      temporaries that killed operations left, and the markers of dead operations.
// Nothing is removed when the newest commit cannot be read. Files of other names are never
// touched. `own_commit`, when given, is the commit the caller just published and read back
// (its commit_seq names it): the cleanup takes it as read instead of reading it again.
void RemoveStaleFiles(Storage& storage, const std::string& dir, const std::string& own_id,
                      const Metadata* own_commit = nullptr);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_CLEANUP_H_
