// Rank-local saves (SaveOptions::collective false, docs/FORMAT.md section 4.2) attacked the way
// a user or a broken job would: damaged, stray and disagreeing rank manifests, saves of
// several kinds into one directory, Finalize interrupted at every storage operation, and the
// operations that read a checkpoint run on a directory of rank manifests. The ranks run one
// after another in this process (a rank-local save makes no Comm call).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "checkpoint/rank_local_save.h"
#include "format/tessera/manifest.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/remove_keys.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 2;
constexpr int64_t kRows = 4;  // rows of "w" per rank

// Generation `gen` of one rank's state: rows [4r, 4r+4) of "w" [4N, 3] (F32), the whole "b"
// [5] held by every rank (rank 0 the main replica), and the object "step" on every rank.
struct RankState {
  std::vector<float> w, b;
  std::vector<uint8_t> step;
  int rank;
  explicit RankState(int gen, int r)
      : w(kRows * 3), b(5), step{static_cast<uint8_t>(gen)}, rank(r) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = gen * 1000.0f + rank * 100.0f + i;
    for (size_t i = 0; i < b.size(); ++i) b[i] = -gen * 1000.0f - i;
  }
  StateDict Dict(DType w_dtype = DType::kF32) {
    StateDict s;
    Shape local = {kRows, w_dtype == DType::kF32 ? 3 : 6};  // F16 of the same bytes
    EXPECT_OK(s.Add(ShardedTensor::Shard("w", TensorView(w.data(), w_dtype, local),
                                         {kRows * kRanks, local[1]}, {kRows * rank, 0})));
    EXPECT_OK(
        s.Add(ShardedTensor::Shard("b", TensorView(b.data(), DType::kF32, {5}), {5}, {0}, {rank})));
    EXPECT_OK(s.Add(ShardedObject{"step", step, {}}));
    return s;
  }
};

SaveOptions RankLocal(const std::string& tag, std::shared_ptr<Storage> storage) {
  SaveOptions o;
  o.collective = false;
  o.save_tag = tag;
  o.storage = std::move(storage);
  return o;
}

// Saves generation `gen` rank-locally on the given ranks (all by default).
void SaveRanks(const std::string& path, int gen, const std::string& tag,
               std::shared_ptr<Storage> storage, std::vector<int> ranks = {0, 1},
               bool pause = true) {
  for (int r : ranks) {
    RankState s(gen, r);
    ASSERT_OK(SaveRankLocal(s.Dict(), path, r, kRanks, RankLocal(tag, storage)));
  }
  // Distinct save times (milliseconds) for the saves that follow.
  if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(3));
}

// A collective save of generation `gen` by kRanks ranks.
void SaveCollective(const std::string& path, int gen, std::shared_ptr<Storage> storage,
                    bool pause = true) {
  std::vector<Status> statuses = RunLocalRanks(kRanks, [&](Comm& comm) -> Status {
    RankState s(gen, comm.rank());
    SaveOptions o;
    o.storage = storage;
    return Save(s.Dict(), path, comm, o).status();
  });
  for (const Status& s : statuses) ASSERT_OK(s);
  if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(3));
}

// Loads the whole "w", "b" and "step" in one process; returns the generation they hold, -1
// when the load fails (error in *error), -2 when the values are of no single generation.
int LoadedGeneration(const std::string& path, std::shared_ptr<Storage> storage, Status* error) {
  std::vector<float> w(kRows * kRanks * 3, -1), b(5, -1);
  StateDict s;
  EXPECT_OK(
      s.Add(ShardedTensor::Whole("w", TensorView(w.data(), DType::kF32, {kRows * kRanks, 3}))));
  EXPECT_OK(s.Add(ShardedTensor::Whole("b", TensorView(b.data(), DType::kF32, {5}))));
  EXPECT_OK(s.Add(ShardedObject{"step", {}, {}}));
  LoadOptions o;
  o.storage = storage;
  *error = Load(s, path, o).status();
  if (!error->ok()) return -1;
  const int gen = std::get<ShardedObject>(*s.Find("step")).data.at(0);
  for (int r = 0; r < kRanks; ++r) {
    RankState want(gen, r);
    if (!std::equal(want.w.begin(), want.w.end(), w.begin() + r * want.w.size())) return -2;
    if (want.b != b) return -2;
  }
  return gen;
}

