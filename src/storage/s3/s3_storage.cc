#include "tessera/s3_storage.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/utf8.h"
#include "storage/s3/object_writer.h"
#include "storage/s3/s3_client.h"

namespace tessera {
namespace {

using s3::S3Client;

class S3WritableFile : public WritableFile {
 public:
  S3WritableFile(std::shared_ptr<S3Client> client, std::string bucket, std::string key,
                 std::string path, bool create_only)
      : writer_(std::move(client), std::move(bucket), std::move(key), create_only),
        path_(std::move(path)) {}

  // Publishes nothing unless Sync or Close did (the writer aborts its upload).
  ~S3WritableFile() override = default;

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    TESSERA_RETURN_IF_ERROR(Writable("write to"));
    if (offset != writer_.size()) {
      return Unimplemented("write to " + path_ + " at offset " + std::to_string(offset) +
                           ": objects on S3 are written front to back and the next byte is at "
                           "offset " +
                           std::to_string(writer_.size()) + " (S3 has no positional writes)");
    }
    failed_ = writer_.Append(std::span<const std::byte>(static_cast<const std::byte*>(data), n))
                  .WithContext("writing " + path_);
    return failed_;
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return FailedPrecondition("sync " + path_ + " after Close");
    if (published_) return Status::Ok();
    TESSERA_RETURN_IF_ERROR(Writable("sync"));
    return PublishLocked();
  }

  Status Close() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::Ok();
    closed_ = true;
    if (published_) return Status::Ok();
    if (!failed_.ok()) {
      writer_.Abort().IgnoreError();
      return failed_.WithContext("closing " + path_ + " (not published)");
    }
    return PublishLocked();
  }

  const std::string& path() const override { return path_; }

 private:
  Status Writable(const char* what) const {
    if (closed_) return FailedPrecondition(std::string(what) + " " + path_ + " after Close");
    if (published_) {
      return FailedPrecondition(std::string(what) + " " + path_ +
                                " after Sync published it (an S3 object cannot be appended to)");
    }
    return failed_;
  }

  Status PublishLocked() {
    failed_ = writer_.Finish().WithContext("publishing " + path_);
    published_ = failed_.ok();
    return failed_;
  }

  mutable std::mutex mu_;
  s3::ObjectWriter writer_;
  const std::string path_;
  Status failed_;
  bool published_ = false;
  bool closed_ = false;
};

class S3ReadableFile : public ReadableFile {
 public:
  // `prefix`: the object's first bytes, fetched with the open (NewReadableFileWithPrefix).
  S3ReadableFile(std::shared_ptr<S3Client> client, std::string bucket, std::string key,
                 std::string path, uint64_t size, std::string etag, std::string prefix = {})
      : client_(std::move(client)),
        bucket_(std::move(bucket)),
        key_(std::move(key)),
        path_(std::move(path)),
        size_(size),
        etag_(std::move(etag)),
        prefix_(std::move(prefix)) {}

  Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
    if (offset > size_ || n > size_ - offset) {
      return DataLoss("read of " + path_ + " at offset " + std::to_string(offset) + " length " +
                      std::to_string(n) + " is past the end of the file (size " +
                      std::to_string(size_) + "; truncated?)");
    }
    // What lies in the prefix comes from memory; only the rest is fetched.
    size_t held = 0;
    if (offset < prefix_.size()) {
      held = static_cast<size_t>(std::min<uint64_t>(n, prefix_.size() - offset));
      if (held > 0) std::memcpy(dst, prefix_.data() + offset, held);
      if (held == n) return Status::Ok();
    }
    return client_
        ->GetRange(bucket_, key_, offset + held,
                   std::span<std::byte>(static_cast<std::byte*>(dst) + held, n - held), etag_)
        .WithContext("reading " + path_);
  }

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }

 private:
  std::shared_ptr<S3Client> client_;
  const std::string bucket_, key_, path_;
  const uint64_t size_;
  const std::string etag_;
  const std::string prefix_;  // bytes [0, prefix_.size()) of the object, as of etag_
};

}  // namespace

