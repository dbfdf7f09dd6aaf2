#include "storage/msc_config.h"

#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

namespace tessera {
namespace {

// A configuration file is the user's own, but it is still bounded.
constexpr size_t kMaxConfigBytes = 4u << 20;

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The first "${...}" or "$NAME" left in `s`, or "": what MSC refuses as an unresolved
// environment variable after expanding (utils.expand_env_vars: \$\{[^}]+\}|\$[A-Za-z_]\w*).
std::string Unresolved(const std::string& s) {
  for (size_t i = s.find('$'); i != std::string::npos; i = s.find('$', i + 1)) {
    if (i + 1 >= s.size()) break;
    const char c = s[i + 1];
    if (c == '{') {
      const size_t close = s.find('}', i + 2);
      if (close != std::string::npos && close > i + 2) return s.substr(i, close - i + 1);
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = i + 2;
      while (end < s.size() &&
             (std::isalnum(static_cast<unsigned char>(s[end])) || s[end] == '_')) {
        ++end;
      }
      return s.substr(i, end - i);
    }
  }
  return "";
}

// ${VAR} and $VAR from the environment, as Python's os.path.expandvars (what MSC calls): an
// unset one is left as written, and Checked() below then refuses it as MSC does.
std::string Expand(const std::string& s, const s3::GetEnv& getenv) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (s[i] != '$' || i + 1 >= s.size()) {
      out.push_back(s[i++]);
      continue;
    }
    size_t begin = i + 1, end;
    const bool braced = s[begin] == '{';
    if (braced) {
      end = s.find('}', begin);
      if (end == std::string::npos) {
        out.append(s, i, std::string::npos);
        break;
      }
      ++begin;
    } else {
      end = begin;
      while (end < s.size() &&
             (std::isalnum(static_cast<unsigned char>(s[end])) || s[end] == '_')) {
        ++end;
      }
    }
    const std::string name = s.substr(begin, end - begin);
    const size_t next = braced ? end + 1 : end;
    std::optional<std::string> value = name.empty() ? std::nullopt : getenv(name);
    out += value ? *value : s.substr(i, next - i);
    i = next;
  }
  return out;
}

// `s` with its environment variables expanded, or the error MSC gives for one that is unset
// (`where` names the file and the field).
Result<std::string> Checked(const std::string& s, const s3::GetEnv& getenv,
                            const std::string& where) {
  std::string expanded = Expand(s, getenv);
  if (const std::string name = Unresolved(expanded); !name.empty()) {
    return InvalidArgument(where + ": unresolved environment variable " + name + " in '" + s +
                           "' (multi-storage-client refuses it too)");
  }
  return expanded;
}

// Flattens the scalars of `node` into `out` ("a.b" for nested maps; sequences are skipped).
Status Flatten(const YAML::Node& node, const std::string& prefix, const s3::GetEnv& getenv,
               const std::string& where, std::map<std::string, std::string>& out) {
  if (!node.IsDefined() || !node.IsMap()) return Status::Ok();  // a missing key is undefined
  for (const auto& item : node) {
    const std::string key = prefix + item.first.as<std::string>();
    if (item.second.IsScalar()) {
      TESSERA_ASSIGN_OR_RETURN(out[key],
                               Checked(item.second.as<std::string>(), getenv, where + ", " + key));
    } else if (item.second.IsMap()) {
      TESSERA_RETURN_IF_ERROR(Flatten(item.second, key + ".", getenv, where, out));
    }
  }
  return Status::Ok();
}

// Whether two parsed nodes hold the same data, as Python's == on the loaded dicts (MSC's test
// for a profile defined twice): maps whatever their order, sequences in order, scalars by text.
bool SameData(const YAML::Node& a, const YAML::Node& b) {
  if (a.Type() != b.Type()) return false;
  switch (a.Type()) {
    case YAML::NodeType::Scalar:
      return a.Scalar() == b.Scalar();
    case YAML::NodeType::Sequence:
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i) {
        if (!SameData(a[i], b[i])) return false;
      }
      return true;
    case YAML::NodeType::Map:
      if (a.size() != b.size()) return false;
      for (const auto& item : a) {
        const YAML::Node other = b[item.first.as<std::string>()];
        if (!other || !SameData(item.second, other)) return false;
      }
      return true;
    default:
      return true;  // both null or both undefined
  }
}

