#include "format/checkpoint_index.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/checksum.h"
#include "format/huggingface/hf_index.h"
#include "format/tessera/manifest.h"
#include "format/tessera/rank_manifests.h"
#include "format/torch_dist/dcp_codec.h"
#include "format/torch_dist/dcp_writer.h"

namespace tessera {
namespace {

// Bytes per read call of a manifest.
constexpr uint64_t kManifestPiece = 8u << 20;
// Listings of a directory whose commits keep vanishing under the reader before it gives up.
constexpr int kListAttempts = 4;

bool Has(const std::vector<std::string>& names, const std::string& name) {
  return std::binary_search(names.begin(), names.end(), name);
}

// Nothing is allocated from a length the file claims until it is checked: the header first
// (the file must have exactly the size it declares, within kMaxManifestBytes), then the
// checksum, streamed through a small buffer, and only then the manifest's own buffer. A corrupt
// or hostile manifest (e.g. sparse, 64 GiB) costs a short error, not its size in memory.
}  // namespace

Result<Metadata> ReadCommit(Storage& storage, const std::string& dir, const std::string& name) {
  const std::string path = JoinPath(dir, name);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  const ReadableFile& in = *file;
  Bytes prefix(std::min<uint64_t>(in.size(), kManifestHeaderBytes));
  TESSERA_RETURN_IF_ERROR(in.ReadAt(0, prefix.data(), prefix.size()));
  TESSERA_ASSIGN_OR_RETURN(const uint64_t total, CheckManifestHeader(prefix, in.size(), path));
  const uint64_t covered = total - kManifestTrailerBytes;  // bytes the checksum covers
  std::vector<uint8_t> piece(std::min<uint64_t>(covered, kManifestPiece));
  ChecksumStream checksum;
  for (uint64_t done = 0; done < covered;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(piece.size(), covered - done));
    TESSERA_RETURN_IF_ERROR(in.ReadAt(done, piece.data(), n));
    checksum.Update(piece.data(), n);
    done += n;
  }
  uint64_t stored = 0;
  TESSERA_RETURN_IF_ERROR(in.ReadAt(covered, &stored, sizeof(stored)));  // little-endian host
  if (checksum.Digest() != stored) return ManifestChecksumMismatch(path);
  Bytes bytes(total);
  for (uint64_t done = 0; done < total;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kManifestPiece, total - done));
    TESSERA_RETURN_IF_ERROR(in.ReadAt(done, bytes.data() + done, n));
    done += n;
  }
  TESSERA_ASSIGN_OR_RETURN(Metadata m, DecodeManifest(bytes, path));
  // A commit's number is in its name and in its bytes: a manifest copied or renamed to another
  // number (by hand, or by a tool that does not know the format) would reorder saves.
  uint64_t seq = 0;
  if (ParseCommitName(name, &seq) && m.format_version >= 3 && m.commit_seq != seq) {
    return DataLoss(path + ": corrupt manifest: it is commit " + std::to_string(m.commit_seq) +
                    " of its directory, its name says " + std::to_string(seq));
  }
  if (m.part_rank >= 0 || (seq == 0 && m.rank_local_reference)) {
    return DataLoss(path +
                    ": corrupt manifest: a rank manifest or a reference under the name of "
                    "a commit");
  }
  return m;
}

