// CheckpointManager on S3 (moto on loopback, signatures enforced): readers of a root under an
// object store's throttling.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "manager/testing/kill_trials.h"
#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"
#include "storage/s3/testing/s3_test_util.h"
#include "tessera/checkpoint_manager.h"
#include "tessera/local_comm.h"
#include "tessera/s3_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

// A storage on moto's bucket through a client of its own, with `faults` (null: none) and at most
// `max_attempts` tries per request.
std::shared_ptr<S3Storage> StorageOn(s3::testing::MotoServer& server,
                                     std::shared_ptr<s3::HttpFaultHook> faults = nullptr,
                                     int max_attempts = 10) {
  s3::S3ClientOptions options = server.ClientOptions();
  options.http.fault_hook = std::move(faults);
  options.retry.max_attempts = max_attempts;
  Result<std::shared_ptr<s3::S3Client>> client = s3::S3Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::make_shared<S3Storage>(*client, server.bucket()) : nullptr;
}

// A storage on moto's bucket whose client answers ListObjectsV2 with 503 SlowDown twice, then
// passes it on (per client: each request succeeds on its third try, within the retries); with
// `always` non-empty, every listing whose URL holds it is throttled, past the 3 tries allowed.
std::shared_ptr<S3Storage> ThrottledListings(s3::testing::MotoServer& server,
                                             std::atomic<int>& throttled,
                                             const std::string& always = "") {
  auto faults = std::make_shared<s3::testing::ScriptedFaults>(
      [&throttled, always](const s3::HttpRequest& request, const std::string& kind, int nth) {
        const bool forever = !always.empty() && request.url.find(always) != std::string::npos;
        if (kind != "ListObjectsV2" || (nth % 3 == 2 && !forever)) {
          return s3::HttpFaultHook::Decision{};
        }
        ++throttled;
        return s3::testing::S3ErrorReply(503, "SlowDown");
      });
  return StorageOn(server, faults, /*max_attempts=*/3);
}

// 64 ranks open one root at once while the store throttles their listings: every rank resumes
// from the newest step, never an older one or "no checkpoint" (issue 34; mlcommons/dlio #347
// resumed 512 throttled ranks from "0 checkpoints").
TEST(S3CheckpointManagerTest, SixtyFourRanksListingAThrottledRootResumeFromTheNewestStep) {
  Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
  ASSERT_TRUE(server.ok()) << "could not start the S3 test server (moto): "
                           << server.status().ToString();
  const std::string root = s3::testing::UniquePrefix() + "/run";
  std::atomic<int> throttled{0};
  {
    CheckpointManagerOptions o;
    o.async = false;
    o.storage = ThrottledListings(**server, throttled);
    ASSERT_NE(o.storage, nullptr);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointManager> manager,
                         CheckpointManager::Open(root, o));
    std::vector<uint32_t> values(1024);
    for (int64_t step : {100, 200, 300}) {
      for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<uint32_t>(step + i);
      StateDict dict;
      ASSERT_OK(dict.Add(ShardedTensor::Whole(
          "w", TensorView(values.data(), DType::kU32, {static_cast<int64_t>(values.size())}))));
      ASSERT_OK(manager->Save(step, dict).status());
    }
  }
  throttled = 0;
  Status s = FirstError(RunLocalRanks(64, [&](Comm& comm) -> Status {
    CheckpointManagerOptions o;
    o.storage = ThrottledListings(**server, throttled);
    if (o.storage == nullptr) return Internal("no client");
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> manager,
                             CheckpointManager::Open(root, o));
    TESSERA_ASSIGN_OR_RETURN(std::optional<int64_t> latest, manager->LatestStep());
    if (latest != std::optional<int64_t>(300)) {
      return Internal("rank " + std::to_string(comm.rank()) + " resumes from " +
                      (latest ? "step " + std::to_string(*latest) : std::string("nothing")));
    }
    return Status::Ok();
  }));
  EXPECT_OK(s);
  EXPECT_GE(throttled.load(), 64 * 2);

  // Half the ranks are throttled past their retries on the newest step's listing: they fail
  // with the store's error; none resumes from step 200.
  std::atomic<int> failed{0};
  s = FirstError(RunLocalRanks(64, [&](Comm& comm) -> Status {
    CheckpointManagerOptions o;
    o.storage = ThrottledListings(**server, throttled, comm.rank() % 2 ? "iter_0000300" : "");
    if (o.storage == nullptr) return Internal("no client");
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> manager,
                             CheckpointManager::Open(root, o));
    Result<std::optional<int64_t>> latest = manager->LatestStep();
    if (comm.rank() % 2 == 0) {
      if (latest.ok() && *latest == std::optional<int64_t>(300)) return Status::Ok();
      return Internal("rank " + std::to_string(comm.rank()) + ": " + latest.status().ToString());
    }
    if (latest.ok()) {
      return Internal("rank " + std::to_string(comm.rank()) +
                      " was throttled past its retries "
                      "and resumes from " +
                      (*latest ? "step " + std::to_string(**latest) : std::string("nothing")));
    }
    if (latest.status().code() != StatusCode::kIOError ||
        latest.status().message().find("503 SlowDown") == std::string::npos) {
      return Internal("rank " + std::to_string(comm.rank()) + ": " + latest.status().ToString());
    }
    ++failed;
    return Status::Ok();
  }));
  EXPECT_OK(s);
  EXPECT_EQ(failed.load(), 32);
}

