#include "checkpoint/commit.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "checkpoint/sequence.h"
#include "core/utf8.h"
#include "format/tessera/manifest.h"

namespace tessera {
namespace {

std::string ParentDir(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  size_t parent_end = path.find_last_not_of('/', slash);
  return parent_end == std::string::npos ? "/" : path.substr(0, parent_end + 1);
}

// The whole of a small file. Files up to kSmallFilePrefixBytes come with their open (one GET
// on S3).
constexpr size_t kSmallFilePrefixBytes = 1u << 20;
Result<Bytes> ReadWhole(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in,
                           storage.NewReadableFileWithPrefix(path, kSmallFilePrefixBytes));
  if (in->size() > kMaxManifestBytes) {
    return DataLoss(path + " is " + std::to_string(in->size()) + " bytes");
  }
  Bytes bytes(in->size());
  TESSERA_RETURN_IF_ERROR(in->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

// Before a commit: `writer`'s target check, and every data file of `metadata` still in `dir`
// (`names`): another process may have removed them.
Status CheckFilesBeforeCommit(const std::string& dir, const FormatWriter& writer,
                              const Metadata& metadata, const std::vector<std::string>& names) {
  TESSERA_RETURN_IF_ERROR(writer.CheckTarget(dir, names));
  const std::set<std::string> present(names.begin(), names.end());
  for (const FileInfo& f : metadata.files) {
    if (!present.count(f.name)) {
      return DataLoss("data file " + JoinPath(dir, f.name) + " of this save vanished before " +
                      "the commit (removed by another process?); nothing was committed");
    }
  }
  return Status::Ok();
}

}  // namespace

Status CheckUserMetadata(const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (!IsValidUtf8(key)) {
      return BadOption("SaveOptions::user_metadata",
                       "key " + QuoteBytes(key) + " is not valid UTF-8");
    }
    if (!IsValidUtf8(value)) {
      return InvalidArgument("SaveOptions::user_metadata[" + QuoteBytes(key) +
                             "] = " + QuoteBytes(value) + " is not valid UTF-8")
          .WithDetail(
              {.kind = StatusDetail::Kind::kBadOption, .options = {"SaveOptions::user_metadata"}});
    }
  }
  return Status::Ok();
}

std::vector<std::string> SortedUnique(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

Status CreateDurableDirs(Storage& storage, const std::string& path, SyncPolicy sync) {
  // Nothing to walk, create or sync where a directory is a key prefix; a file under the
  // directory's own name is found by the listing that follows (S3Storage::ListDir).
  if (storage.capabilities().implicit_directories) return storage.CreateDirs(path);
  std::vector<std::string> missing;  // deepest first
  for (std::string dir = path;;) {
    TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(dir));
    if (type == FileType::kDirectory) break;
    if (type == FileType::kFile) {
      return FailedPrecondition("cannot create checkpoint directory " + path + ": " + dir +
                                " is a file");
    }
    missing.push_back(dir);
    std::string parent = ParentDir(dir);
    if (parent == dir) break;
    dir = std::move(parent);
  }
  if (missing.empty()) return Status::Ok();
  TESSERA_RETURN_IF_ERROR_CTX(storage.CreateDirs(path), "creating checkpoint directory");
  if (sync == SyncPolicy::kFull) {
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      TESSERA_RETURN_IF_ERROR(storage.SyncDir(ParentDir(*it)));
    }
  }
  return Status::Ok();
}

std::string NewSaveId(const std::vector<std::string>& existing_names) {
  std::random_device device;  // the kernel's random source, not seeded from anything visible
  while (true) {
    const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
    char id[17];
    std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(bits));
    const std::string marker = MarkerName(id);
    const std::string tagged = DataFileTag(id);
    const bool used = std::any_of(existing_names.begin(), existing_names.end(), [&](const auto& n) {
      // Any name carrying the id: tessera's files and those of other formats (DCP data files
      // "__0_0.tsr-<id>.distcp").
      return n.find(tagged) != std::string::npos || n.starts_with(marker) || SaveIdOf(n) == id;
    });
    if (!used) return id;
  }
}

