#include "tessera/async_save.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "core/thread_priority.h"
#include "device/device_staging.h"
#include "device/host_memory_device.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
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

AsyncSaveOptions Deferred(std::shared_ptr<Storage> storage) {
  AsyncSaveOptions o;
  o.save.storage = std::move(storage);
  o.staging = StagingMode::kDeferred;
  return o;
}

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
  for (StagingMode staging : {StagingMode::kBlocking, StagingMode::kDeferred}) {
    for (WhenBusy when_busy : {WhenBusy::kWait, WhenBusy::kQueue}) {
      Status s = FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
        RankTensor t;
        AsyncSaveOptions o;
        o.save.storage = storage;
        o.when_busy = when_busy;
        o.staging = staging;
        o.staging_piece_bytes = 4096;  // 1 KiB rows: every save is 4 pieces on 2 threads
        o.staging_threads = 2;
        std::vector<AsyncSaveHandle> handles;
        for (int step = 0; step < 30; ++step) {
          // A training step: an all-reduce of gradients on the caller's comm, then the
          // optimizer step (after the last save's staging).
          std::vector<int64_t> grad = {step, comm.rank()};
          TESSERA_RETURN_IF_ERROR(comm.AllReduce(grad, ReduceOp::kSum));
          if (grad[0] != 4 * step || grad[1] != 6)
            return Internal("all-reduce mixed with the save");
          if (!handles.empty()) TESSERA_RETURN_IF_ERROR(handles.back().WaitStaged());
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
      EXPECT_TRUE(s.ok()) << (staging == StagingMode::kBlocking ? "kBlocking, " : "kDeferred, ")
                          << (when_busy == WhenBusy::kWait ? "kWait: " : "kQueue: ")
                          << s.ToString();
    }
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
  EXPECT_FALSE(testing::HasCommit(*memory, "/ck"));
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

TEST(AsyncSaveTest, ABadStateOnOneRankFailsDeferredSavesInWaitWithNoCollectiveInTheCall) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> calls(3), staged(3);
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    RankTensor t;
    StateDict dict = t.Dict(comm);
    if (comm.rank() == 1) {
      std::get<ShardedTensor>(dict.entries()[0]).global_offset = {100, 0};  // out of bounds
    }
    Result<AsyncSaveHandle> h = AsyncSave(dict, "/ck", comm, Deferred(memory));
    calls[comm.rank()] = h.status();
    if (!h.ok()) return h.status();
    staged[comm.rank()] = h->WaitStaged();
    return h->Wait();
  });
  EXPECT_OK(calls[0]);
  EXPECT_THAT(calls[1].message(), HasSubstr("tensor 'w'"));
  EXPECT_OK(calls[2]);
  EXPECT_OK(staged[0]);
  EXPECT_OK(staged[2]);
  for (int r : {0, 2}) EXPECT_THAT(statuses[r].message(), HasSubstr("rank 1: tensor 'w'"));
  EXPECT_FALSE(testing::HasCommit(*memory, "/ck"));
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

// Runs `before` ahead of every file a save creates and of the manifest's publication: the
// points the tests below hold a save at, or watch it from.
class HookedStorage : public StorageWrapper {
 public:
  HookedStorage(std::shared_ptr<Storage> base, std::function<void()> before)
      : StorageWrapper(std::move(base)), before_(std::move(before)) {}
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    before_();
    return target().NewWritableFile(path, mode);
  }
  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    before_();
    return target().Publish(path, bytes, mode, sync);
  }

 private:
  std::function<void()> before_;
};

