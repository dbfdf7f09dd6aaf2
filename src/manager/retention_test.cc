#include "manager/retention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tessera::manager {
namespace {

using ::testing::HasSubstr;

StepFacts Committed(int64_t step) {
  return {.step = step, .path = "/r/" + StepDirName(step), .state = StepState::kCommitted};
}

std::vector<int64_t> Deleted(const std::vector<RetentionDecision>& plan) {
  std::vector<int64_t> out;
  for (const RetentionDecision& d : plan) {
    if (d.deleted) out.push_back(d.step);
  }
  return out;
}

TEST(PlanRetentionTest, KeepsTheNewestAndTheMultiples) {
  std::vector<StepFacts> facts;
  for (int64_t step = 1; step <= 10; ++step) facts.push_back(Committed(step));
  const auto plan = PlanRetention(facts, {.keep_last = 2, .keep_every = 4});
  EXPECT_EQ(Deleted(plan), (std::vector<int64_t>{1, 2, 3, 5, 6, 7}));
  EXPECT_EQ(plan[9].reason, "the newest committed");
  EXPECT_EQ(plan[8].reason, "one of the newest 2 committed");
  EXPECT_EQ(plan[7].reason, "a multiple of 4");
  EXPECT_EQ(plan[0].reason, "older than the newest 2 committed");
}

TEST(PlanRetentionTest, NothingGoesWithoutACommittedCheckpoint) {
  std::vector<StepFacts> facts = {{.step = 1, .state = StepState::kUncommitted},
                                  {.step = 2, .state = StepState::kDamaged}};
  EXPECT_TRUE(Deleted(PlanRetention(facts, {.keep_last = 1})).empty());
}

TEST(PlanRetentionTest, StepsNewerThanTheNewestCommittedStay) {
  // 4 is a save still running (or one that died), 5 is damaged: neither replaces 3.
  std::vector<StepFacts> facts = {Committed(1),
                                  Committed(2),
                                  Committed(3),
                                  {.step = 4, .state = StepState::kUncommitted},
                                  {.step = 5, .state = StepState::kDamaged}};
  const auto plan = PlanRetention(facts, {.keep_last = 1});
  EXPECT_EQ(Deleted(plan), (std::vector<int64_t>{1, 2}));
  EXPECT_THAT(plan[3].reason, HasSubstr("not finished"));
  EXPECT_THAT(plan[4].reason, HasSubstr("damaged"));
}

TEST(PlanRetentionTest, OlderUncommittedAndUnexaminedStepsGo) {
  std::vector<StepFacts> facts = {{.step = 1},  // not examined
                                  {.step = 2, .state = StepState::kUncommitted},
                                  Committed(3)};
  EXPECT_EQ(Deleted(PlanRetention(facts, {.keep_last = 1})), (std::vector<int64_t>{1, 2}));
}

TEST(PlanRetentionTest, MarkedInFlightAndUsedStepsStay) {
  std::vector<StepFacts> facts = {Committed(1), Committed(2), Committed(3), Committed(4),
                                  Committed(5)};
  facts[0].marked = true;
  facts[1].in_flight = true;
  facts[2].live_user = "being read by process 7 on host h";
  const auto plan = PlanRetention(facts, {.keep_last = 1});
  EXPECT_EQ(Deleted(plan), (std::vector<int64_t>{4}));
  EXPECT_EQ(plan[0].reason, "marked to be kept");
  EXPECT_EQ(plan[2].reason, "being read by process 7 on host h");
}

TEST(PlanRetentionTest, AStepWhoseRestoreFailedDoesNotCount) {
  // 3 failed its restore: 2 is the newest usable checkpoint and is kept; 3 stays too (newer).
  std::vector<StepFacts> facts = {Committed(1), Committed(2), Committed(3)};
  facts[2].failed = true;
  const auto plan = PlanRetention(facts, {.keep_last = 1});
  EXPECT_EQ(Deleted(plan), (std::vector<int64_t>{1}));
  EXPECT_EQ(plan[1].reason, "the newest committed");
  EXPECT_THAT(plan[2].reason, HasSubstr("its restore failed"));
}

}  // namespace
}  // namespace tessera::manager
