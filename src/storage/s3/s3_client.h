// A client for the S3 protocol: the object operations tessera needs, each signed with SigV4,
// retried with exponential backoff and full jitter where S3 says to retry, and turned into a
// Status that names the bucket, the key, the byte range, the HTTP status and S3's error code.
//
//   retried      transport failures (connect, reset, timeout), HTTP 500/502/503/504/429 and
//                the codes SlowDown, InternalError, ServiceUnavailable, RequestTimeout,
//                Throttling; at most RetryPolicy::max_attempts tries and max_total time
//   not retried  everything else, at once: 403 (SignatureDoesNotMatch, InvalidAccessKeyId,
//                AccessDenied), 404 (NoSuchBucket, NoSuchKey, NoSuchUpload), 412, 400s
//
// Integrity: every PUT and part carries x-amz-checksum-crc32c (S3 verifies it and refuses a
// body that does not match); CompleteMultipartUpload lists each part's checksum. Over plain
// HTTP the payload is also signed (its SHA-256 in x-amz-content-sha256), over HTTPS it is
// UNSIGNED-PAYLOAD (TLS and the checksum protect it), as botocore does.
//
// Thread safety: S3Client is safe to use from several threads at once.
#ifndef TESSERA_STORAGE_S3_S3_CLIENT_H_
#define TESSERA_STORAGE_S3_S3_CLIENT_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "storage/s3/http.h"
#include "storage/s3/s3_config.h"
#include "storage/s3/s3_xml.h"
#include "storage/s3/sigv4.h"
#include "storage/s3/transfer.h"
#include "tessera/status.h"