int LoadedGeneration(const std::string& path, std::shared_ptr<Storage> storage) {
  Status error;
  const int gen = LoadedGeneration(path, storage, &error);
  EXPECT_GE(gen, 0) << error.ToString();
  return gen;
}

std::vector<std::string> Names(Storage& storage, const std::string& path) {
  Result<std::vector<std::string>> names = storage.ListDir(path);
  EXPECT_OK(names);
  std::vector<std::string> out = names.ok() ? *names : std::vector<std::string>{};
  std::sort(out.begin(), out.end());
  return out;
}

int CountRankManifests(Storage& storage, const std::string& path) {
  std::vector<std::string> names = Names(storage, path);
  return std::count_if(names.begin(), names.end(), [](const std::string& n) {
    return n.starts_with("tessera.manifest.rank-");
  });
}

std::string PartPath(const std::string& path, const std::string& tag, int rank) {
  return path + "/" + RankManifestName(RankLocalSaveId(tag), rank);
}

// ---- disagreeing ranks -----------------------------------------------------------------------

TEST(RankLocalTest, RanksSavingDifferentDtypesAreNamedWithTheKeyAndBothRanks) {
  auto memory = std::make_shared<MemoryStorage>();
  RankState r0(1, 0), r1(1, 1);
  ASSERT_OK(SaveRankLocal(r0.Dict(), "/ck", 0, kRanks, RankLocal("t", memory)));
  ASSERT_OK(SaveRankLocal(r1.Dict(DType::kF16), "/ck", 1, kRanks, RankLocal("t", memory)));
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_THAT(error.message(), HasSubstr("key 'w'"));
  EXPECT_THAT(error.message(), HasSubstr("on rank 0"));
  EXPECT_THAT(error.message(), HasSubstr("on rank 1"));
}

// A key that is a tensor on one rank and an object on another.
TEST(RankLocalTest, KeyThatIsATensorOnOneRankAndAnObjectOnAnotherIsNamedWithBothRanks) {
  auto memory = std::make_shared<MemoryStorage>();
  RankState r0(1, 0);
  ASSERT_OK(SaveRankLocal(r0.Dict(), "/ck", 0, kRanks, RankLocal("t", memory)));
  RankState r1(1, 1);
  StateDict other;
  ASSERT_OK(other.Add(ShardedObject{"w", {1, 2}, {}}));
  ASSERT_OK(SaveRankLocal(other, "/ck", 1, kRanks, RankLocal("t", memory)));
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_THAT(error.message(), HasSubstr("key 'w'"));
  EXPECT_THAT(error.message(), HasSubstr("tensor on rank 0"));
  EXPECT_THAT(error.message(), HasSubstr("object on rank 1"));
}

// Ranks given different tags (e.g. the rank in the tag) make one incomplete save each.
TEST(RankLocalTest, RanksGivenDifferentTagsAreToldSo) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "step-1.rank0", memory, {0});
  SaveRanks("/ck", 1, "step-1.rank1", memory, {1});
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_EQ(error.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(error.message(), HasSubstr("different SaveOptions::save_tag"));
}

// Two ranks that both hold an overlapping (not equal) box as the main replica.
TEST(RankLocalTest, OverlapBetweenRanksIsNamedWithBothRanks) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<float> data(6, 1.0f);
  for (int r = 0; r < kRanks; ++r) {
    StateDict s;
    ASSERT_OK(
        s.Add(ShardedTensor::Shard("w", TensorView(data.data(), DType::kF32, {6}), {10}, {4 * r})));
    ASSERT_OK(SaveRankLocal(s, "/ck", r, kRanks, RankLocal("t", memory)));
  }
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_THAT(error.message(), HasSubstr("key 'w'"));
  EXPECT_THAT(error.message(), HasSubstr("overlap"));
  EXPECT_THAT(error.message(), HasSubstr("written by rank 0 and rank 1"));
}

// A rank of a save by another number of ranks (a misconfigured job): an error naming the file.
TEST(RankLocalTest, RankManifestClaimingAnotherNumberOfRanksIsNamed) {
  auto memory = std::make_shared<MemoryStorage>();
  RankState r0(1, 0), r1(1, 1);
  ASSERT_OK(SaveRankLocal(r0.Dict(), "/ck", 0, kRanks, RankLocal("t", memory)));
  ASSERT_OK(SaveRankLocal(r1.Dict(), "/ck", 1, 3, RankLocal("t", memory)));
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_THAT(error.message(), HasSubstr(RankManifestName(RankLocalSaveId("t"), 1)));
  EXPECT_THAT(error.message(), HasSubstr("3 ranks"));
}

