#include "tessera/checkpoint_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>

#include "checkpoint/commit.h"
#include "manager/root_files.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A training state whose every byte depends on the step: rank r of n holds rows [8r, 8r + 8) of
// a [8n, 512] U32 tensor, and an object naming the step.
struct TrainState {
  std::vector<uint32_t> rows = std::vector<uint32_t>(8 * 512);
  ShardedObject note{.key = "note"};

  static uint32_t Value(int64_t step, int rank, size_t i) {
    uint64_t x = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull + rank * 1000003ull + i;
    x ^= x >> 31;
    return static_cast<uint32_t>(x * 0xBF58476D1CE4E5B9ull >> 32);
  }
  void Fill(int64_t step, int rank) {
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = Value(step, rank, i);
    const std::string text = "step " + std::to_string(step);
    note.data.assign(text.begin(), text.end());
  }
  bool Holds(int64_t step, int rank) const {
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] != Value(step, rank, i)) return false;
    }
    const std::string text = "step " + std::to_string(step);
    return note.data == std::vector<uint8_t>(text.begin(), text.end());
  }
  StateDict Dict(int rank, int ranks) {
    StateDict s;
    EXPECT_OK(s.Add(ShardedTensor::Shard("w", TensorView(rows.data(), DType::kU32, {8, 512}),
                                         {8 * ranks, 512}, {8 * rank, 0})));
    ShardedObject object = note;
    object.replica_id = {rank};
    EXPECT_OK(s.Add(std::move(object)));
    return s;
  }
  // Takes the object's loaded bytes from `dict`.
  void From(const StateDict& dict) { note.data = std::get<ShardedObject>(*dict.Find("note")).data; }
};

CheckpointManagerOptions Options(std::shared_ptr<Storage> storage, int keep_last = 0) {
  CheckpointManagerOptions o;
  o.storage = std::move(storage);
  o.retention.keep_last = keep_last;
  return o;
}

// Saves steps [first, last] through `manager`, one rank, and waits.
void SaveSteps(CheckpointManager& manager, int64_t first, int64_t last) {
  TrainState t;
  for (int64_t step = first; step <= last; ++step) {
    t.Fill(step, 0);
    StateDict dict = t.Dict(0, 1);
    ASSERT_OK(manager.Save(step, dict).status());
  }
  ASSERT_OK(manager.Wait());
}

// Restores the latest step into a fresh state and checks every byte.
Result<int64_t> RestoreAndCheck(CheckpointManager& manager, RestoreReport* out = nullptr) {
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  TESSERA_ASSIGN_OR_RETURN(RestoreReport report, manager.Restore(dict));
  t.From(dict);
  if (!t.Holds(report.step, 0)) {
    return Internal("step " + std::to_string(report.step) + " restored other bytes");
  }
  if (out) *out = report;
  return report.step;
}

// Flips one byte of the first data file of `dir`.
void CorruptDataFile(MemoryStorage& storage, const std::string& dir) {
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, storage.ListDir(dir));
  for (const std::string& name : names) {
    if (!name.ends_with(".safetensors")) continue;
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, storage.GetFileContents(dir + "/" + name));
    bytes[bytes.size() - 100] ^= 0xff;
    storage.SetFileContents(dir + "/" + name, bytes);
    return;
  }
  FAIL() << "no data file in " << dir;
}

TEST(StepDirNameTest, SortableAndOneSpellingPerStep) {
  EXPECT_EQ(StepDirName(0), "iter_0000000");
  EXPECT_EQ(StepDirName(1000), "iter_0001000");
  EXPECT_EQ(StepDirName(123456789), "iter_123456789");
  EXPECT_EQ(ParseStepDirName("iter_0001000"), 1000);
  EXPECT_EQ(ParseStepDirName("iter_123456789"), 123456789);
  for (const char* bad : {"iter_001000", "iter_00001000", "iter_0001000x", "iter_-000001",
                          "step_0001000", "iter_", "iter_99999999999999999999"}) {
    EXPECT_EQ(ParseStepDirName(bad), std::nullopt) << bad;
  }
}

TEST(CheckpointManagerTest, SavesRestoresAndRecordsTheStep) {
  auto storage = std::make_shared<MemoryStorage>();
  for (bool async : {true, false}) {
    const std::string root = async ? "/async" : "/sync";
    CheckpointManagerOptions o = Options(storage);
    o.async = async;
    CheckpointManager manager(root, o);
    ASSERT_OK_AND_ASSIGN(std::optional<int64_t> none, manager.LatestStep());
    EXPECT_EQ(none, std::nullopt);
    TrainState t;
    StateDict dict = t.Dict(0, 1);
    EXPECT_EQ(manager.Restore(dict).status().code(), StatusCode::kNotFound);
    SaveSteps(manager, 1, 3);
    ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
    EXPECT_THAT(all, ElementsAre(1, 2, 3));
    ASSERT_OK_AND_ASSIGN(int64_t step, RestoreAndCheck(manager));
    EXPECT_EQ(step, 3);
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(root + "/iter_0000002", storage));
    EXPECT_EQ(m.user_metadata.at("step"), "2");
    EXPECT_THAT(m.user_metadata.at(kManagerMetadataKey), HasSubstr("\"world_size\":1"));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> tracker,
                         storage->GetFileContents(root + "/" + kTrackerFileName));
    EXPECT_EQ(std::string(tracker.begin(), tracker.end()), "3");
    EXPECT_OK(manager.Close());
  }
}

