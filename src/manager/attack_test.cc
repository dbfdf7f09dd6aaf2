// The manager's defects found by the third attack (issue 30, docs/RELIABILITY.md section 9):
// an explicit prune of a URI root, a step directory that is a symbolic link, the step INT64_MAX,
// a crafted world size, owners in another pid namespace, a layout that is not UTF-8.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <fstream>

#include "checkpoint/marker.h"
#include "manager/per_rank.h"
#include "tessera/checkpoint_manager.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// One rank's state: a [4, 4] F32 tensor filled with the step.
struct SmallState {
  std::vector<float> w = std::vector<float>(16);
  StateDict Dict() {
    StateDict s;
    EXPECT_OK(s.Add(
        ShardedTensor::Shard("w", TensorView(w.data(), DType::kF32, {4, 4}), {4, 4}, {0, 0})));
    return s;
  }
};

void SaveStep(CheckpointManager& manager, int64_t step) {
  SmallState state;
  std::fill(state.w.begin(), state.w.end(), static_cast<float>(step % 1000));
  StateDict dict = state.Dict();
  ASSERT_OK(manager.Save(step, dict).status());
  ASSERT_OK(manager.Wait());
}

// Defect 5: Prune took the root as given (a URI) for a path of the store, found no step and
// reported "0 of 0" while LatestStep named the newest.
TEST(ManagerAttackTest, ExplicitPruneOfAFileUriRootDeletesWhatThePolicyDoesNotKeep) {
  testing::TempDir dir;
  const std::string root = "file://" + dir.path() + "/run";
  CheckpointManager manager(root);
  for (int64_t step = 1; step <= 4; ++step) SaveStep(manager, step);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(1, 2, 3, 4));
  ASSERT_OK_AND_ASSIGN(PruneReport report, manager.Prune({.keep_last = 1}));
  ASSERT_EQ(report.steps.size(), 4u);
  EXPECT_EQ(report.deleted, 3);
  EXPECT_EQ(report.steps[0].path, root + "/iter_0000001");  // as the caller spells the root
  ASSERT_OK_AND_ASSIGN(all, manager.AllSteps());
  EXPECT_THAT(all, ElementsAre(4));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/run/iter_0000001"));
}

// Defect 6: a step name that is a symbolic link out of the root had every file of its target
// unlinked by prune.
TEST(ManagerAttackTest, PruneAndDeleteNeverFollowAStepThatIsASymbolicLink) {
  testing::TempDir dir;
  const std::string root = dir.Sub("run");
  const std::string victim = dir.Sub("victim");
  std::filesystem::create_directories(victim);
  std::ofstream(victim + "/precious.txt") << "not tessera's";
  std::vector<std::string> warnings;
  CheckpointManagerOptions options;
  options.warn = [&](const std::string& m) { warnings.push_back(m); };
  CheckpointManager manager(root, options);
  for (int64_t step = 1; step <= 3; ++step) SaveStep(manager, step);
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/iter_0000000").c_str()), 0);

  ASSERT_OK_AND_ASSIGN(PruneReport report, manager.Prune({.keep_last = 1}));
  EXPECT_EQ(report.deleted, 2);  // steps 1 and 2; the link is not a step of the root
  for (const RetentionDecision& d : report.steps) EXPECT_NE(d.step, 0);
  EXPECT_TRUE(std::filesystem::exists(victim + "/precious.txt"));
  EXPECT_TRUE(std::filesystem::is_symlink(root + "/iter_0000000"));
  ASSERT_FALSE(warnings.empty());
  EXPECT_THAT(warnings.back(), HasSubstr("iter_0000000 is a symbolic link"));

  const Status deleted = manager.Delete(0);
  EXPECT_EQ(deleted.code(), StatusCode::kFailedPrecondition) << deleted.ToString();
  EXPECT_THAT(deleted.message(), HasSubstr("symbolic link"));
  EXPECT_TRUE(std::filesystem::exists(victim + "/precious.txt"));
}

// Defect 19: LatestStep named the step INT64_MAX, but Restore started below INT64_MAX and found
// nothing ("a fresh run").
TEST(ManagerAttackTest, TheStepInt64MaxIsRestored) {
  testing::TempDir dir;
  CheckpointManager manager(dir.Sub("run"));
  SaveStep(manager, INT64_MAX);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager.LatestStep());
  ASSERT_EQ(latest, INT64_MAX);
  EXPECT_EQ(ParseStepDirName(StepDirName(INT64_MAX)), INT64_MAX);
  SmallState state;
  StateDict dict = state.Dict();
  ASSERT_OK_AND_ASSIGN(RestoreReport report, manager.Restore(dict));
  EXPECT_EQ(report.step, INT64_MAX);
  EXPECT_EQ(state.w[0], static_cast<float>(INT64_MAX % 1000));
}

