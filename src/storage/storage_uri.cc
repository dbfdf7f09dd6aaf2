#include "tessera/storage_uri.h"

#include <cctype>
#include <string_view>

#if TESSERA_HAVE_S3
#include "storage/msc_config.h"
#endif

namespace tessera {
namespace {

using Location = std::pair<std::shared_ptr<Storage>, std::string>;

// "s3" for "s3://..."; "" for a plain path (no "scheme://" prefix).
std::string SchemeOf(const std::string& uri) {
  const size_t sep = uri.find("://");
  if (sep == std::string::npos || sep == 0) return "";
  for (size_t i = 0; i < sep; ++i) {
    const char c = uri[i];
    const bool ok = std::isalpha(static_cast<unsigned char>(c)) ||
                    (i > 0 && (std::isdigit(static_cast<unsigned char>(c)) || c == '+' ||
                               c == '-' || c == '.'));
    if (!ok) return "";
  }
  std::string scheme = uri.substr(0, sep);
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return scheme;
}

Result<Location> OpenFile(const std::string& uri) {
  std::string path = uri.substr(7);  // "file://"
  if (path.starts_with("localhost/")) path = path.substr(9);
  if (!path.starts_with("/")) {
    return InvalidArgument("'" + uri + "': a file URI takes an absolute path (file:///dir)");
  }
  return Location(NewPosixStorage(), path);
}

#if TESSERA_HAVE_S3
// "bucket/some/prefix" -> {"bucket", "some/prefix"}.
std::pair<std::string, std::string> SplitBucket(const std::string& rest) {
  const size_t slash = rest.find('/');
  if (slash == std::string::npos) return {rest, ""};
  return {rest.substr(0, slash), S3Storage::KeyOf(rest.substr(slash + 1))};
}

Status CheckBucketName(const std::string& bucket, const std::string& uri) {
  if (bucket.empty()) return InvalidArgument("'" + uri + "' names no bucket (s3://bucket/path)");
  for (char c : bucket) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' ||
          std::isupper(static_cast<unsigned char>(c)))) {
      return InvalidArgument("'" + uri + "': '" + bucket + "' is not a bucket name");
    }
  }
  return Status::Ok();
}

Result<Location> OpenS3(const std::string& bucket, const std::string& path,
                        const S3StorageOptions& base, const std::string& uri) {
  TESSERA_RETURN_IF_ERROR(CheckBucketName(bucket, uri));
  S3StorageOptions options = base;
  options.bucket = bucket;
  Result<std::shared_ptr<S3Storage>> storage = S3Storage::Open(options);
  if (!storage.ok()) return storage.status().WithContext("opening " + uri);
  return Location(*storage, path);
}

Result<uint64_t> ParseBytes(const std::string& s, const std::string& what) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0')
    return InvalidArgument(what + " '" + s + "' is not a whole number");
  return static_cast<uint64_t>(v);
}

// PyYAML's booleans (YAML 1.1, what MSC reads its config with): "no" and "off" are false.
std::optional<bool> YamlBool(const std::string& v) {
  for (std::string_view t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"}) {
    if (v == t) return true;
  }
  for (std::string_view f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"}) {
    if (v == f) return false;
  }
  return std::nullopt;
}

// MSC's FileBasedCredentials: a JSON file in the AWS credential_process format ({"Version": 1,
// "AccessKeyId": ..., "SecretAccessKey": ..., "SessionToken": ...}), read once when the
// storage opens (MSC re-reads it when asked to refresh; tessera's client does not refresh).
Status ReadCredentialFile(const std::string& file, const std::string& where,
                          S3StorageOptions& options) {
  Result<MscFileCredentials> read = ReadMscCredentialFile(file);
  if (!read.ok()) return read.status().WithContext(where);
  options.access_key_id = read->access_key_id;
  options.secret_access_key = read->secret_access_key;
  options.session_token = read->session_token;
  return Status::Ok();
}