TEST(CheckpointManagerTest, OpenFailsAtOnceNamingWhatIsWrong) {
  // A root URI that names no bucket: the error comes from Open, before any operation.
  Result<std::unique_ptr<CheckpointManager>> no_bucket = CheckpointManager::Open("s3:///run");
  EXPECT_EQ(no_bucket.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(no_bucket.status().message(), HasSubstr("names no bucket"));
  // Step names that are not valid.
  CheckpointManagerOptions bad_naming = Options(std::make_shared<MemoryStorage>());
  bad_naming.step_naming.min_digits = 20;  // 0 to 19
  Result<std::unique_ptr<CheckpointManager>> naming = CheckpointManager::Open("/r", bad_naming);
  EXPECT_EQ(naming.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(naming.status().message(), HasSubstr("min_digits"));
  // The deprecated constructor fails every operation with the same error instead.
  CheckpointManager constructed("s3:///run");
  EXPECT_EQ(constructed.LatestStep().status().message(), no_bucket.status().message());
  // A root that opens: the manager works as a constructed one.
  auto storage = std::make_shared<MemoryStorage>();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointManager> opened,
                       CheckpointManager::Open("/r", Options(storage)));
  SaveSteps(*opened, 1, 2);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, opened->LatestStep());
  EXPECT_EQ(latest, 2);
  EXPECT_OK(opened->Close());
}

TEST(CheckpointManagerTest, LatestIsTheNewestWholeCheckpoint) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 3);
  // Step 5: a save that died before its commit. Step 4: its index damaged. Step 6: a file.
  ASSERT_OK(storage->CreateDirs("/r/iter_0000005"));
  storage->SetFileContents("/r/iter_0000005/tsr-0123456789abcdef-r00000-f000.safetensors", {1});
  ASSERT_OK(storage->CreateDirs("/r/iter_0000004"));
  // A first commit (docs/FORMAT.md, section 4) that is not a manifest.
  storage->SetFileContents("/r/iter_0000004/tessera.manifest.00000000000000000001",
                           {'T', 'S', 'R'});
  storage->SetFileContents("/r/iter_0000006", {1});
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager.LatestStep());
  EXPECT_EQ(latest, 3);
  ASSERT_OK_AND_ASSIGN(std::vector<StepInfo> steps, manager.Steps());
  ASSERT_EQ(steps.size(), 5u);
  EXPECT_EQ(steps[3].state, StepState::kDamaged);
  EXPECT_THAT(steps[3].problem, HasSubstr("tessera.manifest"));
  EXPECT_EQ(steps[4].state, StepState::kUncommitted);
  // A data file removed after the commit: the checkpoint is not whole any more.
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, storage->ListDir("/r/iter_0000003"));
  for (const std::string& name : names) {
    if (name.ends_with(".safetensors")) ASSERT_OK(storage->Remove("/r/iter_0000003/" + name));
  }
  ASSERT_OK_AND_ASSIGN(latest, manager.LatestStep());
  EXPECT_EQ(latest, 2);
  // A checkpoint of another step copied into a step directory is not that step.
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> two, storage->ListDir("/r/iter_0000002"));
  ASSERT_OK(storage->CreateDirs("/r/iter_0000009"));
  for (const std::string& name : two) {
    ASSERT_OK_AND_ASSIGN(auto bytes, storage->GetFileContents("/r/iter_0000002/" + name));
    storage->SetFileContents("/r/iter_0000009/" + name, bytes);
  }
  ASSERT_OK_AND_ASSIGN(latest, manager.LatestStep());
  EXPECT_EQ(latest, 2);
}

TEST(CheckpointManagerTest, RetentionKeepsTheLastNTheMultiplesAndTheMarked) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManagerOptions o = Options(storage, 2);
  o.retention.keep_every = 4;
  CheckpointManager manager("/r", o);
  SaveSteps(manager, 1, 2);
  ASSERT_OK(manager.Mark(1, "the best eval loss"));
  SaveSteps(manager, 3, 10);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 4, 8, 9, 10));
  ASSERT_OK_AND_ASSIGN(std::vector<StepInfo> steps, manager.Steps());
  EXPECT_TRUE(steps[0].marked);
  ASSERT_TRUE(manager.LastRetention().has_value());
  EXPECT_EQ(manager.LastRetention()->steps.front().reason, "marked to be kept");
  // Unmarked, it goes with the next retention.
  ASSERT_OK(manager.Unmark(1));
  SaveSteps(manager, 11, 11);
  ASSERT_OK_AND_ASSIGN(all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(4, 8, 10, 11));
  EXPECT_EQ(manager.Mark(7).code(), StatusCode::kNotFound);
}