namespace {

// Splits "/a/b/c.safetensors" into ("/a/b", "c.safetensors").
std::pair<std::string, std::string> SplitPath(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

// Another format's index, held to every rule of a tessera manifest (docs/FORMAT.md, 3.3):
// encoded and decoded, which is also how it travels between ranks.
Result<CheckpointIndex> Checked(std::string root, const Metadata& m, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(Metadata checked,
                           DecodeManifest(EncodeManifest(m), "the index of " + path));
  checked.format_version = 0;
  return CheckpointIndex{std::move(root), std::move(checked)};
}

// A complete rank-local save merged into one index (a part damaged after it was committed is
// named, with the way out).
Result<CheckpointIndex> MergedRankLocalSave(Storage& storage, const std::string& path,
                                            const RankManifestSet& set) {
  auto damaged = [&](const Status& problem) {
    return Status(problem.code(),
                  "the rank-local save " + set.save_id + " in " + path + ": " + problem.message() +
                      " (the newest checkpoint in " + path +
                      " is damaged; the next save into the directory supersedes it, or "
                      "removing the rank manifests of save " +
                      set.save_id + " makes the checkpoint before it load)");
  };
  if (!set.problem.ok()) return damaged(set.problem);
  Result<Metadata> merged = MergeRankManifests(storage, path, set);
  if (merged.status().code() == StatusCode::kDataLoss) return damaged(merged.status());
  if (!merged.ok()) return merged.status();
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex checked,
                           Checked(path, *merged, path + " (rank-local save " + set.save_id + ")"));
  checked.metadata.format_version = kFormatVersion;
  checked.rank_local = true;
  return checked;
}

// The sets of version 2 parts and the version 2 manifest (commit 0): the newest complete
// checkpoint among them by save time, as a version 2 reader chose (docs/FORMAT.md, 4.2). A set
// with every part present but one damaged takes part in the choice when its header facts could
// be read from another part: if it is the newest, the error names the damaged file (a damaged
// newest save is not replaced silently by an older one). A set none of whose parts can be read
// has no save time: it counts as incomplete. nullopt: nothing complete.
Result<std::optional<CheckpointIndex>> ReadVersion2Commits(
    Storage& storage, const std::string& path, bool has_manifest,
    const std::vector<const RankManifestSet*>& sets) {
  std::optional<Metadata> whole;
  if (has_manifest) {
    TESSERA_ASSIGN_OR_RETURN(whole, ReadCommit(storage, path, kVersion2ManifestFileName));
  }
  const RankManifestSet* newest_complete = nullptr;
  for (const RankManifestSet* set : sets) {
    if (set->complete() &&
        (!newest_complete || set->save_time_unix_ms > newest_complete->save_time_unix_ms)) {
      newest_complete = set;
    }
  }
  if (newest_complete &&
      (!whole || newest_complete->save_time_unix_ms > whole->save_time_unix_ms)) {
    TESSERA_ASSIGN_OR_RETURN(CheckpointIndex merged,
                             MergedRankLocalSave(storage, path, *newest_complete));
    return std::optional<CheckpointIndex>(std::move(merged));
  }
  if (whole) return std::optional<CheckpointIndex>(CheckpointIndex{path, std::move(*whole)});
  return std::optional<CheckpointIndex>();
}

// The error of a directory with rank-local saves and no complete checkpoint: the newest
// incomplete save (`newest`: by commit, else by save time) and the ranks it lacks.
Status NoCompleteCheckpoint(const std::string& path, const std::vector<RankManifestSet>& sets,
                            const RankManifestSet* newest) {
  if (!newest) {
    return sets.front().problem.WithContext(path +
                                            " holds no complete checkpoint: no part of "
                                            "the rank-local save " +
                                            sets.front().save_id + " can be read");
  }
  // Several incomplete saves and none complete: most likely the ranks were given different tags.
  const auto readable = std::count_if(sets.begin(), sets.end(),
                                      [](const RankManifestSet& set) { return set.header_read; });
  const bool several = readable > 1;
  if (newest->complete()) {  // its reference was removed as superseded; a rank finished later
    return FailedPrecondition(path + " holds no complete checkpoint: the rank-local save " +
                              newest->save_id +
                              " has every part, but no commit places it (a newer save "
                              "superseded it before its last rank finished)");
  }
  return FailedPrecondition(
      path + " holds no complete checkpoint: the rank-local save " + newest->save_id +
      " lacks the manifests of " + newest->MissingRanks() +
      " (a rank that has not finished or died; the others committed)" +
      (several ? "; it holds " + std::to_string(readable) +
                     " incomplete rank-local saves: did the ranks give different "
                     "SaveOptions::save_tag values? Every rank must give the same tag"
               : "") +
      (newest->problem.ok() ? "" : "; " + newest->problem.message()));
}

// A tessera directory (docs/FORMAT.md, 4): the highest numbered commit that is loadable (a
// whole manifest, or a reference whose rank-local save has every part), else the version 2
// commits. kNotFound when a numbered manifest listed is gone when read (superseded and removed
// by a cleanup meanwhile): the caller lists again.
Result<CheckpointIndex> ReadTesseraDirectory(Storage& storage, const std::string& path,
                                             const std::vector<std::string>& names,
                                             const std::vector<RankManifestSet>& sets) {
  std::map<uint64_t, std::string> commits;  // seq -> name
  for (const std::string& name : names) {
    uint64_t seq = 0;
    if (ParseCommitName(name, &seq)) commits.emplace(seq, name);
  }
  std::map<std::string, const RankManifestSet*> set_of;
  for (const RankManifestSet& set : sets) set_of[set.save_id] = &set;
  std::optional<RankManifestSet> newest_incomplete;  // of a reference, the newest
  for (auto it = commits.rbegin(); it != commits.rend() && it->first > 0; ++it) {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadCommit(storage, path, it->second));
    if (!m.rank_local_reference) return CheckpointIndex{path, std::move(m)};
    // The parts as the reference counts them.
    RankManifestSet set;
    if (auto found = set_of.find(m.save_id); found != set_of.end()) set = *found->second;
    set.save_id = m.save_id;
    set.num_ranks = m.num_ranks;
    set.header_read = true;
    if (set.complete()) {
      TESSERA_ASSIGN_OR_RETURN(CheckpointIndex merged, MergedRankLocalSave(storage, path, set));
      merged.metadata.commit_seq = it->first;
      return merged;
    }
    if (!newest_incomplete) newest_incomplete = std::move(set);
  }
  std::vector<const RankManifestSet*> legacy;
  for (const RankManifestSet& set : sets) {
    if (set.legacy()) legacy.push_back(&set);
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<CheckpointIndex> old,
                           ReadVersion2Commits(storage, path, commits.count(0) > 0, legacy));
  if (old) return std::move(*old);
  if (newest_incomplete) return NoCompleteCheckpoint(path, sets, &*newest_incomplete);
  // Sets none of which is referenced: a version 3 save whose rank 0 has not committed (it
  // places the save in the order before its own part), or version 2 saves none complete.
  const RankManifestSet* newest = nullptr;
  for (const RankManifestSet& set : sets) {
    if (!set.header_read) continue;
    if (!newest ||
        (set.legacy() && newest->legacy() && set.save_time_unix_ms > newest->save_time_unix_ms)) {
      newest = &set;
    }
  }
  return NoCompleteCheckpoint(path, sets, newest);
}