// Forwards to `base`, but holds the creation of every writable file (and the publication) until
// Open(): a save can neither write nor commit before the test lets it.
class GateStorage : public HookedStorage {
 public:
  explicit GateStorage(std::shared_ptr<Storage> base)
      : HookedStorage(std::move(base), [this] { Wait(); }) {}
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Several tensors per rank, of several dtypes and sizes (empty, smaller than a piece, several
// pieces), with random bytes; the keys are the rank's own.
struct RandomState {
  std::vector<std::vector<uint8_t>> buffers;
  StateDict dict;
  RandomState(int rank, uint64_t seed) {
    const std::vector<std::pair<DType, int64_t>> tensors = {
        {DType::kF32, 0},    {DType::kF32, 3},    {DType::kBF16, 5000},
        {DType::kI64, 1500}, {DType::kU8, 70000}, {DType::kF64, 17}};
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto [dtype, n] = tensors[i];
      buffers.push_back(testing::RandomBytes(n * DTypeSize(dtype), seed * 100 + rank * 10 + i));
      (void)dict.Add(ShardedTensor::Whole("r" + std::to_string(rank) + ".t" + std::to_string(i),
                                          TensorView(buffers.back().data(), dtype, {n})));
    }
    (void)dict.Add(ShardedObject{"r" + std::to_string(rank) + ".obj", {1, 2, 3}, {}});
  }
  // Fresh zeroed buffers with the same keys, to load into.
  static RandomState Zeroed(int rank) {
    RandomState s(rank, 0);
    for (auto& b : s.buffers) std::fill(b.begin(), b.end(), 0);
    return s;
  }
};

// Every chunk checksum (the manifest's record of the bytes) of the checkpoint at `path`.
Result<std::map<std::string, std::vector<uint64_t>>> ChunkChecksums(const std::string& path,
                                                                    std::shared_ptr<Storage> s) {
  TESSERA_ASSIGN_OR_RETURN(Metadata metadata, ReadMetadata(path, s));
  std::map<std::string, std::vector<uint64_t>> sums;
  for (const TensorInfo& t : metadata.tensors) {
    for (const ChunkInfo& c : t.chunks) sums[t.key].push_back(c.location.checksum);
  }
  return sums;
}

TEST(AsyncSaveTest, DeferredStagingCommitsTheSameBytesAsBlocking) {
  auto storage = std::make_shared<MemoryStorage>();
  Status s = FirstError(RunLocalRanks(3, [&](Comm& comm) -> Status {
    RandomState state(comm.rank(), 7);
    AsyncSaveOptions o;
    o.save.storage = storage;
    o.staging_piece_bytes = 4096;  // big tensors span pieces, small ones share them
    o.staging_threads = 3;
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle blocking, AsyncSave(state.dict, "/b", comm, o));
    TESSERA_RETURN_IF_ERROR(blocking.Wait());
    o.staging = StagingMode::kDeferred;
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle deferred, AsyncSave(state.dict, "/d", comm, o));
    TESSERA_RETURN_IF_ERROR(deferred.WaitStaged());
    TESSERA_RETURN_IF_ERROR(deferred.Wait());
    for (const std::string path : {"/b", "/d"}) {
      RandomState loaded = RandomState::Zeroed(comm.rank());
      TESSERA_RETURN_IF_ERROR(
          Load(loaded.dict, path, comm, LoadOptions{.storage = storage}).status());
      if (loaded.buffers != state.buffers) return Internal(path + " holds other bytes");
    }
    return Status::Ok();
  }));
  ASSERT_OK(s);
  ASSERT_OK_AND_ASSIGN(auto blocking_sums, ChunkChecksums("/b", storage));
  ASSERT_OK_AND_ASSIGN(auto deferred_sums, ChunkChecksums("/d", storage));
  EXPECT_EQ(blocking_sums.size(), 18u);
  EXPECT_EQ(blocking_sums, deferred_sums);
}

TEST(AsyncSaveTest, WaitStagedReturnsBeforeTheCommitAndLaterChangesAreNotSaved) {
  auto memory = std::make_shared<MemoryStorage>();
  auto gate = std::make_shared<GateStorage>(memory);
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    std::fill(t.data.begin(), t.data.end(), 1.0f);
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, Deferred(gate)));
    TESSERA_RETURN_IF_ERROR(h.WaitStaged());
    if (!h.Staged() || h.Done()) return Internal("staged: want true, done: want false");
    std::fill(t.data.begin(), t.data.end(), 2.0f);  // the optimizer step
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() == 0) gate->Open();
    TESSERA_RETURN_IF_ERROR(h.Wait());
    return ExpectLoads("/ck", memory, comm, 1.0f);
  }));
  EXPECT_OK(s);
}