TEST(CheckpointManagerTest, PruneDryRunChangesNothing) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 5);
  EXPECT_EQ(manager.Prune({.keep_last = 0}).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(PruneReport dry, manager.Prune({.keep_last = 2}, /*dry_run=*/true));
  EXPECT_TRUE(dry.dry_run);
  EXPECT_EQ(dry.deleted, 3);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 2, 3, 4, 5));
  ASSERT_OK_AND_ASSIGN(PruneReport real, manager.Prune({.keep_last = 2}));
  EXPECT_EQ(real.deleted, 3);
  ASSERT_EQ(real.steps.size(), dry.steps.size());
  for (size_t i = 0; i < real.steps.size(); ++i) {
    EXPECT_EQ(real.steps[i].deleted, dry.steps[i].deleted) << real.steps[i].step;
    EXPECT_EQ(real.steps[i].reason, dry.steps[i].reason);
  }
  ASSERT_OK_AND_ASSIGN(all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(4, 5));
  ASSERT_OK_AND_ASSIGN(FileType gone, storage->Stat("/r/iter_0000001"));
  EXPECT_EQ(gone, FileType::kNotFound);
}

TEST(CheckpointManagerTest, AStepBeingReadIsNotPruned) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 3);
  ASSERT_OK_AND_ASSIGN(ReadLease lease, manager.Lease(1));
  EXPECT_EQ(lease.path(), "/r/iter_0000001");
  ASSERT_OK_AND_ASSIGN(PruneReport pruned, manager.Prune({.keep_last = 1}));
  EXPECT_EQ(pruned.deleted, 1);
  EXPECT_THAT(pruned.steps[0].reason, HasSubstr("being read by process"));
  // Another manager (another job) sees the lease too; Delete refuses as well.
  CheckpointManager other("/r", Options(storage));
  EXPECT_EQ(other.Delete(1).code(), StatusCode::kFailedPrecondition);
  lease.Release();
  ASSERT_OK_AND_ASSIGN(pruned, other.Prune({.keep_last = 1}));
  EXPECT_EQ(pruned.deleted, 1);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(3));
}

TEST(CheckpointManagerTest, ALeaseOfADeadProcessDoesNotProtect) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 2);
  const std::string dead =
      "tessera read lease\nhost=this-host-does-not-exist\nboot_id=x\npid=1\nprocess_start=1\n"
      "created_unix_ms=0\n";
  storage->SetFileContents("/r/iter_0000001/tessera.reading.0000000000000001",
                           std::vector<uint8_t>(dead.begin(), dead.end()));
  ASSERT_OK_AND_ASSIGN(PruneReport pruned, manager.Prune({.keep_last = 1}));
  EXPECT_EQ(pruned.deleted, 1);
}

TEST(CheckpointManagerTest, AReaderBacksOffFromATombstoneAndADeadDeletionIsFinished) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 3);
  // A deletion of step 1 by this process, in progress: readers back off, it is not listed.
  ASSERT_OK(manager::CreateSmallFile(*storage, "/r/iter_0000001/tessera.deleting",
                                     "tessera deletion\n" + ThisProcessOwnerRecord(), false));
  EXPECT_EQ(manager.Lease(1).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(2, 3));
  ASSERT_OK_AND_ASSIGN(PruneReport pruned, manager.Prune({.keep_last = 2}));
  EXPECT_EQ(pruned.deleted, 0);
  EXPECT_THAT(pruned.steps[0].reason, HasSubstr("being deleted by process"));
  // The deletion died after removing the manifest: the next prune finishes it.
  const std::string dead =
      "tessera deletion\nhost=gone\nboot_id=x\npid=1\nprocess_start=1\n"
      "created_unix_ms=0\n";
  storage->SetFileContents("/r/iter_0000001/tessera.deleting",
                           std::vector<uint8_t>(dead.begin(), dead.end()));
  ASSERT_OK(storage->Remove(testing::CommitPath(*storage, "/r/iter_0000001")));
  ASSERT_OK_AND_ASSIGN(pruned, manager.Prune({.keep_last = 2}));
  EXPECT_EQ(pruned.deleted, 1);
  ASSERT_OK_AND_ASSIGN(FileType gone, storage->Stat("/r/iter_0000001"));
  EXPECT_EQ(gone, FileType::kNotFound);
}

TEST(CheckpointManagerTest, RestoreFallsBackFromADamagedNewestCheckpointAndSaysSo) {
  auto storage = std::make_shared<MemoryStorage>();
  std::vector<std::string> warnings;
  CheckpointManagerOptions o = Options(storage, 2);
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  CheckpointManager manager("/r", o);
  SaveSteps(manager, 1, 3);
  CorruptDataFile(*storage, "/r/iter_0000003");
  CheckpointManager resumed("/r", o);
  RestoreReport report;
  ASSERT_OK_AND_ASSIGN(int64_t step, RestoreAndCheck(resumed, &report));
  EXPECT_EQ(step, 2);
  ASSERT_EQ(report.skipped.size(), 1u);
  EXPECT_EQ(report.skipped[0].step, 3);
  EXPECT_TRUE(report.skipped[0].failed_checks);
  EXPECT_EQ(report.skipped[0].reason.code(), StatusCode::kDataLoss);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("step 3 of /r failed its checks"));
  EXPECT_THAT(warnings[0], HasSubstr("checksum"));
  // The failed step no longer counts: LatestStep passes it over, saving from step 3 on is
  // allowed, and the retention neither counts it nor deletes it.
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, resumed.LatestStep());
  EXPECT_EQ(latest, 2);
  SaveSteps(resumed, 3, 4);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, resumed.AllSteps());
  EXPECT_THAT(all, ElementsAre(3, 4));
  ASSERT_OK_AND_ASSIGN(step, RestoreAndCheck(resumed));
  EXPECT_EQ(step, 4);
  // A step asked for by number never falls back.
  CorruptDataFile(*storage, "/r/iter_0000004");
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  CheckpointManager third("/r", o);
  Result<RestoreReport> asked = third.Restore(dict, RestoreOptions{.step = 4});
  EXPECT_EQ(asked.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(asked.status().message(), HasSubstr("restoring step 4"));
}

