// The S3 client against a real S3 protocol server (moto, started by the test, signatures
// enforced), with faults from a scripted HTTP hook and from a loopback TCP proxy.
#include "storage/s3/s3_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "storage/s3/object_writer.h"
#include "storage/s3/testing/fault_proxy.h"
#include "storage/s3/testing/moto_server.h"
#include "storage/s3/testing/s3_test_util.h"

namespace tessera::s3 {
namespace {

using testing::FaultProxy;
using ::testing::HasSubstr;
using testing::MotoServer;
using testing::Pattern;
using testing::ScriptedFaults;
using testing::SharedMotoServer;
using testing::UniquePrefix;
using Action = HttpFaultHook::Action;
using Decision = HttpFaultHook::Decision;

#define S3_ASSERT_OK(expr)                                             \
  do {                                                                 \
    const ::tessera::Status _s = ::tessera::internal::GetStatus(expr); \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString();            \
  } while (0)

uint64_t Requests(const S3Client& c, S3Op op) {
  return c.stats().requests[static_cast<size_t>(op)];
}

class S3ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<MotoServer*> server = SharedMotoServer();
    // No skipping: a missing server fails every S3 test, loudly.
    ASSERT_TRUE(server.ok()) << "could not start the S3 test server: "
                             << server.status().ToString();
    server_ = *server;
    bucket_ = server_->bucket();
    prefix_ = UniquePrefix() + "/";
    client_ = NewClient();
  }

  std::shared_ptr<S3Client> NewClient(std::function<void(S3ClientOptions&)> tweak = nullptr) {
    S3ClientOptions options = server_->ClientOptions();
    if (tweak) tweak(options);
    Result<std::shared_ptr<S3Client>> c = S3Client::Create(options);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }

  std::vector<std::byte> Get(const std::string& key, uint64_t offset, size_t n) {
    std::vector<std::byte> out(n);
    const Status s = client_->GetRange(bucket_, key, offset, out);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }

  std::vector<std::string> Uploads() {
    Result<std::vector<UploadListing::Upload>> u = client_->ListMultipartUploads(bucket_, prefix_);
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    std::vector<std::string> keys;
    if (u.ok()) {
      for (const auto& upload : *u) keys.push_back(upload.key);
    }
    return keys;
  }

  MotoServer* server_ = nullptr;
  std::string bucket_, prefix_;
  std::shared_ptr<S3Client> client_;
};

// ---- signing and clear errors --------------------------------------------------------------

TEST_F(S3ClientTest, ServerEnforcesSignaturesAndAWrongSecretFailsAtOnce) {
  const std::string key = prefix_ + "signed";
  const std::vector<std::byte> data = Pattern(1000, 1);
  S3_ASSERT_OK(client_->PutObject(bucket_, key, data, false));

  auto bad = NewClient([](S3ClientOptions& o) {
    o.config.credentials.secret_access_key = "not-the-secret";
    o.config.credentials_source = "the test";
  });
  const Status s = bad->PutObject(bucket_, key, data, false);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("HTTP 403 SignatureDoesNotMatch"));
  EXPECT_THAT(s.message(), HasSubstr("s3://" + bucket_ + "/" + key));
  EXPECT_THAT(s.message(), HasSubstr("check AWS_SECRET_ACCESS_KEY"));
  EXPECT_EQ(bad->stats().total_requests(), 1u) << "a signature error must not be retried";

  std::vector<std::byte> out(10);
  const Status read = bad->GetRange(bucket_, key, 5, out);
  EXPECT_THAT(read.message(), HasSubstr("SignatureDoesNotMatch"));
  EXPECT_THAT(read.message(), HasSubstr("bytes 5-14"));
}

TEST_F(S3ClientTest, AnUnknownAccessKeyFailsAtOnce) {
  auto bad =
      NewClient([](S3ClientOptions& o) { o.config.credentials.access_key_id = "AKIDUNKNOWN"; });
  const Result<ListPage> page = bad->ListObjectsPage(bucket_, prefix_, "/", "");
  ASSERT_FALSE(page.ok());
  EXPECT_THAT(page.status().message(), HasSubstr("HTTP 403 InvalidAccessKeyId"));
  EXPECT_THAT(page.status().message(), HasSubstr("AKIDUNKNOWN"));
  EXPECT_EQ(bad->stats().total_requests(), 1u);
}

