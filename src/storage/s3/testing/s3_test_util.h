// Helpers shared by the S3 tests: scripted HTTP faults, byte patterns, Python runs.
#ifndef TESSERA_STORAGE_S3_TESTING_S3_TEST_UTIL_H_
#define TESSERA_STORAGE_S3_TESTING_S3_TEST_UTIL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "storage/s3/http.h"
#include "tessera/status.h"

namespace tessera::s3::testing {

// An HttpFaultHook whose decisions come from a function of the request and how many requests
// of its kind (RequestKind) came before. Counts every request it sees.
class ScriptedFaults : public HttpFaultHook {
 public:
  using Script =
      std::function<Decision(const HttpRequest& request, const std::string& kind, int nth_of_kind)>;
  explicit ScriptedFaults(Script script = nullptr) : script_(std::move(script)) {}

  void Set(Script script) {
    std::lock_guard<std::mutex> lock(mu_);
    script_ = std::move(script);
  }
  Decision Before(const HttpRequest& request) override;
  int count(const std::string& kind) const;

 private:
  mutable std::mutex mu_;
  Script script_;
  std::vector<std::pair<std::string, int>> counts_;
};

// "HeadObject", "GetObject", "PutObject", "UploadPart", "CreateMultipartUpload",
// "CompleteMultipartUpload", "AbortMultipartUpload", "ListObjectsV2", "ListMultipartUploads",
// "DeleteObject", "DeleteObjects" or "Other", from the method and the query.
std::string RequestKind(const HttpRequest& request);

// An HTTP error reply of S3's shape.
HttpFaultHook::Decision S3ErrorReply(long status, const std::string& code);

std::vector<std::byte> Pattern(size_t n, uint32_t seed);

// Runs `script` with TestPython(), `input` on its stdin; its stdout, or an error with its
// exit status and output.
Result<std::string> RunPython(const std::string& script, const std::string& input);

}  // namespace tessera::s3::testing

#endif  // TESSERA_STORAGE_S3_TESTING_S3_TEST_UTIL_H_