TEST(CheckpointManagerTest, EveryCheckpointDamagedIsAnErrorNamingEach) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManagerOptions o = Options(storage);
  o.warn = [](const std::string&) {};
  CheckpointManager manager("/r", o);
  SaveSteps(manager, 1, 2);
  CorruptDataFile(*storage, "/r/iter_0000001");
  CorruptDataFile(*storage, "/r/iter_0000002");
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  Result<RestoreReport> r = manager.Restore(dict);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("step 2: "));
  EXPECT_THAT(r.status().message(), HasSubstr("step 1: "));
}

TEST(CheckpointManagerTest, ACallerMistakeDoesNotFallBack) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManager manager("/r", Options(storage));
  SaveSteps(manager, 1, 2);
  std::vector<float> wrong(4);
  StateDict dict;
  ASSERT_OK(dict.Add(ShardedTensor::Whole("w", TensorView(wrong.data(), DType::kF32, {4}))));
  Result<RestoreReport> r = manager.Restore(dict);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("restoring step 2"));
}

TEST(CheckpointManagerTest, AStepBehindACommittedOneIsRefused) {
  auto storage = std::make_shared<MemoryStorage>();
  {
    CheckpointManager manager("/r", Options(storage));
    SaveSteps(manager, 1, 5);
  }
  // A run that forgot to restore starts from step 1 again.
  CheckpointManager fresh("/r", Options(storage));
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  Result<ManagedSave> forked = fresh.Save(1, dict);
  EXPECT_EQ(forked.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(forked.status().message(), HasSubstr("committed checkpoint of step 5"));
  EXPECT_EQ(fresh.Save(5, dict).status().code(), StatusCode::kFailedPrecondition);
  // Restored, it goes on; steps must increase.
  ASSERT_OK_AND_ASSIGN(int64_t step, RestoreAndCheck(fresh));
  EXPECT_EQ(step, 5);
  SaveSteps(fresh, 6, 6);
  EXPECT_EQ(fresh.Save(6, dict).status().code(), StatusCode::kInvalidArgument);
  // A step restored by number, with newer committed ones: saving after it is refused too (the
  // newer ones failed nothing).
  CheckpointManager older("/r", Options(storage));
  TrainState o;
  StateDict odict = o.Dict(0, 1);
  ASSERT_OK(older.Restore(odict, RestoreOptions{.step = 5}).status());
  EXPECT_EQ(older.Save(6, dict).status().code(), StatusCode::kFailedPrecondition);
  // To discard the newer steps instead: Delete them.
  CheckpointManager discard("/r", Options(storage));
  for (int64_t s : {5, 6}) ASSERT_OK(discard.Delete(s));
  SaveSteps(discard, 5, 5);
}

// A Storage whose writes under one path wait for Open(): a save that stays in flight.
class GatedStorage : public MemoryStorage {
 public:
  explicit GatedStorage(std::string gated) : gated_(std::move(gated)) {}
  using MemoryStorage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    if (path.find(gated_) != std::string::npos) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return open_; });
    }
    return MemoryStorage::NewWritableFile(path, mode);
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  const std::string gated_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

TEST(CheckpointManagerTest, SkipPolicySaysWhichSaveIsInFlight) {
  auto storage = std::make_shared<GatedStorage>("iter_0000001/tsr-");
  CheckpointManagerOptions o = Options(storage);
  o.when_saving = WhenSaving::kSkip;
  CheckpointManager manager("/r", o);
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  ASSERT_OK_AND_ASSIGN(ManagedSave first, manager.Save(1, dict));
  EXPECT_FALSE(first.skipped);
  ASSERT_OK_AND_ASSIGN(ManagedSave second, manager.Save(2, dict));
  EXPECT_TRUE(second.skipped);
  EXPECT_EQ(second.skip_reason, "the save of step 1 is still being written");
  storage->Open();
  ASSERT_OK(manager.Wait());
  ASSERT_OK_AND_ASSIGN(ManagedSave third, manager.Save(3, dict));
  EXPECT_FALSE(third.skipped);
  ASSERT_OK(manager.Close());
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 3));
  // Rank-local saves cannot agree on skipping.
  o.save.save.collective = false;
  CheckpointManager local("/l", o);
  EXPECT_EQ(local.Save(1, dict).status().code(), StatusCode::kInvalidArgument);
}