TEST_F(S3ClientTest, AMissingBucketIsNotFoundAtOnce) {
  const std::vector<std::byte> data = Pattern(10, 2);
  const Status put = client_->PutObject("no-such-bucket-tessera", "k", data, false);
  EXPECT_EQ(put.code(), StatusCode::kNotFound) << put.ToString();
  EXPECT_THAT(put.message(), HasSubstr("NoSuchBucket"));
  EXPECT_THAT(put.message(), HasSubstr("s3://no-such-bucket-tessera/k"));
  const Result<ListPage> page = client_->ListObjectsPage("no-such-bucket-tessera", "", "/", "");
  EXPECT_EQ(page.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client_->stats().total_requests(), 2u) << "a missing bucket must not be retried";
}

TEST_F(S3ClientTest, AccessDeniedIsClearAndNotRetried) {
  // moto enforces IAM policies: a user without any policy is denied.
  auto setup = NewClient();
  S3Call create{.op = S3Op::kOther, .method = "POST", .service = "iam"};
  const std::string body =
      "Action=CreateUser&UserName=nobody-" + UniquePrefix() + "&Version=2010-05-08";
  create.body = std::as_bytes(std::span<const char>(body.data(), body.size()));
  create.headers = {{"Content-Type", "application/x-www-form-urlencoded"}};
  S3_ASSERT_OK(setup->Execute(create).status);
  const std::string user =
      body.substr(body.find("UserName=") + 9, body.find("&Version") - body.find("UserName=") - 9);
  const std::string key_body = "Action=CreateAccessKey&UserName=" + user + "&Version=2010-05-08";
  create.body = std::as_bytes(std::span<const char>(key_body.data(), key_body.size()));
  S3CallResult made = setup->Execute(create);
  S3_ASSERT_OK(made.status);
  const std::string& xml = made.response.body;
  auto between = [&](const std::string& tag) {
    const size_t a = xml.find("<" + tag + ">") + tag.size() + 2;
    return xml.substr(a, xml.find("</" + tag + ">") - a);
  };
  auto denied = NewClient([&](S3ClientOptions& o) {
    o.config.credentials = Credentials{between("AccessKeyId"), between("SecretAccessKey"), ""};
  });
  const std::vector<std::byte> data = Pattern(10, 3);
  const Status s = denied->PutObject(bucket_, prefix_ + "denied", data, false);
  EXPECT_THAT(s.message(), HasSubstr("HTTP 403 AccessDenied")) << s.ToString();
  EXPECT_EQ(denied->stats().total_requests(), 1u);
}

// botocore (the AWS SDK for Python) recomputes the signature of requests this client builds:
// keys with spaces and escapes, queries, ranges, conditional headers, a session token.
TEST_F(S3ClientTest, BotocoreComputesTheSameSignatures) {
  auto client = NewClient([](S3ClientOptions& o) {
    o.config.credentials =
        Credentials{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session/token+="};
    o.config.region = "eu-west-3";
    o.config.endpoint_url = "https://objects.example.com:9443/base";
  });
  const std::string body = "<Delete><Object><Key>a</Key></Object></Delete>";
  const auto bytes = std::as_bytes(std::span<const char>(body.data(), body.size()));
  std::vector<S3Call> calls = {
      {.op = S3Op::kGet,
       .method = "GET",
       .bucket = "b",
       .key = "dir/a b+c%d~e=f.safetensors",
       .headers = {{"Range", "bytes=10-19"}, {"If-Match", "\"abc\""}}},
      {.op = S3Op::kPut,
       .method = "PUT",
       .bucket = "b",
       .key = "x/\xc3\xa9t\xc3\xa9 (1).bin",
       .headers = {{"If-None-Match", "*"}, {"x-amz-checksum-crc32c", "AAAAAA=="}},
       .body = bytes},
      {.op = S3Op::kList,
       .method = "GET",
       .bucket = "b",
       .query = {{"list-type", "2"},
                 {"prefix", "ckpt/step 1/"},
                 {"delimiter", "/"},
                 {"continuation-token", "a+b/c=="},
                 {"encoding-type", "url"}}},
      {.op = S3Op::kUploadPart,
       .method = "PUT",
       .bucket = "b",
       .key = "k",
       .query = {{"partNumber", "7"}, {"uploadId", "x~y/z"}},
       .body = bytes},
      {.op = S3Op::kDeleteObjects,
       .method = "POST",
       .bucket = "b",
       .query = {{"delete", ""}},
       .headers = {{"Content-Type", "application/xml"}},
       .body = bytes},
  };
  nlohmann::json requests = nlohmann::json::array();
  std::vector<std::string> ours;
  const auto when = std::chrono::system_clock::from_time_t(1767225600);  // 2026-01-01
  for (const S3Call& call : calls) {
    const HttpRequest r = client->BuildRequest(call, when);
    nlohmann::json headers = nlohmann::json::object();
    std::string authorization;
    for (const auto& [name, value] : r.headers) {
      if (name == "Authorization") {
        authorization = value;
      } else if (name != "host") {
        headers[name] = value;
      }
    }
    ours.push_back(authorization.substr(authorization.find("Signature=") + 10));
    requests.push_back(
        {{"method", r.method},
         {"url", r.url},
         {"headers", headers},
         {"body", std::string(reinterpret_cast<const char*>(r.body.data()), r.body.size())}});
  }
  const std::string script = R"(
import json, sys
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session/token+=")
for r in json.load(sys.stdin):
    req = AWSRequest(method=r["method"], url=r["url"], headers=r["headers"], data=r["body"].encode())
    req.context["timestamp"] = r["headers"]["x-amz-date"]
    auth = S3SigV4Auth(creds, "s3", "eu-west-3")
    print(auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req))
)";
  Result<std::string> out = testing::RunPython(script, requests.dump());
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  std::vector<std::string> theirs;
  std::istringstream lines(*out);
  for (std::string line; std::getline(lines, line);) theirs.push_back(line);
  ASSERT_EQ(theirs.size(), ours.size()) << *out;
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i], theirs[i]) << "request " << i << ": " << requests[i].dump();
  }
}

