// Per-rank state (StepExtras::per_rank): the keys it is saved under, the record of the world
// size and layout it was saved with (user metadata kManagerMetadataKey), and which saved ranks'
// values each rank of a restore takes.
#ifndef TESSERA_MANAGER_PER_RANK_H_
#define TESSERA_MANAGER_PER_RANK_H_

#include <map>
#include <string>
#include <vector>

#include "tessera/checkpoint_manager.h"

namespace tessera::manager {

// "per_rank/<name>/rank_<rank>".
std::string PerRankKey(const std::string& name, int rank);

// What kManagerMetadataKey holds.
struct ManagerRecord {
  int world_size = 0;
  std::string layout;
  std::vector<std::string> per_rank;  // names, sorted
};
std::string EncodeRecord(const ManagerRecord& record);
// An absent record (""): world_size 0, nothing per rank. kDataLoss naming the step when the
// text is not such a record.
// `saved_ranks`: the checkpoint's own count of the ranks that saved it (Metadata::num_ranks;
// 0 when unknown): a record claiming more ranks than that is kDataLoss, so that a crafted
// world_size cannot make a restore plan (and allocate) for 2^31 ranks.
Result<ManagerRecord> DecodeRecord(const std::string& text, int64_t step, int32_t saved_ranks);

// The keys of per-rank state each rank of a restore of `world_size` ranks loads, given the
// saved record: rank r gets the values of saved rank r when the world size and layout match;
// otherwise `map` must say which (kInvalidArgument naming the state, both world sizes and
// layouts without it, or naming the bad rank it returned). `load[r]` are the names and saved
// ranks rank r loads, in order; rank 0 also loads (and drops) the values no rank takes, so that
// a load with strict key checks finds every key of the checkpoint asked for.
struct PerRankPlan {
  struct Item {
    std::string name;
    int saved_rank = 0;
    bool dropped = false;  // loaded only so that no key is left unasked for
  };
  std::vector<std::vector<Item>> load;  // per rank of the restore
};
Result<PerRankPlan> PlanPerRank(const ManagerRecord& saved, int world_size,
                                const std::string& layout, const PerRankMap& map, int64_t step);

}  // namespace tessera::manager

#endif  // TESSERA_MANAGER_PER_RANK_H_