TEST(AsyncSaveTest, TheCheckCatchesATensorChangedBeforeWaitStaged) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> staged(2);
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    std::fill(t.data.begin(), t.data.end(), 1.0f);
    AsyncSaveOptions o = Deferred(memory);
    o.check_unchanged_until_staged = true;
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, o));
    if (comm.rank() == 1) {
      while (!h.Staged()) std::this_thread::yield();  // the copy is made...
      t.data[700] = 3.0f;                             // ...and the source changes after it
    }
    staged[comm.rank()] = h.WaitStaged();
    return h.Wait();
  });
  EXPECT_OK(staged[0]);
  EXPECT_EQ(staged[1].code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(staged[1].message(),
              HasSubstr("tensor 'w' changed before WaitStaged (bytes [0, 4096)"));
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("rank 1: tensor 'w' changed"));
  }
  EXPECT_FALSE(testing::HasCommit(*memory, "/ck"));
}

TEST(AsyncSaveTest, TheCheckPassesUnchangedTensorsWhoeverChecks) {
  // WaitStaged, Wait, the next AsyncSave (under kWait: it would otherwise wait forever for a
  // save waiting for its check), dropping the handle, destroying the comm: each does the check.
  auto memory = std::make_shared<MemoryStorage>();
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    AsyncSaveOptions o = Deferred(memory);
    o.check_unchanged_until_staged = true;
    o.staging_piece_bytes = 4096;
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle a, AsyncSave(dict, "/a", comm, o));
    TESSERA_RETURN_IF_ERROR(a.WaitStaged());
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle b, AsyncSave(dict, "/b", comm, o));
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle c, AsyncSave(dict, "/c", comm, o));
    TESSERA_RETURN_IF_ERROR(b.Wait());  // b was checked by AsyncSave of c
    TESSERA_RETURN_IF_ERROR(c.Wait());
    TESSERA_RETURN_IF_ERROR(AsyncSave(dict, "/d", comm, o).status());  // the handle goes at once
    return a.Wait();
  }));
  EXPECT_OK(s);
  for (const std::string path : {"/a", "/b", "/c", "/d"}) {
    Status loaded = FirstError(
        RunLocalRanks(2, [&](Comm& comm) { return ExpectLoads(path, memory, comm, 0.0f); }));
    EXPECT_TRUE(loaded.ok()) << path << ": " << loaded.ToString();
  }
}

TEST(AsyncSaveTest, DroppingTheHandleWaitsForTheCopyBeforeTheCallerFreesItsTensors) {
  auto memory = std::make_shared<MemoryStorage>();
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    // 16 MiB in 4 KiB pieces on one thread: the copy is far from done when AsyncSave returns.
    auto data = std::make_unique<std::vector<float>>(4 << 20, 4.0f);
    StateDict dict;
    TESSERA_RETURN_IF_ERROR(
        dict.Add(ShardedTensor::Shard("big", TensorView(data->data(), DType::kF32, {1024, 4096}),
                                      {2048, 4096}, {1024 * comm.rank(), 0})));
    AsyncSaveOptions o = Deferred(memory);
    o.staging_threads = 1;
    o.staging_piece_bytes = 4096;
    TESSERA_RETURN_IF_ERROR(AsyncSave(dict, "/ck", comm, o).status());  // handle dropped here
    std::fill(data->begin(), data->end(), -1.0f);  // would reach the checkpoint if still copying
    data.reset();
    // A second save on the comm: its Wait means the first one is committed too.
    StateDict empty;
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(empty, "/empty", comm, o));
    TESSERA_RETURN_IF_ERROR(h.Wait());
    std::vector<float> loaded(4 << 20, 0.0f);
    StateDict load;
    TESSERA_RETURN_IF_ERROR(
        load.Add(ShardedTensor::Shard("big", TensorView(loaded.data(), DType::kF32, {1024, 4096}),
                                      {2048, 4096}, {1024 * comm.rank(), 0})));
    TESSERA_RETURN_IF_ERROR(Load(load, "/ck", comm, LoadOptions{.storage = memory}).status());
    if (std::count(loaded.begin(), loaded.end(), 4.0f) != static_cast<ptrdiff_t>(loaded.size())) {
      return Internal("the checkpoint holds bytes written after the handle was dropped");
    }
    return Status::Ok();
  }));
  EXPECT_OK(s);
}