// ---- objects -------------------------------------------------------------------------------

TEST_F(S3ClientTest, PutHeadAndRangedGets) {
  const std::string key = prefix_ + "obj";
  const std::vector<std::byte> data = Pattern((9u << 20) + 123, 4);  // > 2 read chunks
  S3_ASSERT_OK(client_->PutObject(bucket_, key, data, false));
  Result<ObjectInfo> info = client_->HeadObject(bucket_, key, true);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->size, data.size());
  EXPECT_FALSE(info->etag.empty());
  EXPECT_EQ(info->checksum_crc32c, Crc32cBase64(Crc32c(data)));

  client_->ResetStats();
  for (auto [offset, n] : std::vector<std::pair<uint64_t, size_t>>{
           {0, 1}, {1, 100}, {4095, 2}, {(5u << 20) - 3, 7}, {data.size() - 1, 1}}) {
    const std::vector<std::byte> got = Get(key, offset, n);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), data.begin() + offset)) << offset;
  }
  EXPECT_EQ(Requests(*client_, S3Op::kGet), 5u);
  // Exactly what was asked for: the bytes received are the bytes read.
  EXPECT_EQ(client_->stats().bytes_received, 1u + 100 + 2 + 7 + 1);

  client_->ResetStats();
  const std::vector<std::byte> whole = Get(key, 0, data.size());
  EXPECT_TRUE(whole == data);
  EXPECT_EQ(Requests(*client_, S3Op::kGet), 3u) << "a long read runs as several ranged GETs";
  EXPECT_EQ(client_->stats().bytes_received, data.size());

  std::vector<std::byte> past(10);
  const Status s = client_->GetRange(bucket_, key, data.size() - 5, past);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  const Status changed = client_->GetRange(bucket_, key, 0, past, "\"not-the-etag\"");
  EXPECT_EQ(changed.code(), StatusCode::kDataLoss) << changed.ToString();
  EXPECT_THAT(changed.message(), HasSubstr("changed since it was opened"));
}

// GetPrefix opens and reads an object's head in one GET: its size and ETag as a HEAD gives
// them, and min(max_bytes, size) bytes; an empty object costs a HEAD besides (S3 answers 416).
TEST_F(S3ClientTest, GetPrefixGivesSizeEtagAndTheFirstBytesInOneRequest) {
  const std::string key = prefix_ + "prefixed";
  const std::vector<std::byte> data = Pattern(100000, 7);
  S3_ASSERT_OK(client_->PutObject(bucket_, key, data, false));
  Result<ObjectInfo> head = client_->HeadObject(bucket_, key);
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  for (size_t max : {size_t{1}, size_t{4096}, data.size() - 1, data.size(), data.size() + 9}) {
    client_->ResetStats();
    Result<ObjectPrefix> got = client_->GetPrefix(bucket_, key, max);
    ASSERT_TRUE(got.ok()) << max << ": " << got.status().ToString();
    EXPECT_EQ(got->info.size, data.size()) << max;
    EXPECT_EQ(got->info.etag, head->etag) << max;
    const size_t n = std::min(max, data.size());
    ASSERT_EQ(got->bytes.size(), n) << max;
    EXPECT_EQ(std::memcmp(got->bytes.data(), data.data(), n), 0) << max;
    EXPECT_EQ(Requests(*client_, S3Op::kGet), 1u) << max;
    EXPECT_EQ(Requests(*client_, S3Op::kHead), 0u) << max;
  }
  const std::string empty = prefix_ + "empty";
  S3_ASSERT_OK(client_->PutObject(bucket_, empty, {}, false));
  Result<ObjectPrefix> none = client_->GetPrefix(bucket_, empty, 4096);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->info.size, 0u);
  EXPECT_TRUE(none->bytes.empty());
  Result<ObjectPrefix> missing = client_->GetPrefix(bucket_, prefix_ + "missing", 4096);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  EXPECT_THAT(missing.status().message(), HasSubstr(prefix_ + "missing"));
}