// A storage on moto's bucket whose uploads (PutObject, UploadPart) are all throttled: a rank
// whose writes fail past its 2 tries.
std::shared_ptr<S3Storage> ThrottledUploads(s3::testing::MotoServer& server) {
  auto faults = std::make_shared<s3::testing::ScriptedFaults>([](const s3::HttpRequest&,
                                                                 const std::string& kind, int) {
    return kind == "PutObject" || kind == "UploadPart" ? s3::testing::S3ErrorReply(503, "SlowDown")
                                                       : s3::HttpFaultHook::Decision{};
  });
  return StorageOn(server, faults, /*max_attempts=*/2);
}

// Four ranks save a step collectively; rank 2's uploads are throttled past its retries. Every
// rank's save fails, with the same error naming rank 2, the object and the HTTP status, well
// within the collective deadline; the step before stays the latest and restores.
TEST(S3CheckpointManagerTest, ARankWhoseUploadsAreThrottledFailsTheSaveOnEveryRank) {
  Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string root = s3::testing::UniquePrefix() + "/run";
  auto save = [&](int64_t step, bool throttle_rank2) {
    return RunLocalRanks(
        4,
        [&](Comm& comm) -> Status {
          CheckpointManagerOptions o;
          o.async = false;
          o.storage =
              throttle_rank2 && comm.rank() == 2 ? ThrottledUploads(**server) : StorageOn(**server);
          TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> manager,
                                   CheckpointManager::Open(root, o));
          std::vector<uint32_t> rows(256);
          for (size_t i = 0; i < rows.size(); ++i) {
            rows[i] = static_cast<uint32_t>(step * 100000 + comm.rank() * 1000 + i);
          }
          StateDict dict;
          TESSERA_RETURN_IF_ERROR(dict.Add(ShardedTensor::Shard(
              "w", TensorView(rows.data(), DType::kU32, {1, 256}), {4, 256}, {comm.rank(), 0})));
          return manager->Save(step, dict, comm).status();
        },
        LocalCommOptions{.timeout = std::chrono::seconds(120)});
  };
  for (const Status& s : save(1, false)) ASSERT_OK(s);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Status> failed = save(2, true);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 60.0);
  for (size_t r = 0; r < failed.size(); ++r) {
    EXPECT_FALSE(failed[r].ok()) << "rank " << r;
    EXPECT_THAT(failed[r].message(), ::testing::HasSubstr("rank 2")) << "rank " << r;
    EXPECT_THAT(failed[r].message(), ::testing::HasSubstr("HTTP 503 SlowDown")) << "rank " << r;
    EXPECT_THAT(failed[r].message(), ::testing::HasSubstr(root + "/iter_0000002/")) << "rank " << r;
    EXPECT_EQ(failed[r].message(), failed[0].message()) << "rank " << r;
  }
  CheckpointManagerOptions o;
  o.storage = StorageOn(**server);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointManager> manager,
                       CheckpointManager::Open(root, o));
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager->LatestStep());
  EXPECT_EQ(latest, std::optional<int64_t>(1));
}