TEST(AsyncSaveTest, BadStagingOptionsFailAsyncSaveOnEveryRank) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    StateDict dict = t.Dict(comm);
    AsyncSaveOptions o;  // kBlocking: the call agrees
    o.save.storage = memory;
    if (comm.rank() == 1) o.staging_threads = 0;
    Status threads = AsyncSave(dict, "/ck", comm, o).status();
    o.staging_threads = 4;
    if (comm.rank() == 0) o.staging_piece_bytes = 100;
    Status pieces = AsyncSave(dict, "/ck", comm, o).status();
    if (threads.ok() || pieces.ok()) return Internal("bad options accepted");
    return InvalidArgument(threads.message() + " | " + pieces.message());
  });
  for (const Status& s : statuses) {
    EXPECT_THAT(s.message(),
                HasSubstr("rank 1: AsyncSaveOptions::staging_threads must be at least 1, not 0"));
    EXPECT_THAT(s.message(),
                HasSubstr("rank 0: AsyncSaveOptions::staging_piece_bytes must be at least 4096"));
  }
}

// Records the nice value of the threads that create the data files and publish the manifest.
class NiceRecordingStorage : public HookedStorage {
 public:
  explicit NiceRecordingStorage(std::shared_ptr<Storage> base)
      : HookedStorage(std::move(base), [this] { Record(); }) {}
  std::set<int> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  void Record() {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.insert(ThisThreadNice());
  }
  std::mutex mu_;
  std::set<int> seen_;
};

TEST(AsyncSaveTest, TheBackgroundSaveRunsAtItsNiceValueAndTheCallerKeepsItsOwn) {
  const int caller_nice = ThisThreadNice();
  if (caller_nice != 0) GTEST_FAIL() << "the test must start at nice 0, not " << caller_nice;
  for (const int nice : {10, 0}) {  // fresh comms: fresh threads, which start at nice 0
    auto storage = std::make_shared<NiceRecordingStorage>(std::make_shared<MemoryStorage>());
    std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
      RankTensor t;
      StateDict dict = t.Dict(comm);
      AsyncSaveOptions o;  // kBlocking: the caller's thread helps copy, at its own priority
      o.save.storage = storage;
      o.background_nice = nice;
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, o));
      TESSERA_RETURN_IF_ERROR(h.Wait());
      if (ThisThreadNice() != 0) return Internal("the caller's thread was made nicer");
      return Status::Ok();
    });
    for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(storage->seen(), std::set<int>{nice});
  }
}

TEST(AsyncSaveTest, ANiceValueOutOfRangeIsRefusedNamingTheOption) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(1, [&](Comm& comm) -> Status {
    RankTensor t;
    StateDict dict = t.Dict(comm);
    AsyncSaveOptions o;
    o.save.storage = memory;
    o.background_nice = 20;
    return AsyncSave(dict, "/ck", comm, o).status();
  });
  EXPECT_THAT(statuses[0].message(),
              HasSubstr("AsyncSaveOptions::background_nice must be 0 to 19, not 20"));
}

TEST(AsyncSaveTest, AStagingBufferThatCannotBeAllocatedFailsNamingTheTensor) {
  std::vector<float> small(4);
  StateDict dict;
  // 2^52 bytes: more than any address space; the data is never read, the allocation fails.
  ASSERT_OK(dict.Add(ShardedTensor::Whole(
      "huge", TensorView(small.data(), DType::kU8, {int64_t{1} << 26, int64_t{1} << 26}))));
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  AsyncSaveOptions o = Deferred(std::make_shared<MemoryStorage>());
  Result<AsyncSaveHandle> h = AsyncSave(dict, "/ck", *comm, o);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(h.status().message(), HasSubstr("tensor 'huge': allocating a staging buffer"));
}

TEST(AsyncSaveTest, AWriteFailureAfterDeferredStagingReachesWaitNotWaitStaged) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> staged(2);
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    RankTensor t;
    AsyncSaveOptions o = Deferred(memory);
    if (comm.rank() == 1) {
      o.save.storage = std::make_shared<FaultInjectingStorage>(
          memory, FaultPlan{.fail_at = 1, .crash = false, .path_filter = ""});
    }
    StateDict dict = t.Dict(comm);
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, "/ck", comm, o));
    staged[comm.rank()] = h.WaitStaged();
    return h.Wait();
  });
  for (const Status& s : staged) EXPECT_OK(s);
  for (const Status& s : statuses) EXPECT_THAT(s.message(), HasSubstr("rank 1"));
}

