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

// ${VAR} and $VAR from the environment; unset ones are left as written (as MSC does).
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

// Flattens the scalars of `node` into `out` ("a.b" for nested maps; sequences are skipped).
void Flatten(const YAML::Node& node, const std::string& prefix, const s3::GetEnv& getenv,
             std::map<std::string, std::string>& out) {
  if (!node.IsDefined() || !node.IsMap()) return;  // a missing key is an undefined node
  for (const auto& item : node) {
    const std::string key = prefix + item.first.as<std::string>();
    if (item.second.IsScalar()) {
      out[key] = Expand(item.second.as<std::string>(), getenv);
    } else if (item.second.IsMap()) {
      Flatten(item.second, key + ".", getenv, out);
    }
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
      std::string file = Expand(entry.as<std::string>(), getenv);
      if (!file.starts_with("/")) file = Dirname(path) + "/" + file;
      TESSERA_ASSIGN_OR_RETURN(YAML::Node included, Load(file));
      TESSERA_ASSIGN_OR_RETURN(auto more, Profiles(included, file, false, getenv));
      for (auto& [name, node] : more) {
        auto it = profiles.find(name);
        if (it != profiles.end() && YAML::Dump(it->second) != YAML::Dump(node)) {
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

std::vector<std::string> MscConfigSearchPaths(const s3::GetEnv& getenv) {
  std::vector<std::string> paths;
  auto both = [&](const std::string& stem) {
    paths.push_back(stem + ".yaml");
    paths.push_back(stem + ".json");
  };
  if (auto v = getenv("MSC_CONFIG"); v && !v->empty()) paths.push_back(*v);
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
    if (node["provider_bundle"] || node["storage_provider_profiles"]) {
      return Unimplemented("MSC profile '" + name + "' in " + path +
                           " uses a provider bundle or several backends, which tessera cannot "
                           "open");
    }
    const YAML::Node provider = node["storage_provider"];
    if (!provider || !provider["type"]) {
      return InvalidArgument("MSC profile '" + name + "' in " + path +
                             " has no storage_provider type");
    }
    profile.provider_type = Expand(provider["type"].as<std::string>(), getenv);
    Flatten(provider["options"], "", getenv, profile.options);
    if (const YAML::Node credentials = node["credentials_provider"]; credentials) {
      if (credentials["type"]) {
        profile.credentials_type = Expand(credentials["type"].as<std::string>(), getenv);
      }
      Flatten(credentials["options"], "", getenv, profile.credentials_options);
    }
  } catch (const std::exception& e) {
    return InvalidArgument("malformed MSC profile '" + name + "' in " + path + ": " + e.what());
  }
  return profile;
}

}  // namespace tessera