std::string S3Storage::KeyOf(const std::string& path) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    const std::string part = path.substr(begin, end - begin);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    begin = end + 1;
  }
  std::string key;
  for (const std::string& part : parts) {
    if (!key.empty()) key.push_back('/');
    key += part;
  }
  return key;
}

std::string S3Storage::DirPrefix(const std::string& path) {
  const std::string key = KeyOf(path);
  return key.empty() ? "" : key + "/";
}

Result<std::string> S3Storage::FileKey(const std::string& path) const {
  std::string key = KeyOf(path);
  if (key.empty()) {
    return InvalidArgument("'" + path + "' names no object in bucket " + bucket_ +
                           " (a file needs a key)");
  }
  return key;
}

Result<std::shared_ptr<S3Storage>> S3Storage::Open(const S3StorageOptions& options) {
  if (options.bucket.empty()) return InvalidArgument("S3 storage: no bucket given");
  s3::S3Overrides overrides;
  overrides.profile = options.profile;
  overrides.region = options.region;
  overrides.endpoint_url = options.endpoint_url;
  if (!options.access_key_id.empty() || !options.secret_access_key.empty()) {
    if (options.access_key_id.empty() || options.secret_access_key.empty()) {
      return InvalidArgument("S3 storage: give both access_key_id and secret_access_key");
    }
    overrides.credentials =
        s3::Credentials{options.access_key_id, options.secret_access_key, options.session_token};
  }
  if (!options.addressing_style.empty()) {
    bool ok = false;
    overrides.addressing_style = s3::ParseAddressingStyle(options.addressing_style, &ok);
    if (!ok) {
      return InvalidArgument("S3 storage: addressing_style '" + options.addressing_style +
                             "' is none of path, virtual, auto");
    }
  }
  s3::S3ClientOptions client_options;
  TESSERA_ASSIGN_OR_RETURN(client_options.config, s3::ResolveS3Config(overrides));
  client_options.part_bytes = options.part_bytes;
  client_options.max_concurrency = options.max_concurrency;
  client_options.max_inflight_bytes = options.max_inflight_bytes;
  client_options.read_chunk_bytes = options.read_chunk_bytes;
  client_options.retry = s3::RetryPolicy{options.max_attempts, options.retry_base_delay,
                                         options.retry_max_delay, options.retry_max_total};
  client_options.http.connect_timeout = options.connect_timeout;
  client_options.http.stall_timeout = options.stall_timeout;
  client_options.http.resolve = options.resolve;
  client_options.http.verify_tls = options.verify_tls;
  client_options.http.ca_bundle = options.ca_bundle;
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<S3Client> client,
                           S3Client::Create(std::move(client_options)));
  return std::make_shared<S3Storage>(std::move(client), options.bucket);
}

S3Storage::S3Storage(std::shared_ptr<s3::S3Client> client, std::string bucket)
    : client_(std::move(client)), bucket_(std::move(bucket)) {}

S3Storage::~S3Storage() = default;

StorageCapabilities S3Storage::capabilities() const {
  // A ranged GET is a request (and on moto a read of the whole object): reads fetch what they
  // will need in ranges of read_chunk_bytes.
  return StorageCapabilities{.rename = false,
                             .positional_writes = false,
                             .directory_sync = false,
                             .conditional_create = true,
                             .coalesce_read_bytes = client_->options().read_chunk_bytes,
                             .implicit_directories = true};
}

Status S3Storage::CheckBucket() {
  if (bucket_seen_.load()) return Status::Ok();
  // A listing has a body, so a missing bucket says NoSuchBucket.
  TESSERA_RETURN_IF_ERROR(client_->ListObjectsPage(bucket_, "", "", "", 1).status());
  bucket_seen_.store(true);
  return Status::Ok();
}

Status S3Storage::Publish(const std::string& path, std::span<const std::byte> bytes,
                          PublishMode mode, bool sync) {
  (void)sync;  // a completed PUT is durable on S3
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  const bool create_only = mode == PublishMode::kCreateOnly;
  Status status;
  if (bytes.size() <= client_->PartBytes(1)) {
    status = client_->PutObject(bucket_, key, bytes, create_only);
  } else {
    s3::ObjectWriter writer(client_, bucket_, key, create_only);
    status = writer.Append(bytes);
    if (status.ok()) status = writer.Finish();
  }
  return status.WithContext("publishing " + path);
}

