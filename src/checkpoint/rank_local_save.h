// A rank-local save (SaveOptions::collective false): no communication at all. Every rank
// writes what it holds as the main replica (files named with an attempt id of its own) and
// commits the manifest of its part; rank 0 first places the save in the directory's order
// with a reference (docs/FORMAT.md, section 4.2); readers merge the parts
// (format/rank_manifests.h). Every rank does O(1) metadata operations (no listing).
#ifndef TESSERA_CHECKPOINT_RANK_LOCAL_SAVE_H_
#define TESSERA_CHECKPOINT_RANK_LOCAL_SAVE_H_

#include <string>

#include "tessera/checkpoint.h"

namespace tessera {

// The save id of a rank-local save tagged `tag`: 16 hex digits of a hash of it, the same on
// every rank without a message.
std::string RankLocalSaveId(const std::string& tag);

// Rank `rank` of `num_ranks` saves its part. Not collective: calls no Comm.
Result<SaveReport> SaveRankLocal(const StateDict& state, const std::string& path, int rank,
                                 int num_ranks, const SaveOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_RANK_LOCAL_SAVE_H_