// Not built under AddressSanitizer: it keeps freed memory in quarantine, so resident memory is
// not the program's.
#if !defined(__SANITIZE_ADDRESS__)
uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

TEST(AsyncSaveTest, MemoryStaysFlatOver100DeferredSaves) {
  testing::TempDir dir;
  uint64_t after_2 = 0, after_100 = 0;
  constexpr size_t kRankBytes = 2 << 20;
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    std::vector<float> data(kRankBytes / sizeof(float), 1.0f);
    StateDict dict;
    TESSERA_RETURN_IF_ERROR(
        dict.Add(ShardedTensor::Shard("w", TensorView(data.data(), DType::kF32, {512, 1024}),
                                      {1024, 1024}, {512 * comm.rank(), 0})));
    AsyncSaveOptions o = Deferred(nullptr);
    o.save.sync = SyncPolicy::kNone;
    o.staging_piece_bytes = 256 << 10;
    for (int i = 0; i < 100; ++i) {
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(dict, dir.Sub("ck"), comm, o));
      TESSERA_RETURN_IF_ERROR(h.WaitStaged());
      data[i] = static_cast<float>(i);
      TESSERA_RETURN_IF_ERROR(h.Wait());
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (comm.rank() == 0 && i == 1) after_2 = ResidentBytes();
      if (comm.rank() == 0 && i == 99) after_100 = ResidentBytes();
    }
    return Status::Ok();
  }));
  ASSERT_OK(s);
  // One staging set per rank is kept; a leak of one per save would add 400 MiB.
  EXPECT_LT(static_cast<int64_t>(after_100) - static_cast<int64_t>(after_2),
            static_cast<int64_t>(kRankBytes))
      << "after save 2: " << after_2 << " bytes resident, after save 100: " << after_100;
}
#endif  // !defined(__SANITIZE_ADDRESS__)

TEST(AsyncSaveTest, DestroyingTheCommWaitsForDeferredStagingAndItsCheck) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<std::unique_ptr<Comm>> comms = NewLocalComms(2);
  std::vector<std::thread> threads;
  std::vector<Status> statuses(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      RankTensor t;
      std::fill(t.data.begin(), t.data.end(), 6.0f);
      AsyncSaveOptions o = Deferred(memory);
      o.check_unchanged_until_staged = true;
      StateDict dict = t.Dict(*comms[r]);
      Result<AsyncSaveHandle> h = AsyncSave(dict, "/ck", *comms[r], o);
      statuses[r] = h.status();
      comms[r].reset();  // the handle is alive and unchecked: the saver checks, then commits
      if (h.ok() && !h->Done()) statuses[r] = Internal("not done after the comm was destroyed");
      if (h.ok() && statuses[r].ok()) statuses[r] = h->Wait();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) ASSERT_OK(s);
  Status s = FirstError(
      RunLocalRanks(2, [&](Comm& comm) { return ExpectLoads("/ck", memory, comm, 6.0f); }));
  EXPECT_OK(s);
}

// ---- AsyncSaveOptions::staging_budget_bytes ----

// Rank r holds rows [64r, 64r + 64) of a [64 * ranks, 4096] float tensor (1 MiB a rank) of
// random values, and a small tensor.
struct BigRankState {
  std::vector<uint8_t> big, small;
  StateDict dict;
  BigRankState(const Comm& comm, uint64_t seed)
      : big(testing::RandomBytes(64 * 4096 * 4, seed + comm.rank())),
        small(testing::RandomBytes(40, seed + 100 + comm.rank())) {
    (void)dict.Add(ShardedTensor::Shard("w", TensorView(big.data(), DType::kF32, {64, 4096}),
                                        {64 * comm.size(), 4096}, {64 * comm.rank(), 0}));
    (void)dict.Add(ShardedTensor::Whole("r" + std::to_string(comm.rank()) + ".b",
                                        TensorView(small.data(), DType::kU8, {40})));
  }
  // Loads `path` into zeroed buffers and compares them with this state's bytes.
  Status ExpectSavedIn(const std::string& path, std::shared_ptr<Storage> storage, Comm& comm) {
    BigRankState loaded(comm, 0);
    std::fill(loaded.big.begin(), loaded.big.end(), 0);
    std::fill(loaded.small.begin(), loaded.small.end(), 0);
    TESSERA_RETURN_IF_ERROR(
        Load(loaded.dict, path, comm, LoadOptions{.storage = storage}).status());
    if (loaded.big != big || loaded.small != small) return Internal(path + " holds other bytes");
    return Status::Ok();
  }
};

