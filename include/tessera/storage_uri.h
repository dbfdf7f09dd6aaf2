// OpenStorage: from a location a user typed to the Storage that holds it and the path inside.
//
//   /ckpt/step100, ckpt, file:///ckpt   the local file system (NewPosixStorage), that path
//   s3://bucket/ckpt/step100            an S3Storage on `bucket`, path "ckpt/step100"
//                                       (credentials, region and endpoint as the AWS CLI
//                                       finds them: AWS_ACCESS_KEY_ID, AWS_PROFILE,
//                                       AWS_ENDPOINT_URL, ~/.aws/config, ...)
//   msc://profile/ckpt/step100          through Megatron's multi-storage-client configuration
//                                       (MSC_CONFIG or its default files): an S3 profile
//                                       (types s3, s8k, gcs_s3) opens an S3Storage on the
//                                       bucket of its base_path, with its endpoint_url,
//                                       region_name, profile_name, S3Credentials, verify and
//                                       s3.addressing_style; a file profile opens the local file
//                                       system under its base_path; any other provider is an
//                                       error naming the profile and the provider.
//
// The returned path is what Save, Load and the other entry points take with that storage.
#ifndef TESSERA_STORAGE_URI_H_
#define TESSERA_STORAGE_URI_H_

#include <memory>
#include <string>
#include <utility>

#include "tessera/s3_storage.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

struct OpenStorageOptions {
  // Settings for S3 storages (transfer sizes, retries, timeouts; where empty, credentials and
  // endpoint are looked up). The URI's bucket, and an MSC profile's settings, take precedence.
  S3StorageOptions s3;
  // The multi-storage-client config file for msc:// URIs; empty: MSC_CONFIG or MSC's default
  // locations.
  std::string msc_config;
};

Result<std::pair<std::shared_ptr<Storage>, std::string>> OpenStorage(
    const std::string& uri, const OpenStorageOptions& options);
Result<std::pair<std::shared_ptr<Storage>, std::string>> OpenStorage(const std::string& uri);

// What every entry point that takes a path and an optional storage does with them (Save,
// AsyncSave, Load, ReadMetadata, IsCommitted, Verify, Finalize, RemoveKeys, Convert,
// CheckpointManager): a storage given is used with `path` as it is (the path is a path inside
// that storage, never a URI); without one (null), `path` goes through OpenStorage, so
// "s3://bucket/ckpt", "msc://profile/ckpt" and "file:///ckpt" reach their stores and a plain path
// the local file system. Errors are OpenStorage's (a URI of an unknown scheme, a bucket that
// cannot be opened, an MSC profile that is not S3), naming the URI.
Result<std::pair<std::shared_ptr<Storage>, std::string>> ResolveStorage(
    const std::string& path, std::shared_ptr<Storage> storage);

}  // namespace tessera

#endif  // TESSERA_STORAGE_URI_H_
