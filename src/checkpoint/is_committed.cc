// IsCommitted: is there a whole checkpoint here, without reading its data (checkpoint.h).
#include <set>

#include "format/checkpoint_index.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"

namespace tessera {

Result<bool> IsCommitted(const std::string& path, std::shared_ptr<Storage> storage,
                         Metadata* metadata) {
  if (!storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    return IsCommitted(location.second, location.first, metadata);
  }
  Result<CheckpointIndex> index = ReadCheckpointIndex(*storage, path);
  if (!index.ok()) {
    const StatusCode code = index.status().code();
    // Nothing committed: no directory, no index, an incomplete rank-local save.
    if (code == StatusCode::kNotFound || code == StatusCode::kFailedPrecondition) return false;
    return index.status();
  }
  // The index lists every data file with its size: one listing and one open per file, so a
  // file removed or truncated since the commit makes the checkpoint not whole.
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(index->root));
  const std::set<std::string> present(names.begin(), names.end());
  for (const FileInfo& file : index->metadata.files) {
    const std::string file_path = JoinPath(index->root, file.name);
    if (!present.count(file.name)) {
      return DataLoss("the checkpoint at " + path + " lists the data file " + file.name +
                      ", which is missing");
    }
    Result<std::unique_ptr<ReadableFile>> opened = storage->NewReadableFile(file_path);
    if (opened.status().code() == StatusCode::kNotFound) {
      return DataLoss("the checkpoint at " + path + " lists the data file " + file.name +
                      ", which is missing");
    }
    TESSERA_RETURN_IF_ERROR(opened.status());
    if ((*opened)->size() != file.size) {
      return DataLoss("the data file " + file_path + " is " + std::to_string((*opened)->size()) +
                      " bytes long; the checkpoint's index says " + std::to_string(file.size));
    }
  }
  if (metadata != nullptr) *metadata = std::move(index->metadata);
  return true;
}

}  // namespace tessera
