#include "checkpoint/dcp_commit.h"

#include <algorithm>
#include <set>

#include "checkpoint/commit.h"
#include "checkpoint/marker.h"
#include "format/tessera/manifest.h"
#include "format/torch_dist/dcp_format_writer.h"
#include "format/torch_dist/dcp_writer.h"

namespace tessera {
namespace {

using torch_dist::DcpMetadata;

// The whole of a (small) file.
Result<Bytes> ReadWholeFile(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in, storage.NewReadableFile(path));
  Bytes bytes(in->size());
  TESSERA_RETURN_IF_ERROR(in->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

std::set<std::string> DataFilesOf(const DcpMetadata& dcp) {
  std::set<std::string> files;
  for (const torch_dist::DcpStorage& s : dcp.storage) files.insert(s.relative_path);
  return files;
}

// Every data file of the new checkpoint is there, and no tessera manifest.
Status CheckDirectoryBeforeCommit(Storage& storage, const std::string& dir,
                                  const std::set<std::string>& files) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dir));
  TESSERA_RETURN_IF_ERROR(torch_dist::CheckDcpSaveTarget(dir, names));
  const std::set<std::string> present(names.begin(), names.end());
  for (const std::string& f : files) {
    if (!present.count(f)) {
      return DataLoss("data file " + JoinPath(dir, f) + " of this save vanished before the " +
                      "commit (removed by another process?); nothing was committed");
    }
  }
  return Status::Ok();
}

// After the rename: the `.metadata` in place is ours, or a later save's.
Status CheckReadBack(Storage& storage, const std::string& path, const Bytes& written,
                     const std::string& save_id) {
  TESSERA_ASSIGN_OR_RETURN(Bytes stored, ReadWholeFile(storage, path));
  if (stored == written) return Status::Ok();
  Result<DcpMetadata> now = torch_dist::ReadDcpMetadata(stored, path);
  if (now.ok()) {
    const std::set<std::string> files = DataFilesOf(*now);
    const bool ours = std::any_of(files.begin(), files.end(), [&](const std::string& f) {
      return torch_dist::DcpDataFileSaveId(f) == save_id;
    });
    if (!ours) return Status::Ok();  // replaced by a save that committed since: ours did first
  }
  return DataLoss(path + " does not read back as written (" + std::to_string(stored.size()) +
                  " bytes read, " + std::to_string(written.size()) +
                  " written): " + (now.ok() ? "the bytes differ" : now.status().message()));
}

}  // namespace

Status CommitDcpCheckpoint(Storage& storage, const std::string& dir, const Metadata& metadata,
                           const DcpCommitOptions& options, bool& renamed) {
  Result<DcpMetadata> dcp = torch_dist::ToDcpMetadata(
      metadata, {.flavor = options.flavor, .checkpoint_id = dir, .key_paths = options.key_paths});
  if (!dcp.ok()) {
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           dcp.status().message());
  }
  return CommitDcpMetadata(storage, dir, *dcp, metadata.save_id, options.sync, renamed);
}

Status CommitDcpMetadata(Storage& storage, const std::string& dir, const DcpMetadata& dcp,
                         const std::string& save_id, SyncPolicy sync, bool& renamed) {
  const std::string path = JoinPath(dir, torch_dist::kDcpMetadataFileName);
  Result<std::vector<uint8_t>> encoded = torch_dist::EncodeDcpMetadata(dcp);
  // What the writer writes must read back as written, or the save would replace a good
  // checkpoint by one nobody can read.
  Result<DcpMetadata> check = encoded.ok() ? torch_dist::ReadDcpMetadata(*encoded, path)
                                           : Result<DcpMetadata>(encoded.status());
  DcpMetadata expected = dcp;  // as the reader links it
  if (check.ok()) TESSERA_RETURN_IF_ERROR(torch_dist::LinkDcpStorage(expected, path));
  if (!check.ok() || !(*check == expected)) {
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           (check.ok() ? std::string("the .metadata does not read back as written")
                                       : check.status().message()));
  }
  const Bytes bytes(encoded->begin(), encoded->end());
  TESSERA_RETURN_IF_ERROR(CheckDirectoryBeforeCommit(storage, dir, DataFilesOf(dcp)));
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));  // the data files' names
  renamed = true;  // from here on the new .metadata may be visible, even if Publish fails
  TESSERA_RETURN_IF_ERROR(
      storage.Publish(path, std::as_bytes(std::span(bytes)), PublishMode::kReplace, durable));
  return CheckReadBack(storage, path, bytes, save_id);
}

void RemoveStaleDcpFiles(Storage& storage, const std::string& dir, const std::string& save_id) {
  // 1. What is there, and which saves may still be running (their files are kept).
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return;
  const SaveMarkers markers = FindSaveMarkers(storage, dir, *names, save_id);
  // 2. The .metadata in place now, read after the markers: a save that committed after ours
  // and has already finished is the one it describes. Unreadable: remove nothing.
  const std::string path = JoinPath(dir, torch_dist::kDcpMetadataFileName);
  Result<Bytes> bytes = ReadWholeFile(storage, path);
  if (!bytes.ok()) return;
  Result<DcpMetadata> current = torch_dist::ReadDcpMetadata(*bytes, path);
  if (!current.ok()) return;
  const std::set<std::string> live = DataFilesOf(*current);
  // 3. Remove the rest of tessera's DCP files.
  for (const std::string& name : *names) {
    // What a killed Publish of `.metadata` left: every writer of it holds a marker.
    std::string target;
    if (ParsePublishTemporaryName(name, &target)) {
      if (target == torch_dist::kDcpMetadataFileName && markers.others_running == 0) {
        storage.Remove(JoinPath(dir, name)).IgnoreError();
      }
      continue;
    }
    std::string id = torch_dist::DcpDataFileSaveId(name);
    if (id.empty()) id = torch_dist::TempDcpMetadataSaveId(name);  // a version 2 writer's
    if (id.empty() || markers.running.count(id) || live.count(name)) continue;
    storage.Remove(JoinPath(dir, name)).IgnoreError();
  }
  for (const std::string& name : markers.dead_markers) {
    storage.Remove(JoinPath(dir, name)).IgnoreError();
  }
}

}  // namespace tessera