// An MSC S3 profile's settings over `options` (the names are boto3's, as MSC passes them on).
Status ApplyMscS3Profile(const MscProfile& p, S3StorageOptions& options, std::string& base_path) {
  const std::string where = "MSC profile '" + p.name + "' in " + p.config_file;
  auto get = [&](const std::string& key) {
    auto it = p.options.find(key);
    return it == p.options.end() ? std::string() : it->second;
  };
  base_path = get("base_path");
  if (!get("endpoint_url").empty()) options.endpoint_url = get("endpoint_url");
  if (!get("region_name").empty()) options.region = get("region_name");
  if (!get("profile_name").empty()) options.profile = get("profile_name");
  if (!get("s3.addressing_style").empty()) options.addressing_style = get("s3.addressing_style");
  if (const std::string verify = get("verify"); !verify.empty()) {
    if (const std::optional<bool> b = YamlBool(verify); b) {
      options.verify_tls = *b;
    } else {
      options.ca_bundle = verify;  // a CA bundle's path
    }
  }
  if (!get("signature_version").empty()) {
    return Unimplemented(where + ": signature_version '" + get("signature_version") +
                         "' is not supported (tessera signs every request with SigV4)");
  }
  if (const std::string v = get("multipart_chunksize"); !v.empty()) {
    TESSERA_ASSIGN_OR_RETURN(options.part_bytes, ParseBytes(v, where + ": multipart_chunksize"));
  }
  // Each a whole number within bounds, or an error naming the file, the field and the range.
  auto bounded = [&](const std::string& field, uint64_t max) -> Result<uint64_t> {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t n, ParseBytes(get(field), where + ": " + field));
    if (n < 1 || n > max) {
      return InvalidArgument(where + ": " + field + " " + std::to_string(n) + " is outside [1, " +
                             std::to_string(max) + "]");
    }
    return n;
  };
  if (!get("max_concurrency").empty()) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t n, bounded("max_concurrency", kMaxS3Concurrency));
    options.max_concurrency = static_cast<size_t>(n);
  }
  // botocore's retries: max_attempts counts the retries after the first try (0: none);
  // total_max_attempts counts every try. tessera's max_attempts counts every try.
  if (!get("retries.total_max_attempts").empty()) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t n,
                             bounded("retries.total_max_attempts", kMaxS3Attempts));
    options.max_attempts = static_cast<int>(n);
  } else if (!get("retries.max_attempts").empty()) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t n, ParseBytes(get("retries.max_attempts"),
                                                          where + ": retries.max_attempts"));
    if (n > kMaxS3Attempts - 1) {
      return InvalidArgument(where + ": retries.max_attempts " + std::to_string(n) +
                             " is outside [0, " + std::to_string(kMaxS3Attempts - 1) + "]");
    }
    options.max_attempts = static_cast<int>(n) + 1;
  }
  if (p.credentials_type.empty()) return Status::Ok();  // the AWS default chain
  if (p.credentials_type == "FileBasedCredentials") {
    auto it = p.credentials_options.find("credential_file_path");
    if (it == p.credentials_options.end() || it->second.empty()) {
      return InvalidArgument(where + ": FileBasedCredentials needs credential_file_path");
    }
    return ReadCredentialFile(it->second, where, options);
  }
  if (p.credentials_type != "S3Credentials") {
    return Unimplemented(where + " uses credentials provider '" + p.credentials_type +
                         "'; tessera reads S3Credentials (access_key, secret_key, session_token), "
                         "FileBasedCredentials (credential_file_path) or, without a "
                         "credentials_provider, the AWS environment and profiles");
  }
  auto cred = [&](const std::string& key) {
    auto it = p.credentials_options.find(key);
    return it == p.credentials_options.end() ? std::string() : it->second;
  };
  options.access_key_id = cred("access_key");
  options.secret_access_key = cred("secret_key");
  options.session_token = cred("session_token");
  if (options.access_key_id.empty() || options.secret_access_key.empty()) {
    return InvalidArgument(where + ": S3Credentials needs access_key and secret_key");
  }
  return Status::Ok();
}

// A "." or ".." segment of `path`, or "". MSC keeps them in object keys as written, where
// tessera's keys resolve them: such a path would name other objects than MSC's.
std::string DotSegment(const std::string& path) {
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    const std::string_view part(path.data() + begin, end - begin);
    if (part == "." || part == "..") return std::string(part);
    begin = end + 1;
  }
  return "";
}

