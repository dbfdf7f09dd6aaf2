#include "tools/uploads.h"

#include <charconv>

namespace tessera::tools {

Result<std::optional<std::vector<IncompleteUpload>>> IncompleteUploadsUnder(
    const std::shared_ptr<Storage>& storage, const std::string& dir) {
  auto* s3 = dynamic_cast<S3Storage*>(storage.get());
  if (s3 == nullptr) return std::optional<std::vector<IncompleteUpload>>();
  Result<std::vector<IncompleteUpload>> uploads = s3->ListIncompleteUploads(dir);
  if (!uploads.ok()) {
    return uploads.status().WithContext("listing the incomplete multipart uploads under " + dir);
  }
  return std::optional<std::vector<IncompleteUpload>>(std::move(*uploads));
}

Result<int64_t> ParseDurationSeconds(const std::string& text, const std::string& option) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [rest, error] = std::from_chars(text.data(), end, value);
  int64_t unit = 0;
  if (error == std::errc() && value >= 0) {
    const std::string suffix(rest, end);
    unit = suffix.empty() || suffix == "s" ? 1
           : suffix == "m"                 ? 60
           : suffix == "h"                 ? 3600
           : suffix == "d"                 ? 86400
                                           : 0;
  }
  if (unit == 0 || value > INT64_MAX / unit) {
    return InvalidArgument(option + " '" + text +
                           "' is not a duration: a whole number of seconds, or with s, m, h or d "
                           "(e.g. 3600, 90m, 24h, 7d)");
  }
  return value * unit;
}

std::string UploadUri(const std::shared_ptr<Storage>& storage, const IncompleteUpload& upload) {
  auto* s3 = dynamic_cast<S3Storage*>(storage.get());
  return s3 == nullptr ? upload.key : "s3://" + s3->bucket() + "/" + upload.key;
}

}  // namespace tessera::tools
