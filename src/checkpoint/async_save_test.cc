#include "tessera/async_save.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Rank r holds rows [4r, 4r + 4) of a [4 * ranks, 256] float tensor, all equal to `value`.
struct RankTensor {
  std::vector<float> data = std::vector<float>(4 * 256);
  StateDict Dict(const Comm& comm) {
    StateDict s;
    (void)s.Add(ShardedTensor::Shard("w", TensorView(data.data(), DType::kF32, {4, 256}),
                                     {4 * comm.size(), 256}, {4 * comm.rank(), 0}));
    (void)s.Add(ShardedObject{"step", {static_cast<uint8_t>(data[0])}, {comm.rank()}});
    return s;
  }
};

Status ExpectLoads(const std::string& path, std::shared_ptr<Storage> storage, Comm& comm,
                   float value) {
  RankTensor t;
  StateDict dict = t.Dict(comm);
  LoadOptions o;
  o.storage = storage;
  TESSERA_RETURN_IF_ERROR(Load(dict, path, comm, o).status());
  for (float v : t.data) {
    if (v != value)
      return Internal("loaded " + std::to_string(v) + ", want " + std::to_string(value));
  }
  return Status::Ok();
}

TEST(AsyncSaveTest, CheckpointHoldsTheValuesAtStagingTime) {
  auto storage = std::make_shared<MemoryStorage>();
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    std::fill(t.data.begin(), t.data.end(), 1.0f);
    AsyncSaveOptions o;
    o.save.storage = storage;
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, o));
    std::fill(t.data.begin(), t.data.end(), 2.0f);  // the next training step, at once
    TESSERA_RETURN_IF_ERROR(h.Wait());
    if (!h.Done() || !h.TryStatus() || !h.report()) return Internal("handle not done after Wait");
    return ExpectLoads("/ck", storage, comm, 1.0f);
  }));
  EXPECT_OK(s);
}

TEST(AsyncSaveTest, CallerKeepsUsingItsCommDuringBackgroundSaves) {
  auto storage = std::make_shared<MemoryStorage>();
  for (WhenBusy when_busy : {WhenBusy::kWait, WhenBusy::kQueue}) {
    Status s = FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
      RankTensor t;
      AsyncSaveOptions o;
      o.save.storage = storage;
      o.when_busy = when_busy;
      std::vector<AsyncSaveHandle> handles;
      for (int step = 0; step < 30; ++step) {
        // A training step: an all-reduce of gradients on the caller's comm.
        std::vector<int64_t> grad = {step, comm.rank()};
        TESSERA_RETURN_IF_ERROR(comm.AllReduce(grad, ReduceOp::kSum));
        if (grad[0] != 4 * step || grad[1] != 6) return Internal("all-reduce mixed with the save");
        std::fill(t.data.begin(), t.data.end(), static_cast<float>(step));
        if (step % 3 == 0) {
          StateDict dict = t.Dict(comm);
          TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h,
                                   AsyncSave(dict, "/ck" + std::to_string(step % 2), comm, o));
          handles.push_back(h);
        }
      }
      for (const AsyncSaveHandle& h : handles) TESSERA_RETURN_IF_ERROR(h.Wait());
      TESSERA_RETURN_IF_ERROR(ExpectLoads("/ck1", storage, comm, 27.0f));
      return ExpectLoads("/ck0", storage, comm, 24.0f);
    }));
    EXPECT_TRUE(s.ok()) << (when_busy == WhenBusy::kWait ? "kWait: " : "kQueue: ") << s.ToString();
  }
}

TEST(AsyncSaveTest, AFailingRankFailsEveryHandleAndLeavesNoManifest) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    RankTensor t;
    AsyncSaveOptions o;
    o.save.storage = memory;
    if (comm.rank() == 1) {
      o.save.storage = std::make_shared<FaultInjectingStorage>(
          memory, FaultPlan{.fail_at = 1, .crash = false, .path_filter = ""});
    }
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, o));
    return h.Wait();
  });
  for (const Status& s : statuses) EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat("/ck/tessera.manifest"));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(AsyncSaveTest, ABadStateOnOneRankFailsAsyncSaveOnEveryRank) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    StateDict dict = t.Dict(comm);
    if (comm.rank() == 1) {
      std::get<ShardedTensor>(dict.entries()[0]).global_offset = {100, 0};  // out of bounds
    }
    AsyncSaveOptions o;
    o.save.storage = memory;
    return AsyncSave(dict, "/ck", comm, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_THAT(s.message(), HasSubstr("rank 1: tensor 'w'"));
  }
}

TEST(AsyncSaveTest, DestroyingTheCommWithASaveInFlightFinishesIt) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<std::unique_ptr<Comm>> comms = NewLocalComms(2);
  std::vector<std::thread> threads;
  std::vector<Status> statuses(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      RankTensor t;
      std::fill(t.data.begin(), t.data.end(), 5.0f);
      AsyncSaveOptions o;
      o.save.storage = memory;
      StateDict dict = t.Dict(*comms[r]);
      statuses[r] = AsyncSave(dict, "/ck", *comms[r], o).status();
      comms[r].reset();  // without waiting for the handle
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) ASSERT_OK(s);
  Status s = FirstError(
      RunLocalRanks(2, [&](Comm& comm) { return ExpectLoads("/ck", memory, comm, 5.0f); }));
  EXPECT_OK(s);
}

}  // namespace
}  // namespace tessera