uint64_t HostStagingBytes() {
  Result<std::shared_ptr<DeviceStaging>> staging = DeviceStaging::For(HostMemoryDevice::Get());
  return staging.ok() ? (*staging)->pinned_bytes() : ~uint64_t{0};
}

TEST(AsyncSaveTest, OverItsStagingBudgetASaveHandsTheTensorsBackOnlyAsItWritesThem) {
  ReleaseIdlePinnedMemory(*HostMemoryDevice::Get());
  constexpr uint64_t kBudget = 64 << 10;  // 1/16 of a rank's state
  auto memory = std::make_shared<MemoryStorage>();
  auto gate = std::make_shared<GateStorage>(memory);
  std::atomic<uint64_t> most_staged{0};
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    BigRankState state(comm, 11);
    const std::vector<uint8_t> at_call = state.big;
    AsyncSaveOptions o = Deferred(gate);
    o.staging_budget_bytes = kBudget;
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(state.dict, "/ck", comm, o));
    // Nothing can be written yet, so at most the budget is staged: the tensors stay the caller's.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (h.Staged()) return Internal("staged before a byte was written, over a budget");
    most_staged = std::max<uint64_t>(most_staged, HostStagingBytes());
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() == 0) gate->Open();
    TESSERA_RETURN_IF_ERROR(h.WaitStaged());
    most_staged = std::max<uint64_t>(most_staged, HostStagingBytes());
    std::fill(state.big.begin(), state.big.end(), 0xEE);  // the optimizer step: not saved
    TESSERA_RETURN_IF_ERROR(h.Wait());
    state.big = at_call;
    return state.ExpectSavedIn("/ck", memory, comm);
  }));
  ASSERT_OK(s);
  // Both ranks (threads of this process) share the host staging: a budget each.
  EXPECT_GT(most_staged.load(), 0u);
  EXPECT_LE(most_staged.load(), 2 * kBudget);
}

TEST(AsyncSaveTest, WithABudgetBlockingStagingReturnsOnceStagedAndTheStateFitsTheBudget) {
  auto memory = std::make_shared<MemoryStorage>();
  auto gate = std::make_shared<GateStorage>(memory);
  Status s = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    BigRankState state(comm, 12);
    AsyncSaveOptions o;
    o.save.storage = memory;
    o.staging_budget_bytes = 100 << 10;  // kBlocking: AsyncSave returns once staged
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle over, AsyncSave(state.dict, "/over", comm, o));
    if (!over.Staged()) return Internal("kBlocking returned before the state was staged");
    TESSERA_RETURN_IF_ERROR(over.Wait());
    TESSERA_RETURN_IF_ERROR(state.ExpectSavedIn("/over", memory, comm));
    // A budget the state fits in: copied whole at once, before anything is written.
    o.save.storage = gate;
    o.staging = StagingMode::kDeferred;
    o.staging_budget_bytes = 2 << 20;
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle fits, AsyncSave(state.dict, "/fits", comm, o));
    TESSERA_RETURN_IF_ERROR(fits.WaitStaged());
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() == 0) gate->Open();
    TESSERA_RETURN_IF_ERROR(fits.Wait());
    return state.ExpectSavedIn("/fits", memory, comm);
  }));
  EXPECT_OK(s);
}

TEST(AsyncSaveTest, TheUnchangedCheckOverAStagingBudgetIsRefusedNamingBothOptions) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(2, [&](Comm& comm) -> Status {
    BigRankState state(comm, 13);
    AsyncSaveOptions o = Deferred(memory);
    o.staging_budget_bytes = 64 << 10;
    o.check_unchanged_until_staged = true;
    return AsyncSave(state.dict, "/ck", comm, o).status();
  });
  for (const Status& status : statuses) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.message();
    EXPECT_THAT(status.message(), HasSubstr("check_unchanged_until_staged"));
    EXPECT_THAT(status.message(), HasSubstr("staging_budget_bytes (65536)"));
  }
  EXPECT_FALSE(ReadMetadata("/ck", memory).ok());
}

}  // namespace
}  // namespace tessera
