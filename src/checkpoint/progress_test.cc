// The progress callbacks of Save, Load and Verify: one thread (the caller's), never
// backwards, ending at done == total, and the totals mean what the headers say.
#include "checkpoint/progress.h"

#include <gtest/gtest.h>

#include <mutex>
#include <thread>

#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

// Records the calls of one progress callback and the threads they came from.
struct Recorder {
  std::thread::id caller = std::this_thread::get_id();
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  bool other_thread = false;
  std::function<void(uint64_t, uint64_t)> Callback() {
    return [this](uint64_t done, uint64_t total) {
      other_thread |= std::this_thread::get_id() != caller;
      calls.emplace_back(done, total);
    };
  }
  // Never backwards, one total, ending at done == total == `want_total`.
  void Check(uint64_t want_total) const {
    ASSERT_FALSE(calls.empty());
    EXPECT_FALSE(other_thread);
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i].second, want_total) << "call " << i;
      EXPECT_LE(calls[i].first, calls[i].second) << "call " << i;
      if (i > 0) {
        EXPECT_LE(calls[i - 1].first, calls[i].first) << "call " << i;
      }
    }
    EXPECT_EQ(calls.back().first, want_total);
  }
};

TEST(ProgressMeterTest, ReportsFromTheCallingThreadWhileWorkersRunAndClampsToTheTotal) {
  Recorder recorder;
  ProgressMeter meter(recorder.Callback(), 1000);
  meter.ParallelFor(3, [&](size_t i) {
    for (int k = 0; k < 5; ++k) {
      meter.Add(100);
      std::this_thread::sleep_for(std::chrono::milliseconds(60));  // several report intervals
    }
  });
  EXPECT_GE(recorder.calls.size(), 3u);  // reports while the workers ran, and at the end
  meter.Finish();
  recorder.Check(1000);
  // Without a callback the calling thread works too, and nothing is reported.
  ProgressMeter silent(nullptr, 10);
  std::vector<std::thread::id> ids(2);
  silent.ParallelFor(2, [&](size_t i) { ids[i] = std::this_thread::get_id(); });
  EXPECT_EQ(ids[0], std::this_thread::get_id());
  EXPECT_NE(ids[1], std::this_thread::get_id());
}

// A state of `n` float tensors of `elements` each, whole.
struct Floats {
  // uint32_t holding F32 bits: compared bitwise (random bits include NaNs).
  std::vector<std::vector<uint32_t>> data;
  Floats(int n, size_t elements, uint64_t seed) : data(n, std::vector<uint32_t>(elements)) {
    for (int i = 0; i < n; ++i) testing::FillRandom(data[i].data(), elements * 4, seed + i);
  }
  StateDict Dict() {
    StateDict s;
    for (size_t i = 0; i < data.size(); ++i) {
      (void)s.Add(ShardedTensor::Whole(
          "t" + std::to_string(i),
          TensorView(data[i].data(), DType::kF32, {static_cast<int64_t>(data[i].size())})));
    }
    return s;
  }
};

TEST(ProgressTest, LoadAndVerifyCountTheBytesOfTheirWork) {
  auto storage = std::make_shared<MemoryStorage>();
  Floats saved(4, 1 << 18, 1);  // 4 MiB
  SaveOptions save;
  save.storage = storage;
  Recorder save_progress;
  save.progress = save_progress.Callback();
  ASSERT_OK_AND_ASSIGN(SaveReport report, Save(saved.Dict(), "/ck", save));
  save_progress.Check(report.bytes_written);

  Floats loaded(4, 1 << 18, 99);
  StateDict dict = loaded.Dict();
  LoadOptions load;
  load.storage = storage;
  Recorder load_progress;
  load.progress = load_progress.Callback();
  ASSERT_OK_AND_ASSIGN(LoadReport loaded_report, Load(dict, "/ck", load));
  EXPECT_EQ(loaded_report.bytes_needed, 4u << 20);
  load_progress.Check(loaded_report.bytes_needed);
  EXPECT_EQ(loaded.data, saved.data);

  VerifyOptions verify;
  verify.storage = storage;
  Recorder verify_progress;
  verify.progress = verify_progress.Callback();
  ASSERT_OK_AND_ASSIGN(VerifyReport verified, Verify("/ck", verify));
  verify_progress.Check(verified.bytes_checked);
  EXPECT_EQ(verified.bytes_checked, 4u << 20);
}

// Every rank reports its own bytes, read or received from other ranks, on its own thread.
TEST(ProgressTest, ShardedLoadWithReadSharingReachesEachRanksBytesNeeded) {
  auto storage = std::make_shared<MemoryStorage>();
  Floats saved(3, 1 << 16, 2);
  SaveOptions save;
  save.storage = storage;
  ASSERT_OK(Save(saved.Dict(), "/ck", save));
  for (ReadSharing sharing : {ReadSharing::kNone, ReadSharing::kAllGather, ReadSharing::kBroadcast,
                              ReadSharing::kReadOnce}) {
    SCOPED_TRACE(static_cast<int>(sharing));
    Status status = FirstError(RunLocalRanks(3, [&](Comm& comm) -> Status {
      // Every rank loads everything (replicas): with sharing, each rank reads some of it and
      // receives the rest.
      Floats mine(3, 1 << 16, 50 + comm.rank());
      StateDict dict = mine.Dict();
      LoadOptions load;
      load.storage = storage;
      load.read_sharing = sharing;
      Recorder recorder;
      load.progress = recorder.Callback();
      TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(dict, "/ck", comm, load));
      recorder.Check(report.bytes_needed);
      if (mine.data != saved.data) return Internal("rank loaded wrong values");
      if (sharing != ReadSharing::kNone && report.bytes_received == 0) {
        return Internal("nothing was shared");
      }
      return Status::Ok();
    }));
    ASSERT_OK(status);
  }
}

}  // namespace
}  // namespace tessera