TEST_F(S3ClientTest, CreateOnlyPutHasExactlyOneWinner) {
  const std::string key = prefix_ + "manifest";
  constexpr int kRacers = 6;
  std::vector<std::vector<std::byte>> contents;
  for (int i = 0; i < kRacers; ++i) contents.push_back(Pattern(1000 + i, 10 + i));
  std::vector<Status> results(kRacers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRacers; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = client_->PutObject(bucket_, key, contents[i], true); });
  }
  for (auto& t : threads) t.join();
  int winner = -1;
  for (int i = 0; i < kRacers; ++i) {
    if (results[i].ok()) {
      EXPECT_EQ(winner, -1) << "two creators won";
      winner = i;
    } else {
      EXPECT_EQ(results[i].code(), StatusCode::kAlreadyExists) << results[i].ToString();
      EXPECT_THAT(results[i].message(), HasSubstr("already exists"));
    }
  }
  ASSERT_NE(winner, -1);
  Result<std::string> stored = client_->GetObject(bucket_, key);
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->size(), contents[winner].size());
  EXPECT_EQ(std::memcmp(stored->data(), contents[winner].data(), stored->size()), 0);
}

TEST_F(S3ClientTest, ListingPaginatesAndDecodesKeys) {
  const std::vector<std::string> names = {
      "a", "b c", "d+e", "f%20g", "\xc3\xa9t\xc3\xa9", "sub/x", "sub/y", "sub2/z/deep", "h&i<j>"};
  const std::vector<std::byte> one = Pattern(1, 5);
  for (const std::string& n : names)
    S3_ASSERT_OK(client_->PutObject(bucket_, prefix_ + n, one, false));
  Result<ListResult> all = client_->ListObjects(bucket_, prefix_, "");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  std::vector<std::string> keys;
  for (const auto& o : all->objects) keys.push_back(o.key.substr(prefix_.size()));
  std::vector<std::string> want = names;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(keys, want);

  Result<ListPage> page = client_->ListObjectsPage(bucket_, prefix_, "/", "", 3);
  ASSERT_TRUE(page.ok());
  EXPECT_TRUE(page->truncated);
  client_->ResetStats();
  Result<ListResult> level = client_->ListObjects(bucket_, prefix_, "/");
  ASSERT_TRUE(level.ok());
  EXPECT_EQ(level->objects.size(), 6u);
  EXPECT_THAT(level->common_prefixes, ::testing::ElementsAre(prefix_ + "sub/", prefix_ + "sub2/"));
  EXPECT_EQ(Requests(*client_, S3Op::kList), 1u);

  // Paginated: 3 a page.
  std::vector<std::string> paged;
  std::string token;
  int pages = 0;
  do {
    Result<ListPage> p = client_->ListObjectsPage(bucket_, prefix_, "", token, 3);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    for (const auto& o : p->objects) paged.push_back(o.key.substr(prefix_.size()));
    token = p->truncated ? p->next_continuation_token : "";
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(paged, want);
  EXPECT_EQ(pages, 3);
}

TEST_F(S3ClientTest, DeleteObjectsInBatchesOfAThousand) {
  std::vector<std::string> keys;
  for (int i = 0; i < 1003; ++i) keys.push_back(prefix_ + "k" + std::to_string(i));
  const std::vector<std::byte> one = Pattern(1, 6);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < keys.size(); i += 4) {
        if (!client_->PutObject(bucket_, keys[i], one, false).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  client_->ResetStats();
  S3_ASSERT_OK(client_->DeleteObjects(bucket_, keys));
  EXPECT_EQ(Requests(*client_, S3Op::kDeleteObjects), 2u);
  Result<ListResult> left = client_->ListObjects(bucket_, prefix_, "");
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->objects.empty());
  S3_ASSERT_OK(
      client_->DeleteObject(bucket_, prefix_ + "never-existed"));  // S3's idempotent DELETE
}

// ---- multipart -----------------------------------------------------------------------------

TEST_F(S3ClientTest, MultipartUploadsPartsInParallelWithinTheBudget) {
  const std::string key = prefix_ + "big";
  const std::vector<std::byte> data = Pattern((23u << 20) + 17, 7);  // 5 parts of 5 MiB
  auto client = NewClient([](S3ClientOptions& o) { o.max_inflight_bytes = 2 * kMinPartBytes; });
  {
    ObjectWriter writer(client, bucket_, key, /*create_only=*/true);
    for (size_t done = 0; done < data.size();) {  // odd-sized appends
      const size_t n = std::min<size_t>(data.size() - done, 1'000'003);
      S3_ASSERT_OK(writer.Append(std::span(data).subspan(done, n)));
      done += n;
    }
    S3_ASSERT_OK(writer.Finish());
  }
  EXPECT_EQ(Requests(*client, S3Op::kCreateMultipart), 1u);
  EXPECT_EQ(Requests(*client, S3Op::kUploadPart), 5u);
  EXPECT_EQ(Requests(*client, S3Op::kCompleteMultipart), 1u);
  EXPECT_LE(client->budget().peak(), 2 * kMinPartBytes);
  Result<ObjectInfo> info = client_->HeadObject(bucket_, key);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->size, data.size());
  EXPECT_TRUE(Get(key, 0, data.size()) == data);
  EXPECT_TRUE(Uploads().empty());
}