Status CommitIndex(Storage& storage, const std::string& dir, const FormatWriter& writer,
                   Metadata& metadata, SyncPolicy sync, bool& visible,
                   const std::string& location) {
  writer.FinishIndex(metadata);
  const std::string where = location.empty() ? dir : location;
  auto encode = [&](const Metadata& m) -> Result<Bytes> {
    Result<Bytes> bytes = writer.EncodeIndex(m, where);
    if (bytes.ok()) return bytes;
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           bytes.status().message());
  };
  TESSERA_ASSIGN_OR_RETURN(Bytes bytes, encode(metadata));
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dir));
  TESSERA_RETURN_IF_ERROR(CheckFilesBeforeCommit(dir, writer, metadata, names));
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));  // the data files' names
  if (!writer.NumberedCommits()) {
    const std::string path = JoinPath(dir, writer.IndexFileName());
    // From here on the new index may be visible, even if Publish fails (unless it left no file).
    visible = true;
    const Status published =
        storage.Publish(path, std::as_bytes(std::span(bytes)), PublishMode::kReplace, durable);
    if (!published.ok()) {
      // The name may hold an earlier save's index: a file there proves nothing, so only a store
      // with rename and no file at all clears it.
      visible = PublishMayHavePlaced(storage, path);
      return published;
    }
    TESSERA_ASSIGN_OR_RETURN(const Bytes stored, ReadWhole(storage, path));
    if (stored == bytes || writer.ReplacedByLaterSave(stored, metadata.save_id, path)) {
      return Status::Ok();
    }
    return DataLoss(path + " does not read back as written (" + std::to_string(stored.size()) +
                    " bytes read, " + std::to_string(bytes.size()) + " written)");
  }
  TESSERA_ASSIGN_OR_RETURN(metadata.commit_seq, PublishNewestCommit(
                                                    storage, dir,
                                                    [&](uint64_t seq) {
                                                      metadata.commit_seq = seq;
                                                      return encode(metadata);
                                                    },
                                                    HighestCommit(names), durable, &visible));
  TESSERA_ASSIGN_OR_RETURN(bytes, encode(metadata));
  // Read it back: the previous checkpoint's files are removed only when the new index is
  // really there. Gone already is fine: a newer commit superseded it and its cleanup ran.
  const std::string path = JoinPath(dir, writer.IndexFileName(metadata.commit_seq));
  Result<Bytes> stored = ReadWhole(storage, path);
  if (!stored.ok() && stored.status().code() != StatusCode::kNotFound) return stored.status();
  if (stored.ok() && *stored != bytes) {
    return DataLoss(path + " does not read back as written (" + std::to_string(stored->size()) +
                    " bytes read, " + std::to_string(bytes.size()) + " written)");
  }
  WriteSequenceHint(storage, dir, metadata.commit_seq);
  return Status::Ok();
}

void RemoveStaleFilesAfterCommit(Storage& storage, const std::string& dir,
                                 const FormatWriter& writer, const std::string& own_id,
                                 const Metadata* own_commit) {
  if (writer.NumberedCommits()) return RemoveStaleFiles(storage, dir, own_id, own_commit);
  // 1. What is there, and which saves may still be running (their files are kept).
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return;
  const SaveMarkers markers = FindSaveMarkers(storage, dir, *names, own_id);
  // 2. The index in place now, read after the markers: a save that committed after ours and
  // has already finished is the one it describes. Unreadable: remove nothing.
  const std::string index = writer.IndexFileName();
  const std::string path = JoinPath(dir, index);
  Result<Bytes> bytes = ReadWhole(storage, path);
  if (!bytes.ok()) return;
  Result<std::set<std::string>> live = writer.FilesOfIndex(*bytes, path);
  if (!live.ok()) return;
  // 3. Remove the rest of the format's files that carry a save id.
  for (const std::string& name : *names) {
    // What a killed Publish of the index left: every writer of it holds a marker.
    std::string target;
    if (ParsePublishTemporaryName(name, &target)) {
      if (target == index && markers.others_running == 0) {
        storage.RemoveIfPresent(JoinPath(dir, name)).IgnoreError();
      }
      continue;
    }
    const std::string id = writer.SaveIdOfFile(name);
    if (id.empty() || markers.running.count(id) || live->count(name)) continue;
    storage.RemoveIfPresent(JoinPath(dir, name)).IgnoreError();
  }
  for (const std::string& name : markers.dead_markers) {
    storage.RemoveIfPresent(JoinPath(dir, name)).IgnoreError();
  }
}

}  // namespace tessera
