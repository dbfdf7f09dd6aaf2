// Save planning at scale: ranks that hold the same boxes (data-parallel replicas) send their
// plan to the coordinator once between them.
//
//   every rank: holdings = its local plan without replica ids; signature = XXH3-128 of them
//   AllGather(signature)       -> every rank knows the groups of equal holdings and their
//                                 leaders (the lowest rank of each group)
//   Gather(message)            -> the leader of each group sends the holdings; every rank sends
//                                 the ranges of items it holds as the main replica
//   coordinator                -> one plan per group, global plan, writers mapped back to ranks
//   Scatter(write ranges)      -> each rank: the items it writes, as ranges
//
// The coordinator receives the unique holdings once, plus a few bytes per rank, instead of
// every rank's plan: with data-parallel degree D, about 1/D of what a plain gather brings.
// Pure and deterministic (no I/O, no communication); save.cc runs the collectives.
#ifndef TESSERA_PLAN_PLAN_EXCHANGE_H_
#define TESSERA_PLAN_PLAN_EXCHANGE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "plan/save_plan.h"

namespace tessera {

struct PlanSignature {
  uint64_t low = 0;
  uint64_t high = 0;
  friend auto operator<=>(const PlanSignature&, const PlanSignature&) = default;
};

// The local plan without replica ids: what the ranks of one group have in common, in item order.
Bytes EncodeHoldings(const LocalPlan& plan);
PlanSignature SignHoldings(std::span<const uint8_t> holdings);
Bytes EncodeSignature(const PlanSignature& signature);
Result<PlanSignature> DecodeSignature(std::span<const uint8_t> bytes);

// [begin, end) ranges of item indices.
using ItemRanges = std::vector<std::pair<uint32_t, uint32_t>>;
// The items of `plan` this rank holds as the main replica.
ItemRanges MainItemRanges(const LocalPlan& plan);
// Items as ranges, and back.
ItemRanges ToRanges(std::span<const uint32_t> sorted_items);
std::vector<uint32_t> FromRanges(const ItemRanges& ranges);
Bytes EncodeRanges(const ItemRanges& ranges);
Result<ItemRanges> DecodeRanges(std::span<const uint8_t> bytes, size_t* consumed = nullptr);

// Ranks grouped by equal signatures; the same on every rank.
struct PlanGroups {
  std::vector<int32_t> group_of;              // per rank
  std::vector<std::vector<int32_t>> members;  // per group, ascending; members[g][0] leads
};
PlanGroups GroupBySignature(std::span<const PlanSignature> signatures);

// What a rank sends the coordinator: the holdings when it leads its group (`holdings` not
// null), and its main item ranges.
Bytes EncodePlanMessage(const Bytes* holdings, const ItemRanges& main_items);
struct PlanMessage {
  std::optional<LocalPlan> holdings;
  ItemRanges main_items;
};
Result<PlanMessage> DecodePlanMessage(std::span<const uint8_t> bytes);

// The coordinator: the global plan from every rank's message (messages[r] from rank r), with
// GlobalSavePlan::writes, chunk_writers and object_writers in real ranks. Errors name ranks.
Result<GlobalSavePlan> BuildGroupedSavePlan(const PlanGroups& groups,
                                            std::vector<PlanMessage>& messages,
                                            const SavePlanOptions& options);

}  // namespace tessera

#endif  // TESSERA_PLAN_PLAN_EXCHANGE_H_