// The index of the directory `path` whose entries (sorted) are `names`.
Result<CheckpointIndex> ReadDirectory(Storage& storage, const std::string& path,
                                      const std::vector<std::string>& names) {
  const bool has_commit = std::any_of(names.begin(), names.end(), [](const std::string& n) {
    uint64_t seq = 0;
    return ParseCommitName(n, &seq);
  });
  TESSERA_ASSIGN_OR_RETURN(std::vector<RankManifestSet> sets,
                           FindRankManifestSets(storage, path, names));
  if (has_commit || !sets.empty()) {
    Result<CheckpointIndex> index = ReadTesseraDirectory(storage, path, names, sets);
    // Incomplete rank-local saves beside a PyTorch DCP checkpoint do not hide it.
    if (index.ok() || index.status().code() != StatusCode::kFailedPrecondition ||
        !Has(names, torch_dist::kDcpMetadataFileName)) {
      return index;
    }
  }
  if (Has(names, torch_dist::kDcpMetadataFileName)) {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, torch_dist::ReadDcpDirectory(storage, path, names));
    return Checked(path, m, path);
  }
  const bool uncommitted_tessera = std::any_of(names.begin(), names.end(), [](const auto& n) {
    return IsTesseraDataFileName(n) || IsTempManifestName(n);
  });
  const bool safetensors = std::any_of(names.begin(), names.end(), [](const std::string& n) {
    return n.ends_with(".safetensors") || n == kHuggingFaceIndexName;
  });
  if (!uncommitted_tessera && safetensors) {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadHuggingFaceDirectory(storage, path, names));
    return Checked(path, m, path);
  }
  return FailedPrecondition(path + " holds no committed checkpoint (no tessera.manifest.<n>" +
                            (uncommitted_tessera
                                 ? "; the data files of a save that did not finish are there"
                                 : ", PyTorch DCP .metadata or *.safetensors") +
                            ")");
}

}  // namespace

Result<CheckpointIndex> ReadCheckpointIndex(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(path));
  if (type == FileType::kNotFound) {
    return NotFound("checkpoint directory " + path + " does not exist");
  }
  if (type == FileType::kFile) {
    if (!path.ends_with(".safetensors")) {
      return FailedPrecondition(path +
                                " is a file, not a checkpoint directory (a single file "
                                "must be a .safetensors file)");
    }
    auto [dir, name] = SplitPath(path);
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadHuggingFaceFile(storage, dir, name));
    return Checked(dir, m, path);
  }
  // A numbered manifest or a part listed may be gone when read: superseded and removed by the
  // cleanup of a commit made meanwhile. The directory is then listed again.
  for (int attempt = 1;; ++attempt) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
    std::sort(names.begin(), names.end());
    Result<CheckpointIndex> index = ReadDirectory(storage, path, names);
    if (index.ok() || index.status().code() != StatusCode::kNotFound || attempt == kListAttempts) {
      return index;
    }
  }
}

}  // namespace tessera
