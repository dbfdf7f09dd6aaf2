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
    EXPECT_THAT(opened.message(), HasSubstr("outside [1, "));
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
