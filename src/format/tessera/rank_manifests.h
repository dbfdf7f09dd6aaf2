// Rank-local saves (SaveOptions::collective false): every rank commits a manifest of its own
// part, "tessera.manifest.rank-<save_id>-r<rank>" (docs/FORMAT.md, section 4.2). Readers treat
// the parts of one save id as one checkpoint once all num_ranks of them are there and their
// union passes every rule of a manifest.
#ifndef TESSERA_FORMAT_TESSERA_RANK_MANIFESTS_H_
#define TESSERA_FORMAT_TESSERA_RANK_MANIFESTS_H_

#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// The rank manifests of one save id found in a directory.
struct RankManifestSet {
  std::string save_id;
  std::map<int, std::string> names;  // rank -> file name
  // From the lowest rank's manifest that can be read (a damaged part counts as missing for
  // these facts, so a damaged save does not hide the saves around it).
  int32_t num_ranks = 0;
  int64_t save_time_unix_ms = 0;
  bool header_read = false;  // false: no part could be read (num_ranks, save time unknown)
  // Of the part the header facts come from. A set of version 3 parts loads only through a
  // reference (docs/FORMAT.md, 4.2); one of version 2 parts is ordered by save time below every
  // numbered commit, as version 2 readers ordered it.
  uint32_t format_version = 0;
  // The first part that cannot be read or does not fit the others (a rank at or beyond
  // num_ranks), naming its file; OK otherwise. Such a set never loads.
  Status problem;
  // Every rank 0..num_ranks-1 has its part here. A part of a rank beyond them does not make
  // the set incomplete (it is a `problem`, reported when the set is the newest).
  bool complete() const {
    return header_read && std::distance(names.begin(), names.lower_bound(num_ranks)) == num_ranks;
  }
  // Version 2 parts: ordered by save time, without a reference.
  bool legacy() const { return header_read && format_version <= 2; }
  // "ranks 3, 5 (of 8)": the ranks whose manifest is missing; the first kMissingRanksShown of
  // them, then "and N more". Costs O(parts present + kMissingRanksShown), whatever num_ranks
  // claims.
  std::string MissingRanks() const;
  static constexpr int kMissingRanksShown = 16;
};

// The sets in `names` (a directory listing of `dir`), each with the header facts of its lowest
// rank's readable manifest. A part that cannot be read or decoded is recorded in the set's
// `problem`, not returned: other checkpoints in the directory stay readable. Errors: none but
// those of the storage.
Result<std::vector<RankManifestSet>> FindRankManifestSets(Storage& storage, const std::string& dir,
                                                          const std::vector<std::string>& names);

// Reads every manifest of the complete set and merges them into one whole-checkpoint Metadata:
// the same dtype, shape and partial flag for a key on every rank (else an error naming the key
// and both ranks), chunks held by several ranks kept once, user metadata of rank 0, the save
// time of the set (rank 0's). The result is not yet validated (ReadCheckpointIndex holds it to
// every rule).
Result<Metadata> MergeRankManifests(Storage& storage, const std::string& dir,
                                    const RankManifestSet& set);

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_RANK_MANIFESTS_H_