// Defect 14: a crafted world_size of 2^31-1 in a step's manager record made a restore with
// map_per_rank plan (and allocate) for every one of those ranks.
TEST(ManagerAttackTest, ACraftedWorldSizeIsBoundedByTheRanksThatSaved) {
  const std::string crafted = R"({"world_size":2147483647,"layout":"","per_rank":["rng"]})";
  Result<manager::ManagerRecord> bounded = manager::DecodeRecord(crafted, 7, /*saved_ranks=*/2);
  EXPECT_EQ(bounded.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(bounded.status().message(), HasSubstr("world_size 2147483647 is more than the 2"));
  EXPECT_THAT(bounded.status().message(), HasSubstr("step 7"));
  Result<manager::ManagerRecord> unknown = manager::DecodeRecord(crafted, 7, /*saved_ranks=*/0);
  EXPECT_EQ(unknown.status().code(), StatusCode::kDataLoss);
  ASSERT_OK(manager::DecodeRecord(R"({"world_size":2,"layout":"","per_rank":[]})", 7, 2));

  // End to end: a checkpoint saved by one rank whose record claims 2^31-1 ranks.
  testing::TempDir dir;
  const std::string root = dir.Sub("run");
  SmallState state;
  StateDict dict = state.Dict();
  ASSERT_OK(dict.Add(ShardedObject{.key = "per_rank/rng/rank_0", .data = {1, 2, 3}}));
  SaveOptions save;
  save.user_metadata = {{kStepMetadataKey, "7"}, {kManagerMetadataKey, crafted}};
  ASSERT_OK(Save(dict, root + "/" + StepDirName(7), save).status());
  CheckpointManager manager(root);
  RestoreOptions options;
  options.map_per_rank = [](int rank, int, int) { return std::vector<int>{rank}; };
  StateDict target = state.Dict();
  Result<RestoreReport> restored = manager.Restore(target, options);
  EXPECT_EQ(restored.status().code(), StatusCode::kDataLoss) << restored.status().ToString();
  EXPECT_THAT(restored.status().message(), HasSubstr("world_size 2147483647"));
}

// Defect 7: an owner of another pid namespace on this host and boot (a container sharing the
// node's host name) was judged by its pid here, found dead, and its lease ignored.
TEST(ManagerAttackTest, AnOwnerInAnotherPidNamespaceIsNotTakenForDead) {
  std::string record = ThisProcessOwnerRecord();
  ASSERT_THAT(record, HasSubstr("pid_ns=pid:["));
  // The same host and boot, a pid that runs no process here.
  const size_t pid = record.find("\npid=");
  const size_t end = record.find('\n', pid + 1);
  record.replace(pid, end - pid, "\npid=4194000");
  const size_t ns = record.find("pid_ns=");
  const std::string ours = record.substr(ns, record.find('\n', ns) - ns);
  EXPECT_FALSE(OwnerRecordMayBeAlive(record)) << "a dead pid of our own namespace";
  std::string other = record;
  other.replace(ns, ours.size(), "pid_ns=pid:[1]");
  EXPECT_TRUE(OwnerRecordMayBeAlive(other)) << "another namespace cannot be checked from here";
  // A message naming the owner says which namespace, so two of one pid can be told apart.
  EXPECT_THAT(DescribeOwnerRecord(other), HasSubstr("pid:[1])"));
  std::string old = record;  // written before the field existed: judged as before
  old.erase(ns, ours.size() + 1);
  EXPECT_FALSE(OwnerRecordMayBeAlive(old));
}

// Issue 30, defect 1 (every argument): a layout that is not UTF-8 made the JSON writer of the
// manager record throw; it is the caller's mistake, named.
TEST(ManagerAttackTest, ALayoutThatIsNotUtf8IsAnError) {
  testing::TempDir dir;
  CheckpointManagerOptions options;
  options.layout = "tp2\xc3";
  CheckpointManager manager(dir.Sub("run"), options);
  SmallState state;
  StateDict dict = state.Dict();
  const Status saved = manager.Save(1, dict).status();
  EXPECT_EQ(saved.code(), StatusCode::kInvalidArgument) << saved.ToString();
  EXPECT_THAT(saved.message(), HasSubstr("layout"));
}

}  // namespace
}  // namespace tessera