TEST_F(S3ClientTest, CreateOnlyMultipartLosesToAnExistingObjectAndAborts) {
  const std::string key = prefix_ + "taken";
  const std::vector<std::byte> first = Pattern(100, 8);
  S3_ASSERT_OK(client_->PutObject(bucket_, key, first, false));
  const std::vector<std::byte> data = Pattern(11u << 20, 9);
  ObjectWriter writer(client_, bucket_, key, /*create_only=*/true);
  S3_ASSERT_OK(writer.Append(data));
  const Status s = writer.Finish();
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("If-None-Match"));
  EXPECT_TRUE(Get(key, 0, first.size()) == first);
  EXPECT_TRUE(Uploads().empty()) << "the losing upload was not aborted";
}

TEST_F(S3ClientTest, AWriterDestroyedUnfinishedPublishesNothing) {
  const std::string key = prefix_ + "dropped";
  {
    ObjectWriter writer(client_, bucket_, key, false);
    S3_ASSERT_OK(writer.Append(Pattern(11u << 20, 10)));
    EXPECT_EQ(writer.parts_submitted(), 2);
  }
  EXPECT_EQ(client_->HeadObject(bucket_, key).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Uploads().empty());
}

// ---- faults --------------------------------------------------------------------------------

TEST_F(S3ClientTest, SlowDownBurstsAreRetriedWithBackoff) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const HttpRequest&, const std::string& kind, int nth) {
        // The first three tries of every request of these kinds are throttled.
        if ((kind == "PutObject" || kind == "UploadPart" || kind == "GetObject") && nth % 4 < 3) {
          return testing::S3ErrorReply(503, "SlowDown");
        }
        return Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) { o.http.fault_hook = faults; });
  const std::string key = prefix_ + "throttled";
  const std::vector<std::byte> data = Pattern(100, 11);
  S3_ASSERT_OK(client->PutObject(bucket_, key, data, true));
  std::vector<std::byte> got(100);
  S3_ASSERT_OK(client->GetRange(bucket_, key, 0, got));
  EXPECT_TRUE(got == data);
  EXPECT_EQ(client->stats().retries, 6u);
}

TEST_F(S3ClientTest, RetriesAreBoundedThenTheErrorNamesEverything) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const HttpRequest&, const std::string& kind, int) {
        return kind == "UploadPart" ? testing::S3ErrorReply(503, "SlowDown") : Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) {
    o.http.fault_hook = faults;
    o.retry.max_attempts = 4;
  });
  const std::string key = prefix_ + "never";
  ObjectWriter writer(client, bucket_, key, false);
  S3_ASSERT_OK(writer.Append(Pattern((5u << 20) + 10, 12)));
  const Status s = writer.Finish();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  // Whichever part failed first: its number and byte range.
  EXPECT_THAT(s.message(), ::testing::AnyOf(HasSubstr("part 1: S3 UploadPart s3://" + bucket_ +
                                                      "/" + key + " bytes 0-5242879"),
                                            HasSubstr("part 2: S3 UploadPart s3://" + bucket_ +
                                                      "/" + key + " bytes 5242880-5242889")));
  EXPECT_THAT(s.message(), HasSubstr("HTTP 503 SlowDown"));
  EXPECT_THAT(s.message(), HasSubstr("gave up after 4 attempts"));
  EXPECT_EQ(faults->count("UploadPart"), 8);  // both parts, 4 tries each
  EXPECT_GE(faults->count("AbortMultipartUpload"), 1);
  EXPECT_EQ(client_->HeadObject(bucket_, key).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Uploads().empty());
}

