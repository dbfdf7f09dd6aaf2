// S3Client: endpoints, signing, retries and errors. The operations are in s3_operations.cc.
#include "storage/s3/s3_client.h"

#include <isa-l/crc.h>
#include <openssl/evp.h>

#include <algorithm>
#include <random>
#include <thread>

#include "tessera/s3_storage.h"

namespace tessera::s3 {
namespace {

using Clock = std::chrono::steady_clock;

bool IsDnsCompatibleBucket(const std::string& b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return b.front() != '-' && b.back() != '-';
}

bool RetryableStatus(long status, const std::string& code) {
  if (status == 500 || status == 502 || status == 503 || status == 504 || status == 429) {
    return true;
  }
  return code == "SlowDown" || code == "InternalError" || code == "ServiceUnavailable" ||
         code == "RequestTimeout" || code == "Throttling" || code == "ThrottlingException" ||
         code == "RequestLimitExceeded";
}

bool RetryableTransport(TransportError e) {
  return e == TransportError::kConnect || e == TransportError::kTimeout ||
         e == TransportError::kReset;
}

std::string_view TransportName(TransportError e) {
  switch (e) {
    case TransportError::kConnect:
      return "could not connect";
    case TransportError::kTimeout:
      return "timed out";
    case TransportError::kReset:
      return "connection reset";
    case TransportError::kTooLong:
      return "reply too long";
    default:
      return "transport error";
  }
}

std::string Seconds(Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", std::chrono::duration<double>(d).count());
  return buf;
}

// Full jitter (AWS's "Exponential Backoff And Jitter"): uniform in [0, min(cap, base * 2^k)].
std::chrono::milliseconds Backoff(const RetryPolicy& policy, int attempt) {
  thread_local std::mt19937_64 random{std::random_device{}()};
  const int64_t base = std::max<int64_t>(1, policy.base_delay.count());
  const int shift = std::min(attempt - 1, 30);
  const int64_t cap = std::min<int64_t>(policy.max_delay.count(), base << shift);
  return std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(0, cap)(random));
}

std::string Describe(const S3Call& call) {
  std::string out = "S3 " + std::string(S3OpName(call.op)) + " ";
  out += call.bucket.empty() ? std::string("(service)") : S3Client::Uri(call.bucket, call.key);
  if (call.range) {
    out += " bytes " + std::to_string(call.range->first) + "-" + std::to_string(call.range->second);
  }
  return out;
}

}  // namespace

std::string_view S3OpName(S3Op op) {
  static constexpr std::string_view kNames[] = {"HeadObject",
                                                "GetObject",
                                                "PutObject",
                                                "ListObjectsV2",
                                                "DeleteObject",
                                                "DeleteObjects",
                                                "CreateMultipartUpload",
                                                "UploadPart",
                                                "CompleteMultipartUpload",
                                                "AbortMultipartUpload",
                                                "ListMultipartUploads",
                                                "Request"};
  const auto i = static_cast<size_t>(op);
  return i < std::size(kNames) ? kNames[i] : "Request";
}

uint64_t S3Stats::total_requests() const {
  uint64_t n = 0;
  for (uint64_t r : requests) n += r;
  return n;
}

uint32_t Crc32c(std::span<const std::byte> data, uint32_t crc) {
  // ISA-L's crc32_iscsi neither inverts its input nor its output.
  uint32_t state = ~crc;
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  for (size_t left = data.size(); left > 0;) {
    const size_t n = std::min<size_t>(left, 1u << 30);  // its length is an int
    state = crc32_iscsi(const_cast<unsigned char*>(p), static_cast<int>(n), state);
    p += n;
    left -= n;
  }
  return ~state;
}

std::string Base64(std::span<const uint8_t> bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), bytes.data(),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(std::max(0, n)));
  return out;
}

Result<std::vector<uint8_t>> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return InvalidArgument("'" + std::string(text) + "' is not base64");
  std::vector<uint8_t> out(text.size() / 4 * 3);
  const int n = EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) return InvalidArgument("'" + std::string(text) + "' is not base64");
  size_t size = static_cast<size_t>(n);
  for (size_t i = text.size(); i > 0 && text[i - 1] == '=' && size > 0; --i) --size;
  out.resize(size);
  return out;
}

