// OpenStorage: plain paths, file://, s3:// (against moto, credentials from the environment as
// the AWS CLI reads them) and msc:// through multi-storage-client configs.
#include "tessera/storage_uri.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "storage/msc_config.h"
#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// Sets environment variables for one test, and restores them.
class ScopedEnv {
 public:
  void Set(const std::string& name, const std::string& value) {
    Remember(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void Unset(const std::string& name) {
    Remember(name);
    ::unsetenv(name.c_str());
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  void Remember(const std::string& name) {
    if (saved_.count(name)) return;
    const char* v = ::getenv(name.c_str());
    saved_[name] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

class StorageUriTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_uri_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // Nothing of this machine's own AWS or MSC settings.
    for (const char* v :
         {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
          "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
          "AWS_ENDPOINT_URL_S3", "MSC_CONFIG", "XDG_CONFIG_HOME"}) {
      env_.Unset(v);
    }
    env_.Set("HOME", dir_);
    env_.Set("XDG_CONFIG_DIRS", dir_ + "/xdg");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The moto server and its credentials in the environment, as a user would set them.
  s3::testing::MotoServer* UseMoto() {
    Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
    EXPECT_TRUE(server.ok()) << "could not start the S3 test server: "
                             << server.status().ToString();
    if (!server.ok()) return nullptr;
    env_.Set("AWS_ACCESS_KEY_ID", (*server)->credentials().access_key_id);
    env_.Set("AWS_SECRET_ACCESS_KEY", (*server)->credentials().secret_access_key);
    env_.Set("AWS_ENDPOINT_URL", (*server)->endpoint());
    return *server;
  }

  void WriteConfig(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name) << text;
  }

  std::string dir_;
  ScopedEnv env_;
};

TEST_F(StorageUriTest, PlainPathsAndFileUris) {
  for (const auto& [uri, path] :
       std::vector<std::pair<std::string, std::string>>{{"/ckpt/step1", "/ckpt/step1"},
                                                        {"relative/dir", "relative/dir"},
                                                        {"file:///ckpt/x", "/ckpt/x"},
                                                        {"file://localhost/ckpt/y", "/ckpt/y"},
                                                        {"dir:with:colons", "dir:with:colons"}}) {
    auto opened = OpenStorage(uri);
    ASSERT_TRUE(opened.ok()) << uri << ": " << opened.status().ToString();
    EXPECT_EQ(opened->second, path) << uri;
    EXPECT_TRUE(opened->first->capabilities().rename) << uri;  // POSIX
  }
  EXPECT_EQ(OpenStorage("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(OpenStorage("file://relative").status().message(), HasSubstr("absolute path"));
  const Status gs = OpenStorage("gs://bucket/x").status();
  EXPECT_EQ(gs.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(gs.message(), HasSubstr("gs://"));
}

TEST_F(StorageUriTest, S3UrisUseTheAwsEnvironment) {
  s3::testing::MotoServer* server = UseMoto();
  ASSERT_NE(server, nullptr);
  const std::string prefix = s3::testing::UniquePrefix();
  auto opened = OpenStorage("s3://" + server->bucket() + "/" + prefix + "/ckpt/step100/");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto& [storage, path] = *opened;
  EXPECT_EQ(path, prefix + "/ckpt/step100");
  EXPECT_TRUE(storage->capabilities().conditional_create);
  ASSERT_TRUE(
      storage->Publish(JoinPath(path, "manifest"), AsBytes("m"), PublishMode::kCreateOnly, true)
          .ok());
  auto names = storage->ListDir(path);
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  EXPECT_THAT(*names, ::testing::ElementsAre("manifest"));

  EXPECT_THAT(OpenStorage("s3:///x").status().message(), HasSubstr("names no bucket"));
  env_.Unset("AWS_SECRET_ACCESS_KEY");
  EXPECT_THAT(OpenStorage("s3://b/x").status().message(),
              HasSubstr("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"));
}

TEST_F(StorageUriTest, MscS3ProfileWithStaticCredentials) {
  s3::testing::MotoServer* server = UseMoto();
  ASSERT_NE(server, nullptr);
  // The keys come through ${VAR} expansion, as MSC's docs recommend; the AWS variables are
  // not what supplies them.
  env_.Set("TEST_MSC_KEY", server->credentials().access_key_id);
  env_.Set("TEST_MSC_SECRET", server->credentials().secret_access_key);
  env_.Unset("AWS_ACCESS_KEY_ID");
  env_.Unset("AWS_SECRET_ACCESS_KEY");
  env_.Unset("AWS_ENDPOINT_URL");
  const std::string prefix = s3::testing::UniquePrefix();
  WriteConfig("msc.yaml",
              "profiles:\n"
              "  train:\n"
              "    storage_provider:\n"
              "      type: s3\n"
              "      options:\n"
              "        base_path: " +
                  server->bucket() + "/" + prefix +
                  "\n"
                  "        endpoint_url: " +
                  server->endpoint() +
                  "\n"
                  "        region_name: us-east-1\n"
                  "        multipart_chunksize: 5242880\n"
                  "        s3:\n"
                  "          addressing_style: path\n"
                  "    credentials_provider:\n"
                  "      type: S3Credentials\n"
                  "      options:\n"
                  "        access_key: ${TEST_MSC_KEY}\n"
                  "        secret_key: $TEST_MSC_SECRET\n");
  env_.Set("MSC_CONFIG", dir_ + "/msc.yaml");
  auto opened = OpenStorage("msc://train/ckpt/iter_0000100");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto& [storage, path] = *opened;
  EXPECT_EQ(path, prefix + "/ckpt/iter_0000100");
  ASSERT_TRUE(
      storage->Publish(JoinPath(path, "m"), AsBytes("x"), PublishMode::kReplace, true).ok());
  auto* s3 = dynamic_cast<S3Storage*>(storage.get());
  ASSERT_NE(s3, nullptr);
  EXPECT_EQ(s3->bucket(), server->bucket());
  EXPECT_TRUE(s3->client().HeadObject(server->bucket(), prefix + "/ckpt/iter_0000100/m").ok());
  EXPECT_EQ(s3->client().options().part_bytes, 5u << 20);
}

// What multi-storage-client 1.3.1 does with the same config (checked against MSC itself in
// python/tests/test_msc.py): a leading slash of base_path does not count, "msc:/p/x" (pathlib's
// spelling) is msc://p/x, retries.max_attempts counts retries after the first try, "no" is
// false, and msc://_s3-bucket/key is the bucket with the environment's endpoint.
TEST_F(StorageUriTest, MscPathsNameTheObjectsMscNames) {
  env_.Set("AWS_ACCESS_KEY_ID", "k");  // opening needs credentials; nothing is sent
  env_.Set("AWS_SECRET_ACCESS_KEY", "s");
  const std::string profile =
      "profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
      "        base_path: //bkt/pre/fix\n        endpoint_url: http://127.0.0.1:9\n"
      "        verify: no\n        retries:\n          max_attempts: 0\n";
  WriteConfig("msc.yaml", profile);
  env_.Set("MSC_CONFIG", dir_ + "/msc.yaml");
  for (const std::string uri : {"msc://p/a/b", "msc:/p/a/b", "msc://p//a///b"}) {
    auto opened = OpenStorage(uri);
    ASSERT_TRUE(opened.ok()) << uri << ": " << opened.status().ToString();
    auto* s3 = dynamic_cast<S3Storage*>(opened->first.get());
    ASSERT_NE(s3, nullptr) << uri;
    EXPECT_EQ(s3->bucket(), "bkt") << uri;
    EXPECT_EQ(S3Storage::KeyOf(opened->second), "pre/fix/a/b") << uri;
    EXPECT_FALSE(s3->client().options().http.verify_tls) << uri;
    EXPECT_EQ(s3->client().options().retry.max_attempts, 1) << uri;
  }
  WriteConfig("total.yaml",
              "profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
              "        base_path: bkt\n        retries:\n          max_attempts: 2\n"
              "          total_max_attempts: 7\n");
  env_.Set("MSC_CONFIG", dir_ + "/total.yaml");
  auto total = OpenStorage("msc://p/x");
  ASSERT_TRUE(total.ok()) << total.status().ToString();
  EXPECT_EQ(dynamic_cast<S3Storage*>(total->first.get())->client().options().retry.max_attempts, 7);

  env_.Set("AWS_ENDPOINT_URL", "http://127.0.0.1:9");
  auto implicit = OpenStorage("msc://_s3-other-bucket/ck/step1");
  ASSERT_TRUE(implicit.ok()) << implicit.status().ToString();
  EXPECT_EQ(dynamic_cast<S3Storage*>(implicit->first.get())->bucket(), "other-bucket");
  EXPECT_EQ(implicit->second, "ck/step1");
}

// Where tessera would name other objects than MSC, or read a config MSC refuses, it refuses
// too, naming what: dot segments (MSC keeps them in keys), unset variables, MSC_CONFIG that is
// not a file, profile features that redirect objects, unsigned requests.
TEST_F(StorageUriTest, MscConfigsThatWouldDivergeFromMscAreRefused) {
  WriteConfig("msc.yaml",
              "profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
              "        base_path: bkt/pre\n        endpoint_url: http://127.0.0.1:9\n");
  env_.Set("MSC_CONFIG", dir_ + "/msc.yaml");
  for (const std::string uri : {"msc://p/a/../b", "msc://p/./b", "msc://p/a/.."}) {
    const Status s = OpenStorage(uri).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << uri;
    EXPECT_THAT(s.message(), HasSubstr("segment")) << uri;
    EXPECT_THAT(s.message(), HasSubstr(uri));
  }
  struct Case {
    std::string options, profile_extra, expected;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"        base_path: ${TESSERA_TEST_UNSET_VAR}/x\n", "",
       "unresolved environment variable ${TESSERA_TEST_UNSET_VAR}", StatusCode::kInvalidArgument},
      {"        base_path: bkt\n        region_name: $TESSERA_TEST_UNSET_VAR\n", "",
       "unresolved environment variable $TESSERA_TEST_UNSET_VAR", StatusCode::kInvalidArgument},
      {"        base_path: bkt/a/../b\n", "", "'..' segment in its base_path",
       StatusCode::kInvalidArgument},
      {"        base_path: bkt\n", "    metadata_provider:\n      type: manifest\n",
       "uses metadata_provider", StatusCode::kUnimplemented},
      {"        base_path: bkt\n",
       "    replicas:\n      - replica_profile: q\n        read_priority: 1\n", "uses replicas",
       StatusCode::kUnimplemented},
      {"        base_path: bkt\n        signature_version: UNSIGNED\n", "",
       "signature_version 'UNSIGNED' is not supported", StatusCode::kUnimplemented},
      {"        base_path: bkt\n", "    credentials_provider:\n      type: FileBasedCredentials\n",
       "FileBasedCredentials needs credential_file_path", StatusCode::kInvalidArgument},
  };
  env_.Unset("TESSERA_TEST_UNSET_VAR");
  for (const Case& c : cases) {
    WriteConfig("case.yaml",
                "profiles:\n  p:\n    storage_provider:\n      type: s3\n"
                "      options:\n" +
                    c.options + c.profile_extra);
    env_.Set("MSC_CONFIG", dir_ + "/case.yaml");
    const Status s = OpenStorage("msc://p/x").status();
    EXPECT_EQ(s.code(), c.code) << c.expected << ": " << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr(c.expected));
    EXPECT_THAT(s.message(), HasSubstr(dir_ + "/case.yaml"));
  }
  for (const std::string value : {std::string(""), dir_}) {
    env_.Set("MSC_CONFIG", value);
    const Status s = OpenStorage("msc://p/x").status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "'" << value << "'";
    EXPECT_THAT(s.message(), HasSubstr("MSC_CONFIG is set to '" + value + "'"));
  }
}

// Includes as MSC reads them: paths as written (no variables), the same profile in two files
// with its keys in another order is one profile, different data is an error naming both files.
TEST_F(StorageUriTest, MscIncludesAreMergedAsMscMergesThem) {
  env_.Set("AWS_ACCESS_KEY_ID", "k");  // opening needs credentials; nothing is sent
  env_.Set("AWS_SECRET_ACCESS_KEY", "s");
  const std::string p1 =
      "profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
      "        base_path: bkt\n        endpoint_url: http://127.0.0.1:9\n";
  const std::string p1_reordered =
      "profiles:\n  p:\n    storage_provider:\n      options:\n"
      "        endpoint_url: http://127.0.0.1:9\n        base_path: bkt\n      type: s3\n";
  std::filesystem::create_directories(dir_ + "/inc");
  WriteConfig("inc/same.yaml", p1_reordered);
  WriteConfig("main.yaml", "include:\n  - inc/same.yaml\n" + p1);
  env_.Set("MSC_CONFIG", dir_ + "/main.yaml");
  auto same = OpenStorage("msc://p/x");
  EXPECT_TRUE(same.ok()) << same.status().ToString();

  WriteConfig("inc/other.yaml",
              "profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
              "        base_path: other\n");
  WriteConfig("main.yaml", "include:\n  - inc/other.yaml\n" + p1);
  const Status differs = OpenStorage("msc://p/x").status();
  EXPECT_EQ(differs.code(), StatusCode::kInvalidArgument) << differs.ToString();
  EXPECT_THAT(differs.message(), HasSubstr("defined differently"));
  EXPECT_THAT(differs.message(), HasSubstr(dir_ + "/inc/other.yaml"));

  env_.Set("TESSERA_TEST_INC", dir_ + "/inc");
  WriteConfig("main.yaml", "include:\n  - ${TESSERA_TEST_INC}/same.yaml\n" + p1);
  const Status unexpanded = OpenStorage("msc://p/x").status();
  EXPECT_FALSE(unexpanded.ok());
  EXPECT_THAT(unexpanded.message(), HasSubstr("${TESSERA_TEST_INC}/same.yaml"));
}

// MSC's FileBasedCredentials: the AWS credential_process JSON file.
TEST_F(StorageUriTest, MscFileBasedCredentials) {
  WriteConfig("creds.json", R"({"Version": 1, "AccessKeyId": "AKID", "SecretAccessKey": "SECRET",)"
                            R"( "SessionToken": "TOKEN", "Expiration": "2030-01-01T00:00:00Z"})");
  WriteConfig("msc.yaml",
              "profiles:\n  p:\n    storage_provider:\n      type: s3\n"
              "      options:\n        base_path: bkt\n"
              "        endpoint_url: http://127.0.0.1:9\n"
              "    credentials_provider:\n      type: FileBasedCredentials\n"
              "      options:\n        credential_file_path: " +
                  dir_ + "/creds.json\n");
  env_.Set("MSC_CONFIG", dir_ + "/msc.yaml");
  auto opened = OpenStorage("msc://p/x");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const s3::Credentials& credentials =
      dynamic_cast<S3Storage*>(opened->first.get())->client().options().config.credentials;
  EXPECT_EQ(credentials.access_key_id, "AKID");
  EXPECT_EQ(credentials.secret_access_key, "SECRET");
  EXPECT_EQ(credentials.session_token, "TOKEN");
  WriteConfig("creds.json", R"({"Version": 2, "AccessKeyId": "A", "SecretAccessKey": "S"})");
  const Status v2 = OpenStorage("msc://p/x").status();
  EXPECT_EQ(v2.code(), StatusCode::kInvalidArgument) << v2.ToString();
  EXPECT_THAT(v2.message(), HasSubstr(dir_ + "/creds.json has Version '2', not 1"));
}

TEST_F(StorageUriTest, MscConfigErrorsNameTheProfileAndProvider) {
  WriteConfig("msc.yaml",
              "include:\n  - more.yaml\n"
              "profiles:\n"
              "  blob:\n    storage_provider:\n      type: azure\n"
              "      options:\n        base_path: c\n"
              "  ais:\n    storage_provider:\n      type: s3\n"
              "      options:\n        base_path: b\n"
              "    credentials_provider:\n      type: AISCredentials\n"
              "  local:\n    storage_provider:\n      type: file\n"
              "      options:\n        base_path: /data/ckpts\n");
  WriteConfig("more.yaml",
              "profiles:\n  extra:\n    storage_provider:\n      type: file\n"
              "      options:\n        base_path: /extra\n");
  env_.Set("MSC_CONFIG", dir_ + "/msc.yaml");
  const Status azure = OpenStorage("msc://blob/x").status();
  EXPECT_EQ(azure.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(azure.message(), HasSubstr("'blob'"));
  EXPECT_THAT(azure.message(), HasSubstr("'azure'"));
  EXPECT_THAT(azure.message(), HasSubstr(dir_ + "/msc.yaml"));
  EXPECT_THAT(OpenStorage("msc://ais/x").status().message(), HasSubstr("'AISCredentials'"));
  const Status missing = OpenStorage("msc://nope/x").status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("'nope'"));
  EXPECT_THAT(missing.message(), HasSubstr("ais, blob, extra, local"));
  auto local = OpenStorage("msc://local/run1/iter_5");
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ(local->second, "/data/ckpts/run1/iter_5");
  auto extra = OpenStorage("msc://extra/y");
  ASSERT_TRUE(extra.ok()) << extra.status().ToString();
  EXPECT_EQ(extra->second, "/extra/y");

  WriteConfig("bad.yaml", "profiles: [unclosed\n");
  env_.Set("MSC_CONFIG", dir_ + "/bad.yaml");
  const Status bad = OpenStorage("msc://x/y").status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr(dir_ + "/bad.yaml"));
}

// Issue 30, defects 13 and 18: max_concurrency 100000 started that many threads (the process
// aborted on std::system_error), and an include of /dev/zero was read whole before its size was
// checked.
TEST_F(StorageUriTest, MscConfigValuesAndFilesAreBounded) {
  const std::string s3_profile =
      "profiles:\n  big:\n    storage_provider:\n      type: s3\n"
      "      options:\n        base_path: bucket\n        endpoint_url: http://127.0.0.1:9\n";
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, std::string>>{{"max_concurrency", "100000"},
                                                        {"max_concurrency", "0"},
                                                        {"retries.max_attempts", "4294967297"}}) {
    const size_t dot = field.find('.');
    const std::string yaml_field = dot == std::string::npos
                                       ? "        " + field + ": " + value + "\n"
                                       : "        " + field.substr(0, dot) + ":\n          " +
                                             field.substr(dot + 1) + ": " + value + "\n";
    WriteConfig("big.yaml", s3_profile + yaml_field);
    env_.Set("MSC_CONFIG", dir_ + "/big.yaml");
    const Status opened = OpenStorage("msc://big/x").status();
    EXPECT_EQ(opened.code(), StatusCode::kInvalidArgument) << field << " " << opened.ToString();
    EXPECT_THAT(opened.message(), HasSubstr(field + " " + value));
    EXPECT_THAT(opened.message(), HasSubstr(" is outside ["));
    EXPECT_THAT(opened.message(), HasSubstr(dir_ + "/big.yaml"));
  }
  WriteConfig("zero.yaml", "include:\n  - /dev/zero\n" + s3_profile);
  env_.Set("MSC_CONFIG", dir_ + "/zero.yaml");
  const Status zero = OpenStorage("msc://big/x").status();
  EXPECT_EQ(zero.code(), StatusCode::kInvalidArgument) << zero.ToString();
  EXPECT_THAT(zero.message(), HasSubstr("/dev/zero is longer than"));
}

TEST_F(StorageUriTest, MscConfigIsFoundWhereMscLooks) {
  const Status none = OpenStorage("msc://p/x").status();
  EXPECT_EQ(none.code(), StatusCode::kNotFound);
  EXPECT_THAT(none.message(), HasSubstr(dir_ + "/.msc_config.yaml"));
  EXPECT_THAT(none.message(), HasSubstr("MSC_CONFIG"));
  auto fs = OpenStorage("msc://__filesystem__/tmp/x");  // MSC's implicit profile
  ASSERT_TRUE(fs.ok()) << fs.status().ToString();
  EXPECT_EQ(fs->second, "/tmp/x");

  std::filesystem::create_directories(dir_ + "/.config/msc");
  std::ofstream(dir_ + "/.config/msc/config.json")
      << R"({"profiles": {"p": {"storage_provider": {"type": "file", "options": {"base_path": "/j"}}}}})";
  auto json = OpenStorage("msc://p/x");
  ASSERT_TRUE(json.ok()) << json.status().ToString();
  EXPECT_EQ(json->second, "/j/x");
  const std::vector<std::string> paths = MscConfigSearchPaths(s3::ProcessEnv());
  EXPECT_EQ(paths.front(), dir_ + "/.msc_config.yaml");
  EXPECT_EQ(paths.back(), "/etc/msc_config.json");
}

}  // namespace
}  // namespace tessera