TEST_F(S3ClientTest, RetriesStopAtTheTimeBudget) {
  auto faults = std::make_shared<ScriptedFaults>([](const HttpRequest&, const std::string&, int) {
    return testing::S3ErrorReply(500, "InternalError");
  });
  auto client = NewClient([&](S3ClientOptions& o) {
    o.http.fault_hook = faults;
    o.retry.max_attempts = 1000;
    o.retry.base_delay = std::chrono::milliseconds(20);
    o.retry.max_delay = std::chrono::milliseconds(50);
    o.retry.max_total = std::chrono::milliseconds(500);
  });
  const auto start = std::chrono::steady_clock::now();
  const Status s = client->PutObject(bucket_, prefix_ + "x", Pattern(1, 1), false);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_THAT(s.message(), HasSubstr("HTTP 500 InternalError"));
  EXPECT_THAT(s.message(), HasSubstr("gave up after"));
  EXPECT_LT(took, std::chrono::milliseconds(1500));
  EXPECT_LT(faults->count("PutObject"), 1000);
}

TEST_F(S3ClientTest, APartThatKeepsFailingAbortsTheUpload) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const HttpRequest& r, const std::string& kind, int) {
        if (kind == "UploadPart" && r.url.find("partNumber=2&") != std::string::npos) {
          return testing::S3ErrorReply(500, "InternalError");
        }
        return Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) {
    o.http.fault_hook = faults;
    o.retry.max_attempts = 3;
  });
  const std::string key = prefix_ + "part2";
  ObjectWriter writer(client, bucket_, key, true);
  Status s = writer.Append(Pattern(16u << 20, 13));
  if (s.ok()) s = writer.Finish();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("part 2"));
  EXPECT_THAT(s.message(), HasSubstr("bytes 5242880-10485759"));
  EXPECT_THAT(s.message(), HasSubstr("HTTP 500 InternalError"));
  EXPECT_EQ(client_->HeadObject(bucket_, key).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Uploads().empty());
}

// A create-only PUT whose reply is lost: the retry meets its own object (412) and recognises
// it by its checksum; a different object is still kAlreadyExists.
TEST_F(S3ClientTest, ALostReplyToACreateOnlyPutIsRecognisedAsOurs) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const HttpRequest&, const std::string& kind, int nth) {
        return kind == "PutObject" && nth == 0 ? Decision{Action::kResetAfterSend} : Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) { o.http.fault_hook = faults; });
  const std::string key = prefix_ + "lost-reply";
  const std::vector<std::byte> data = Pattern(5000, 14);
  S3_ASSERT_OK(client->PutObject(bucket_, key, data, true));
  EXPECT_EQ(faults->count("PutObject"), 2);
  const Status again = client->PutObject(bucket_, key, Pattern(5000, 15), true);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
}

// Every try's reply lost (the PUT reached the server each time): a commit reported an error
// although it had committed (issue 30, item 20). Now the object is looked at: these bytes there
// is success, for a replace and a create-only PUT; when it cannot be looked at either, the
// error says the PUT may have committed; an object that is not there stays an error.
TEST_F(S3ClientTest, APutWhoseRepliesAreAllLostIsCheckedBeforeFailing) {
  std::atomic<bool> head_fails{false};
  std::atomic<bool> never_sent{false};
  auto faults =
      std::make_shared<ScriptedFaults>([&](const HttpRequest&, const std::string& kind, int) {
        if (kind == "PutObject") {
          return Decision{never_sent ? Action::kReset : Action::kResetAfterSend};
        }
        if (kind == "HeadObject" && head_fails) return Decision{Action::kReset};
        return Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) {
    o.http.fault_hook = faults;
    o.retry.max_attempts = 2;
  });
  const std::vector<std::byte> data = Pattern(3000, 31);
  for (const bool create_only : {false, true}) {
    const std::string key = prefix_ + (create_only ? "all-lost-create" : "all-lost-replace");
    S3_ASSERT_OK(client->PutObject(bucket_, key, data, create_only));
    EXPECT_TRUE(Get(key, 0, data.size()) == data);
  }
  head_fails = true;
  const Status unknown = client->PutObject(bucket_, prefix_ + "all-lost-unknown", data, false);
  EXPECT_EQ(unknown.code(), StatusCode::kIOError) << unknown.ToString();
  EXPECT_THAT(unknown.message(), HasSubstr("may have committed"));
  EXPECT_THAT(unknown.message(), HasSubstr("ask IsCommitted"));
  head_fails = false;
  never_sent = true;  // a reset before sending: nothing landed, and the HEAD says so
  const Status failed = client->PutObject(bucket_, prefix_ + "never-sent", data, false);
  EXPECT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  EXPECT_THAT(failed.message(), ::testing::Not(HasSubstr("may have committed")));
}

