#include "storage/s3/http.h"

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

namespace tessera::s3 {
namespace {

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

std::string ToLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

// One request in flight: what the callbacks read and fill.
struct Transfer {
  const HttpRequest* request;
  HttpResponse* response;
  CURL* curl;
  size_t max_body;
  std::chrono::milliseconds stall_timeout;
  size_t sent = 0;
  bool too_long = false;
  bool stalled = false;
  // The stall watchdog: the byte counts last seen and when they last moved.
  curl_off_t last_up = -1, last_down = -1;
  std::chrono::steady_clock::time_point last_move = std::chrono::steady_clock::now();
};

// curl's own low-speed check averages over a window of several seconds, so a request whose
// body went into the socket buffers at once is declared stalled only seconds late; this one
// fails a request as soon as no byte has moved either way for stall_timeout.
int Progress(void* user, curl_off_t, curl_off_t down, curl_off_t, curl_off_t up) {
  auto* t = static_cast<Transfer*>(user);
  const auto now = std::chrono::steady_clock::now();
  if (up != t->last_up || down != t->last_down) {
    t->last_up = up;
    t->last_down = down;
    t->last_move = now;
    return 0;
  }
  if (now - t->last_move > t->stall_timeout) {
    t->stalled = true;
    return 1;  // aborts the transfer (CURLE_ABORTED_BY_CALLBACK)
  }
  return 0;
}

size_t ReadBody(char* buffer, size_t size, size_t items, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::span<const std::byte> body = t->request->body;
  const size_t n = std::min(size * items, body.size() - t->sent);
  if (n > 0) std::memcpy(buffer, body.data() + t->sent, n);
  t->sent += n;
  return n;
}

// curl rewinds the body when it resends on a fresh connection.
int SeekBody(void* user, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(user);
  if (origin != SEEK_SET || offset < 0 || static_cast<uint64_t>(offset) > t->request->body.size()) {
    return CURL_SEEKFUNC_CANTSEEK;
  }
  t->sent = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

size_t WriteBody(char* data, size_t size, size_t items, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * items;
  long code = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &code);
  const std::span<std::byte> sink = t->request->sink;
  if (code >= 200 && code < 300 && !sink.empty()) {
    if (n > sink.size() - t->response->body_bytes) {
      t->too_long = true;
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    std::memcpy(sink.data() + t->response->body_bytes, data, n);
  } else {
    if (n > t->max_body - t->response->body.size()) {
      t->too_long = true;
      return 0;
    }
    t->response->body.append(data, n);
  }
  t->response->body_bytes += n;
  return n;
}

size_t WriteHeader(char* data, size_t size, size_t items, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string_view line(data, size * items);
  if (line.starts_with("HTTP/")) {
    t->response->headers.clear();  // a new status line (after an interim reply)
  } else if (const size_t colon = line.find(':'); colon != std::string_view::npos) {
    t->response->headers.emplace_back(ToLower(Trim(line.substr(0, colon))),
                                      std::string(Trim(line.substr(colon + 1))));
  }
  return size * items;
}

TransportError Classify(CURLcode code, bool too_long, bool stalled) {
  if (stalled) return TransportError::kTimeout;
  switch (code) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
      return TransportError::kConnect;
    case CURLE_OPERATION_TIMEDOUT:
      return TransportError::kTimeout;
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
      return TransportError::kReset;
    case CURLE_WRITE_ERROR:
      return too_long ? TransportError::kTooLong : TransportError::kOther;
    default:
      return TransportError::kOther;
  }
}

// The outcome of a fault that answers without sending (kRespond, kReset); nullopt when the
// request is to be sent (kPass, kResetAfterSend). Takes the fault's body.
std::optional<HttpOutcome> AnswerWithoutSending(HttpFaultHook::Decision& fault) {
  HttpOutcome outcome;
  switch (fault.action) {
    case HttpFaultHook::Action::kPass:
    case HttpFaultHook::Action::kResetAfterSend:
      break;
    case HttpFaultHook::Action::kRespond:
      outcome.response.status = fault.status;
      outcome.response.body = std::move(fault.body);
      outcome.response.body_bytes = outcome.response.body.size();
      return outcome;
    case HttpFaultHook::Action::kReset:
      outcome.error = TransportError::kReset;
      outcome.error_text = "injected connection reset before sending";
      outcome.maybe_sent = false;
      return outcome;
  }
  return std::nullopt;
}

// What kResetAfterSend turns a successful exchange into: the reply lost, the request sent.
HttpOutcome ResetAfterSending() {
  HttpOutcome outcome;
  outcome.error = TransportError::kReset;
  outcome.error_text = "injected connection reset after sending";
  outcome.maybe_sent = true;
  return outcome;
}

// The request's headers as curl takes them, with curl's own Expect and Accept suppressed. The
// caller frees the list (curl_slist_free_all) once the transfer is over.
curl_slist* HeaderList(const HttpRequest& request) {
  curl_slist* headers = nullptr;
  for (const auto& [name, value] : request.headers) {
    headers = curl_slist_append(headers, (name + ": " + value).c_str());
  }
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
  headers = curl_slist_append(headers, "Accept:");
  return headers;
}

// The limit on a request's total time: the smaller of the client's and the request's, where
// zero means none.
std::chrono::milliseconds TotalTimeout(const HttpOptions& options,
                                       std::chrono::milliseconds request_timeout) {
  std::chrono::milliseconds total = options.request_timeout;
  if (request_timeout.count() > 0 && (total.count() == 0 || request_timeout < total)) {
    total = request_timeout;
  }
  return total;
}

// How `curl` connects, whatever the request: the shared caches, HTTP/1.1, buffer sizes,
// timeouts and TLS checks.
void SetConnectionOptions(CURL* curl, const HttpOptions& options, CURLSH* share,
                          curl_slist* resolve, std::chrono::milliseconds request_timeout) {
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_SHARE, share);
  if (resolve) curl_easy_setopt(curl, CURLOPT_RESOLVE, resolve);
  curl_easy_setopt(curl, CURLOPT_HTTP_VERSION, CURL_HTTP_VERSION_1_1);
  curl_easy_setopt(curl, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, static_cast<long>(CURL_MAX_READ_SIZE));
  curl_easy_setopt(curl, CURLOPT_UPLOAD_BUFFERSIZE, 2L << 20);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(options.connect_timeout.count()));
  const std::chrono::milliseconds total = TotalTimeout(options, request_timeout);
  if (total.count() > 0)
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(total.count()));
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, options.verify_tls ? 1L : 0L);
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, options.verify_tls ? 2L : 0L);
  if (!options.ca_bundle.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, options.ca_bundle.c_str());
}