// A part of a rank beyond the save's number of ranks beside a complete save (a job of 3 ranks
// that saved the same tag): the newest save is damaged, so the error names the file rather than
// an older checkpoint loading in silence.
TEST(RankLocalTest, ExtraPartOfARankBeyondNumRanksIsNamed) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  SaveRanks("/ck", 2, "t", memory);
  ASSERT_OK(SaveRankLocal(StateDict(), "/ck", 2, 3, RankLocal("t", memory)));
  Status error;
  EXPECT_EQ(LoadedGeneration("/ck", memory, &error), -1);
  EXPECT_THAT(error.message(), HasSubstr(PartPath("/ck", "t", 2)));
  EXPECT_THAT(error.message(), HasSubstr("of a save by 2 ranks"));
}

// A part copied under another rank's name: its own part_rank gives it away.
TEST(RankLocalTest, PartRankDisagreeingWithTheFileNameIsNamed) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "t", memory, {0});
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> part, memory->GetFileContents(PartPath("/ck", "t", 0)));
  memory->SetFileContents(PartPath("/ck", "t", 1), part);
  Status error = ReadMetadata("/ck", memory).status();
  EXPECT_THAT(error.message(), HasSubstr(PartPath("/ck", "t", 1)));
  EXPECT_THAT(error.message(), HasSubstr("part of rank 0"));
}

// ---- damaged and stray files -------------------------------------------------------------------

void FlipLastByte(MemoryStorage& memory, const std::string& path) {
  Result<std::vector<uint8_t>> bytes = memory.GetFileContents(path);
  ASSERT_OK(bytes);
  bytes->back() ^= 0xff;
  memory.SetFileContents(path, *bytes);
}

// The newest save's part is damaged: the reader says which file, rather than loading something
// else silently.
TEST(RankLocalTest, CorruptPartOfTheNewestSaveIsNamed) {
  for (int victim : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(victim) + "'s part is corrupt");
    auto memory = std::make_shared<MemoryStorage>();
    SaveCollective("/ck", 1, memory);
    SaveRanks("/ck", 2, "t", memory);
    FlipLastByte(*memory, PartPath("/ck", "t", victim));
    Status error;
    EXPECT_EQ(LoadedGeneration("/ck", memory, &error), -1);
    EXPECT_THAT(error.message(), HasSubstr(PartPath("/ck", "t", victim)));
    EXPECT_THAT(error.message(), HasSubstr("checksum mismatch"));
    EXPECT_THAT(error.message(), HasSubstr("the next save into the directory supersedes it"));
  }
}

// A damaged part of a save that is not the checkpoint (a later collective save replaced it)
// does not make the directory unreadable: the later save loads and its cleanup removes the
// damaged save.
TEST(RankLocalTest, CorruptPartOfAnOlderSaveDoesNotHideTheNewerCheckpoint) {
  for (int victim : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(victim) + "'s part is corrupt");
    auto memory = std::make_shared<MemoryStorage>();
    SaveRanks("/ck", 1, "t", memory);
    FlipLastByte(*memory, PartPath("/ck", "t", victim));
    SaveCollective("/ck", 2, memory);
    EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
    EXPECT_EQ(CountRankManifests(*memory, "/ck"), 0) << "the cleanup removed the damaged save";
    ASSERT_OK(Verify("/ck", memory));
  }
}

