#include "storage/s3/s3_config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace tessera::s3 {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

std::string Lower(std::string s) {
  for (char& c : s) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

// AWS's config and credentials files are a few kilobytes; more is not one.
constexpr size_t kMaxSettingsFileBytes = 4u << 20;

// An INI file's text, or nullopt when it does not exist.
Result<std::optional<std::string>> ReadOptionalFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<std::string>();
    return IOErrorFromErrno("reading AWS settings file " + path, errno);
  }
  TESSERA_ASSIGN_OR_RETURN(std::string text,
                           ReadBoundedFile(path, kMaxSettingsFileBytes, "AWS settings file"));
  return std::optional<std::string>(std::move(text));
}

std::string ExpandHome(const std::string& path, const GetEnv& getenv) {
  if (path == "~" || path.starts_with("~/")) {
    return getenv("HOME").value_or("") + path.substr(1);
  }
  return path;
}

// The non-empty value of variable `name`.
std::optional<std::string> Var(const GetEnv& getenv, const std::string& name) {
  std::optional<std::string> v = getenv(name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

struct Files {
  std::string credentials_path, config_path;
  IniFile credentials, config;
};

Result<Files> ReadFiles(const GetEnv& getenv) {
  Files files;
  files.credentials_path =
      ExpandHome(Var(getenv, "AWS_SHARED_CREDENTIALS_FILE").value_or("~/.aws/credentials"), getenv);
  files.config_path = ExpandHome(Var(getenv, "AWS_CONFIG_FILE").value_or("~/.aws/config"), getenv);
  for (auto [path, ini] : {std::pair{&files.credentials_path, &files.credentials},
                           std::pair{&files.config_path, &files.config}}) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<std::string> text, ReadOptionalFile(*path));
    if (!text) continue;
    TESSERA_ASSIGN_OR_RETURN(*ini, ParseAwsIni(*text, *path));
  }
  return files;
}

// The profile's section of the config file ("default" or "profile NAME"), or null.
const std::map<std::string, std::string>* ConfigSection(const Files& files,
                                                        const std::string& profile) {
  auto it = files.config.find("profile " + profile);
  if (it == files.config.end() && profile == "default") it = files.config.find("default");
  return it == files.config.end() ? nullptr : &it->second;
}

std::string Get(const std::map<std::string, std::string>* section, const std::string& key) {
  if (section == nullptr) return "";
  auto it = section->find(key);
  return it == section->end() ? "" : it->second;
}

// Settings tessera does not implement, named so that a user knows why their profile fails.
Status CheckUnsupported(const std::map<std::string, std::string>* section,
                        const std::string& where) {
  for (const char* key : {"credential_process", "role_arn", "sso_session", "sso_start_url",
                          "web_identity_token_file", "credential_source"}) {
    if (!Get(section, key).empty()) {
      return Unimplemented(where + " sets " + key +
                           ", which tessera's S3 client does not support; give static keys "
                           "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                           "aws_access_key_id and aws_secret_access_key in the profile)");
    }
  }
  return Status::Ok();
}

Result<std::optional<Credentials>> CredentialsFrom(const std::map<std::string, std::string>* s,
                                                   const std::string& where) {
  const std::string id = Get(s, "aws_access_key_id");
  const std::string secret = Get(s, "aws_secret_access_key");
  if (id.empty() && secret.empty()) return std::optional<Credentials>();
  if (id.empty() || secret.empty()) {
    return InvalidArgument(where + " has " +
                           (id.empty() ? "aws_secret_access_key but no aws_access_key_id"
                                       : "aws_access_key_id but no aws_secret_access_key"));
  }
  return std::optional<Credentials>(Credentials{id, secret, Get(s, "aws_session_token")});
}

Status ResolveCredentials(const S3Overrides& overrides, const GetEnv& getenv, const Files& files,
                          bool explicit_profile, S3Config& config) {
  if (overrides.credentials) {
    config.credentials = *overrides.credentials;
    config.credentials_source = "the caller";
    return Status::Ok();
  }
  if (!explicit_profile) {
    const auto id = Var(getenv, "AWS_ACCESS_KEY_ID");
    const auto secret = Var(getenv, "AWS_SECRET_ACCESS_KEY");
    if (id && secret) {
      config.credentials = Credentials{*id, *secret, Var(getenv, "AWS_SESSION_TOKEN").value_or("")};
      config.credentials_source = "the environment (AWS_ACCESS_KEY_ID)";
      return Status::Ok();
    }
    if (id || secret) {
      return InvalidArgument(id ? "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"
                                : "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not");
    }
  }
  const std::string& profile = config.profile;
  auto cred_it = files.credentials.find(profile);
  const auto* cred_section = cred_it == files.credentials.end() ? nullptr : &cred_it->second;
  const std::string cred_where = files.credentials_path + " [" + profile + "]";
  TESSERA_RETURN_IF_ERROR(CheckUnsupported(cred_section, cred_where));
  TESSERA_ASSIGN_OR_RETURN(std::optional<Credentials> from_credentials,
                           CredentialsFrom(cred_section, cred_where));
  if (from_credentials) {
    config.credentials = *from_credentials;
    config.credentials_source = cred_where;
    return Status::Ok();
  }
  const auto* section = ConfigSection(files, profile);
  const std::string where = files.config_path + " [profile " + profile + "]";
  TESSERA_RETURN_IF_ERROR(CheckUnsupported(section, where));
  TESSERA_ASSIGN_OR_RETURN(std::optional<Credentials> from_config, CredentialsFrom(section, where));
  if (from_config) {
    config.credentials = *from_config;
    config.credentials_source = where;
    return Status::Ok();
  }
  return FailedPrecondition(
      "no AWS credentials found for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give "
      "profile '" +
      profile + "' aws_access_key_id and aws_secret_access_key in " + files.credentials_path +
      " or " + files.config_path +
      " (instance metadata, SSO and credential_process are not supported)");
}

