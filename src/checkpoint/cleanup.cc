#include "checkpoint/cleanup.h"

#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "checkpoint/marker.h"
#include "checkpoint/sequence.h"
#include "format/checkpoint_index.h"
#include "format/tessera/manifest.h"
#include "format/tessera/rank_manifests.h"
#include "format/tessera/tessera_format.h"

namespace tessera {
namespace {

// A rank-local save that no reference places yet (its rank 0 has not committed) is kept this
// long after its own save time: its other ranks may have finished long before rank 0 does.
// Older, it died before rank 0 committed, and is garbage. (A clock decides only what is
// garbage, never which save is the newer.)
constexpr int64_t kUnreferencedSaveLifetimeMs = 24ll * 3600 * 1000;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What the checkpoint in place and the saves after it need.
struct Needed {
  std::optional<uint64_t> newest_loadable;  // N's number (0: the version 2 manifest or set)
  std::set<std::string> files;              // named by N
  std::set<std::string> save_ids;           // every file carrying one of these stays
};

// Step 3: the newest commit now, from the highest listed up through the numbers that exist.
Result<uint64_t> NewestCommitNow(Storage& storage, const std::string& dir,
                                 const std::vector<std::string>& names) {
  uint64_t top = HighestCommit(names);
  while (top < std::numeric_limits<uint64_t>::max()) {  // nothing can lie above the last number
    TESSERA_ASSIGN_OR_RETURN(FileType next, storage.Stat(JoinPath(dir, CommitName(top + 1))));
    if (next == FileType::kNotFound) return top;
    ++top;
  }
  return top;
}

// Whether every rank 0..num_ranks-1 of `save_id` has its part among `names`.
bool PartsComplete(const std::vector<std::string>& names, const std::string& save_id,
                   int32_t num_ranks) {
  std::set<int> ranks;
  for (const std::string& name : names) {
    std::string id;
    int rank = 0;
    if (ParseRankManifestName(name, &id, &rank) && id == save_id && rank < num_ranks) {
      ranks.insert(rank);
    }
  }
  return static_cast<int64_t>(ranks.size()) == num_ranks;
}

// Step 4 over the numbered commits; then, when none is loadable, the version 2 ones. Every
// commit below N is read too (there are few: cleanups remove them): a rank-local save that a
// reference places, loadable or not, is never taken for one whose rank 0 has not committed.
Result<Needed> WhatIsNeeded(Storage& storage, const std::string& dir,
                            const std::vector<std::string>& names, uint64_t top,
                            const Metadata* own_commit) {
  Needed needed;
  std::set<std::string> referenced;
  // The numbers listed, and those found above them (step 3), newest first.
  std::set<uint64_t, std::greater<>> seqs;
  for (const std::string& name : names) {
    uint64_t seq = 0;
    if (ParseCommitName(name, &seq) && seq > 0) seqs.insert(seq);
  }
  // Overflow-safe at the top of the range: counts up from the highest listed to `top`, never
  // past it (seq <= top with top = 2^64 - 1 would never end).
  for (uint64_t seq = HighestCommit(names); seq < top;) seqs.insert(++seq);
  for (uint64_t seq : seqs) {
    Result<Metadata> read = Metadata();
    const bool own = own_commit != nullptr && own_commit->commit_seq == seq;
    if (!own) read = ReadCommit(storage, dir, CommitName(seq));
    const Result<const Metadata*> commit =
        read.ok() ? Result<const Metadata*>(own ? own_commit : &*read) : read.status();
    // Below N, what cannot be read is not needed; above it, the newest commit must be read
    // (nothing is removed otherwise). One removed since the listing (a cleanup from the
    // lowest up) has nothing loadable below it either.
    if (!commit.ok() && needed.newest_loadable) continue;
    if (!commit.ok() && commit.status().code() == StatusCode::kNotFound && seq < top) break;
    TESSERA_RETURN_IF_ERROR(commit.status());
    if ((*commit)->rank_local_reference) referenced.insert((*commit)->save_id);
    if (needed.newest_loadable) continue;
    if (!(*commit)->rank_local_reference) {
      needed.newest_loadable = seq;
      for (const FileInfo& f : (*commit)->files) needed.files.insert(f.name);
      continue;
    }
    needed.save_ids.insert((*commit)->save_id);  // loadable or pending: its files stay
    if (PartsComplete(names, (*commit)->save_id, (*commit)->num_ranks)) {
      needed.newest_loadable = seq;
    }
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<RankManifestSet> sets,
                           FindRankManifestSets(storage, dir, names));
  for (const RankManifestSet& set : sets) {
    // Version 3 saves that no reference places (rank 0 has not committed), while young.
    if (!set.legacy() && !referenced.count(set.save_id) &&
        (!set.header_read || NowUnixMs() - set.save_time_unix_ms < kUnreferencedSaveLifetimeMs)) {
      needed.save_ids.insert(set.save_id);
    }
  }
  if (needed.newest_loadable) return needed;
  // No numbered commit loads: the version 2 checkpoint, and the version 2 saves newer than it.
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(storage, dir));
  if (index.metadata.commit_seq != 0) {
    return Aborted(dir + " changed while it was cleaned up");  // a commit came meanwhile
  }
  needed.newest_loadable = 0;
  for (const FileInfo& f : index.metadata.files) needed.files.insert(f.name);
  if (index.rank_local) needed.save_ids.insert(index.metadata.save_id);
  for (const RankManifestSet& set : sets) {
    if (set.legacy() && set.problem.ok() &&
        set.save_time_unix_ms > index.metadata.save_time_unix_ms) {
      needed.save_ids.insert(set.save_id);
    }
  }
  return needed;
}

// Whether a temporary a Publish left (`target`: the name it was for) may be removed. Commits and
// the hint are published by operations that hold a marker: their temporaries go when no other
// operation runs. A marker's or a rank manifest's goes with its operation.
bool TemporaryIsStale(const std::string& target, const SaveMarkers& markers) {
  uint64_t seq = 0;
  if (ParseCommitName(target, &seq) || target == kSequenceHintFileName) {
    return markers.others_running == 0;
  }
  const std::string id = SaveIdOf(target);
  return !id.empty() && !markers.running.count(id);
}

}  // namespace