TEST_F(S3ClientTest, ALostReplyToACreateOnlyCompletionIsRecognisedAsOurs) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const HttpRequest&, const std::string& kind, int nth) {
        return kind == "CompleteMultipartUpload" && nth == 0 ? Decision{Action::kResetAfterSend}
                                                             : Decision{};
      });
  auto client = NewClient([&](S3ClientOptions& o) { o.http.fault_hook = faults; });
  const std::string key = prefix_ + "lost-complete";
  const std::vector<std::byte> data = Pattern(12u << 20, 16);
  ObjectWriter writer(client, bucket_, key, true);
  S3_ASSERT_OK(writer.Append(data));
  S3_ASSERT_OK(writer.Finish());
  EXPECT_EQ(faults->count("CompleteMultipartUpload"), 2);
  EXPECT_TRUE(Get(key, 0, data.size()) == data);
}

// The process dies after its parts and before the completion: nothing is visible, and the
// upload it left is found and aborted by the cleanup.
TEST_F(S3ClientTest, ACrashBetweenPartsAndCompletionLeavesNoObject) {
  std::atomic<bool> crashed{false};
  auto faults =
      std::make_shared<ScriptedFaults>([&](const HttpRequest&, const std::string& kind, int) {
        if (kind == "CompleteMultipartUpload") crashed = true;
        return crashed ? Decision{Action::kReset} : Decision{};  // nothing leaves a dead process
      });
  auto client = NewClient([&](S3ClientOptions& o) {
    o.http.fault_hook = faults;
    o.retry.max_attempts = 2;
  });
  const std::string key = prefix_ + "crashed";
  {
    ObjectWriter writer(client, bucket_, key, true);
    S3_ASSERT_OK(writer.Append(Pattern(11u << 20, 17)));
    EXPECT_FALSE(writer.Finish().ok());
  }
  EXPECT_EQ(client_->HeadObject(bucket_, key).status().code(), StatusCode::kNotFound);
  Result<ListResult> listed = client_->ListObjects(bucket_, prefix_, "");
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->objects.empty()) << "a half object is visible";
  EXPECT_EQ(Uploads(), std::vector<std::string>{key});
  // moto reports every upload as started at 2010-11-10T20:48:33Z, so "recent" here is "less
  // than a century old".
  Result<int> kept =
      client_->AbortIncompleteUploads(bucket_, prefix_, std::chrono::hours(24 * 365 * 100));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, 0) << "a recent upload (maybe a live writer's) was aborted";
  Result<int> aborted = client_->AbortIncompleteUploads(bucket_, prefix_, std::chrono::seconds(0));
  ASSERT_TRUE(aborted.ok()) << aborted.status().ToString();
  EXPECT_EQ(*aborted, 1);
  EXPECT_TRUE(Uploads().empty());
}