// A save of one rank whose only part is truncated: the error names the file, alone in the
// directory or placed above a committed checkpoint (a damaged newest checkpoint is never
// replaced silently by an older one; version 2 counted it as missing, having no time to order
// it by). A version 2 save whose only part is truncated still counts as missing.
TEST(RankLocalTest, TruncatedOnlyPartIsNamedAndNeverHidesBehindAnOlderCheckpoint) {
  auto memory = std::make_shared<MemoryStorage>();
  RankState s(1, 0);
  ASSERT_OK(SaveRankLocal(s.Dict(), "/alone", 0, 1, RankLocal("t", memory)));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                       memory->GetFileContents(PartPath("/alone", "t", 0)));
  bytes.resize(bytes.size() / 2);
  memory->SetFileContents(PartPath("/alone", "t", 0), bytes);
  Status error = ReadMetadata("/alone", memory).status();
  EXPECT_THAT(error.message(), HasSubstr(PartPath("/alone", "t", 0)));

  SaveCollective("/ck", 1, memory);
  ASSERT_OK(SaveRankLocal(s.Dict(), "/ck", 0, 1, RankLocal("t", memory)));
  memory->SetFileContents(PartPath("/ck", "t", 0), bytes);
  EXPECT_EQ(LoadedGeneration("/ck", memory, &error), -1);
  EXPECT_THAT(error.message(), HasSubstr(PartPath("/ck", "t", 0)));
  EXPECT_THAT(error.message(), HasSubstr("the next save into the directory supersedes it"));

  // Version 2: a collective save's manifest and, newer by save time, a save whose part is cut.
  auto old = std::make_shared<MemoryStorage>();
  SaveCollective("/v2", 1, old);
  ASSERT_OK_AND_ASSIGN(Metadata whole, ReadMetadata("/v2", old));
  const std::string numbered = testing::CommitPath(*old, "/v2");
  old->SetFileContents("/v2/tessera.manifest", EncodeManifestVersion2(whole));
  ASSERT_OK(old->Remove(numbered));
  Metadata part = whole;
  part.save_id = RankLocalSaveId("t");
  part.part_rank = 0;
  part.num_ranks = 1;
  part.save_time_unix_ms = whole.save_time_unix_ms + 1000;
  Bytes cut = EncodeManifestVersion2(part);
  cut.resize(cut.size() / 2);
  old->SetFileContents("/v2/" + RankManifestName(part.save_id, 0), cut);
  EXPECT_EQ(LoadedGeneration("/v2", old), 1);
}

// A rank that died while writing its part leaves "<part>.tmp": readers ignore it, the rank's
// retry of the same tag replaces it, and the cleanup of a later save removes it.
TEST(RankLocalTest, StrayTemporaryPartIsIgnoredAndCleanedUp) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  memory->SetFileContents(PartPath("/ck", "t", 1) + ".tmp", {1, 2, 3});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  SaveRanks("/ck", 2, "t", memory);
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  memory->SetFileContents(PartPath("/ck", "u", 0) + ".tmp", {1, 2, 3});
  SaveCollective("/ck", 3, memory);
  EXPECT_EQ(LoadedGeneration("/ck", memory), 3);
  for (const std::string& name : Names(*memory, "/ck")) {
    EXPECT_FALSE(name.starts_with("tessera.manifest.rank-")) << name;
  }
}

// The data files of a complete set deleted by hand: the load and Verify name a missing file.
TEST(RankLocalTest, DeletedDataFilesOfACompleteSetAreNamed) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "t", memory);
  std::vector<std::string> removed;
  for (const std::string& name : Names(*memory, "/ck")) {
    if (name.starts_with("tsr-") && name.find("-r00001-") != std::string::npos) {
      removed.push_back(name);
      ASSERT_OK(memory->Remove("/ck/" + name));
    }
  }
  ASSERT_FALSE(removed.empty());
  auto names_a_removed_file = [&](const Status& error) {
    EXPECT_THAT(error.message(), HasSubstr("is missing"));
    return std::any_of(removed.begin(), removed.end(), [&](const std::string& name) {
      return error.message().find(name) != std::string::npos;
    });
  };
  Status error;
  EXPECT_EQ(LoadedGeneration("/ck", memory, &error), -1);
  EXPECT_TRUE(names_a_removed_file(error)) << error.ToString();
  Status verified = Verify("/ck", memory).status();
  EXPECT_TRUE(names_a_removed_file(verified)) << verified.ToString();
}

// ---- saves of several kinds into one directory -------------------------------------------------

TEST(RankLocalTest, CollectiveSaveAfterARankLocalOneRemovesItsFiles) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "t", memory);
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  SaveCollective("/ck", 2, memory);
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/ck", memory));
  const std::string old_id = RankLocalSaveId("t");
  for (const std::string& name : Names(*memory, "/ck")) {
    EXPECT_EQ(name.find(old_id), std::string::npos) << name;
  }
}