// kill -9 of a managed training loop saving to S3 at random moments, uploads in flight (a 24
// MiB state: two data files of 12 MiB, each a multipart upload of 8 MiB parts, set by the MSC
// profile the loop saves through: the default 32 MiB parts would make each one PUT): after every
// kill the latest step restores bit for bit and no committed step is lost (kill_trials::Run);
// the uploads the killed savers left are listed, and aborting them leaves none (issue 34).
TEST(CheckpointManagerKillTest, OnS3LatestLoadsAfterEveryKillAndTheDeadUploadsAreAborted) {
  Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  // The loop program finds the server as a user's program would: the AWS variables.
  ::setenv("AWS_ACCESS_KEY_ID", (*server)->credentials().access_key_id.c_str(), 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", (*server)->credentials().secret_access_key.c_str(), 1);
  ::setenv("AWS_ENDPOINT_URL", (*server)->endpoint().c_str(), 1);
  ::setenv("AWS_REGION", "us-east-1", 1);
  ::setenv("AWS_CONFIG_FILE", "/dev/null", 1);
  ::setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null", 1);
  ::unsetenv("AWS_SESSION_TOKEN");
  ::unsetenv("AWS_PROFILE");
  ::unsetenv("AWS_ENDPOINT_URL_S3");
  const std::string prefix = s3::testing::UniquePrefix() + "/run";
  testing::TempDir dir;
  kill_trials::Trials t;
  {
    std::ofstream config(dir.Sub("msc.yaml"));
    config << "profiles:\n  kill:\n    storage_provider:\n      type: s3\n"
           << "      options:\n        base_path: " << (*server)->bucket() << "/" << prefix << "\n"
           << "        endpoint_url: " << (*server)->endpoint() << "\n"
           << "        region_name: us-east-1\n        multipart_chunksize: 8388608\n";
  }
  ::setenv("MSC_CONFIG", dir.Sub("msc.yaml").c_str(), 1);
  t.root = "msc://kill";
  t.log = dir.Sub("loop.log");
  t.elements = 6 << 20;  // 24 MiB
  t.trials = 50;
  t.seed = 20261207;
  t.max_delay = std::chrono::microseconds(2500000);  // a save to moto takes about a second
  kill_trials::Run(t);
  if (HasFatalFailure()) return;

  std::shared_ptr<S3Storage> storage = StorageOn(**server);
  ASSERT_NE(storage, nullptr);
  Result<std::vector<IncompleteUpload>> left = storage->ListIncompleteUploads(prefix);
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  std::printf("kill test on S3: %zu incomplete multipart uploads left by killed savers\n",
              left->size());
  EXPECT_FALSE(left->empty()) << "no kill in 50 hit an upload in flight";
  Result<int> aborted = storage->AbortIncompleteUploads(prefix, std::chrono::seconds(0));
  ASSERT_TRUE(aborted.ok()) << aborted.status().ToString();
  EXPECT_EQ(*aborted, static_cast<int>(left->size()));
  Result<std::vector<IncompleteUpload>> after = storage->ListIncompleteUploads(prefix);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_TRUE(after->empty());
}

}  // namespace
}  // namespace tessera
