#include "format/tessera/tessera_format.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/checksum.h"
#include "format/tessera/manifest.h"
#include "format/tessera/rank_manifests.h"
#include "format/tessera/tessera_writer.h"

namespace tessera {
namespace {

// Bytes per read call of a manifest.
constexpr uint64_t kManifestPiece = 8u << 20;

}  // namespace

// Nothing is allocated from a length the file claims until it is checked: the header first
// (the file must have exactly the size it declares, within kMaxManifestBytes), then the
// checksum, streamed through a small buffer, and only then the manifest's own buffer. A corrupt
// or hostile manifest (e.g. sparse, 64 GiB) costs a short error, not its size in memory. A file
// of at most kManifestPiece bytes (every manifest but the largest) is read in one call: its
// buffer is no larger than the streaming one, and on an object store each call is a request.
Result<Metadata> ReadCommit(Storage& storage, const std::string& dir, const std::string& name) {
  const std::string path = JoinPath(dir, name);
  // A manifest of up to kManifestPiece bytes is read whole next: on S3 with the open, one GET.
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                           storage.NewReadableFileWithPrefix(path, kManifestPiece));
  const ReadableFile& in = *file;
  Bytes bytes;
  if (in.size() <= kManifestPiece) {
    bytes.resize(in.size());
    TESSERA_RETURN_IF_ERROR(in.ReadAt(0, bytes.data(), bytes.size()));
    TESSERA_ASSIGN_OR_RETURN(const uint64_t total, CheckManifestHeader(bytes, in.size(), path));
    bytes.resize(total);  // the size it declares is the file's: nothing is cut
  } else {
    Bytes prefix(kManifestHeaderBytes);
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
    bytes.resize(total);
    for (uint64_t done = 0; done < total;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kManifestPiece, total - done));
      TESSERA_RETURN_IF_ERROR(in.ReadAt(done, bytes.data() + done, n));
      done += n;
    }
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

// A complete rank-local save merged into one index (a part damaged after it was committed is
// named, with the way out).
Result<FormatIndex> MergedRankLocalSave(Storage& storage, const std::string& path,
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
  TESSERA_ASSIGN_OR_RETURN(
      Metadata checked, CheckAsManifest(*merged, path + " (rank-local save " + set.save_id + ")"));
  checked.format_version = kFormatVersion;
  return FormatIndex{path, std::move(checked), /*rank_local=*/true};
}

// The sets of version 2 parts and the version 2 manifest (commit 0): the newest complete
// checkpoint among them by save time, as a version 2 reader chose (docs/FORMAT.md, 4.2). A set
// with every part present but one damaged takes part in the choice when its header facts could
// be read from another part: if it is the newest, the error names the damaged file (a damaged
// newest save is not replaced silently by an older one). A set none of whose parts can be read
// has no save time: it counts as incomplete. nullopt: nothing complete.
Result<std::optional<FormatIndex>> ReadVersion2Commits(
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
    TESSERA_ASSIGN_OR_RETURN(FormatIndex merged,
                             MergedRankLocalSave(storage, path, *newest_complete));
    return std::optional<FormatIndex>(std::move(merged));
  }
  if (whole) return std::optional<FormatIndex>(FormatIndex{path, std::move(*whole)});
  return std::optional<FormatIndex>();
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
  Status status = FailedPrecondition(
      path + " holds no complete checkpoint: the rank-local save " + newest->save_id +
      " lacks the manifests of " + newest->MissingRanks() +
      " (a rank that has not finished or died; the others committed)" +
      (several ? "; it holds " + std::to_string(readable) +
                     " incomplete rank-local saves: did the ranks give different "
                     "SaveOptions::save_tag values? Every rank must give the same tag"
               : "") +
      (newest->problem.ok() ? "" : "; " + newest->problem.message()));
  if (!several) return status;
  // The advice names an option: Python words it as its own argument.
  return status.WithDetail({.options = {"SaveOptions::save_tag"}});
}

