// Megatron's multi-storage-client (MSC) configuration, read for `msc://profile/path` URIs: the
// YAML (or JSON) file that names profiles, each with a storage provider (its type and options)
// and an optional credentials provider.
//
// Found as MSC finds it: $MSC_CONFIG, else the first of ${XDG_CONFIG_HOME}/msc/config.{yaml,json},
// ~/.msc_config.{yaml,json}, ~/.config/msc/config.{yaml,json},
// ${XDG_CONFIG_DIRS:-/etc/xdg}/msc/config.{yaml,json}, /etc/msc_config.{yaml,json}; MSC_CONFIG
// set to an empty value or a directory is an error, as in MSC. Strings of the profile read get
// ${VAR} and $VAR expanded from the environment; an unset one is an error naming it, as in MSC.
// The top-level `include` list merges the profiles of other files (paths as written, no
// variables, relative to the including file; no nested includes; one name defined with
// different data twice is an error). Profile features that change which objects a path names
// (metadata_provider, replicas, provider bundles, several backends) are refused by name. Checked
// against multi-storage-client 1.3.1 itself by python/tests/test_msc.py.
//
// Reference: multi-storage-client's docs/src/references/configuration.rst and
// multistorageclient/config.py (read_msc_config, _find_config_file_paths).
#ifndef TESSERA_STORAGE_MSC_CONFIG_H_
#define TESSERA_STORAGE_MSC_CONFIG_H_

#include <map>
#include <string>
#include <vector>

#include "storage/s3/s3_config.h"
#include "tessera/status.h"

namespace tessera {

struct MscProfile {
  std::string name;
  std::string config_file;    // where it was found
  std::string provider_type;  // storage_provider.type: "s3", "file", "azure", ...
  // storage_provider.options, scalars only, nested maps flattened with '.':
  // {"base_path": "bucket/prefix", "s3.addressing_style": "path", ...}
  std::map<std::string, std::string> options;
  std::string credentials_type;  // credentials_provider.type, "" when absent
  std::map<std::string, std::string> credentials_options;
};

// MSC's FileBasedCredentials: a JSON file in the AWS credential_process format
// ({"Version": 1, "AccessKeyId": ..., "SecretAccessKey": ..., "SessionToken": ...}).
struct MscFileCredentials {
  std::string access_key_id, secret_access_key, session_token;
};
// Errors name the file and what is wrong with it (missing, not an object, Version not 1, no
// AccessKeyId or SecretAccessKey).
Result<MscFileCredentials> ReadMscCredentialFile(const std::string& path);

// The files searched, in order (what an error names when none exists).
std::vector<std::string> MscConfigSearchPaths(const s3::GetEnv& getenv);

// Profile `name` of the MSC configuration: `config_path` when given, else the search above.
// kNotFound names the profile and the file (or the paths searched); a malformed file is
// kInvalidArgument naming it.
Result<MscProfile> FindMscProfile(const std::string& name, const std::string& config_path = "",
                                  const s3::GetEnv& getenv = s3::ProcessEnv());

}  // namespace tessera

#endif  // TESSERA_STORAGE_MSC_CONFIG_H_