Result<YAML::Node> Load(const std::string& path) {
  // Bounded while reading: an `include:` of /dev/zero must not fill memory first.
  Result<std::string> text = s3::ReadBoundedFile(path, kMaxConfigBytes, "MSC config");
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return IOErrorFromErrno("reading MSC config " + path, ENOENT);
    }
    return text.status();
  }
  try {
    // yaml-cpp reports errors by exception; they stop here.
    YAML::Node root = YAML::Load(*text);
    if (!root.IsNull() && !root.IsMap()) {
      return InvalidArgument("MSC config " + path + " is not a mapping of sections");
    }
    return root;
  } catch (const std::exception& e) {
    return InvalidArgument("malformed MSC config " + path + ": " + e.what());
  }
}

// The profiles of `root` and of the files it includes.
Result<std::map<std::string, YAML::Node>> Profiles(const YAML::Node& root, const std::string& path,
                                                   bool allow_include, const s3::GetEnv& getenv) {
  std::map<std::string, YAML::Node> profiles;
  try {
    if (const YAML::Node p = root["profiles"]; p && p.IsMap()) {
      for (const auto& item : p) profiles[item.first.as<std::string>()] = item.second;
    }
    const YAML::Node include = root["include"];
    if (!include) return profiles;
    if (!allow_include) {
      return InvalidArgument("MSC config " + path + ": an included file cannot include others");
    }
    if (!include.IsSequence()) {
      return InvalidArgument("MSC config " + path + ": `include` is not a list of files");
    }
    for (const auto& entry : include) {
      // As MSC: no environment variables in include paths; relative to the including file.
      std::string file = entry.as<std::string>();
      if (!file.starts_with("/")) file = Dirname(path) + "/" + file;
      TESSERA_ASSIGN_OR_RETURN(YAML::Node included, Load(file));
      TESSERA_ASSIGN_OR_RETURN(auto more, Profiles(included, file, false, getenv));
      for (auto& [name, node] : more) {
        auto it = profiles.find(name);
        if (it != profiles.end() && !SameData(it->second, node)) {
          return InvalidArgument("MSC config: profile '" + name + "' is defined differently in " +
                                 path + " and " + file);
        }
        profiles[name] = node;
      }
    }
  } catch (const std::exception& e) {
    return InvalidArgument("malformed MSC config " + path + ": " + e.what());
  }
  return profiles;
}

}  // namespace

Result<MscFileCredentials> ReadMscCredentialFile(const std::string& path) {
  const std::string what = "FileBasedCredentials file " + path;
  Result<std::string> text = s3::ReadBoundedFile(path, 1 << 20, "credential file");
  if (!text.ok()) return text.status().WithContext(what);
  MscFileCredentials out;
  try {
    // JSON is YAML; yaml-cpp reports errors by exception, which stop here.
    const YAML::Node root = YAML::Load(*text);
    if (!root.IsMap()) return InvalidArgument(what + " is not a JSON object");
    auto field = [&](const char* name) {
      const YAML::Node v = root[name];
      return v && v.IsScalar() ? v.Scalar() : std::string();
    };
    if (field("Version") != "1") {
      return InvalidArgument(what + " has Version '" + field("Version") + "', not 1");
    }
    out.access_key_id = field("AccessKeyId");
    out.secret_access_key = field("SecretAccessKey");
    out.session_token = field("SessionToken");
  } catch (const std::exception& e) {
    return InvalidArgument("malformed " + what + ": " + e.what());
  }
  if (out.access_key_id.empty() || out.secret_access_key.empty()) {
    return InvalidArgument(what + " lacks AccessKeyId or SecretAccessKey");
  }
  return out;
}

std::vector<std::string> MscConfigSearchPaths(const s3::GetEnv& getenv) {
  std::vector<std::string> paths;
  auto both = [&](const std::string& stem) {
    paths.push_back(stem + ".yaml");
    paths.push_back(stem + ".json");
  };
  if (auto v = getenv("MSC_CONFIG"); v) paths.push_back(*v);
  if (auto v = getenv("XDG_CONFIG_HOME"); v && !v->empty()) both(*v + "/msc/config");
  if (auto home = getenv("HOME"); home && !home->empty()) {
    both(*home + "/.msc_config");
    both(*home + "/.config/msc/config");
  }
  std::string dirs = getenv("XDG_CONFIG_DIRS").value_or("");
  if (dirs.empty()) dirs = "/etc/xdg";
  std::istringstream in(dirs);
  for (std::string dir; std::getline(in, dir, ':');) {
    if (!dir.empty()) both(dir + "/msc/config");
  }
  both("/etc/msc_config");
  return paths;
}

