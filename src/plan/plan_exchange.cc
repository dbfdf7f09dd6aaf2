#include "plan/plan_exchange.h"

#include <algorithm>
#include <map>

#include "core/byte_io.h"
#include "core/checksum.h"

namespace tessera {
namespace {

void PutVarint(Bytes& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v) | 0x80);
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

bool GetVarint(std::span<const uint8_t> in, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && at < in.size(); shift += 7) {
    const uint8_t byte = in[at++];
    v |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

}  // namespace

Bytes EncodeHoldings(const LocalPlan& plan) { return EncodeLocalPlan(plan, false); }

PlanSignature SignHoldings(std::span<const uint8_t> holdings) {
  const Checksum128Value h = Checksum128(holdings.data(), holdings.size());
  return {h.low, h.high};
}

Bytes EncodeSignature(const PlanSignature& signature) {
  Bytes out;
  ByteWriter w(&out);
  w.Put(signature.low);
  w.Put(signature.high);
  return out;
}

Result<PlanSignature> DecodeSignature(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  PlanSignature s;
  TESSERA_RETURN_IF_ERROR(r.Get(&s.low));
  TESSERA_RETURN_IF_ERROR(r.Get(&s.high));
  if (!r.AtEnd()) return DataLoss("plan signature: trailing bytes");
  return s;
}

ItemRanges ToRanges(std::span<const uint32_t> sorted_items) {
  ItemRanges ranges;
  for (uint32_t i : sorted_items) {
    if (!ranges.empty() && ranges.back().second == i) {
      ++ranges.back().second;
    } else {
      ranges.emplace_back(i, i + 1);
    }
  }
  return ranges;
}

std::vector<uint32_t> FromRanges(const ItemRanges& ranges) {
  std::vector<uint32_t> items;
  for (const auto& [begin, end] : ranges) {
    for (uint32_t i = begin; i < end; ++i) items.push_back(i);
  }
  return items;
}

ItemRanges MainItemRanges(const LocalPlan& plan) {
  std::vector<uint32_t> main;
  for (uint32_t i = 0; i < plan.items.size(); ++i) {
    if (IsMainReplica(plan.items[i].replica_id)) main.push_back(i);
  }
  return ToRanges(main);
}

// Ranges as varints: count, then each range's gap from the previous end and its length.
Bytes EncodeRanges(const ItemRanges& ranges) {
  Bytes out;
  PutVarint(out, ranges.size());
  uint32_t previous_end = 0;
  for (const auto& [begin, end] : ranges) {
    PutVarint(out, begin - previous_end);
    PutVarint(out, end - begin);
    previous_end = end;
  }
  return out;
}

Result<ItemRanges> DecodeRanges(std::span<const uint8_t> bytes, size_t* consumed) {
  size_t at = 0;
  uint64_t count = 0;
  if (!GetVarint(bytes, at, count) || count > bytes.size()) {
    return DataLoss("item ranges: bad count");
  }
  ItemRanges ranges;
  ranges.reserve(count);
  uint64_t previous_end = 0;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t gap = 0, length = 0;
    if (!GetVarint(bytes, at, gap) || !GetVarint(bytes, at, length)) {
      return DataLoss("item ranges: truncated");
    }
    const uint64_t begin = previous_end + gap, end = begin + length;
    if (end > UINT32_MAX || end < begin) return DataLoss("item ranges: out of range");
    ranges.emplace_back(static_cast<uint32_t>(begin), static_cast<uint32_t>(end));
    previous_end = end;
  }
  if (consumed) *consumed = at;
  return ranges;
}

PlanGroups GroupBySignature(std::span<const PlanSignature> signatures) {
  PlanGroups groups;
  groups.group_of.resize(signatures.size());
  std::map<PlanSignature, int32_t> group_of_signature;
  for (size_t r = 0; r < signatures.size(); ++r) {
    auto [it, inserted] =
        group_of_signature.try_emplace(signatures[r], static_cast<int32_t>(groups.members.size()));
    if (inserted) groups.members.emplace_back();
    groups.group_of[r] = it->second;
    groups.members[it->second].push_back(static_cast<int32_t>(r));
  }
  return groups;
}