// What `curl` sends and where the reply goes: the URL, headers and method, and the callbacks
// (stall watchdog, body, reply) on `transfer`. `headers`, `error_buffer` and `transfer` must
// outlive the transfer.
void SetRequestOptions(CURL* curl, const HttpRequest& request, curl_slist* headers,
                       char* error_buffer, Transfer* transfer) {
  curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, &Progress);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, transfer);
  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT" || request.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, &ReadBody);
    curl_easy_setopt(curl, CURLOPT_READDATA, transfer);
    curl_easy_setopt(curl, CURLOPT_SEEKFUNCTION, &SeekBody);
    curl_easy_setopt(curl, CURLOPT_SEEKDATA, transfer);
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &WriteBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, transfer);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &WriteHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, transfer);
}

// Fills `outcome` from curl_easy_perform's `code`: the reply's status, or the error, its text
// and whether the server may have seen the request.
void RecordResult(CURLcode code, const Transfer& transfer, const char* error_buffer,
                  const HttpOptions& options, HttpOutcome& outcome) {
  long request_size = 0;
  curl_easy_getinfo(transfer.curl, CURLINFO_REQUEST_SIZE, &request_size);
  if (code == CURLE_OK) {
    curl_easy_getinfo(transfer.curl, CURLINFO_RESPONSE_CODE, &outcome.response.status);
    return;
  }
  outcome.error = Classify(code, transfer.too_long, transfer.stalled);
  outcome.error_text = error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(code);
  if (transfer.stalled) {
    outcome.error_text =
        "no byte moved for " + std::to_string(options.stall_timeout.count()) + " ms";
  }
  if (transfer.too_long) {
    const std::span<std::byte> sink = transfer.request->sink;
    outcome.error_text = "the reply is longer than the " +
                         std::to_string(sink.empty() ? options.max_body_bytes : sink.size()) +
                         " bytes expected";
  }
  // Nothing of the request left this machine: the server cannot have acted on it.
  outcome.maybe_sent = request_size > 0 && outcome.error != TransportError::kConnect;
}

}  // namespace

