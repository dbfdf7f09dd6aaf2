// S3Storage: a Storage on one bucket of an S3-compatible object store (AWS S3, MinIO, Ceph
// RGW, R2, GCS interop, ...). Paths are keys: "ckpt/step100/manifest" is the object of that
// key; leading '/', empty and "." components are dropped and ".." drops the component before
// it, so "/ckpt//x" and "ckpt/./x" name the same object.
//
// What S3 can do, and so what this Storage does (capabilities()):
//   - no rename: Rename is kUnimplemented; commit with Publish (kCreateOnly is a conditional
//     PUT with If-None-Match: *, so exactly one racing creator wins; kReplace is a plain PUT,
//     atomic on S3).
//   - no positional writes: a WritableFile takes writes front to back, each at the offset
//     where the previous one ended (anything else is kUnimplemented naming the path and both
//     offsets). Full parts upload in the background as they fill (multipart, several in
//     parallel, within a memory budget); Sync or Close publishes the object (one PUT when it
//     is smaller than a part); nothing is visible before. A file destroyed without Sync or
//     Close, or closed after an error, publishes nothing and aborts its upload. After Sync the
//     object is published and immutable: later writes fail. kExclusive files fail at open with
//     kAlreadyExists when the key exists, and publish create-only (a racing creator loses).
//   - no directories: a "directory" is a key prefix ending in '/'. CreateDirs and SyncDir do
//     nothing and succeed; Stat says kDirectory when some key lies under the path; ListDir
//     lists the names under it (ListObjectsV2 with delimiter '/'), and of a prefix with no keys
//     returns an empty list (S3 cannot tell an empty directory from a missing one); RemoveDir
//     of an empty or missing prefix succeeds and of a non-empty one fails.
//   - reads: ranged GETs of exactly the bytes asked for, conditional on the ETag seen at open
//     (a file replaced since is kDataLoss, never a mix); long reads run as several GETs in
//     parallel. Map is kUnimplemented.
//   - Remove: HEAD then DELETE, so that a missing key is kNotFound (S3's DELETE itself
//     succeeds either way).
//
// Credentials, region and endpoint come from S3StorageOptions or, where empty, from the
// places the AWS CLI reads (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/config, AWS_ENDPOINT_URL,
// ...): see src/storage/s3/s3_config.h. OpenStorage (storage_uri.h) builds one from a URI.
//
// Thread safety: safe to use from several threads at once.
#ifndef TESSERA_S3_STORAGE_H_
#define TESSERA_S3_STORAGE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

namespace s3 {
class S3Client;
}

// Bounds of S3StorageOptions (and of an msc:// profile's max_concurrency and
// retries.max_attempts): a thread per unit of concurrency, so a typo of 100000 would try to start
// that many threads; beyond these, more buys nothing against one endpoint.
inline constexpr size_t kMaxS3Concurrency = 256;
inline constexpr int kMaxS3Attempts = 10000;