std::string Crc32cBase64(uint32_t crc) {
  const uint8_t be[4] = {static_cast<uint8_t>(crc >> 24), static_cast<uint8_t>(crc >> 16),
                         static_cast<uint8_t>(crc >> 8), static_cast<uint8_t>(crc)};
  return Base64(be);
}

std::string S3Client::Uri(const std::string& bucket, const std::string& key) {
  return "s3://" + bucket + "/" + key;
}

S3Client::S3Client(S3ClientOptions options)
    : options_(std::move(options)), budget_(options_.max_inflight_bytes) {}

S3Client::~S3Client() = default;

Result<std::shared_ptr<S3Client>> S3Client::Create(S3ClientOptions options) {
  if (options.part_bytes < kMinPartBytes || options.part_bytes > kMaxPartBytes) {
    return InvalidArgument("S3 part_bytes " + std::to_string(options.part_bytes) +
                           " is outside S3's limits [5 MiB, 5 GiB]");
  }
  options.max_part_bytes = std::clamp(options.max_part_bytes, options.part_bytes, kMaxPartBytes);
  if (options.read_chunk_bytes == 0) options.read_chunk_bytes = S3ClientOptions().read_chunk_bytes;
  if (options.retry.max_attempts < 1) options.retry.max_attempts = 1;
  if (options.max_concurrency < 1 || options.max_concurrency > kMaxS3Concurrency) {
    return InvalidArgument("S3 max_concurrency " + std::to_string(options.max_concurrency) +
                           " is outside [1, " + std::to_string(kMaxS3Concurrency) + "]");
  }
  if (options.retry.max_attempts > kMaxS3Attempts) {
    return InvalidArgument("S3 max_attempts " + std::to_string(options.retry.max_attempts) +
                           " is outside [1, " + std::to_string(kMaxS3Attempts) + "]");
  }
  std::shared_ptr<S3Client> client(new S3Client(std::move(options)));
  const std::string& url = client->options_.config.endpoint_url;
  if (url.empty()) {
    client->scheme_ = "https";
    client->authority_ = "s3." + client->options_.config.region + ".amazonaws.com";
  } else {
    const size_t sep = url.find("://");
    if (sep == std::string::npos) {
      return InvalidArgument("S3 endpoint URL '" + RedactUrl(url) +
                             "' has no scheme (http:// or https://)");
    }
    client->scheme_ = url.substr(0, sep);
    if (client->scheme_ != "http" && client->scheme_ != "https") {
      return InvalidArgument("S3 endpoint URL '" + RedactUrl(url) + "': scheme '" +
                             client->scheme_ + "' is neither http nor https");
    }
    std::string rest = url.substr(sep + 3);
    const size_t slash = rest.find('/');
    client->authority_ = rest.substr(0, slash);
    if (slash != std::string::npos) client->base_path_ = rest.substr(slash);
    while (!client->base_path_.empty() && client->base_path_.back() == '/') {
      client->base_path_.pop_back();
    }
    if (client->authority_.empty() ||
        client->authority_.find_first_of("?#@ ") != std::string::npos) {
      return InvalidArgument("S3 endpoint URL '" + RedactUrl(url) + "' has no valid host" +
                             (client->authority_.find('@') != std::string::npos
                                  ? " (credentials go in the environment or a profile, never "
                                    "in the URL)"
                                  : ""));
    }
    // The Host header (and so the signature) leaves out a scheme's default port.
    const std::string default_port = client->scheme_ == "https" ? ":443" : ":80";
    if (client->authority_.ends_with(default_port)) {
      client->authority_.resize(client->authority_.size() - default_port.size());
    }
    client->custom_endpoint_ = true;
  }
  client->http_ = std::make_unique<HttpClient>(client->options_.http);
  client->pool_ = std::make_unique<TransferPool>(client->options_.max_concurrency);
  return client;
}

uint64_t S3Client::PartBytes(int number) const {
  const int doublings = std::min((number - 1) / 1000, 20);
  return std::min(options_.max_part_bytes, options_.part_bytes << doublings);
}