TEST(RankLocalTest, NewestCompleteSaveWinsAndAnIncompleteOneFallsBack) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  SaveRanks("/ck", 2, "t2", memory, {1});  // incomplete
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  SaveRanks("/ck", 2, "t2", memory, {0});  // complete
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  SaveRanks("/ck", 3, "t3", memory, {0});  // newer, incomplete
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  SaveRanks("/ck", 3, "t3", memory, {1});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 3);
  ASSERT_OK_AND_ASSIGN(Metadata finalized, Finalize("/ck", memory));
  EXPECT_EQ(finalized.save_id, RankLocalSaveId("t3"));
  EXPECT_EQ(LoadedGeneration("/ck", memory), 3);
  EXPECT_EQ(CountRankManifests(*memory, "/ck"), 0) << "t2's parts are removed too";
  ASSERT_OK(Verify("/ck", memory));
}

// An incomplete rank-local save beside a PyTorch DCP checkpoint does not hide it; once complete,
// it is the checkpoint of the directory.
TEST(RankLocalTest, IncompleteRankLocalSaveBesideADcpCheckpointDoesNotHideIt) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<Status> statuses = RunLocalRanks(kRanks, [&](Comm& comm) -> Status {
    RankState s(1, comm.rank());
    SaveOptions o;
    o.storage = memory;
    o.format = CheckpointFormat::kTorchDist;
    return Save(s.Dict(), "/ck", comm, o).status();
  });
  for (const Status& s : statuses) ASSERT_OK(s);
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  SaveRanks("/ck", 2, "t2", memory, {0});  // incomplete
  ASSERT_OK_AND_ASSIGN(Metadata dcp, ReadMetadata("/ck", memory));
  EXPECT_EQ(dcp.format, CheckpointFormat::kTorchDist);
  SaveRanks("/ck", 2, "t2", memory, {1});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
}

// Saves are ordered by save time in milliseconds: a rank-local save that follows a collective
// one within the same millisecond must still be the newer.
TEST(RankLocalTest, RankLocalSaveRightAfterACollectiveOneIsTheNewer) {
  for (int i = 0; i < 50; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    auto memory = std::make_shared<MemoryStorage>();
    SaveCollective("/ck", 1, memory, /*pause=*/false);
    SaveRanks("/ck", 2, "t", memory, {0, 1}, /*pause=*/false);
    ASSERT_EQ(LoadedGeneration("/ck", memory), 2);
  }
}

// Ranks run at their own pace: rank 0 commits its part of the next save before rank 1 commits
// its part of this one, and Finalize of this save runs before rank 1 starts the next. Finalize
// must neither make the merged manifest newer than the next save (it took the latest part's
// time while saves are ordered by the lowest rank's) nor let its cleanup delete the next save's
// part of rank 0 (no live marker protected it).
TEST(RankLocalTest, FinalizedSaveStaysOlderThanTheNextOneOfAFastRank) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "t1", memory, {0});
  SaveRanks("/ck", 2, "t2", memory, {0});
  SaveRanks("/ck", 1, "t1", memory, {1});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  ASSERT_OK_AND_ASSIGN(Metadata finalized, Finalize("/ck", memory));
  EXPECT_EQ(finalized.save_id, RankLocalSaveId("t1"));
  SaveRanks("/ck", 2, "t2", memory, {1});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  ASSERT_OK_AND_ASSIGN(finalized, Finalize("/ck", memory));
  EXPECT_EQ(finalized.save_id, RankLocalSaveId("t2"));
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
}

// ---- a rank that dies mid-save
// -------------------------------------------------------------------