// Fails every data file write of one step's save.
FaultPlan FailStep(int64_t step) {
  return FaultPlan{.fail_at = 0, .crash = false, .path_filter = StepDirName(step) + "/tsr-"};
}

TEST(CheckpointManagerTest, AFailedBackgroundSaveRaisesInTheNextCall) {
  auto memory = std::make_shared<MemoryStorage>();
  auto storage = std::make_shared<FaultInjectingStorage>(memory);
  CheckpointManager manager("/r", Options(storage, 2));
  SaveSteps(manager, 1, 1);
  storage->SetPlan(FailStep(2));
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  ASSERT_OK(manager.Save(2, dict).status());  // fails in the background
  Result<ManagedSave> next = manager.Save(3, dict);
  EXPECT_EQ(next.status().code(), StatusCode::kIOError);
  EXPECT_THAT(next.status().message(), HasSubstr("nothing was saved for step 3"));
  EXPECT_THAT(next.status().message(), HasSubstr("the save of step 2 into /r/iter_0000002 failed"));
  EXPECT_THAT(next.status().message(), HasSubstr("injected fault"));
  // Told once; the run may go on.
  ASSERT_OK(manager.Save(4, dict).status());
  ASSERT_OK(manager.Wait());
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 4));
  // Wait and Close report it too.
  storage->SetPlan(FailStep(5));
  ASSERT_OK(manager.Save(5, dict).status());
  EXPECT_EQ(manager.Wait().code(), StatusCode::kIOError);
  EXPECT_OK(manager.Wait());
  storage->SetPlan(FailStep(6));
  ASSERT_OK(manager.Save(6, dict).status());
  EXPECT_EQ(manager.Close().code(), StatusCode::kIOError);
  EXPECT_EQ(manager.Save(7, dict).status().code(), StatusCode::kFailedPrecondition);
}

// A run killed between a commit and its retention leaves more than keep_last checkpoints; if
// every restart died the same way the root would grow without end. The next manager applies
// the policy before its first save writes anything (the failing save shows it ran first).
TEST(CheckpointManagerTest, TheFirstSaveAppliesTheRetentionAKilledRunOwed) {
  auto memory = std::make_shared<MemoryStorage>();
  auto storage = std::make_shared<FaultInjectingStorage>(memory);
  {
    CheckpointManager killed("/r", Options(storage, 0));  // as if killed before each retention
    SaveSteps(killed, 1, 5);
  }
  CheckpointManagerOptions o = Options(storage, 2);
  o.async = false;
  CheckpointManager manager("/r", o);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 2, 3, 4, 5));  // opening and listing delete nothing
  storage->SetPlan(FailStep(6));
  TrainState t;
  StateDict dict = t.Dict(0, 1);
  EXPECT_EQ(manager.Save(6, dict).status().code(), StatusCode::kIOError);
  ASSERT_OK_AND_ASSIGN(all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(4, 5));
  ASSERT_TRUE(manager.LastRetention().has_value());
  EXPECT_EQ(manager.LastRetention()->steps.size(), 5u);
  ASSERT_OK_AND_ASSIGN(int64_t restored, RestoreAndCheck(manager));
  EXPECT_EQ(restored, 5);
}

TEST(CheckpointManagerTest, TheDestructorHandsOverAFailureNobodySaw) {
  auto storage = std::make_shared<FaultInjectingStorage>(std::make_shared<MemoryStorage>());
  std::vector<Status> unseen;
  {
    CheckpointManagerOptions o = Options(storage);
    o.on_unseen_failure = [&](const Status& s) { unseen.push_back(s); };
    CheckpointManager manager("/r", o);
    storage->SetPlan(FailStep(1));
    TrainState t;
    StateDict dict = t.Dict(0, 1);
    ASSERT_OK(manager.Save(1, dict).status());
  }
  ASSERT_EQ(unseen.size(), 1u);
  EXPECT_THAT(unseen[0].message(), HasSubstr("the save of step 1"));
  // Seen through Wait: nothing left for the destructor.
  {
    CheckpointManagerOptions o = Options(storage);
    o.on_unseen_failure = [&](const Status& s) { unseen.push_back(s); };
    CheckpointManager manager("/w", o);
    storage->SetPlan(FailStep(1));
    TrainState t;
    StateDict dict = t.Dict(0, 1);
    ASSERT_OK(manager.Save(1, dict).status());
    EXPECT_FALSE(manager.Wait().ok());
  }
  EXPECT_EQ(unseen.size(), 1u);
}

TEST(CheckpointManagerDeathTest, ByDefaultAnUnseenFailureAbortsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto storage = std::make_shared<FaultInjectingStorage>(std::make_shared<MemoryStorage>());
        CheckpointManager manager("/r", Options(storage));
        storage->SetPlan(FailStep(1));
        TrainState t;
        StateDict dict = t.Dict(0, 1);
        (void)manager.Save(1, dict);
      },
      "a checkpoint save failed and the CheckpointManager of /r was destroyed");
}

