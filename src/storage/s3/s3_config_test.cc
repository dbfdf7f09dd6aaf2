// Where credentials, region, endpoint and addressing come from (s3_config.h), with a fake
// environment and settings files of the test's own.
#include "storage/s3/s3_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace tessera::s3 {
namespace {

using ::testing::HasSubstr;

class S3ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_s3_config_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    env_["HOME"] = dir_;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  GetEnv Env() {
    return [this](const std::string& name) -> std::optional<std::string> {
      auto it = env_.find(name);
      return it == env_.end() ? std::nullopt : std::optional<std::string>(it->second);
    };
  }
  void WriteFile(const std::string& relative, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(dir_ + "/" + relative).parent_path());
    std::ofstream(dir_ + "/" + relative) << text;
  }
  Result<S3Config> Resolve(S3Overrides overrides = {}) { return ResolveS3Config(overrides, Env()); }

  std::string dir_;
  std::map<std::string, std::string> env_;
};

TEST_F(S3ConfigTest, EnvironmentCredentialsComeFirst) {
  env_["AWS_ACCESS_KEY_ID"] = "AKIDENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "secret-env";
  env_["AWS_SESSION_TOKEN"] = "token";
  WriteFile(".aws/credentials",
            "[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = f\n");
  Result<S3Config> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "AKIDENV");
  EXPECT_EQ(c->credentials.secret_access_key, "secret-env");
  EXPECT_EQ(c->credentials.session_token, "token");
  EXPECT_THAT(c->credentials_source, HasSubstr("environment"));
  EXPECT_EQ(c->region, "us-east-1");
  EXPECT_EQ(c->endpoint_url, "");
  EXPECT_EQ(c->addressing_style, AddressingStyle::kAuto);
}

TEST_F(S3ConfigTest, HalfAKeyPairIsAnError) {
  env_["AWS_ACCESS_KEY_ID"] = "AKIDENV";
  Result<S3Config> c = Resolve();
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("AWS_SECRET_ACCESS_KEY is not"));
}

TEST_F(S3ConfigTest, ProfilesFromTheCredentialsAndConfigFiles) {
  WriteFile(".aws/credentials",
            "# comment\n[default]\naws_access_key_id=AKIDDEFAULT\naws_secret_access_key=d\n\n"
            "[train]\naws_access_key_id = AKIDTRAIN\naws_secret_access_key = t\n"
            "aws_session_token = tok\n");
  WriteFile(".aws/config",
            "[default]\nregion = eu-west-1\n"
            "[profile train]\nregion = us-west-2\nendpoint_url = http://minio:9000\n"
            "s3 =\n  addressing_style = path\n  max_concurrent_requests = 20\n"
            "[profile configonly]\naws_access_key_id = AKIDCFG\naws_secret_access_key = c\n");
  Result<S3Config> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "AKIDDEFAULT");
  EXPECT_EQ(c->region, "eu-west-1");
  EXPECT_EQ(c->credentials_source, dir_ + "/.aws/credentials [default]");

  env_["AWS_PROFILE"] = "train";
  c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->profile, "train");
  EXPECT_EQ(c->credentials.access_key_id, "AKIDTRAIN");
  EXPECT_EQ(c->credentials.session_token, "tok");
  EXPECT_EQ(c->region, "us-west-2");
  EXPECT_EQ(c->endpoint_url, "http://minio:9000");
  EXPECT_EQ(c->addressing_style, AddressingStyle::kPath);

  env_["AWS_PROFILE"] = "configonly";
  c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "AKIDCFG");
  EXPECT_EQ(c->region, "us-east-1");
}

TEST_F(S3ConfigTest, AnExplicitProfileIgnoresEnvironmentCredentials) {
  env_["AWS_ACCESS_KEY_ID"] = "AKIDENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "e";
  WriteFile(".aws/credentials",
            "[train]\naws_access_key_id = AKIDTRAIN\naws_secret_access_key = t\n");
  Result<S3Config> c = Resolve(S3Overrides{.profile = "train"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "AKIDTRAIN");
  Result<S3Config> missing = Resolve(S3Overrides{.profile = "nope"});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("'nope'"));
}