// Rank 1's part of a rank-local save over a collective checkpoint, through a FaultInjecting
// storage that crashes at operation n, then a simulated machine crash: the directory loads the
// previous checkpoint or the new one, never a mix, and rank 1 saving the same tag again completes
// the new one.
TEST(RankLocalTest, CrashAtEveryStepOfARanksSaveThenItsRetryCompletesTheSave) {
  auto run = [](int64_t n, int64_t* ops) {
    auto memory = std::make_shared<MemoryStorage>();
    SaveCollective("/ck", 1, memory);
    SaveRanks("/ck", 2, "t", memory, {0});
    EXPECT_OK(memory->SyncDir("/ck"));
    auto faulty = std::make_shared<FaultInjectingStorage>(
        memory, FaultPlan{.fail_at = n, .crash = true, .path_filter = ""});
    RankState s(2, 1);
    const Status saved = SaveRankLocal(s.Dict(), "/ck", 1, kRanks, RankLocal("t", faulty)).status();
    if (ops) *ops = faulty->operation_count();
    memory->SimulateCrash();
    const int gen = LoadedGeneration("/ck", memory);
    EXPECT_TRUE(gen == 1 || gen == 2) << gen;
    if (saved.ok()) {
      EXPECT_EQ(gen, 2) << "a save that reported success must be durable";
    }
    if (gen == 1) {
      EXPECT_OK(SaveRankLocal(s.Dict(), "/ck", 1, kRanks, RankLocal("t", memory)));
      EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
    }
    EXPECT_OK(Verify("/ck", memory));
    return gen;
  };
  int64_t total_ops = 0;
  ASSERT_EQ(run(-1, &total_ops), 2);
  ASSERT_GT(total_ops, 5);
  int old_seen = 0, new_seen = 0;
  for (int64_t n = 0; n <= total_ops; ++n) {
    SCOPED_TRACE("crash at operation " + std::to_string(n));
    (run(n, nullptr) == 1 ? old_seen : new_seen)++;
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

// ---- Finalize interrupted ----------------------------------------------------------------------

// A collective save of generation 1, then a complete rank-local save of generation 2, then
// Finalize through a FaultInjectingStorage with `plan`.
struct FinalizeOverExisting {
  std::shared_ptr<MemoryStorage> memory = std::make_shared<MemoryStorage>();
  std::shared_ptr<FaultInjectingStorage> faulty;
  Status finalized;
  explicit FinalizeOverExisting(FaultPlan plan) {
    SaveCollective("/ck", 1, memory);
    SaveRanks("/ck", 2, "t", memory);
    // The saves are long over: their markers' removal is durable (else a simulated crash
    // brings back a marker of this live process, which protects its save's files).
    EXPECT_OK(memory->SyncDir("/ck"));
    faulty = std::make_shared<FaultInjectingStorage>(memory, std::move(plan));
    finalized = Finalize("/ck", faulty).status();
  }
};

// Finalize changes which manifest holds the checkpoint, not the checkpoint: a crash at any
// step leaves generation 2, and Finalize again finishes the job.
TEST(RankLocalTest, CrashAtEveryStepOfFinalizeKeepsTheCheckpointAndFinalizeAgainFinishes) {
  FinalizeOverExisting clean{FaultPlan{}};
  ASSERT_OK(clean.finalized);
  const int64_t total_ops = clean.faulty->operation_count();
  ASSERT_GT(total_ops, 5);
  for (int64_t n = 0; n <= total_ops; ++n) {
    SCOPED_TRACE("crash at operation " + std::to_string(n));
    FinalizeOverExisting run{FaultPlan{.fail_at = n, .crash = true, .path_filter = ""}};
    run.memory->SimulateCrash();
    EXPECT_EQ(LoadedGeneration("/ck", run.memory), 2);
    if (run.finalized.ok()) {
      EXPECT_EQ(CountRankManifests(*run.memory, "/ck"), 0);
      continue;
    }
    ASSERT_OK(Finalize("/ck", run.memory));
    EXPECT_EQ(CountRankManifests(*run.memory, "/ck"), 0);
    EXPECT_EQ(LoadedGeneration("/ck", run.memory), 2);
    ASSERT_OK(Verify("/ck", run.memory));
    for (const std::string& name : Names(*run.memory, "/ck")) {
      EXPECT_FALSE(name.starts_with("tessera.saving.")) << name;
    }
  }
}

TEST(RankLocalTest, FailureAtEveryStepOfFinalizeKeepsTheCheckpointAndFinalizeAgainFinishes) {
  int64_t n = 0;
  for (;; ++n) {
    SCOPED_TRACE("failure at operation " + std::to_string(n));
    FinalizeOverExisting run{FaultPlan{.fail_at = n, .crash = false, .path_filter = ""}};
    EXPECT_EQ(LoadedGeneration("/ck", run.memory), 2);
    if (run.finalized.ok() && !run.faulty->fault_fired()) break;  // past the last operation
    if (!run.finalized.ok()) {
      EXPECT_THAT(run.finalized.message(), HasSubstr("injected fault"));
      // Finalize again finishes the job; or, when the failure came after the last part was
      // removed (the directory's sync), says there is nothing left to do.
      Status again = Finalize("/ck", run.memory).status();
      if (!again.ok()) {
        EXPECT_THAT(again.message(), HasSubstr("nothing to finalize"));
      }
    }
    EXPECT_EQ(CountRankManifests(*run.memory, "/ck"), 0);
    EXPECT_EQ(LoadedGeneration("/ck", run.memory), 2);
  }
  EXPECT_GT(n, 5);
}

// A crash between the commit of the merged manifest and the removal of the parts: both read as
// the same checkpoint, and Finalize again removes the parts (rather than refusing).
TEST(RankLocalTest, FinalizeAgainAfterACrashBeforeThePartsWereRemoved) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  SaveRanks("/ck", 2, "t", memory);
  std::vector<uint8_t> parts[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_OK_AND_ASSIGN(parts[r], memory->GetFileContents(PartPath("/ck", "t", r)));
  }
  ASSERT_OK(Finalize("/ck", memory));
  for (int r = 0; r < kRanks; ++r) memory->SetFileContents(PartPath("/ck", "t", r), parts[r]);
  ASSERT_OK_AND_ASSIGN(Metadata both, ReadMetadata("/ck", memory));
  EXPECT_EQ(both.save_id, RankLocalSaveId("t"));
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  ASSERT_OK(Finalize("/ck", memory));
  EXPECT_EQ(CountRankManifests(*memory, "/ck"), 0);
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  // With nothing left to merge, Finalize says so.
  EXPECT_THAT(Finalize("/ck", memory).status().message(), HasSubstr("nothing to finalize"));
}

// ---- operations on a directory of rank manifests -----------------------------------------------

// RemoveKeys reads the merged set and commits a whole manifest without the keys; the parts go.
TEST(RankLocalTest, RemoveKeysOnAnUnfinalizedSave) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  SaveRanks("/ck", 2, "t", memory);
  RemoveKeysOptions o;
  o.storage = memory;
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport report, RemoveKeys("/ck", {"b"}, o));
  EXPECT_EQ(report.removed_tensors, std::vector<std::string>{"b"});
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/ck", memory));
  EXPECT_EQ(m.part_rank, -1);
  ASSERT_EQ(m.tensors.size(), 1u);
  EXPECT_EQ(m.tensors[0].key, "w");
  EXPECT_EQ(CountRankManifests(*memory, "/ck"), 0);
  ASSERT_OK(Verify("/ck", memory));
  std::vector<float> w(kRows * kRanks * 3);
  StateDict s;
  ASSERT_OK(
      s.Add(ShardedTensor::Whole("w", TensorView(w.data(), DType::kF32, {kRows * kRanks, 3}))));
  LoadOptions lo;
  lo.storage = memory;
  lo.unexpected_keys = KeyPolicy::kSkip;  // "step"
  ASSERT_OK(Load(s, "/ck", lo));
  EXPECT_EQ(w[0], 2000.0f);
  EXPECT_EQ(w[kRows * 3], 2100.0f);
}