TEST(CheckpointManagerTest, ManyRanksSaveAndRestoreCollectively) {
  auto storage = std::make_shared<MemoryStorage>();
  for (bool collective : {true, false}) {
    const std::string root = collective ? "/c" : "/l";
    Status s = FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
      CheckpointManagerOptions o = Options(storage, 2);
      o.save.save.collective = collective;
      CheckpointManager manager(root, o);
      TrainState t;
      for (int64_t step = 1; step <= 4; ++step) {
        t.Fill(step, comm.rank());
        StateDict dict = t.Dict(comm.rank(), comm.size());
        TESSERA_RETURN_IF_ERROR(manager.Save(step, dict, comm).status());
      }
      TESSERA_RETURN_IF_ERROR(manager.Close());
      // Rank-local: every rank's part of step 4 is there once every rank has closed. Rank 0's
      // retention ran when its own part committed, when the others' may not have been there:
      // a prune now finds steps 3 and 4 whole.
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (!collective && comm.rank() == 0) {
        TESSERA_RETURN_IF_ERROR(manager.Prune({.keep_last = 2}).status());
      }
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      CheckpointManager resumed(root, o);
      TrainState back;
      StateDict dict = back.Dict(comm.rank(), comm.size());
      TESSERA_ASSIGN_OR_RETURN(RestoreReport report, resumed.Restore(dict, comm));
      back.From(dict);
      if (report.step != 4 || !back.Holds(4, comm.rank())) {
        return Internal("restored step " + std::to_string(report.step) + " wrongly");
      }
      return Status::Ok();
    }));
    ASSERT_OK(s);
    CheckpointManager manager(root, Options(storage));
    ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
    EXPECT_THAT(all, ElementsAre(3, 4)) << root;
  }
}

TEST(CheckpointManagerTest, ARankLocalStepIsSavedAgainAfterTheAttemptThatDied) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManagerOptions o = Options(storage);
  o.save.save.collective = false;
  // Step 1 whole; step 2 saved by rank 0 only (rank 1 died with the job).
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", o);
    TrainState t;
    t.Fill(1, comm.rank());
    StateDict dict = t.Dict(comm.rank(), 2);
    TESSERA_RETURN_IF_ERROR(manager.Save(1, dict, comm).status());
    TESSERA_RETURN_IF_ERROR(manager.Wait());
    if (comm.rank() == 1) return Status::Ok();
    t.Fill(2, 0);
    dict = t.Dict(0, 2);
    TESSERA_RETURN_IF_ERROR(manager.Save(2, dict, comm).status());
    return manager.Close();
  })));
  CheckpointManager look("/r", o);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, look.LatestStep());
  EXPECT_EQ(latest, 1);
  // The job restarts from step 1 and saves step 2 again: a new session, so rank 0's part of the
  // dead attempt is no obstacle.
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", o);
    TrainState t;
    StateDict dict = t.Dict(comm.rank(), 2);
    TESSERA_ASSIGN_OR_RETURN(RestoreReport report, manager.Restore(dict, comm));
    if (report.step != 1) return Internal("restored step " + std::to_string(report.step));
    t.Fill(2, comm.rank());
    dict = t.Dict(comm.rank(), 2);
    TESSERA_RETURN_IF_ERROR(manager.Save(2, dict, comm).status());
    return manager.Close();
  })));
  ASSERT_OK_AND_ASSIGN(latest, look.LatestStep());
  EXPECT_EQ(latest, 2);
}

TEST(CheckpointManagerTest, PerRankStateNeedsTheSameWorldSizeOrAMapping) {
  auto storage = std::make_shared<MemoryStorage>();
  CheckpointManagerOptions o = Options(storage);
  o.layout = "dp4";
  ASSERT_OK(FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", o);
    TrainState t;
    StateDict dict = t.Dict(comm.rank(), comm.size());
    StepExtras extras;
    extras.per_rank["rng"] = Bytes{static_cast<uint8_t>(10 + comm.rank())};
    extras.per_rank["loader"] = Bytes{static_cast<uint8_t>(20 + comm.rank())};
    TESSERA_RETURN_IF_ERROR(manager.Save(1, dict, comm, extras).status());
    return manager.Close();
  })));
  // The same world size: each rank gets its own values.
  ASSERT_OK(FirstError(RunLocalRanks(4, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", o);
    TrainState t;
    StateDict dict = t.Dict(comm.rank(), comm.size());
    TESSERA_ASSIGN_OR_RETURN(RestoreReport report, manager.Restore(dict, comm));
    if (report.per_rank.at("rng") != std::vector<Bytes>{{static_cast<uint8_t>(10 + comm.rank())}} ||
        report.per_rank.at("loader") !=
            std::vector<Bytes>{{static_cast<uint8_t>(20 + comm.rank())}}) {
      return Internal("rank " + std::to_string(comm.rank()) + " got other per-rank values");
    }
    return Status::Ok();
  })));
  // Two ranks: an error naming the state and both world sizes, unless mapped.
  CheckpointManagerOptions two = o;
  two.layout = "dp2";
  std::vector<Status> refused = RunLocalRanks(2, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", two);
    TrainState t;
    StateDict dict = t.Dict(0, 1);
    return manager.Restore(dict, comm).status();
  });
  for (const Status& s : refused) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("the per-rank state 'loader', 'rng' of step 1 was saved "
                                       "by 4 ranks (layout dp4); this run has 2 ranks (layout "
                                       "dp2)"));
    EXPECT_THAT(s.message(), HasSubstr("map_per_rank"));
  }
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    CheckpointManager manager("/r", two);
    std::vector<uint32_t> rows(8 * 512 * 2);  // each of 2 ranks holds 16 rows
    StateDict dict;
    TESSERA_RETURN_IF_ERROR(dict.Add(ShardedTensor::Shard(
        "w", TensorView(rows.data(), DType::kU32, {16, 512}), {32, 512}, {16 * comm.rank(), 0})));
    TESSERA_RETURN_IF_ERROR(dict.Add(ShardedObject{.key = "note"}));
    RestoreOptions options;
    // Rank r of 2 takes the values of saved ranks 2r and 2r + 1.
    options.map_per_rank = [](int rank, int, int) {
      return std::vector<int>{2 * rank, 2 * rank + 1};
    };
    TESSERA_ASSIGN_OR_RETURN(RestoreReport report, manager.Restore(dict, comm, options));
    const auto want = std::vector<Bytes>{{static_cast<uint8_t>(10 + 2 * comm.rank())},
                                         {static_cast<uint8_t>(11 + 2 * comm.rank())}};
    if (report.per_rank.at("rng") != want) return Internal("mapped values differ");
    return Status::Ok();
  })));
  // A mapping to a rank the save did not have.
  CheckpointManager one("/r", two);
  TrainState t;
  std::vector<uint32_t> all(32 * 512);
  StateDict dict;
  ASSERT_OK(dict.Add(ShardedTensor::Whole("w", TensorView(all.data(), DType::kU32, {32, 512}))));
  ASSERT_OK(dict.Add(ShardedObject{.key = "note"}));
  RestoreOptions bad;
  bad.map_per_rank = [](int, int, int) { return std::vector<int>{4}; };
  Result<RestoreReport> r = one.Restore(dict, bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("gave rank 0 the saved rank 4"));
}

