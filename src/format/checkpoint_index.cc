#include "format/checkpoint_index.h"

#include <algorithm>
#include <optional>

#include "format/checksum.h"
#include "format/huggingface/hf_index.h"
#include "format/manifest.h"
#include "format/rank_manifests.h"
#include "format/torch_dist/dcp_codec.h"
#include "format/torch_dist/dcp_writer.h"

namespace tessera {
namespace {

// Bytes per read call of a manifest.
constexpr uint64_t kManifestPiece = 8u << 20;

bool Has(const std::vector<std::string>& names, const std::string& name) {
  return std::binary_search(names.begin(), names.end(), name);
}

// Nothing is allocated from a length the file claims until it is checked: the header first
// (the file must have exactly the size it declares, within kMaxManifestBytes), then the
// checksum, streamed through a small buffer, and only then the manifest's own buffer. A corrupt
// or hostile manifest (e.g. sparse, 64 GiB) costs a short error, not its size in memory.
Result<Metadata> ReadTesseraManifest(Storage& storage, const std::string& dir) {
  const std::string path = JoinPath(dir, kManifestFileName);
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
  return DecodeManifest(bytes, path);
}

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

// A directory holding rank-local saves, and maybe a committed manifest: the newest complete
// checkpoint among them. A set with every part present but one damaged takes part in the choice
// when its header facts could be read from another part: if it is the newest, the error names the
// damaged file (a damaged newest save is not replaced silently by an older one). A set none of
// whose parts can be read has no save time: it counts as incomplete.
Result<CheckpointIndex> ReadTesseraOrRankLocal(Storage& storage, const std::string& path,
                                               bool has_manifest,
                                               const std::vector<RankManifestSet>& sets) {
  std::optional<Metadata> whole;
  if (has_manifest) {
    TESSERA_ASSIGN_OR_RETURN(whole, ReadTesseraManifest(storage, path));
  }
  const RankManifestSet* newest_complete = nullptr;
  const RankManifestSet* newest = nullptr;
  for (const RankManifestSet& set : sets) {
    if (!set.header_read) continue;
    if (!newest || set.save_time_unix_ms > newest->save_time_unix_ms) newest = &set;
    if (set.complete() &&
        (!newest_complete || set.save_time_unix_ms > newest_complete->save_time_unix_ms)) {
      newest_complete = &set;
    }
  }
  if (newest_complete &&
      (!whole || newest_complete->save_time_unix_ms > whole->save_time_unix_ms)) {
    // A part damaged after it was committed: name it, and say what the way out is.
    auto damaged = [&](const Status& problem) {
      return Status(problem.code(),
                    "the rank-local save " + newest_complete->save_id + " in " + path + ": " +
                        problem.message() + " (the newest checkpoint in " + path +
                        " is damaged; the next save into the directory supersedes it, or "
                        "removing the rank manifests of save " +
                        newest_complete->save_id + " makes the checkpoint before it load)");
    };
    if (!newest_complete->problem.ok()) return damaged(newest_complete->problem);
    Result<Metadata> merged = MergeRankManifests(storage, path, *newest_complete);
    if (merged.status().code() == StatusCode::kDataLoss) return damaged(merged.status());
    if (!merged.ok()) return merged.status();
    Result<CheckpointIndex> checked =
        Checked(path, *merged, path + " (rank-local save " + newest_complete->save_id + ")");
    if (!checked.ok()) return checked.status();
    checked->metadata.format_version = kFormatVersion;
    checked->rank_local = true;
    return checked;
  }
  if (whole) return CheckpointIndex{path, std::move(*whole)};
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
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
  std::sort(names.begin(), names.end());
  TESSERA_ASSIGN_OR_RETURN(std::vector<RankManifestSet> sets,
                           FindRankManifestSets(storage, path, names));
  if (!sets.empty()) {
    Result<CheckpointIndex> index =
        ReadTesseraOrRankLocal(storage, path, Has(names, kManifestFileName), sets);
    // An incomplete rank-local save beside a PyTorch DCP checkpoint does not hide it.
    const bool dcp_beside =
        !Has(names, kManifestFileName) && Has(names, torch_dist::kDcpMetadataFileName);
    if (index.ok() || !dcp_beside || index.status().code() != StatusCode::kFailedPrecondition) {
      return index;
    }
  }
  if (Has(names, kManifestFileName)) {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadTesseraManifest(storage, path));
    return CheckpointIndex{path, std::move(m)};
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
  return FailedPrecondition(
      path + " holds no committed checkpoint (no " + std::string(kManifestFileName) +
      (uncommitted_tessera ? "; the data files of a save that did not finish are there"
                           : ", PyTorch DCP .metadata or *.safetensors") +
      ")");
}

}  // namespace tessera