namespace tessera::s3 {

struct RetryPolicy {
  int max_attempts = 10;  // tries of one request, the first included
  std::chrono::milliseconds base_delay{50};
  std::chrono::milliseconds max_delay{5'000};    // the cap of one backoff
  std::chrono::milliseconds max_total{120'000};  // one request's tries and waits together
};

enum class PayloadSigning { kAuto, kSigned, kUnsigned };

// S3's limits on multipart uploads.
inline constexpr uint64_t kMinPartBytes = 5u << 20;
inline constexpr uint64_t kMaxPartBytes = uint64_t{5} << 30;
inline constexpr int kMaxParts = 10'000;

struct S3ClientOptions {
  S3Config config;
  HttpOptions http;
  RetryPolicy retry;
  PayloadSigning payload_signing = PayloadSigning::kAuto;  // auto: signed over http only
  // Multipart: the size of parts 1-1000; from there it doubles every 1000 parts (up to
  // max_part_bytes), so that 10,000 parts hold any object. An object smaller than one part is
  // sent in one PUT.
  uint64_t part_bytes = 32u << 20;
  uint64_t max_part_bytes = 512u << 20;
  // Threads that upload parts and run ranged reads.
  size_t max_concurrency = 8;
  // Bytes of parts queued for or being uploaded, all writers of the client together (each
  // open writer also holds the one part it is filling).
  uint64_t max_inflight_bytes = 256u << 20;
  // A read longer than this is split into ranged GETs of this size, run in parallel.
  uint64_t read_chunk_bytes = 8u << 20;
};

// Counters of what the client sent, for tests and benchmarks.
enum class S3Op {
  kHead,
  kGet,
  kPut,
  kList,
  kDelete,
  kDeleteObjects,
  kCreateMultipart,
  kUploadPart,
  kCompleteMultipart,
  kAbortMultipart,
  kListMultipart,
  kOther,
  kCount,
};
std::string_view S3OpName(S3Op op);

struct S3Stats {
  std::array<uint64_t, static_cast<size_t>(S3Op::kCount)> requests{};  // attempts, by op
  uint64_t retries = 0;
  uint64_t bytes_sent = 0;      // request bodies
  uint64_t bytes_received = 0;  // reply bodies
  uint64_t total_requests() const;
};

struct ObjectInfo {
  uint64_t size = 0;
  std::string etag;
  std::string checksum_crc32c;  // when the server reported one (HeadObject with checksums)
};

// The first bytes of an object, with what a HEAD says of it (GetPrefix).
struct ObjectPrefix {
  ObjectInfo info;    // size and ETag (no checksum)
  std::string bytes;  // bytes [0, min(max_bytes, info.size))
};

struct ListResult {
  std::vector<ListedObject> objects;
  std::vector<std::string> common_prefixes;
};

// What one request is, for Execute.
struct S3Call {
  S3Op op = S3Op::kOther;
  std::string method;
  std::string bucket;  // empty: a service-level request
  std::string key;     // empty: a bucket-level request
  std::vector<std::pair<std::string, std::string>> query;
  std::vector<std::pair<std::string, std::string>> headers;
  std::span<const std::byte> body;
  std::span<std::byte> sink;  // GET: the caller's buffer
  // For messages: the byte range [first, last] a ranged request moves.
  std::optional<std::pair<uint64_t, uint64_t>> range;
  std::string service = "s3";  // the signing scope's service
  // A 2xx reply whose content is wrong (a ranged GET answered with other bytes, a short body):
  // the check's error is retried like a 5xx, under the same RetryPolicy (attempts, backoff,
  // max_total), and is the call's status when the retries are spent. Null: every 2xx is OK.
  std::function<Status(const HttpResponse&)> check_reply;
};

struct S3CallResult {
  Status status;  // OK for 2xx
  HttpResponse response;
  S3ErrorBody error;  // when the reply was an S3 error document
  int attempts = 0;
  // An earlier try may have taken effect on the server although its reply was lost (a reset
  // after sending, or a 5xx): a create-only request that now fails with 412 may have been
  // ours.
  bool maybe_applied_earlier = false;
  // A failed call: some try, the last included, may have taken effect on the server (its
  // reply was lost after the request was sent, or was a 5xx).
  bool maybe_applied = false;
  // The last try's reply did not fit the call's sink (or max_body_bytes).
  bool reply_too_long = false;
};

// Seconds since the epoch of S3's "2026-11-25T12:34:56.000Z" (UTC); nullopt when it does not
// parse.
std::optional<std::time_t> ParseIso8601(const std::string& s);

class S3Client {
 public:
  // Checks the options (part sizes within S3's limits, an endpoint URL that parses).
  static Result<std::shared_ptr<S3Client>> Create(S3ClientOptions options);
  ~S3Client();

  // ---- objects ----
  // kNotFound when the key does not exist.
  Result<ObjectInfo> HeadObject(const std::string& bucket, const std::string& key,
                                bool with_checksum = false);
  // Reads bytes [offset, offset + dst.size()) into `dst`. With `if_match` (an ETag), fails
  // with kDataLoss when the object changed since that ETag. A range past the end is kDataLoss.
  // Reads longer than read_chunk_bytes run as several ranged GETs in parallel.
  Status GetRange(const std::string& bucket, const std::string& key, uint64_t offset,
                  std::span<std::byte> dst, const std::string& if_match = "");
  // The object's first `max_bytes` bytes (fewer when it is shorter), its size and its ETag, in
  // one ranged GET where a HEAD and a read would take two. kNotFound when absent. An empty
  // object (S3 answers 416 to any range of it) costs a HEAD besides.
  Result<ObjectPrefix> GetPrefix(const std::string& bucket, const std::string& key,
                                 size_t max_bytes);
  // A whole (small) object; kNotFound when absent.
  Result<std::string> GetObject(const std::string& bucket, const std::string& key);
  // One PUT. With `create_only`, kAlreadyExists when the key exists (If-None-Match: *). A PUT
  // that failed after a try whose reply was lost (or a 5xx) looks at the object: these bytes
  // there is success; when it cannot look, the error says the PUT may have committed.
  Status PutObject(const std::string& bucket, const std::string& key,
                   std::span<const std::byte> bytes, bool create_only);
  // S3's DELETE succeeds whether or not the key exists.
  Status DeleteObject(const std::string& bucket, const std::string& key);
  // Deletes `keys` in batches of 1000; the first key S3 could not delete is the error.
  Status DeleteObjects(const std::string& bucket, const std::vector<std::string>& keys);
  // One page of ListObjectsV2.
  Result<ListPage> ListObjectsPage(const std::string& bucket, const std::string& prefix,
                                   const std::string& delimiter,
                                   const std::string& continuation_token, int max_keys = 1000);
  // Every page (at most `limit` objects and prefixes; 0: no limit).
  Result<ListResult> ListObjects(const std::string& bucket, const std::string& prefix,
                                 const std::string& delimiter, size_t limit = 0);

  // ---- multipart ----
  Result<std::string> CreateMultipartUpload(const std::string& bucket, const std::string& key);
  // Uploads part `number` (1-based) with its CRC-32C; returns its ETag and checksum.
  // `object_offset` (where the part starts in the object) is for messages.
  Result<CompletedPart> UploadPart(const std::string& bucket, const std::string& key,
                                   const std::string& upload_id, int number,
                                   std::span<const std::byte> bytes, uint64_t object_offset = 0);
  // With `create_only`, kAlreadyExists when the key exists (If-None-Match: *); the upload is
  // then still open (the caller aborts it). `size` is the object's size, for verifying an
  // ambiguous retry.
  Status CompleteMultipartUpload(const std::string& bucket, const std::string& key,
                                 const std::string& upload_id,
                                 const std::vector<CompletedPart>& parts, bool create_only,
                                 uint64_t size);
  Status AbortMultipartUpload(const std::string& bucket, const std::string& key,
                              const std::string& upload_id);
  Result<std::vector<UploadListing::Upload>> ListMultipartUploads(const std::string& bucket,
                                                                  const std::string& prefix);
  // Aborts the multipart uploads under `prefix` started more than `older_than` ago (what a
  // crashed writer left: their parts cost storage and are invisible to listings). Returns how
  // many it aborted. An upload whose start time does not parse is left alone.
  Result<int> AbortIncompleteUploads(const std::string& bucket, const std::string& prefix,
                                     std::chrono::seconds older_than);

  // ---- buckets (tests and tools) ----
  Status CreateBucket(const std::string& bucket);

  // Sends one request with retries (the operations above are built on it; tests use it for
  // requests of their own).
  S3CallResult Execute(const S3Call& call);

  // The size of part `number` (1-based) of a multipart upload.
  uint64_t PartBytes(int number) const;
  // "s3://bucket/key"
  static std::string Uri(const std::string& bucket, const std::string& key);

  const S3ClientOptions& options() const { return options_; }
  TransferPool& pool() { return *pool_; }
  MemoryBudget& budget() { return budget_; }
  S3Stats stats() const;
  void ResetStats();

  // The URL and signed headers of one try of `call` at `now` (exposed for the signature
  // tests, which check them against botocore).
  HttpRequest BuildRequest(const S3Call& call, std::chrono::system_clock::time_point now) const;

 private:
  explicit S3Client(S3ClientOptions options);
  Status Check(const S3Call& call, const S3CallResult& r) const;
  // Whether the object `key` is `bytes` (size, and CRC-32C `crc` (base64) or the MD5 ETag);
  // false when absent, an error when the HEAD fails.
  Result<bool> ObjectHolds(const std::string& bucket, const std::string& key,
                           std::span<const std::byte> bytes, const std::string& crc);

  S3ClientOptions options_;
  std::string scheme_, authority_, base_path_;  // of the endpoint
  bool custom_endpoint_ = false;
  std::unique_ptr<HttpClient> http_;
  std::unique_ptr<TransferPool> pool_;
  MemoryBudget budget_;
  std::array<std::atomic<uint64_t>, static_cast<size_t>(S3Op::kCount)> requests_{};
  std::atomic<uint64_t> retries_{0}, bytes_sent_{0}, bytes_received_{0};
};

// CRC-32C (Castagnoli) of `data`, continuing from `crc` (0 to start), and its base64 form as
// x-amz-checksum-crc32c wants it (the 4 bytes big-endian).
uint32_t Crc32c(std::span<const std::byte> data, uint32_t crc = 0);
std::string Crc32cBase64(uint32_t crc);
std::string Base64(std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> Base64Decode(std::string_view text);

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_S3_CLIENT_H_