// An object store that throttles the reads of the paths holding `throttled` past its retries
// (what S3Storage returns then: kIOError naming the HTTP status): lists, stats and opens fail.
class ThrottlingStorage : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::string throttled;  // empty: nothing fails

  Result<FileType> Stat(const std::string& path) override {
    TESSERA_RETURN_IF_ERROR(Throttle("HeadObject", path));
    return StorageWrapper::Stat(path);
  }
  Result<std::vector<std::string>> ListDir(const std::string& dir) override {
    TESSERA_RETURN_IF_ERROR(Throttle("ListObjectsV2", dir));
    return StorageWrapper::ListDir(dir);
  }
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    TESSERA_RETURN_IF_ERROR(Throttle("HeadObject", path));
    return StorageWrapper::NewReadableFile(path);
  }

 private:
  Status Throttle(const char* op, const std::string& path) const {
    if (throttled.empty() || path.find(throttled) == std::string::npos) return Status::Ok();
    return IOError(std::string("S3 ") + op + " s3://b" + path +
                   ": HTTP 503 SlowDown: Please reduce your request rate (gave up after 10 "
                   "attempts in 31.2 s)");
  }
};

// A step the storage fails to read is neither "no checkpoint" nor a damaged one: LatestStep,
// Steps, Restore and the retention fail with the storage's error, rather than resume an older
// step or delete a good one (issue 34: throttled listings read as "0 checkpoints").
TEST(CheckpointManagerTest, AStepTheStorageFailsToReadStopsTheListingInsteadOfHidingIt) {
  auto memory = std::make_shared<MemoryStorage>();
  auto storage = std::make_shared<ThrottlingStorage>(memory);
  CheckpointManagerOptions o = Options(storage, 0);
  o.async = false;
  CheckpointManager manager("/r", o);
  SaveSteps(manager, 1, 3);
  for (const std::string& throttled : {StepDirName(3), StepDirName(3) + "/"}) {
    storage->throttled = throttled;  // the step's Stat too, or only what lies in it
    Result<std::optional<int64_t>> latest = manager.LatestStep();
    EXPECT_EQ(latest.status().code(), StatusCode::kIOError) << throttled;
    EXPECT_THAT(latest.status().message(), HasSubstr("HTTP 503 SlowDown")) << throttled;
    EXPECT_EQ(manager.Steps().status().code(), StatusCode::kIOError) << throttled;
    TrainState t;
    StateDict dict = t.Dict(0, 1);
    EXPECT_EQ(manager.Restore(dict).status().code(), StatusCode::kIOError) << throttled;
  }
  // Step 2 unreadable: a retention keeping the newest 2 (3 and 2) must not take 2 for damaged
  // and delete it; it fails and deletes nothing.
  storage->throttled = StepDirName(2) + "/";
  Result<PruneReport> pruned = manager.Prune(RetentionPolicy{.keep_last = 2});
  EXPECT_EQ(pruned.status().code(), StatusCode::kIOError);
  EXPECT_THAT(pruned.status().message(), HasSubstr("step 2"));
  storage->throttled.clear();
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 2, 3));
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager.LatestStep());
  EXPECT_EQ(latest, 3);
  ASSERT_OK_AND_ASSIGN(int64_t restored, RestoreAndCheck(manager));
  EXPECT_EQ(restored, 3);
}

