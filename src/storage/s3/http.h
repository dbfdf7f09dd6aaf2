// HTTP/1.1 requests over libcurl, for the S3 client: a pool of easy handles so that requests
// reuse their connections (a handle keeps its connection open between requests), a share
// handle for the DNS cache and TLS sessions, connect and stall timeouts, bodies sent from and
// received into the caller's memory, and a fault hook for tests.
//
// Thread safety: HttpClient is safe to use from several threads at once; each Perform borrows
// one handle from the pool.
#ifndef TESSERA_STORAGE_S3_HTTP_H_
#define TESSERA_STORAGE_S3_HTTP_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera::s3 {

struct HttpRequest {
  std::string method;  // GET, HEAD, PUT, POST, DELETE
  std::string url;
  std::vector<std::pair<std::string, std::string>> headers;
  std::span<const std::byte> body;  // not owned: must outlive Perform
  // Where the body of a 2xx reply goes (a GET into the caller's buffer). A reply longer than
  // the sink fails with TransportError::kTooLong. Empty: into HttpResponse::body.
  std::span<std::byte> sink;
  // This request's limit on its total time (curl's CURLOPT_TIMEOUT_MS): the S3 client passes
  // what is left of the request's retry budget (RetryPolicy::max_total), so that a reply
  // trickled a byte at a time, which the stall timeout never catches, cannot outlive it. Zero:
  // HttpOptions::request_timeout alone; with both, the smaller.
  std::chrono::milliseconds timeout{0};
};

struct HttpResponse {
  long status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case
  std::string body;         // unless it went to the sink; at most HttpOptions::max_body_bytes
  uint64_t body_bytes = 0;  // bytes of body received (into the sink or `body`)
  // The value of header `name` (lower-case), or null.
  const std::string* Header(std::string_view name) const;
};

enum class TransportError {
  kNone,
  kConnect,  // no connection was made (refused, unresolved): the server saw nothing
  kTimeout,  // the connect timeout, the stall timeout or the request timeout fired
  kReset,    // the connection broke while sending or receiving
  kTooLong,  // the reply did not fit the sink or max_body_bytes
  kOther,
};

struct HttpOutcome {
  TransportError error = TransportError::kNone;
  std::string error_text;  // curl's message when error != kNone
  // False only when the server cannot have acted on the request (kConnect, or a fault
  // injected before sending): then a retry cannot meet the request's own earlier effect.
  bool maybe_sent = true;
  HttpResponse response;  // meaningful when error == kNone
};

// A test hook consulted before every request (HttpOptions::fault_hook).
class HttpFaultHook {
 public:
  enum class Action {
    kPass,            // send it
    kRespond,         // do not send; answer `status` and `body`
    kReset,           // do not send; fail as a reset connection would
    kResetAfterSend,  // send it, then lose the reply as a reset connection would
  };
  struct Decision {
    Action action = Action::kPass;
    long status = 0;
    std::string body;
  };
  virtual ~HttpFaultHook() = default;
  virtual Decision Before(const HttpRequest& request) = 0;
};

struct HttpOptions {
  std::chrono::milliseconds connect_timeout{10'000};
  // A transfer that moves no byte either way for this long fails with kTimeout (checked by
  // curl's progress callback, about every second or more often). A stall, not a total,
  // because a part's upload time grows with its size.
  std::chrono::milliseconds stall_timeout{30'000};
  // A limit on each request's total time; zero: none.
  std::chrono::milliseconds request_timeout{0};
  // CURLOPT_RESOLVE entries, "host:port:address": pins a host name to an address (virtual-
  // hosted bucket names on a local endpoint, or a chosen S3 front end).
  std::vector<std::string> resolve;
  bool verify_tls = true;
  std::string ca_bundle;  // a CA file for TLS instead of the system's; empty: the system's
  // Largest reply body kept in memory (errors, listings): 16 MiB.
  size_t max_body_bytes = 16u << 20;
  // Idle handles (and so open connections) kept for reuse.
  size_t max_idle_handles = 64;
  std::shared_ptr<HttpFaultHook> fault_hook;
};

class HttpClient {
 public:
  explicit HttpClient(HttpOptions options);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  HttpOutcome Perform(const HttpRequest& request);

  const HttpOptions& options() const { return options_; }

 private:
  struct Share;
  void* Acquire();
  void Release(void* handle);

  HttpOptions options_;
  std::unique_ptr<Share> share_;
  std::mutex mu_;
  std::vector<void*> idle_;  // CURL* handles
};

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_HTTP_H_
