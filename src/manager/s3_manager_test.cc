// CheckpointManager on S3 (moto on loopback, signatures enforced): readers of a root under an
// object store's throttling.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"
#include "storage/s3/testing/s3_test_util.h"
#include "tessera/checkpoint_manager.h"
#include "tessera/local_comm.h"
#include "tessera/s3_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

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
  s3::S3ClientOptions options = server.ClientOptions();
  options.http.fault_hook = faults;
  options.retry.max_attempts = 3;
  Result<std::shared_ptr<s3::S3Client>> client = s3::S3Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::make_shared<S3Storage>(*client, server.bucket()) : nullptr;
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

}  // namespace
}  // namespace tessera
