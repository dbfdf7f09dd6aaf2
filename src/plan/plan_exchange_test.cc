// The grouped save planning of plan_exchange.h gives the same plan as the plain one, receives
// about the unique plan bytes, and names real ranks in its errors.
#include "plan/plan_exchange.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// `tp` tensor-parallel shards x `dp` data-parallel replicas: rank r holds row block r / dp of
// every tensor (replica id r % dp), plus an embedding replicated over every rank whose main
// replica is rank 0, and an object per tensor-parallel shard (replica id r % dp, as Megatron
// keys its RNG state).
std::vector<LocalPlan> ReplicatedPlans(int tp, int dp, int tensors) {
  static uint8_t dummy[64];
  std::vector<LocalPlan> plans;
  for (int r = 0; r < tp * dp; ++r) {
    StateDict state;
    for (int t = 0; t < tensors; ++t) {
      EXPECT_OK(state.Add(ShardedTensor::Shard("w" + std::to_string(t),
                                               TensorView(dummy, DType::kF32, {2, 4}), {2 * tp, 4},
                                               {2 * (r / dp), 0}, {r % dp})));
    }
    EXPECT_OK(
        state.Add(ShardedTensor::Shard("emb", TensorView(dummy, DType::kF32, {3}), {3}, {0}, {r})));
    EXPECT_OK(state.Add(ShardedObject{"rng." + std::to_string(r / dp), {1, 2, 3}, {r % dp}}));
    Result<LocalPlan> plan = BuildLocalPlan(state);
    EXPECT_OK(plan);
    plans.push_back(*plan);
  }
  return plans;
}

// What each rank sends, the groups, and the coordinator's messages.
struct Exchange {
  PlanGroups groups;
  std::vector<PlanMessage> messages;
  uint64_t bytes_received = 0;
  uint64_t unique_bytes = 0;
};

Exchange RunExchange(const std::vector<LocalPlan>& plans) {
  Exchange x;
  std::vector<PlanSignature> signatures;
  std::vector<Bytes> holdings;
  for (const LocalPlan& p : plans) {
    holdings.push_back(EncodeHoldings(p));
    signatures.push_back(SignHoldings(holdings.back()));
  }
  x.groups = GroupBySignature(signatures);
  for (size_t r = 0; r < plans.size(); ++r) {
    const bool leads = x.groups.members[x.groups.group_of[r]][0] == static_cast<int32_t>(r);
    Bytes message = EncodePlanMessage(leads ? &holdings[r] : nullptr, MainItemRanges(plans[r]));
    x.bytes_received += message.size() + 16;  // and its signature
    if (leads) x.unique_bytes += holdings[r].size();
    Result<PlanMessage> decoded = DecodePlanMessage(message);
    EXPECT_OK(decoded);
    x.messages.push_back(std::move(*decoded));
  }
  return x;
}

TEST(PlanExchangeTest, GroupedPlanEqualsThePlainOne) {
  for (const auto& [tp, dp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 4}, {4, 2}, {3, 5}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    const std::vector<LocalPlan> plans = ReplicatedPlans(tp, dp, 6);
    Exchange x = RunExchange(plans);
    EXPECT_EQ(x.groups.members.size(), static_cast<size_t>(tp));
    for (bool balance : {false, true}) {
      ASSERT_OK_AND_ASSIGN(GlobalSavePlan plain,
                           BuildGlobalSavePlan(plans, {.balance_writes = balance}));
      Exchange fresh = RunExchange(plans);
      ASSERT_OK_AND_ASSIGN(
          GlobalSavePlan grouped,
          BuildGroupedSavePlan(fresh.groups, fresh.messages, {.balance_writes = balance}));
      EXPECT_EQ(grouped.metadata, plain.metadata);
      EXPECT_EQ(grouped.total_bytes, plain.total_bytes);
      if (!balance) {
        EXPECT_EQ(grouped.writes, plain.writes);  // the main replicas write, as before
      }
      // Every chunk and object is written once, by a rank that holds it.
      size_t writes = 0;
      for (const auto& w : grouped.writes) writes += w.size();
      size_t pieces = grouped.metadata.objects.size();
      for (const TensorInfo& t : grouped.metadata.tensors) pieces += t.chunks.size();
      EXPECT_EQ(writes, pieces);
    }
    // The coordinator receives the unique plans once, plus little per rank.
    if (dp > 1) {
      EXPECT_LT(x.bytes_received, 2 * x.unique_bytes + 64 * plans.size());
    }
  }
}

TEST(PlanExchangeTest, ErrorsNameTheRanksOfAGroup) {
  std::vector<LocalPlan> plans = ReplicatedPlans(2, 3, 1);
  // No rank of the second tensor-parallel shard (ranks 3, 4, 5) holds its main replica.
  for (int r = 3; r < 6; ++r) {
    for (LocalItem& item : plans[r].items) {
      if (item.key == "w0") item.replica_id = {r};
    }
  }
  Exchange x = RunExchange(plans);
  Result<GlobalSavePlan> grouped = BuildGroupedSavePlan(x.groups, x.messages, {});
  ASSERT_FALSE(grouped.ok());
  EXPECT_THAT(grouped.status().message(), HasSubstr("held by ranks 3, 4, 5"));
  EXPECT_THAT(grouped.status().message(), HasSubstr("none holds the main replica"));
}

TEST(PlanExchangeTest, RangesRoundTrip) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<uint32_t> items;
    for (uint32_t i = 0; i < 300; ++i) {
      if (rng() % 3) items.push_back(i);
    }
    const ItemRanges ranges = ToRanges(items);
    ASSERT_OK_AND_ASSIGN(ItemRanges back, DecodeRanges(EncodeRanges(ranges)));
    EXPECT_EQ(FromRanges(back), items);
  }
  EXPECT_EQ(EncodeRanges(ToRanges(std::vector<uint32_t>{0, 1, 2, 3, 4, 5})).size(), 3u);
  EXPECT_FALSE(DecodeRanges(Bytes{5, 1}).ok());
}

}  // namespace
}  // namespace tessera