Result<Location> OpenMsc(const std::string& uri, const OpenStorageOptions& options) {
  const std::string rest = uri.substr(6);  // "msc://"
  const size_t slash = rest.find('/');
  const std::string name = rest.substr(0, slash);
  const std::string path = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (name.empty()) return InvalidArgument("'" + uri + "' names no profile (msc://profile/path)");
  if (const std::string dot = DotSegment(path); !dot.empty()) {
    return InvalidArgument("'" + uri + "' has a '" + dot +
                           "' segment: multi-storage-client keeps it in the object key as "
                           "written, tessera would resolve it; name the path without it");
  }
  Result<MscProfile> found = FindMscProfile(name, options.msc_config);
  if (!found.ok()) {
    if (found.status().code() == StatusCode::kNotFound) {
      // MSC's implicit profiles: the local file system, and an S3 bucket with the AWS
      // environment's endpoint and credentials (msc://_s3-bucket/key, as s3://bucket/key).
      if (name == "__filesystem__") return Location(NewPosixStorage(), "/" + path);
      if (name.starts_with("_s3-") && name.size() > 4) {
        return OpenS3(name.substr(4), S3Storage::KeyOf(path), options.s3, uri);
      }
    }
    return found.status().WithContext("opening " + uri);
  }
  const MscProfile& profile = *found;
  const std::string& type = profile.provider_type;
  if (type == "file") {
    auto it = profile.options.find("base_path");
    const std::string base = it == profile.options.end() ? "/" : it->second;
    return Location(NewPosixStorage(), JoinPath(base, path));
  }
  if (type != "s3" && type != "s8k" && type != "gcs_s3") {
    return Unimplemented("opening " + uri + ": MSC profile '" + name + "' (in " +
                         profile.config_file + ") uses storage provider '" + type +
                         "', which tessera cannot open; it opens S3 profiles (types s3, s8k, "
                         "gcs_s3) and file profiles");
  }
  S3StorageOptions s3 = options.s3;
  std::string base_path;
  TESSERA_RETURN_IF_ERROR_CTX(ApplyMscS3Profile(profile, s3, base_path), "opening " + uri);
  if (const std::string dot = DotSegment(base_path); !dot.empty()) {
    return InvalidArgument("opening " + uri + ": MSC profile '" + name + "' in " +
                           profile.config_file + " has a '" + dot +
                           "' segment in its base_path, which multi-storage-client keeps in "
                           "object keys as written and tessera would resolve");
  }
  // As MSC: leading slashes of the base_path do not count ("/bucket/prefix").
  base_path.erase(0, base_path.find_first_not_of('/'));
  auto [bucket, prefix] = SplitBucket(base_path);
  if (bucket.empty()) {
    return InvalidArgument("opening " + uri + ": MSC profile '" + name + "' in " +
                           profile.config_file + " has no base_path (bucket[/prefix])");
  }
  return OpenS3(bucket, S3Storage::KeyOf(prefix + "/" + path), s3, uri);
}

#else
// Built without the S3 Storage (TESSERA_WITH_S3 off).
Result<Location> WithoutS3(const std::string& uri) {
  return Unimplemented(
      "cannot open '" + uri +
      "': this tessera was built without its S3 Storage (CMake option "
      "TESSERA_WITH_S3; it needs libcurl, OpenSSL, pugixml and yaml-cpp: on Debian "
      "libcurl4-openssl-dev libssl-dev libpugixml-dev libyaml-cpp-dev, then "
      "rebuild or reinstall tessera)");
}
#endif  // TESSERA_HAVE_S3

}  // namespace

Result<std::pair<std::shared_ptr<Storage>, std::string>> OpenStorage(
    const std::string& uri, const OpenStorageOptions& options) {
  if (uri.empty()) return InvalidArgument("an empty path or URI");
  // "msc:/profile/path": a msc:// URI whose slashes a path library collapsed (pathlib does);
  // MSC reads it as msc://profile/path.
  if (uri.starts_with("msc:/") && !uri.starts_with("msc://")) {
    return OpenStorage("msc://" + uri.substr(5), options);
  }
  const std::string scheme = SchemeOf(uri);
  if (scheme.empty()) return Location(NewPosixStorage(), uri);
  if (scheme == "file") return OpenFile(uri);
#if TESSERA_HAVE_S3
  if (scheme == "s3") {
    auto [bucket, path] = SplitBucket(uri.substr(5));
    return OpenS3(bucket, path, options.s3, uri);
  }
  if (scheme == "msc") return OpenMsc(uri, options);
#else
  if (scheme == "s3" || scheme == "msc") return WithoutS3(uri);
#endif
  return Unimplemented("'" + uri +
                       "': tessera opens plain paths and file://, s3:// and msc:// "
                       "URIs, not " +
                       scheme + "://");
}

Result<std::pair<std::shared_ptr<Storage>, std::string>> OpenStorage(const std::string& uri) {
  return OpenStorage(uri, OpenStorageOptions{});
}

Result<std::pair<std::shared_ptr<Storage>, std::string>> ResolveStorage(
    const std::string& path, std::shared_ptr<Storage> storage) {
  if (storage) return Location(std::move(storage), path);
  return OpenStorage(path);
}

}  // namespace tessera