// A crash (what was not durable is lost) at every storage operation of a save and its retention
// leaves a root whose LatestStep loads, bit-exact, and still holds a whole checkpoint.
TEST(CheckpointManagerCrashTest, ACrashAtEveryOperationLeavesALatestThatLoads) {
  int64_t operations = 0;
  for (int64_t fail_at = 0;; ++fail_at) {
    auto memory = std::make_shared<MemoryStorage>();
    auto storage = std::make_shared<FaultInjectingStorage>(memory);
    CheckpointManagerOptions o = Options(storage, 1);
    o.async = false;
    o.warn = [](const std::string&) {};
    {
      CheckpointManager manager("/r", o);
      SaveSteps(manager, 1, 2);
      storage->SetPlan({.fail_at = fail_at, .crash = true});
      TrainState t;
      t.Fill(3, 0);
      StateDict dict = t.Dict(0, 1);
      (void)manager.Save(3, dict);
      operations = storage->operation_count();
    }
    const bool fired = storage->fault_fired();
    memory->SimulateCrash();
    storage->SetPlan({});
    CheckpointManager after("/r", o);
    ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, after.LatestStep());
    ASSERT_TRUE(latest.has_value()) << "fault at operation " << fail_at;
    EXPECT_GE(*latest, 2) << "fault at operation " << fail_at;
    ASSERT_OK_AND_ASSIGN(int64_t restored, RestoreAndCheck(after));
    EXPECT_EQ(restored, *latest) << "fault at operation " << fail_at;
    if (!fired) break;  // the save and its retention ran to the end
  }
  EXPECT_GT(operations, 20);
}

// A storage whose Publish is made of its own calls (as on POSIX) and whose writable files call
// `hook` with their path before their first write: a pause between a file's creation and its
// bytes, where another process can run.
class PauseBeforeWriteStorage : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::function<void(const std::string&)> hook;

  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    return PublishThroughRename(path, bytes, mode, sync);
  }
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                             target().NewWritableFile(path, mode));
    return std::unique_ptr<WritableFile>(new Paused(std::move(file), path, this));
  }

 private:
  class Paused : public WritableFile {
   public:
    Paused(std::unique_ptr<WritableFile> file, std::string path, PauseBeforeWriteStorage* owner)
        : file_(std::move(file)), path_(std::move(path)), owner_(owner) {}
    Status WriteAt(uint64_t offset, const void* data, size_t size) override {
      if (owner_->hook) owner_->hook(path_);
      return file_->WriteAt(offset, data, size);
    }
    Status Sync() override { return file_->Sync(); }
    Status Close() override { return file_->Close(); }
    const std::string& path() const override { return file_->path(); }

   private:
    std::unique_ptr<WritableFile> file_;
    std::string path_;
    PauseBeforeWriteStorage* owner_;
  };
};

// Issue 30, item 4: a second deleter that runs while the first is writing its tombstone never
// sees a tombstone without its owner (once created with its own create and then written, an
// empty tombstone read as a dead deletion's, and the second deleter took the live one over).
// Every small file is published whole: under its name, a tombstone always names a live owner,
// and of the two deleters exactly one deletes the step.
TEST(CheckpointManagerTest, ASecondDeleterInsideTheTombstoneWindowDoesNotTakeOver) {
  auto memory = std::make_shared<MemoryStorage>();
  {
    CheckpointManager manager("/r", Options(memory));
    SaveSteps(manager, 1, 2);
  }
  auto paused = std::make_shared<PauseBeforeWriteStorage>(memory);
  const std::string dir = "/r/iter_0000001";
  const std::string tombstone = dir + "/" + manager::kTombstoneFileName;
  bool ran = false;
  bool visible = false;
  bool visible_alive = false;
  Status second;
  paused->hook = [&](const std::string& path) {
    if (ran || path.find(manager::kTombstoneFileName) == std::string::npos) return;
    ran = true;
    // The first deleter is between creating its tombstone's file and writing its bytes.
    ASSERT_OK_AND_ASSIGN(FileType type, memory->Stat(tombstone));
    visible = type == FileType::kFile;
    if (visible) {
      ASSERT_OK_AND_ASSIGN(std::string text, manager::ReadSmallFile(*memory, tombstone));
      visible_alive = OwnerRecordMayBeAlive(text);
    }
    second = manager::DeleteStepDir(*memory, "/r", dir, /*sync=*/false);
  };
  Status first = manager::DeleteStepDir(*paused, "/r", dir, /*sync=*/false);
  ASSERT_TRUE(ran) << "the tombstone was never written";
  EXPECT_TRUE(!visible || visible_alive)
      << "a tombstone was visible under its name without a live owner";
  if (visible) {
    EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition) << second.ToString();
    EXPECT_THAT(second.message(), HasSubstr("is being deleted by process"));
  }
  EXPECT_NE(first.ok(), second.ok())
      << "first: " << first.ToString() << "; second: " << second.ToString();
  ASSERT_OK_AND_ASSIGN(FileType gone, memory->Stat(dir));
  EXPECT_EQ(gone, FileType::kNotFound);
  // Step 2 is untouched.
  CheckpointManager manager("/r", Options(memory));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(2));
}

}  // namespace
}  // namespace tessera