TEST_F(S3ClientTest, AConnectionResetInsideAPartIsRetried) {
  Result<std::unique_ptr<FaultProxy>> proxy = FaultProxy::Start(server_->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status().ToString();
  auto client =
      NewClient([&](S3ClientOptions& o) { o.config.endpoint_url = (*proxy)->endpoint(); });
  const std::string key = prefix_ + "reset";
  const std::vector<std::byte> data = Pattern(12u << 20, 18);
  (*proxy)->ResetAfterClientBytes(7u << 20);  // inside the second part's body
  ObjectWriter writer(client, bucket_, key, true);
  S3_ASSERT_OK(writer.Append(data));
  S3_ASSERT_OK(writer.Finish());
  EXPECT_EQ((*proxy)->faults_fired(), 1);
  EXPECT_GE(client->stats().retries, 1u);
  EXPECT_TRUE(Get(key, 0, data.size()) == data);
}

TEST_F(S3ClientTest, AStalledServerTimesOutAndTheRequestIsRetried) {
  Result<std::unique_ptr<FaultProxy>> proxy = FaultProxy::Start(server_->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status().ToString();
  auto client = NewClient([&](S3ClientOptions& o) {
    o.config.endpoint_url = (*proxy)->endpoint();
    o.http.stall_timeout = std::chrono::milliseconds(1000);
  });
  const std::string key = prefix_ + "stalled";
  const std::vector<std::byte> data = Pattern(1u << 20, 19);
  (*proxy)->StallAfterClientBytes(100'000, std::chrono::milliseconds(4000));
  const auto start = std::chrono::steady_clock::now();
  S3_ASSERT_OK(client->PutObject(bucket_, key, data, true));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  EXPECT_EQ((*proxy)->faults_fired(), 1);
  EXPECT_GE(client->stats().retries, 1u);
  EXPECT_TRUE(Get(key, 0, data.size()) == data);
}

TEST_F(S3ClientTest, NothingListeningIsRetriedThenNamed) {
  Result<std::unique_ptr<FaultProxy>> proxy = FaultProxy::Start(server_->port());
  ASSERT_TRUE(proxy.ok());
  const std::string dead = (*proxy)->endpoint();
  proxy->reset();  // the port is closed now
  auto client = NewClient([&](S3ClientOptions& o) {
    o.config.endpoint_url = dead;
    o.retry.max_attempts = 3;
  });
  const Status s = client->PutObject(bucket_, prefix_ + "k", Pattern(1, 1), false);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_THAT(s.message(), HasSubstr("could not connect"));
  EXPECT_THAT(s.message(), HasSubstr("gave up after 3 attempts"));
}

TEST_F(S3ClientTest, VirtualHostedAddressing) {
  const std::string host = "s3.tessera.test:" + std::to_string(server_->port());
  auto client = NewClient([&](S3ClientOptions& o) {
    o.config.endpoint_url = "http://" + host;
    o.config.addressing_style = AddressingStyle::kVirtual;
    o.http.resolve = {bucket_ + "." + host + ":127.0.0.1"};
  });
  const HttpRequest r = client->BuildRequest(
      S3Call{.method = "GET", .bucket = bucket_, .key = "a b"}, std::chrono::system_clock::now());
  EXPECT_EQ(r.url, "http://" + bucket_ + "." + host + "/a%20b");
  const std::string key = prefix_ + "virtual";
  const std::vector<std::byte> data = Pattern(300, 20);
  S3_ASSERT_OK(client->PutObject(bucket_, key, data, true));
  std::vector<std::byte> got(300);
  S3_ASSERT_OK(client->GetRange(bucket_, key, 0, got));
  EXPECT_TRUE(got == data);
  Result<ListResult> listed = client->ListObjects(bucket_, prefix_, "/");
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->objects.size(), 1u);
  EXPECT_EQ(listed->objects[0].key, key);
}

TEST(S3ClientOptionsTest, PartSizesAndEndpointsAreChecked) {
  S3ClientOptions o;
  o.part_bytes = 1u << 20;
  EXPECT_EQ(S3Client::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.part_bytes = 8u << 20;
  o.config.endpoint_url = "ftp://x";
  EXPECT_THAT(S3Client::Create(o).status().message(), HasSubstr("neither http nor https"));
  o.config.endpoint_url = "localhost:9000";
  EXPECT_THAT(S3Client::Create(o).status().message(), HasSubstr("no scheme"));
  o.config.endpoint_url = "https://minio.local:443/";
  Result<std::shared_ptr<S3Client>> c = S3Client::Create(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->BuildRequest(S3Call{.method = "GET", .bucket = "b", .key = "k"},
                               std::chrono::system_clock::now())
                .url,
            "https://minio.local/b/k");
  // Parts double every 1000 so that 10,000 parts hold large objects.
  EXPECT_EQ((*c)->PartBytes(1), 8u << 20);
  EXPECT_EQ((*c)->PartBytes(1000), 8u << 20);
  EXPECT_EQ((*c)->PartBytes(1001), 16u << 20);
  EXPECT_EQ((*c)->PartBytes(10000), 512u << 20);
  // AWS's own endpoint: virtual-hosted when the bucket name allows it.
  o.config.endpoint_url = "";
  o.config.region = "eu-west-1";
  c = S3Client::Create(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->BuildRequest(S3Call{.method = "GET", .bucket = "my-bucket", .key = "k"},
                               std::chrono::system_clock::now())
                .url,
            "https://my-bucket.s3.eu-west-1.amazonaws.com/k");
  EXPECT_EQ((*c)->BuildRequest(S3Call{.method = "GET", .bucket = "my.dotted.bucket", .key = "k"},
                               std::chrono::system_clock::now())
                .url,
            "https://s3.eu-west-1.amazonaws.com/my.dotted.bucket/k");
}

TEST(Crc32cTest, KnownValues) {
  const std::string s = "123456789";
  const auto bytes = std::as_bytes(std::span<const char>(s.data(), s.size()));
  EXPECT_EQ(Crc32c(bytes), 0xE3069283u);
  EXPECT_EQ(Crc32c(bytes.subspan(4), Crc32c(bytes.subspan(0, 4))), 0xE3069283u);
  EXPECT_EQ(Crc32c({}), 0u);
  EXPECT_EQ(Crc32cBase64(0xE3069283u), "4waSgw==");
  Result<std::vector<uint8_t>> back = Base64Decode("4waSgw==");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, (std::vector<uint8_t>{0xE3, 0x06, 0x92, 0x83}));
}

}  // namespace
}  // namespace tessera::s3