const std::string* HttpResponse::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return &v;
  }
  return nullptr;
}

// The share handle (DNS cache, TLS sessions) and the CURLOPT_RESOLVE list, shared by every
// handle of the client.
struct HttpClient::Share {
  CURLSH* share = nullptr;
  curl_slist* resolve = nullptr;
  std::array<std::mutex, CURL_LOCK_DATA_LAST> locks;

  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* user) {
    static_cast<Share*>(user)->locks[data].lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* user) {
    static_cast<Share*>(user)->locks[data].unlock();
  }
};

HttpClient::HttpClient(HttpOptions options)
    : options_(std::move(options)), share_(std::make_unique<Share>()) {
  GlobalInit();
  share_->share = curl_share_init();
  curl_share_setopt(share_->share, CURLSHOPT_LOCKFUNC, &Share::Lock);
  curl_share_setopt(share_->share, CURLSHOPT_UNLOCKFUNC, &Share::Unlock);
  curl_share_setopt(share_->share, CURLSHOPT_USERDATA, share_.get());
  curl_share_setopt(share_->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
  curl_share_setopt(share_->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  for (const std::string& entry : options_.resolve) {
    share_->resolve = curl_slist_append(share_->resolve, entry.c_str());
  }
}

HttpClient::~HttpClient() {
  for (void* handle : idle_) curl_easy_cleanup(static_cast<CURL*>(handle));
  curl_share_cleanup(share_->share);
  curl_slist_free_all(share_->resolve);
}

void* HttpClient::Acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      void* handle = idle_.back();
      idle_.pop_back();
      return handle;
    }
  }
  return curl_easy_init();
}

void HttpClient::Release(void* handle) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() < options_.max_idle_handles) {
      idle_.push_back(handle);
      return;
    }
  }
  curl_easy_cleanup(static_cast<CURL*>(handle));
}

HttpOutcome HttpClient::Perform(const HttpRequest& request) {
  HttpFaultHook::Decision fault;
  if (options_.fault_hook) fault = options_.fault_hook->Before(request);
  if (std::optional<HttpOutcome> answered = AnswerWithoutSending(fault))
    return *std::move(answered);

  HttpOutcome outcome;
  CURL* curl = static_cast<CURL*>(Acquire());
  if (curl == nullptr) {
    outcome.error = TransportError::kOther;
    outcome.error_text = "curl_easy_init failed";
    outcome.maybe_sent = false;
    return outcome;
  }
  curl_easy_reset(curl);  // options only: the handle keeps its open connection
  Transfer transfer{&request, &outcome.response, curl, options_.max_body_bytes,
                    options_.stall_timeout};
  char error_buffer[CURL_ERROR_SIZE] = {};
  curl_slist* headers = HeaderList(request);
  SetConnectionOptions(curl, options_, share_->share, share_->resolve, request.timeout);
  SetRequestOptions(curl, request, headers, error_buffer, &transfer);

  const CURLcode code = curl_easy_perform(curl);
  RecordResult(code, transfer, error_buffer, options_, outcome);
  curl_slist_free_all(headers);
  Release(curl);

  if (outcome.error == TransportError::kNone &&
      fault.action == HttpFaultHook::Action::kResetAfterSend) {
    return ResetAfterSending();
  }
  return outcome;
}

}  // namespace tessera::s3
