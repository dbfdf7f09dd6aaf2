#include "manager/per_rank.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

namespace tessera::manager {

std::string PerRankKey(const std::string& name, int rank) {
  return "per_rank/" + name + "/rank_" + std::to_string(rank);
}

std::string EncodeRecord(const ManagerRecord& record) {
  nlohmann::json j = {
      {"world_size", record.world_size}, {"layout", record.layout}, {"per_rank", record.per_rank}};
  return j.dump();
}

Result<ManagerRecord> DecodeRecord(const std::string& text, int64_t step, int32_t saved_ranks) {
  ManagerRecord record;
  if (text.empty()) return record;
  const auto bad = [&](const std::string& why) {
    return DataLoss("the user metadata '" + std::string(kManagerMetadataKey) + "' of step " +
                    std::to_string(step) + " is not a manager record: " + why);
  };
  // Bounded by the user metadata the manifest reader already bounds; parsed without exceptions.
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  const auto world = j.find("world_size");
  const auto layout = j.find("layout");
  const auto names = j.find("per_rank");
  if (world == j.end() || !world->is_number_integer() || *world < 1 || *world > INT32_MAX) {
    return bad("no valid world_size");
  }
  if (layout == j.end() || !layout->is_string()) return bad("no layout string");
  if (names == j.end() || !names->is_array()) return bad("no per_rank list");
  record.world_size = world->get<int>();
  // Every rank of the saving job wrote its per-rank values into this checkpoint, so the
  // checkpoint's own rank count bounds the record's. Without a count (0), the per_rank objects
  // are loaded by name and a missing one fails the load; the plan is still bounded below.
  if (saved_ranks > 0 && record.world_size > saved_ranks) {
    return bad("world_size " + std::to_string(record.world_size) + " is more than the " +
               std::to_string(saved_ranks) + " ranks that saved the checkpoint");
  }
  constexpr int kMaxWorldSizeWithoutCount = 1 << 20;
  if (saved_ranks <= 0 && record.world_size > kMaxWorldSizeWithoutCount) {
    return bad("world_size " + std::to_string(record.world_size) +
               " is more than tessera plans for (" + std::to_string(kMaxWorldSizeWithoutCount) +
               ") and the checkpoint does not say how many ranks saved it");
  }
  record.layout = layout->get<std::string>();
  for (const nlohmann::json& name : *names) {
    if (!name.is_string()) return bad("a per_rank name that is not a string");
    record.per_rank.push_back(name.get<std::string>());
  }
  return record;
}

namespace {

std::string Described(int world_size, const std::string& layout) {
  return std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks") +
         (layout.empty() ? "" : " (layout " + layout + ")");
}

}  // namespace

Result<PerRankPlan> PlanPerRank(const ManagerRecord& saved, int world_size,
                                const std::string& layout, const PerRankMap& map, int64_t step) {
  PerRankPlan plan;
  plan.load.resize(world_size);
  if (saved.per_rank.empty()) return plan;
  const bool same = saved.world_size == world_size &&
                    (saved.layout.empty() || layout.empty() || saved.layout == layout);
  std::string names;
  for (const std::string& name : saved.per_rank)
    names += (names.empty() ? "'" : ", '") + name + "'";
  if (!same && !map) {
    return InvalidArgument("the per-rank state " + names + " of step " + std::to_string(step) +
                           " was saved by " + Described(saved.world_size, saved.layout) +
                           "; this run has " + Described(world_size, layout) +
                           ": say which saved rank's values each rank takes "
                           "(RestoreOptions::map_per_rank)");
  }
  std::set<int> taken;
  for (int r = 0; r < world_size; ++r) {
    std::vector<int> ranks = same ? std::vector<int>{r} : map(r, world_size, saved.world_size);
    if (std::set<int>(ranks.begin(), ranks.end()).size() != ranks.size()) {
      return InvalidArgument("map_per_rank gave rank " + std::to_string(r) +
                             " the same saved rank twice");
    }
    for (int s : ranks) {
      if (s < 0 || s >= saved.world_size) {
        return InvalidArgument("map_per_rank gave rank " + std::to_string(r) + " the saved rank " +
                               std::to_string(s) + ", but step " + std::to_string(step) +
                               " was saved by " + Described(saved.world_size, saved.layout));
      }
      taken.insert(s);
      for (const std::string& name : saved.per_rank) plan.load[r].push_back({name, s, false});
    }
  }
  for (int s = 0; s < saved.world_size; ++s) {
    if (taken.count(s)) continue;
    for (const std::string& name : saved.per_rank) plan.load[0].push_back({name, s, true});
  }
  return plan;
}

}  // namespace tessera::manager
