// The incomplete multipart uploads under a location on an object store: what `tessera ls`
// lists and `tessera prune --abort-uploads-older-than` aborts. A writer that dies mid-upload
// (a SIGKILL, a lost node) leaves its parts; they appear in no listing and cost storage until
// aborted.
#ifndef TESSERA_TOOLS_UPLOADS_H_
#define TESSERA_TOOLS_UPLOADS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/s3_storage.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::tools {

// The uploads under `dir` of `storage`, sorted by key; nullopt when the storage is not an object
// store with multipart uploads (a file system).
Result<std::optional<std::vector<IncompleteUpload>>> IncompleteUploadsUnder(
    const std::shared_ptr<Storage>& storage, const std::string& dir);

// Seconds from "90", "90s", "15m", "24h" or "7d"; kInvalidArgument naming `option` otherwise.
Result<int64_t> ParseDurationSeconds(const std::string& text, const std::string& option);

// "s3://bucket/key" of an upload of `storage` (an S3Storage), or the key alone.
std::string UploadUri(const std::shared_ptr<Storage>& storage, const IncompleteUpload& upload);

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_UPLOADS_H_
