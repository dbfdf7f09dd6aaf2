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

// The whole of a small file.
Result<Bytes> ReadWhole(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in, storage.NewReadableFile(path));
  if (in->size() > kMaxManifestBytes) {
    return DataLoss(path + " is " + std::to_string(in->size()) + " bytes");
  }
  Bytes bytes(in->size());
  TESSERA_RETURN_IF_ERROR(in->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
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

Status CommitManifest(Storage& storage, const std::string& dir, Metadata& metadata, SyncPolicy sync,
                      bool& visible) {
  // What the writer writes must pass the reader's validation, or the save would commit a
  // checkpoint nobody can read.
  if (Result<Metadata> check = DecodeManifest(EncodeManifest(metadata), JoinPath(dir, "manifest"));
      !check.ok()) {
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           check.status().message());
  }
  // Every data file must still be there: another process may have removed them.
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dir));
  const std::set<std::string> present(names.begin(), names.end());
  for (const FileInfo& f : metadata.files) {
    if (!present.count(f.name)) {
      return DataLoss("data file " + JoinPath(dir, f.name) + " of this save vanished before " +
                      "the commit (removed by another process?); nothing was committed");
    }
  }
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));  // the data files' names
  TESSERA_ASSIGN_OR_RETURN(
      metadata.commit_seq,
      PublishNewestCommit(storage, dir, metadata, HighestCommit(names), durable, &visible));
  // Read it back: the previous checkpoint's files are removed only when the new manifest is
  // really there. Gone already is fine: a newer commit superseded it and its cleanup ran.
  const std::string path = JoinPath(dir, CommitName(metadata.commit_seq));
  Result<Bytes> stored = ReadWhole(storage, path);
  if (!stored.ok() && stored.status().code() != StatusCode::kNotFound) return stored.status();
  if (stored.ok() && *stored != EncodeManifest(metadata)) {
    Result<Metadata> now = DecodeManifest(*stored, path);
    return DataLoss(path + " does not read back as written (" + std::to_string(stored->size()) +
                    " bytes read): " + (now.ok() ? "the bytes differ" : now.status().message()));
  }
  WriteSequenceHint(storage, dir, metadata.commit_seq);
  return Status::Ok();
}

}  // namespace tessera