struct S3StorageOptions {
  std::string bucket;
  // Where empty, looked up as the AWS CLI does.
  std::string profile;
  std::string region;
  std::string endpoint_url;  // "http://127.0.0.1:9000"; empty: AWS's, or AWS_ENDPOINT_URL
  std::string access_key_id, secret_access_key, session_token;  // both keys or neither
  std::string addressing_style;  // "path", "virtual", "auto" (empty: the profile's, or auto)
  // Transfers (see s3_client.h): part size (>= 5 MiB), parallel requests, bytes of parts in
  // flight, the size of each ranged GET of a long read.
  uint64_t part_bytes = 32u << 20;
  size_t max_concurrency = 8;  // 1 to kMaxS3Concurrency
  uint64_t max_inflight_bytes = 256u << 20;
  // 32 MiB: a load's reader thread fetches what it will read in reads of this size (one buffer
  // of it per thread); 8 MiB made twice the requests (docs/S3.md, "Reads").
  uint64_t read_chunk_bytes = 32u << 20;
  // Retries of one request, and the time they may take together.
  int max_attempts = 10;  // 1 to kMaxS3Attempts
  std::chrono::milliseconds retry_base_delay{50};
  std::chrono::milliseconds retry_max_delay{5'000};
  std::chrono::milliseconds retry_max_total{120'000};
  std::chrono::milliseconds connect_timeout{10'000};
  std::chrono::milliseconds stall_timeout{30'000};  // no byte moved for this long
  // CURLOPT_RESOLVE entries ("host:port:address").
  std::vector<std::string> resolve;
  bool verify_tls = true;
  std::string ca_bundle;
};

// A multipart upload that was started and neither completed nor aborted (see
// S3Storage::ListIncompleteUploads).
struct IncompleteUpload {
  std::string key;           // of the object it would have written, in the storage's bucket
  std::string upload_id;     // S3's id of the upload
  std::string initiated;     // its start, ISO 8601 as the store wrote it
  int64_t age_seconds = -1;  // since `initiated` by this machine's clock; -1 when it does not parse
};

class S3Storage : public Storage {
 public:
  // Resolves credentials and endpoint (see above) and checks the options; no request is sent.
  static Result<std::shared_ptr<S3Storage>> Open(const S3StorageOptions& options);
  // A storage on `bucket` through an existing client (tests build clients with fault hooks).
  S3Storage(std::shared_ptr<s3::S3Client> client, std::string bucket);
  ~S3Storage() override;

  StorageCapabilities capabilities() const override;
  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override;

  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override;
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  // One ranged GET (bytes 0 to prefix_bytes - 1) opens the object and reads its head: the
  // reply's Content-Range gives the size, its ETag pins the later reads.
  Result<std::unique_ptr<ReadableFile>> NewReadableFileWithPrefix(const std::string& path,
                                                                  size_t prefix_bytes) override;
  Status CreateDirs(const std::string& path) override;
  Result<FileType> Stat(const std::string& path) override;
  Result<std::vector<std::string>> ListDir(const std::string& dir) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Remove(const std::string& path) override;
  // One DELETE (S3's DELETE of a missing key succeeds); a key prefix holds no object of its own
  // name, so nothing under it is touched.
  Status RemoveIfPresent(const std::string& path) override;
  Status RemoveDir(const std::string& path) override;
  Status SyncDir(const std::string& dir) override;

  // The multipart uploads under `dir` started and neither completed nor aborted: what writers
  // that died left behind (their parts are invisible to listings but cost storage), and those
  // of writers still running. Sorted by key.
  Result<std::vector<IncompleteUpload>> ListIncompleteUploads(const std::string& dir);
  // Aborts one of them (its parts are deleted). S3 answers kNotFound (NoSuchUpload) for one that
  // completed or was aborted meanwhile; some servers (moto) accept it.
  Status AbortUpload(const IncompleteUpload& upload);
  // Aborts the multipart uploads under `dir` started more than `older_than` ago. Returns how
  // many it aborted. An upload's age is the store's clock against this machine's: give an age
  // longer than any live save and than the clocks' difference.
  Result<int> AbortIncompleteUploads(const std::string& dir, std::chrono::seconds older_than);

  const std::string& bucket() const { return bucket_; }
  s3::S3Client& client() { return *client_; }
  // The key `path` names (see the header comment), or kInvalidArgument for a path with no
  // key ("" or "/" where a file is needed).
  static std::string KeyOf(const std::string& path);

 private:
  Result<std::string> FileKey(const std::string& path) const;
  // The listing prefix of directory `path`: "" for the root, else "key/".
  static std::string DirPrefix(const std::string& path);
  // The error of an open of `path` (object `key`) that failed with `failed`: a missing object
  // is kNotFound naming both (or the missing bucket's error), anything else `failed` in context.
  Status OpenError(const Status& failed, const std::string& path, const std::string& key);
  // After a 404 on a HEAD (which has no body): whether the bucket itself is missing.
  Status CheckBucket();

  std::shared_ptr<s3::S3Client> client_;
  std::string bucket_;
  std::atomic<bool> bucket_seen_{false};
};

}  // namespace tessera

#endif  // TESSERA_S3_STORAGE_H_
