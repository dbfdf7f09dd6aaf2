// Where an S3 client's credentials, region and endpoint come from: the places the AWS CLI and
// SDKs read, in their order.
//
//   profile      the explicit one (S3Overrides::profile, e.g. an MSC profile's profile_name),
//                else AWS_PROFILE, else AWS_DEFAULT_PROFILE, else "default"
//   credentials  explicit ones; else, unless the profile was explicit, AWS_ACCESS_KEY_ID +
//                AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN); else the profile's section of
//                the credentials file (AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials); else
//                aws_access_key_id etc. in its section of the config file (AWS_CONFIG_FILE,
//                ~/.aws/config)
//   region       explicit; AWS_REGION; AWS_DEFAULT_REGION; the profile's `region`; us-east-1
//   endpoint     explicit; AWS_ENDPOINT_URL_S3; AWS_ENDPOINT_URL; the profile's `services`
//                section's `s3 = endpoint_url = ...`; the profile's `endpoint_url`; AWS's
//                https://s3.<region>.amazonaws.com. AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true
//                skips the variables and the files.
//   addressing   explicit; the profile's `s3 = addressing_style = path|virtual|auto`; auto
//
// Not supported (a clear error names the setting): instance metadata (IMDS), SSO,
// credential_process and role assumption (role_arn).
//
// Thread safety: free functions over values.
#ifndef TESSERA_STORAGE_S3_S3_CONFIG_H_
#define TESSERA_STORAGE_S3_S3_CONFIG_H_

#include <functional>
#include <map>
#include <optional>
#include <string>

#include "storage/s3/sigv4.h"
#include "tessera/status.h"

namespace tessera::s3 {

enum class AddressingStyle {
  // Virtual-hosted (https://bucket.s3.region.amazonaws.com/key) on AWS's own endpoints when
  // the bucket name allows it; path-style (https://endpoint/bucket/key) on a custom endpoint,
  // which MinIO, Ceph RGW and moto expect.
  kAuto,
  kPath,
  kVirtual,
};

// What the caller fixes; empty fields are looked up.
struct S3Overrides {
  std::string profile;
  std::optional<Credentials> credentials;
  std::string region;
  std::string endpoint_url;
  std::optional<AddressingStyle> addressing_style;
};

struct S3Config {
  Credentials credentials;
  std::string credentials_source;  // "environment", "/root/.aws/credentials [default]", ...
  std::string profile;
  std::string region;
  std::string endpoint_url;  // "" for AWS's own endpoint of `region`
  AddressingStyle addressing_style = AddressingStyle::kAuto;
};

// Reads the environment through `getenv` (tests pass their own).
using GetEnv = std::function<std::optional<std::string>(const std::string& name)>;
GetEnv ProcessEnv();

// `url` with its user-info (the "user:password@" of "http://user:password@host/") replaced by
// "***@": what every message that names an endpoint URL prints, so that a credential written
// into the URL never reaches a log.
std::string RedactUrl(std::string_view url);

// The whole content of the file `path`, read with a bound: more than `max_bytes` is
// kInvalidArgument naming `what` and the path, found while reading (a config that names
// /dev/zero, or a huge file, never fills memory). kNotFound when it does not exist.
Result<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes,
                                    const std::string& what);

Result<S3Config> ResolveS3Config(const S3Overrides& overrides = {},
                                 const GetEnv& getenv = ProcessEnv());

// An AWS-style INI file: sections of `key = value` lines, and nested keys under a key with an
// empty value (indented lines, as the config file's `s3 =` block), flattened to "s3.key".
// Hand-written: generic INI parsers (Debian's inih) fold indented lines into the previous
// value instead of nesting them. Lines are '#' or ';' comments, sections, keys or blank; a
// malformed line is an error naming the file and line.
using IniFile = std::map<std::string, std::map<std::string, std::string>>;
Result<IniFile> ParseAwsIni(const std::string& text, const std::string& file_name);

AddressingStyle ParseAddressingStyle(const std::string& s, bool* ok);

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_S3_CONFIG_H_