// ---- what ranks hold ----------------------------------------------------------------------------

// A distributed optimizer's flat ranges (each rank a piece of the flattened local box), a
// partial tensor and per-rank objects.
TEST(RankLocalTest, FlatRangesPartialTensorsAndObjects) {
  auto memory = std::make_shared<MemoryStorage>();
  std::vector<float> full(24);
  for (size_t i = 0; i < full.size(); ++i) full[i] = i + 0.5f;
  std::vector<float> emb(6, 7.0f);
  for (int r = 0; r < kRanks; ++r) {
    const int64_t begin = r == 0 ? 0 : 10, end = r == 0 ? 10 : 24;
    StateDict s;
    ASSERT_OK(s.Add(ShardedTensor::FlatShard(
        "exp_avg", TensorView(full.data() + begin, DType::kF32, {end - begin}), {4, 6}, {0, 0},
        {4, 6}, begin)));
    ShardedTensor part = ShardedTensor::Shard("emb", TensorView(emb.data(), DType::kF32, {2, 3}),
                                              {10, 3}, {2 * r, 0});
    part.partial = true;
    ASSERT_OK(s.Add(std::move(part)));
    ASSERT_OK(s.Add(ShardedObject{"rng." + std::to_string(r), {static_cast<uint8_t>(r)}, {}}));
    ASSERT_OK(SaveRankLocal(s, "/ck", r, kRanks, RankLocal("t", memory)));
  }
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/ck", memory));
  EXPECT_EQ(m.objects.size(), 2u);
  std::vector<float> loaded(24, -1), rows(12, -1);
  StateDict s;
  ASSERT_OK(s.Add(ShardedTensor::Whole("exp_avg", TensorView(loaded.data(), DType::kF32, {4, 6}))));
  ASSERT_OK(s.Add(
      ShardedTensor::Shard("emb", TensorView(rows.data(), DType::kF32, {4, 3}), {10, 3}, {0, 0})));
  ASSERT_OK(s.Add(ShardedObject{"rng.1", {}, {}}));
  LoadOptions lo;
  lo.storage = memory;
  lo.unexpected_keys = KeyPolicy::kSkip;  // "rng.0"
  ASSERT_OK(Load(s, "/ck", lo));
  EXPECT_EQ(loaded, full);
  EXPECT_EQ(rows, std::vector<float>(12, 7.0f));
  EXPECT_EQ(std::get<ShardedObject>(*s.Find("rng.1")).data, std::vector<uint8_t>{1});
  // Rows nobody saved of the partial tensor: an error, not zeros.
  StateDict beyond;
  ASSERT_OK(beyond.Add(
      ShardedTensor::Shard("emb", TensorView(rows.data(), DType::kF32, {4, 3}), {10, 3}, {4, 0})));
  EXPECT_FALSE(Load(beyond, "/ck", lo).ok());
}