Result<std::unique_ptr<WritableFile>> S3Storage::NewWritableFile(const std::string& path,
                                                                 CreateMode mode) {
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  const bool exclusive = mode != CreateMode::kTruncate;
  if (mode == CreateMode::kExclusive) {
    // Fails early; the create-only publish is what guarantees it.
    Result<s3::ObjectInfo> there = client_->HeadObject(bucket_, key);
    if (there.ok()) {
      return AlreadyExists("open " + path + " for writing as a new file: " +
                           S3Client::Uri(bucket_, key) + " exists");
    }
    if (there.status().code() != StatusCode::kNotFound) {
      return there.status().WithContext("open " + path + " for writing");
    }
    TESSERA_RETURN_IF_ERROR_CTX(CheckBucket(), "open " + path + " for writing");
  }
  return std::unique_ptr<WritableFile>(new S3WritableFile(client_, bucket_, key, path, exclusive));
}

Status S3Storage::OpenError(const Status& failed, const std::string& path, const std::string& key) {
  if (failed.code() != StatusCode::kNotFound) return failed.WithContext("open " + path);
  TESSERA_RETURN_IF_ERROR_CTX(CheckBucket(), "open " + path);
  return NotFound("open " + path + ": No such file or directory (no object " +
                  S3Client::Uri(bucket_, key) + ")");
}

Result<std::unique_ptr<ReadableFile>> S3Storage::NewReadableFile(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  Result<s3::ObjectInfo> info = client_->HeadObject(bucket_, key);
  if (!info.ok()) return OpenError(info.status(), path, key);
  return std::unique_ptr<ReadableFile>(
      new S3ReadableFile(client_, bucket_, key, path, info->size, info->etag));
}

Result<std::unique_ptr<ReadableFile>> S3Storage::NewReadableFileWithPrefix(const std::string& path,
                                                                           size_t prefix_bytes) {
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  Result<s3::ObjectPrefix> head = client_->GetPrefix(bucket_, key, prefix_bytes);
  if (!head.ok()) return OpenError(head.status(), path, key);
  return std::unique_ptr<ReadableFile>(new S3ReadableFile(
      client_, bucket_, key, path, head->info.size, head->info.etag, std::move(head->bytes)));
}

Status S3Storage::CreateDirs(const std::string& path) {
  (void)path;  // directories are key prefixes: nothing to create
  return Status::Ok();
}

Status S3Storage::SyncDir(const std::string& dir) {
  (void)dir;  // nothing to sync: a completed PUT is durable and listed
  return Status::Ok();
}

Result<FileType> S3Storage::Stat(const std::string& path) {
  const std::string key = KeyOf(path);
  if (key.empty()) {
    TESSERA_RETURN_IF_ERROR_CTX(CheckBucket(), "stat " + path);
    return FileType::kDirectory;
  }
  Result<s3::ObjectInfo> info = client_->HeadObject(bucket_, key);
  if (info.ok()) return FileType::kFile;
  if (info.status().code() != StatusCode::kNotFound) {
    return info.status().WithContext("stat " + path);
  }
  TESSERA_ASSIGN_OR_RETURN(s3::ListPage page,
                           client_->ListObjectsPage(bucket_, key + "/", "/", "", 1));
  bucket_seen_.store(true);
  const bool any = !page.objects.empty() || !page.common_prefixes.empty();
  return any ? FileType::kDirectory : FileType::kNotFound;
}