TEST_F(S3ConfigTest, FilesNamedByTheEnvironment) {
  env_["AWS_SHARED_CREDENTIALS_FILE"] = "~/elsewhere/creds";
  env_["AWS_CONFIG_FILE"] = dir_ + "/elsewhere/config";
  WriteFile("elsewhere/creds", "[default]\naws_access_key_id = AKIDX\naws_secret_access_key = x\n");
  WriteFile("elsewhere/config", "[default]\nregion = ap-south-1\n");
  Result<S3Config> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "AKIDX");
  EXPECT_EQ(c->region, "ap-south-1");
}

// Issue 30, defect 18: the AWS files were read whole before anything bounded them.
TEST_F(S3ConfigTest, SettingsFilesAreReadWithABound) {
  env_["AWS_CONFIG_FILE"] = "/dev/zero";
  Result<S3Config> c = Resolve();
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().ToString();
  EXPECT_THAT(c.status().message(), HasSubstr("AWS settings file /dev/zero is longer than"));
}

TEST_F(S3ConfigTest, RegionAndEndpointPrecedence) {
  env_["AWS_ACCESS_KEY_ID"] = "A";
  env_["AWS_SECRET_ACCESS_KEY"] = "S";
  WriteFile(".aws/config",
            "[default]\nregion = eu-west-1\nendpoint_url = http://profile:1\nservices = local\n"
            "[services local]\ns3 =\n  endpoint_url = http://services:2\n");
  Result<S3Config> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->endpoint_url, "http://services:2");
  env_["AWS_DEFAULT_REGION"] = "eu-north-1";
  env_["AWS_ENDPOINT_URL"] = "http://generic:3";
  c = Resolve();
  EXPECT_EQ(c->region, "eu-north-1");
  EXPECT_EQ(c->endpoint_url, "http://generic:3");
  env_["AWS_REGION"] = "eu-south-1";
  env_["AWS_ENDPOINT_URL_S3"] = "http://s3only:4";
  c = Resolve();
  EXPECT_EQ(c->region, "eu-south-1");
  EXPECT_EQ(c->endpoint_url, "http://s3only:4");
  c = Resolve(S3Overrides{.region = "x-1", .endpoint_url = "http://explicit:5"});
  EXPECT_EQ(c->region, "x-1");
  EXPECT_EQ(c->endpoint_url, "http://explicit:5");
  env_["AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"] = "true";
  c = Resolve();
  EXPECT_EQ(c->endpoint_url, "");
}

TEST_F(S3ConfigTest, UnsupportedAndMissingCredentialsAreNamed) {
  WriteFile(".aws/config",
            "[profile sso]\nsso_session = corp\nregion = us-east-1\n"
            "[profile role]\nrole_arn = arn:aws:iam::1:role/x\n");
  env_["AWS_PROFILE"] = "role";
  Result<S3Config> c = Resolve();
  EXPECT_EQ(c.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(), HasSubstr("role_arn"));
  env_["AWS_PROFILE"] = "sso";
  EXPECT_THAT(Resolve().status().message(), HasSubstr("sso_session"));
  env_.erase("AWS_PROFILE");
  c = Resolve();
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("AWS_ACCESS_KEY_ID"));
  EXPECT_THAT(c.status().message(), HasSubstr(dir_ + "/.aws/credentials"));
}

TEST_F(S3ConfigTest, BadSettingsNameTheirPlace) {
  WriteFile(".aws/config", "[default]\nregion = x\ns3 =\n  addressing_style = sideways\n");
  env_["AWS_ACCESS_KEY_ID"] = "A";
  env_["AWS_SECRET_ACCESS_KEY"] = "S";
  EXPECT_THAT(Resolve().status().message(), HasSubstr("addressing_style 'sideways'"));
  Result<IniFile> bad = ParseAwsIni("[default]\nregion = x\nnot a setting\n", "cfg");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("cfg line 3"));
  EXPECT_THAT(ParseAwsIni("key = v\n", "cfg").status().message(), HasSubstr("before any"));
  EXPECT_THAT(ParseAwsIni("[open\n", "cfg").status().message(), HasSubstr("closing ']'"));
}

}  // namespace
}  // namespace tessera::s3