// A tessera directory (docs/FORMAT.md, 4): the highest numbered commit that is loadable (a
// whole manifest, or a reference whose rank-local save has every part), else the version 2
// commits. kNotFound when a numbered manifest listed is gone when read (superseded and removed
// by a cleanup meanwhile): the caller lists again.
Result<FormatIndex> ReadTesseraDirectory(Storage& storage, const std::string& path,
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
    if (!m.rank_local_reference) return FormatIndex{path, std::move(m)};
    // The parts as the reference counts them.
    RankManifestSet set;
    if (auto found = set_of.find(m.save_id); found != set_of.end()) set = *found->second;
    set.save_id = m.save_id;
    set.num_ranks = m.num_ranks;
    set.header_read = true;
    if (set.complete()) {
      TESSERA_ASSIGN_OR_RETURN(FormatIndex merged, MergedRankLocalSave(storage, path, set));
      merged.metadata.commit_seq = it->first;
      return merged;
    }
    if (!newest_incomplete) newest_incomplete = std::move(set);
  }
  std::vector<const RankManifestSet*> legacy;
  for (const RankManifestSet& set : sets) {
    if (set.legacy()) legacy.push_back(&set);
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<FormatIndex> old,
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

bool AnyName(const std::vector<std::string>& names, bool (*pick)(std::string_view)) {
  return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return pick(n); });
}
bool IsCommitName(std::string_view name) {
  uint64_t seq = 0;
  return ParseCommitName(name, &seq);
}
bool IsRankManifestName(std::string_view name) {
  std::string save_id;
  int rank = 0;
  return ParseRankManifestName(name, &save_id, &rank);
}
// The files of a save that has not committed yet (or never will).
bool IsUnfinishedSaveFile(std::string_view name) {
  return IsTesseraDataFileName(name) || IsTempManifestName(name) || IsRankManifestName(name);
}

class TesseraFormatImpl final : public Format {
 public:
  CheckpointFormat id() const override { return CheckpointFormat::kTessera; }
  std::string_view commit_description() const override { return "tessera.manifest.<n>"; }

  // A commit or a rank manifest (a rank-local save commits by its parts) makes a tessera
  // checkpoint, complete or not; data files or old temporaries alone are an unfinished save.
  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    if (AnyName(names, IsCommitName) || AnyName(names, IsRankManifestName)) {
      return DirectoryClaim::kCommitted;
    }
    if (AnyName(names, IsTesseraDataFileName) || AnyName(names, IsTempManifestName)) {
      return DirectoryClaim::kUnfinished;
    }
    return DirectoryClaim::kNone;
  }
  bool CountsFile(std::string_view name, DirectoryClaim claim) const override {
    if (claim == DirectoryClaim::kCommitted && IsCommitName(name)) return true;
    return IsUnfinishedSaveFile(name);
  }

  Result<FormatIndex> ReadIndex(Storage& storage, const std::string& dir,
                                const std::vector<std::string>& names) const override {
    TESSERA_ASSIGN_OR_RETURN(std::vector<RankManifestSet> sets,
                             FindRankManifestSets(storage, dir, names));
    return ReadTesseraDirectory(storage, dir, names, sets);
  }

  bool DataFilesHaveHeaders() const override { return true; }

  bool CanWrite() const override { return true; }
  Result<std::unique_ptr<FormatWriter>> NewWriter(const SaveOptions&, bool) const override {
    return NewTesseraWriter();
  }
};

}  // namespace

const Format& TesseraFormat() {
  static const TesseraFormatImpl format;
  return format;
}

Result<Metadata> CheckAsManifest(const Metadata& metadata, const std::string& what) {
  TESSERA_ASSIGN_OR_RETURN(
      Metadata checked, DecodeCarriedIndex(EncodeCarriedIndex(metadata), "the index of " + what));
  checked.format_version = 0;
  return checked;
}

}  // namespace tessera