Result<std::vector<std::string>> S3Storage::ListDir(const std::string& dir) {
  const std::string prefix = DirPrefix(dir);
  TESSERA_ASSIGN_OR_RETURN(s3::ListResult listed, client_->ListObjects(bucket_, prefix, "/"));
  bucket_seen_.store(true);
  std::vector<std::string> names;
  for (const s3::ListedObject& o : listed.objects) {
    // A key equal to the prefix is a "directory marker" object ("dir/"), not an entry.
    if (o.key.size() <= prefix.size()) continue;
    std::string name = o.key.substr(prefix.size());  // ListObjects checked the prefix
    // Listed with the delimiter "/", a key below the prefix holds no "/": one that does is a
    // server's mistake, and would name a file in another directory.
    if (name.find('/') != std::string::npos) {
      return DataLoss("listing " + dir + ": the server returned the key " + QuoteBytes(o.key) +
                      " as an entry of the directory, but it lies deeper");
    }
    names.push_back(std::move(name));
  }
  for (const std::string& p : listed.common_prefixes) {
    std::string name = p.substr(prefix.size());
    if (!name.empty() && name.back() == '/') name.pop_back();
    if (!name.empty()) names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (names.empty() && !prefix.empty()) {
    // Nothing under it: a file of that name is not a directory; else an empty listing.
    Result<s3::ObjectInfo> file = client_->HeadObject(bucket_, KeyOf(dir));
    if (file.ok()) return IOError("list " + dir + ": Not a directory (it is an object)");
  }
  return names;
}

Status S3Storage::Rename(const std::string& from, const std::string& to) {
  return Unimplemented("rename " + from + " to " + to +
                       ": S3 has no rename (capabilities().rename is false); publish the "
                       "final object with Publish instead");
}

Status S3Storage::Remove(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  Result<s3::ObjectInfo> info = client_->HeadObject(bucket_, key);
  if (!info.ok()) {
    if (info.status().code() != StatusCode::kNotFound) {
      return info.status().WithContext("remove " + path);
    }
    TESSERA_ASSIGN_OR_RETURN(FileType type, Stat(path));
    if (type == FileType::kDirectory) {
      return IOError("remove " + path + ": Is a directory (keys lie under it)");
    }
    return NotFound("remove " + path + ": No such file or directory (no object " +
                    S3Client::Uri(bucket_, key) + ")");
  }
  return client_->DeleteObject(bucket_, key).WithContext("remove " + path);
}

Status S3Storage::RemoveIfPresent(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const std::string key, FileKey(path));
  return client_->DeleteObject(bucket_, key).WithContext("remove " + path);
}

Status S3Storage::RemoveDir(const std::string& path) {
  const std::string key = KeyOf(path);
  if (key.empty()) return IOError("remove directory " + path + ": the bucket's root");
  TESSERA_ASSIGN_OR_RETURN(FileType type, Stat(path));
  if (type == FileType::kFile) return IOError("remove directory " + path + ": Not a directory");
  if (type == FileType::kDirectory) {
    return IOError("remove directory " + path + ": Directory not empty");
  }
  return Status::Ok();  // an empty directory and a missing one are the same on S3
}

Result<std::vector<IncompleteUpload>> S3Storage::ListIncompleteUploads(const std::string& dir) {
  TESSERA_ASSIGN_OR_RETURN(auto uploads, client_->ListMultipartUploads(bucket_, DirPrefix(dir)));
  const std::time_t now = std::time(nullptr);
  std::vector<IncompleteUpload> out;
  for (const auto& u : uploads) {
    IncompleteUpload upload{.key = u.key, .upload_id = u.upload_id, .initiated = u.initiated};
    if (std::optional<std::time_t> started = s3::ParseIso8601(u.initiated)) {
      upload.age_seconds = std::max<int64_t>(0, now - *started);
    }
    out.push_back(std::move(upload));
  }
  std::sort(out.begin(), out.end(), [](const IncompleteUpload& a, const IncompleteUpload& b) {
    return std::tie(a.key, a.upload_id) < std::tie(b.key, b.upload_id);
  });
  return out;
}

Status S3Storage::AbortUpload(const IncompleteUpload& upload) {
  return client_->AbortMultipartUpload(bucket_, upload.key, upload.upload_id);
}

Result<int> S3Storage::AbortIncompleteUploads(const std::string& dir,
                                              std::chrono::seconds older_than) {
  return client_->AbortIncompleteUploads(bucket_, DirPrefix(dir), older_than);
}

}  // namespace tessera
