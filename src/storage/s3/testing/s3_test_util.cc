#include "storage/s3/testing/s3_test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "storage/s3/testing/moto_server.h"

namespace tessera::s3::testing {

std::string RequestKind(const HttpRequest& r) {
  const std::string& url = r.url;
  const bool upload_id = url.find("uploadId=") != std::string::npos;
  if (r.method == "HEAD") return "HeadObject";
  if (r.method == "GET") {
    if (url.find("list-type=2") != std::string::npos) return "ListObjectsV2";
    if (url.find("uploads=") != std::string::npos) return "ListMultipartUploads";
    return "GetObject";
  }
  if (r.method == "PUT") return upload_id ? "UploadPart" : "PutObject";
  if (r.method == "POST") {
    if (url.find("uploads=") != std::string::npos) return "CreateMultipartUpload";
    if (upload_id) return "CompleteMultipartUpload";
    if (url.find("delete=") != std::string::npos) return "DeleteObjects";
  }
  if (r.method == "DELETE") return upload_id ? "AbortMultipartUpload" : "DeleteObject";
  return "Other";
}

HttpFaultHook::Decision ScriptedFaults::Before(const HttpRequest& request) {
  const std::string kind = RequestKind(request);
  Script script;
  int nth = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool found = false;
    for (auto& [k, n] : counts_) {
      if (k == kind) {
        nth = n++;
        found = true;
      }
    }
    if (!found) counts_.emplace_back(kind, 1);
    script = script_;
  }
  return script ? script(request, kind, nth) : Decision{};
}

int ScriptedFaults::count(const std::string& kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [k, n] : counts_) {
    if (k == kind) return n;
  }
  return 0;
}

HttpFaultHook::Decision S3ErrorReply(long status, const std::string& code) {
  return HttpFaultHook::Decision{HttpFaultHook::Action::kRespond, status,
                                 "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>" + code +
                                     "</Code><Message>injected " + code +
                                     "</Message><RequestId>fault</RequestId></Error>"};
}

std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<std::byte>(x >> 24);
  }
  return out;
}

Result<std::string> RunPython(const std::string& script, const std::string& input) {
  char dir_template[] = "/tmp/tessera_py_XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) return IOErrorFromErrno("mkdtemp", errno);
  const std::string dir = dir_template;
  std::ofstream(dir + "/script.py") << script;
  std::ofstream(dir + "/input") << input;
  const std::string command = TestPython() + " " + dir + "/script.py < " + dir + "/input 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return IOErrorFromErrno("popen " + command, errno);
  std::string output;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) output.append(buffer, n);
  const int status = ::pclose(pipe);
  std::remove((dir + "/script.py").c_str());
  std::remove((dir + "/input").c_str());
  ::rmdir(dir.c_str());
  if (status != 0) {
    return Internal("python (" + TestPython() + ") exited with status " + std::to_string(status) +
                    ":\n" + output);
  }
  return output;
}

}  // namespace tessera::s3::testing