// AsyncSave with collective false, both staging modes, over a committed checkpoint.
TEST(RankLocalTest, AsyncSaveWithBothStagingModes) {
  for (StagingMode staging : {StagingMode::kBlocking, StagingMode::kDeferred}) {
    SCOPED_TRACE(staging == StagingMode::kBlocking ? "kBlocking" : "kDeferred");
    auto memory = std::make_shared<MemoryStorage>();
    SaveCollective("/ck", 1, memory);
    std::vector<Status> statuses = RunLocalRanks(kRanks, [&](Comm& comm) -> Status {
      RankState s(2, comm.rank());
      AsyncSaveOptions o;
      o.save = RankLocal("async", memory);
      o.staging = staging;
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h, AsyncSave(s.Dict(), "/ck", comm, o));
      TESSERA_RETURN_IF_ERROR(h.WaitStaged());
      s.w.assign(s.w.size(), -5.0f);  // after WaitStaged the state may change
      return h.Wait();
    });
    for (const Status& st : statuses) ASSERT_OK(st);
    EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
    EXPECT_EQ(CountRankManifests(*memory, "/ck"), kRanks);
  }
}

// ---- tags saved again
// ----------------------------------------------------------------------------

// A job that restarts from an older step reaches the same step again and saves the same tag.
// Every attempt writes files of its own names, so the finalized checkpoint's files are never
// touched: the save again is a newer save of the tag, loaded once complete, and until then the
// finalized one loads. (Version 2 refused it: it removed "an earlier attempt's leftovers" by
// name, which were the committed checkpoint's files.)
TEST(RankLocalTest, SavingAFinalizedTagAgainIsANewerSaveAndNeverTouchesTheFinalizedFiles) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveRanks("/ck", 1, "t", memory);
  ASSERT_OK(Finalize("/ck", memory));
  SaveRanks("/ck", 2, "t", memory, {1});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  ASSERT_OK(Verify("/ck", memory));
  SaveRanks("/ck", 2, "t", memory, {0});
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  ASSERT_OK(Verify("/ck", memory));
  // Saving a rank's part of the tag once more, while its part is there, is refused.
  RankState s(3, 0);
  Status again = SaveRankLocal(s.Dict(), "/ck", 0, kRanks, RankLocal("t", memory)).status();
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
  EXPECT_THAT(again.message(), HasSubstr("tag 't'"));
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
}

// A rank that died mid-save retries the same tag: what its attempt left is removed and the set
// completes.
TEST(RankLocalTest, RankThatDiedMidSaveRetriesTheSameTag) {
  auto memory = std::make_shared<MemoryStorage>();
  SaveCollective("/ck", 1, memory);
  SaveRanks("/ck", 2, "t", memory, {0});
  RankState s(2, 1);
  auto dying = std::make_shared<FaultInjectingStorage>(
      memory, FaultPlan{.fail_at = 2, .crash = true, .path_filter = "tsr-"});
  EXPECT_FALSE(SaveRankLocal(s.Dict(), "/ck", 1, kRanks, RankLocal("t", dying)).ok());
  EXPECT_EQ(LoadedGeneration("/ck", memory), 1);
  ASSERT_OK(SaveRankLocal(s.Dict(), "/ck", 1, kRanks, RankLocal("t", memory)));
  EXPECT_EQ(LoadedGeneration("/ck", memory), 2);
  ASSERT_OK(Verify("/ck", memory));
}

}  // namespace
}  // namespace tessera