Bytes EncodePlanMessage(const Bytes* holdings, const ItemRanges& main_items) {
  Bytes out;
  out.push_back(holdings ? 1 : 0);
  const Bytes ranges = EncodeRanges(main_items);
  out.insert(out.end(), ranges.begin(), ranges.end());
  if (holdings) out.insert(out.end(), holdings->begin(), holdings->end());
  return out;
}

Result<PlanMessage> DecodePlanMessage(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return DataLoss("plan message: empty");
  PlanMessage message;
  size_t consumed = 0;
  TESSERA_ASSIGN_OR_RETURN(message.main_items, DecodeRanges(bytes.subspan(1), &consumed));
  if (bytes[0] == 1) {
    TESSERA_ASSIGN_OR_RETURN(message.holdings, DecodeLocalPlan(bytes.subspan(1 + consumed), false));
  } else if (bytes[0] != 0 || 1 + consumed != bytes.size()) {
    return DataLoss("plan message: malformed");
  }
  return message;
}

Result<GlobalSavePlan> BuildGroupedSavePlan(const PlanGroups& groups,
                                            std::vector<PlanMessage>& messages,
                                            const SavePlanOptions& options) {
  const size_t num_groups = groups.members.size();
  const int32_t num_ranks = static_cast<int32_t>(groups.group_of.size());
  // One plan per group, from its leader; an item is the main replica when some member holds
  // it as such, and main_holder says which member (the lowest) does.
  std::vector<LocalPlan> plans(num_groups);
  std::vector<std::vector<int32_t>> main_holder(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    const std::vector<int32_t>& members = groups.members[g];
    PlanMessage& leader = messages[members[0]];
    if (!leader.holdings) {
      return Internal("rank " + std::to_string(members[0]) + " leads its group but sent no plan");
    }
    plans[g] = std::move(*leader.holdings);
    leader.holdings.reset();
    const size_t items = plans[g].items.size();
    main_holder[g].assign(items, -1);
    for (int32_t rank : members) {
      for (const auto& [begin, end] : messages[rank].main_items) {
        if (end > items) {
          return DataLoss("rank " + std::to_string(rank) + " names item " +
                          std::to_string(end - 1) + " of a plan of " + std::to_string(items));
        }
        for (uint32_t i = begin; i < end; ++i) {
          if (main_holder[g][i] < 0) main_holder[g][i] = rank;
        }
      }
    }
    for (size_t i = 0; i < items; ++i) {
      plans[g].items[i].replica_id = main_holder[g][i] >= 0 ? ReplicaId{} : ReplicaId{1};
    }
  }
  SavePlanOptions group_options = options;
  group_options.ranks_of = [&](int32_t g) { return groups.members[g]; };
  group_options.num_ranks = num_ranks;
  TESSERA_ASSIGN_OR_RETURN(GlobalSavePlan plan, BuildGlobalSavePlan(plans, group_options));
  // Writers back to ranks: the member holding the main replica; with balance_writes, the least
  // loaded member of the group the planner chose.
  std::vector<uint64_t> load(num_ranks, 0);
  plan.writes.assign(num_ranks, {});
  auto to_rank = [&](ItemRef& ref) {
    const int32_t g = ref.rank;
    int32_t rank = main_holder[g][ref.item];
    if (options.balance_writes || rank < 0) {
      const std::vector<int32_t>& members = groups.members[g];
      rank = *std::min_element(members.begin(), members.end(),
                               [&](int32_t a, int32_t b) { return load[a] < load[b]; });
    }
    load[rank] += plans[g].items[ref.item].num_bytes;
    ref.rank = rank;
    plan.writes[rank].push_back(ref.item);
  };
  for (auto& writers : plan.chunk_writers) {
    for (ItemRef& ref : writers) to_rank(ref);
  }
  for (ItemRef& ref : plan.object_writers) to_rank(ref);
  for (auto& w : plan.writes) std::sort(w.begin(), w.end());
  return plan;
}

}  // namespace tessera