std::string SaveIdOf(const std::string& name) {
  if (std::string id = SaveIdOfDataFileName(name); !id.empty()) return id;
  if (IsTempManifestName(name)) return name.substr(TempManifestName("").size());
  if (std::string id = MarkerSaveId(name); !id.empty()) return id;
  std::string id;
  int rank = 0;
  const std::string_view committed_name =
      std::string_view(name).substr(0, name.ends_with(".tmp") ? name.size() - 4 : name.size());
  if (ParseRankManifestName(committed_name, &id, &rank)) return id;
  if (name.starts_with(kMarkerPrefix) && name.ends_with(kVersion2MarkerTempSuffix)) {
    // A version 2 marker's temporary.
    return MarkerSaveId(name.substr(0, name.size() - (sizeof(kVersion2MarkerTempSuffix) - 1)));
  }
  return "";
}

void RemoveStaleFiles(Storage& storage, const std::string& dir, const std::string& own_id,
                      const Metadata* own_commit) {
  // 1-3. The listing, then the markers, then the newest commit.
  Result<std::vector<std::string>> listed = storage.ListDir(dir);
  if (!listed.ok()) return;
  const std::vector<std::string>& names = *listed;
  const SaveMarkers markers = FindSaveMarkers(storage, dir, names, own_id);
  Result<uint64_t> top = NewestCommitNow(storage, dir, names);
  if (!top.ok()) return;
  // 4. What stays.
  Result<Needed> needed = WhatIsNeeded(storage, dir, names, *top, own_commit);
  if (!needed.ok()) return;
  // 5. The commits below N, from the lowest up.
  std::map<uint64_t, std::string> commits;
  for (const std::string& name : names) {
    uint64_t seq = 0;
    if (ParseCommitName(name, &seq)) commits.emplace(seq, name);
  }
  // Not while another operation runs: it may be about to commit above a number it found (a
  // commit's place is checked against the one below it, sequence.h), or derive its commit from
  // one of these (RemoveKeys, Finalize). The last operation to finish removes them.
  for (const auto& [seq, name] : commits) {
    if (seq >= *needed->newest_loadable || markers.others_running > 0) break;
    if (!storage.RemoveIfPresent(JoinPath(dir, name)).ok()) break;
  }
  // The files of saves nothing needs, and temporaries of dead operations.
  for (const std::string& name : names) {
    std::string target;
    bool stale = false;
    if (ParsePublishTemporaryName(name, &target)) {
      stale = TemporaryIsStale(target, markers);
    } else if (!MarkerSaveId(name).empty()) {
      continue;  // markers: below
    } else if (const std::string id = SaveIdOf(name); !id.empty()) {
      stale =
          !markers.running.count(id) && !needed->save_ids.count(id) && !needed->files.count(name);
    }
    if (stale) storage.RemoveIfPresent(JoinPath(dir, name)).IgnoreError();
  }
  for (const std::string& name : markers.dead_markers) {
    storage.RemoveIfPresent(JoinPath(dir, name)).IgnoreError();
  }
}

}  // namespace tessera