std::string ResolveEndpoint(const S3Overrides& overrides, const GetEnv& getenv, const Files& files,
                            const std::map<std::string, std::string>* section) {
  if (!overrides.endpoint_url.empty()) return overrides.endpoint_url;
  if (Lower(Var(getenv, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS").value_or("")) == "true") return "";
  for (const char* name : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
    if (auto v = Var(getenv, name)) return *v;
  }
  if (const std::string services = Get(section, "services"); !services.empty()) {
    auto it = files.config.find("services " + services);
    if (it != files.config.end()) {
      if (std::string url = Get(&it->second, "s3.endpoint_url"); !url.empty()) return url;
    }
  }
  return Get(section, "endpoint_url");
}

}  // namespace

GetEnv ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
}

AddressingStyle ParseAddressingStyle(const std::string& s, bool* ok) {
  *ok = true;
  const std::string v = Lower(s);
  if (v == "path") return AddressingStyle::kPath;
  if (v == "virtual") return AddressingStyle::kVirtual;
  if (v == "auto" || v.empty()) return AddressingStyle::kAuto;
  *ok = false;
  return AddressingStyle::kAuto;
}

Result<IniFile> ParseAwsIni(const std::string& text, const std::string& file_name) {
  IniFile ini;
  std::map<std::string, std::string>* section = nullptr;
  std::string parent;  // the key whose nested block the indented lines belong to
  std::istringstream in(text);
  std::string raw;
  for (int line_no = 1; std::getline(in, raw); ++line_no) {
    const std::string_view line = Trim(raw);
    if (line.empty() || line.front() == '#' || line.front() == ';') continue;
    const bool indented = raw.front() == ' ' || raw.front() == '\t';
    auto bad = [&](const std::string& what) {
      return InvalidArgument(file_name + " line " + std::to_string(line_no) + ": " + what);
    };
    if (line.front() == '[') {
      if (line.back() != ']') return bad("a section header without its closing ']'");
      section = &ini[std::string(Trim(line.substr(1, line.size() - 2)))];
      parent.clear();
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) return bad("expected 'key = value'");
    if (section == nullptr) return bad("a setting before any [section]");
    const std::string key(Trim(line.substr(0, eq)));
    const std::string value(Trim(line.substr(eq + 1)));
    if (key.empty()) return bad("a setting without a name");
    if (indented && !parent.empty()) {
      (*section)[parent + "." + key] = value;
      continue;
    }
    (*section)[key] = value;
    parent = value.empty() ? key : "";
  }
  return ini;
}

std::string RedactUrl(std::string_view url) {
  const size_t scheme = url.find("://");
  const size_t start = scheme == std::string_view::npos ? 0 : scheme + 3;
  const size_t end = url.find_first_of("/?#", start);
  const std::string_view authority =
      url.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
  const size_t at = authority.rfind('@');
  if (at == std::string_view::npos) return std::string(url);
  return std::string(url.substr(0, start)) + "***@" + std::string(url.substr(start + at + 1));
}

Result<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes,
                                    const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(what + " " + path + " does not exist");
    return IOErrorFromErrno("reading " + what + " " + path, err);
  }
  std::string text;
  char buffer[64 << 10];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return IOErrorFromErrno("reading " + what + " " + path, err);
    }
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      return InvalidArgument(what + " " + path + " is longer than " + std::to_string(max_bytes) +
                             " bytes; not a settings file");
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

Result<S3Config> ResolveS3Config(const S3Overrides& overrides, const GetEnv& getenv) {
  S3Config config;
  const bool explicit_profile = !overrides.profile.empty();
  config.profile = explicit_profile
                       ? overrides.profile
                       : Var(getenv, "AWS_PROFILE")
                             .value_or(Var(getenv, "AWS_DEFAULT_PROFILE").value_or("default"));
  TESSERA_ASSIGN_OR_RETURN(Files files, ReadFiles(getenv));
  const auto* section = ConfigSection(files, config.profile);
  if (explicit_profile && section == nullptr &&
      files.credentials.find(config.profile) == files.credentials.end()) {
    return NotFound("AWS profile '" + config.profile + "' is in neither " + files.credentials_path +
                    " nor " + files.config_path);
  }
  TESSERA_RETURN_IF_ERROR(ResolveCredentials(overrides, getenv, files, explicit_profile, config));

  config.region = overrides.region;
  for (const char* name : {"AWS_REGION", "AWS_DEFAULT_REGION"}) {
    if (config.region.empty()) config.region = Var(getenv, name).value_or("");
  }
  if (config.region.empty()) config.region = Get(section, "region");
  if (config.region.empty()) config.region = "us-east-1";

  config.endpoint_url = ResolveEndpoint(overrides, getenv, files, section);

  if (overrides.addressing_style) {
    config.addressing_style = *overrides.addressing_style;
  } else if (const std::string style = Get(section, "s3.addressing_style"); !style.empty()) {
    bool ok = false;
    config.addressing_style = ParseAddressingStyle(style, &ok);
    if (!ok) {
      return InvalidArgument(files.config_path + " [profile " + config.profile +
                             "]: s3 addressing_style '" + style +
                             "' is none of path, virtual, auto");
    }
  }
  return config;
}

}  // namespace tessera::s3