Result<MscProfile> FindMscProfile(const std::string& name, const std::string& config_path,
                                  const s3::GetEnv& getenv) {
  std::string path = config_path;
  if (path.empty()) {
    const std::vector<std::string> candidates = MscConfigSearchPaths(getenv);
    // MSC_CONFIG set to an empty value or a directory: MSC fails to read it; so does tessera
    // rather than fall back to another file than MSC's.
    if (auto v = getenv("MSC_CONFIG"); v) {
      struct stat st;
      if (v->empty() || (::stat(v->c_str(), &st) == 0 && !S_ISREG(st.st_mode))) {
        return InvalidArgument("MSC_CONFIG is set to '" + *v +
                               "', which is not a file (unset it to search the default paths)");
      }
    }
    for (const std::string& candidate : candidates) {
      if (Exists(candidate)) {
        path = candidate;
        break;
      }
    }
    if (path.empty()) {
      std::string searched;
      for (const std::string& c : candidates) searched += (searched.empty() ? "" : ", ") + c;
      return NotFound("msc://" + name +
                      "/...: no multi-storage-client config found (set "
                      "MSC_CONFIG; searched " +
                      searched + ")");
    }
  } else if (!Exists(path)) {
    return NotFound("MSC config " + path + " does not exist");
  }
  TESSERA_ASSIGN_OR_RETURN(YAML::Node root, Load(path));
  TESSERA_ASSIGN_OR_RETURN(auto profiles, Profiles(root, path, true, getenv));
  auto it = profiles.find(name);
  if (it == profiles.end()) {
    std::string known;
    for (const auto& [n, node] : profiles) known += (known.empty() ? "" : ", ") + n;
    return NotFound("MSC profile '" + name + "' is not in " + path +
                    (known.empty() ? " (it has no profiles)" : " (its profiles: " + known + ")"));
  }
  MscProfile profile;
  profile.name = name;
  profile.config_file = path;
  try {
    const YAML::Node& node = it->second;
    // Features that change which objects a path names, or where reads come from: tessera
    // refuses them by name rather than address other objects than MSC would.
    for (const char* feature :
         {"provider_bundle", "storage_provider_profiles", "metadata_provider", "replicas"}) {
      const YAML::Node value = node[feature];
      if (value && !value.IsNull() && !(value.IsSequence() && value.size() == 0)) {
        return Unimplemented("MSC profile '" + name + "' in " + path + " uses " + feature +
                             ", which tessera does not support (it opens a profile's "
                             "storage_provider directly)");
      }
    }
    const YAML::Node provider = node["storage_provider"];
    if (!provider || !provider["type"]) {
      return InvalidArgument("MSC profile '" + name + "' in " + path +
                             " has no storage_provider type");
    }
    const std::string where = "MSC profile '" + name + "' in " + path;
    TESSERA_ASSIGN_OR_RETURN(
        profile.provider_type,
        Checked(provider["type"].as<std::string>(), getenv, where + ", storage_provider.type"));
    TESSERA_RETURN_IF_ERROR(Flatten(provider["options"], "", getenv,
                                    where + ", storage_provider.options", profile.options));
    if (const YAML::Node credentials = node["credentials_provider"]; credentials) {
      if (credentials["type"]) {
        TESSERA_ASSIGN_OR_RETURN(profile.credentials_type,
                                 Checked(credentials["type"].as<std::string>(), getenv,
                                         where + ", credentials_provider.type"));
      }
      TESSERA_RETURN_IF_ERROR(Flatten(credentials["options"], "", getenv,
                                      where + ", credentials_provider.options",
                                      profile.credentials_options));
    }
  } catch (const std::exception& e) {
    return InvalidArgument("malformed MSC profile '" + name + "' in " + path + ": " + e.what());
  }
  return profile;
}

}  // namespace tessera