HttpRequest S3Client::BuildRequest(const S3Call& call,
                                   std::chrono::system_clock::time_point now) const {
  AddressingStyle style = options_.config.addressing_style;
  if (style == AddressingStyle::kAuto) {
    style = !custom_endpoint_ && IsDnsCompatibleBucket(call.bucket) ? AddressingStyle::kVirtual
                                                                    : AddressingStyle::kPath;
  }
  std::string host = authority_;
  std::string path = base_path_;
  if (call.bucket.empty()) {
    path += "/";
  } else if (style == AddressingStyle::kVirtual) {
    host = call.bucket + "." + authority_;
    path += "/" + UriEncode(call.key, true);
  } else {
    path += "/" + call.bucket;
    if (!call.key.empty()) path += "/" + UriEncode(call.key, true);
  }

  const bool sign_payload =
      options_.payload_signing == PayloadSigning::kSigned ||
      (options_.payload_signing == PayloadSigning::kAuto && scheme_ == "http");
  const std::string amz_date = AmzDate(now);
  SignableRequest signable;
  signable.method = call.method;
  signable.canonical_uri = path;
  signable.query = call.query;
  signable.payload_hash = sign_payload ? Sha256Hex(call.body) : std::string(kUnsignedPayload);
  signable.headers = {
      {"host", host}, {"x-amz-date", amz_date}, {"x-amz-content-sha256", signable.payload_hash}};
  const Credentials& credentials = options_.config.credentials;
  if (!credentials.session_token.empty()) {
    signable.headers.emplace_back("x-amz-security-token", credentials.session_token);
  }
  for (const auto& header : call.headers) signable.headers.push_back(header);
  const Signature signature =
      SignV4(signable, credentials, SigningScope{options_.config.region, call.service}, amz_date);

  HttpRequest request;
  request.method = call.method;
  request.url = scheme_ + "://" + host + path;
  const std::string query = CanonicalQuery(call.query);
  if (!query.empty()) request.url += "?" + query;
  request.headers = std::move(signable.headers);
  request.headers.emplace_back("Authorization", signature.authorization);
  request.body = call.body;
  request.sink = call.sink;
  return request;
}

S3CallResult S3Client::Execute(const S3Call& call) {
  S3CallResult result;
  const RetryPolicy& policy = options_.retry;
  const Clock::time_point start = Clock::now();
  bool maybe_applied = false;
  for (int attempt = 1;; ++attempt) {
    result.maybe_applied_earlier = maybe_applied;
    result.attempts = attempt;
    requests_[static_cast<size_t>(call.op)].fetch_add(1, std::memory_order_relaxed);
    if (attempt > 1) retries_.fetch_add(1, std::memory_order_relaxed);
    HttpRequest request = BuildRequest(call, std::chrono::system_clock::now());
    // What is left of the budget bounds this try as a whole (docs/S3.md: at most max_total per
    // request, retries included), whatever the stall timeout lets through.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(policy.max_total -
                                                                            (Clock::now() - start));
    request.timeout = std::max(left, std::chrono::milliseconds(1));
    HttpOutcome outcome = http_->Perform(request);
    if (outcome.maybe_sent) bytes_sent_.fetch_add(call.body.size(), std::memory_order_relaxed);
    bytes_received_.fetch_add(outcome.response.body_bytes, std::memory_order_relaxed);

    bool retryable = false;
    std::string what;
    Status wrong_reply;  // a 2xx that call.check_reply refused
    result.reply_too_long = outcome.error == TransportError::kTooLong;
    if (outcome.error != TransportError::kNone) {
      retryable = RetryableTransport(outcome.error);
      maybe_applied = maybe_applied || outcome.maybe_sent;
      what = std::string(TransportName(outcome.error)) + " (" + outcome.error_text + ")";
      result.response = HttpResponse{};
      result.error = S3ErrorBody{};
    } else {
      result.response = std::move(outcome.response);
      const long status = result.response.status;
      if (status >= 200 && status < 300) {
        wrong_reply = call.check_reply ? call.check_reply(result.response) : Status::Ok();
        if (wrong_reply.ok()) {
          result.status = Status::Ok();
          return result;
        }
        retryable = true;
      } else {
        result.error = ParseErrorBody(result.response.body);
        retryable = RetryableStatus(status, result.error.code);
        if (status >= 500) maybe_applied = true;
      }
    }
    const std::chrono::milliseconds delay = Backoff(policy, attempt);
    const bool give_up = !retryable || attempt >= policy.max_attempts ||
                         Clock::now() - start + delay > policy.max_total;
    if (!give_up) {
      std::this_thread::sleep_for(delay);
      continue;
    }
    result.maybe_applied = maybe_applied;
    const std::string tries = retryable ? " (gave up after " + std::to_string(attempt) +
                                              " attempts in " + Seconds(Clock::now() - start) + ")"
                                        : "";
    if (outcome.error != TransportError::kNone) {
      result.status = IOError(Describe(call) + ": " + what + tries);
    } else if (!wrong_reply.ok()) {
      result.status = Status(wrong_reply.code(), wrong_reply.message() + tries);
    } else {
      result.status = Check(call, result);
      if (retryable) result.status = Status(result.status.code(), result.status.message() + tries);
    }
    return result;
  }
}

// The Status of a non-2xx reply: S3's status and code, and what the user can do about it.
Status S3Client::Check(const S3Call& call, const S3CallResult& r) const {
  const long status = r.response.status;
  const std::string& code = r.error.code;
  std::string message = Describe(call) + ": HTTP " + std::to_string(status);
  if (!code.empty()) message += " " + code;
  if (!r.error.message.empty()) message += ": " + r.error.message;
  if (!r.error.request_id.empty()) message += " (request id " + r.error.request_id + ")";
  const Credentials& credentials = options_.config.credentials;
  const std::string& source = options_.config.credentials_source;
  std::string hint;
  StatusCode sc = StatusCode::kIOError;
  if (status == 403) {
    if (code == "SignatureDoesNotMatch") {
      hint = "the secret key does not match access key id '" + credentials.access_key_id +
             "' (credentials from " + source + "): check AWS_SECRET_ACCESS_KEY";
    } else if (code == "InvalidAccessKeyId") {
      hint = "the server does not know access key id '" + credentials.access_key_id +
             "' (credentials from " + source + "): check AWS_ACCESS_KEY_ID and the endpoint";
    } else if (code == "ExpiredToken" || code == "InvalidToken" || code == "TokenRefreshRequired") {
      hint = "the session token is expired or invalid: refresh AWS_SESSION_TOKEN";
    } else if (code == "RequestTimeTooSkewed") {
      hint = "this machine's clock is off by more than 15 minutes";
    } else if (code.empty()) {
      hint =
          "access denied (a HEAD reply carries no error code: wrong credentials or no "
          "permission; access key id '" +
          credentials.access_key_id + "' from " + source + ")";
    } else {
      hint =
          "access key id '" + credentials.access_key_id + "' (from " + source + ") may not do this";
    }
  } else if (status == 404) {
    sc = StatusCode::kNotFound;
    if (code == "NoSuchBucket") hint = "the bucket does not exist";
    if (code == "NoSuchUpload") hint = "the multipart upload was aborted or completed";
  } else if (status == 412) {
    sc = StatusCode::kFailedPrecondition;
  } else if (status == 409) {
    sc = StatusCode::kAlreadyExists;
  } else if (status == 416) {
    sc = StatusCode::kDataLoss;
    hint = "the range is past the end of the object";
  } else if (status == 501) {
    sc = StatusCode::kUnimplemented;
    hint = "the server does not implement this request";
  } else if (status == 400) {
    sc = StatusCode::kInvalidArgument;
  }
  if (!hint.empty()) message += " -- " + hint;
  return Status(sc, message);
}

S3Stats S3Client::stats() const {
  S3Stats s;
  for (size_t i = 0; i < s.requests.size(); ++i) s.requests[i] = requests_[i].load();
  s.retries = retries_.load();
  s.bytes_sent = bytes_sent_.load();
  s.bytes_received = bytes_received_.load();
  return s;
}

void S3Client::ResetStats() {
  for (auto& r : requests_) r.store(0);
  retries_.store(0);
  bytes_sent_.store(0);
  bytes_received_.store(0);
}

}  // namespace tessera::s3
