// Read sharing: ranks that need the same bytes (data-parallel replicas loading the same shard)
// read them from storage once between them and exchange them. Pure and deterministic: every
// rank computes the same assignment and schedule from every rank's run list.
#ifndef TESSERA_PLAN_READ_SHARING_H_
#define TESSERA_PLAN_READ_SHARING_H_

#include <cstdint>
#include <span>
#include <vector>

#include "plan/load_plan.h"
#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

// The bytes a run reads and what it makes of them: what makes two ranks' runs the same.
// What ranks exchange is the run's bytes in memory (converted, with LoadOptions::cast_dtypes).
struct RunKey {
  uint32_t file_index = 0;
  uint64_t file_offset = 0;
  uint64_t length = 0;              // read from the file
  uint64_t destination_length = 0;  // in memory: `length` unless converted
  uint8_t cast_to = 0;              // the DType (its value) they are converted to; 0: none
  friend auto operator<=>(const RunKey&, const RunKey&) = default;
};

Bytes EncodeRunKeys(std::span<const ReadRun> runs);
Result<std::vector<RunKey>> DecodeRunKeys(std::span<const uint8_t> bytes);

struct ReadAssignment {
  std::vector<RunKey> unique;                 // every distinct run, sorted
  std::vector<int32_t> reader;                // per unique run: the rank that reads it
  std::vector<uint32_t> num_holders;          // per unique run: how many ranks need it
  std::vector<std::vector<int32_t>> holders;  // per unique run: ranks that need it, ascending
                                              // (AssignReads only)
  // unique_of[r][i]: the unique run of rank r's run i.
  std::vector<std::vector<uint32_t>> unique_of;
};

// Assigns each distinct run to one of the ranks that need it: runs needed by fewer ranks first,
// larger first, each to the least-loaded (in bytes) of its ranks, ties by rank. The total read
// from storage is the unique bytes needed.
ReadAssignment AssignReads(std::span<const std::vector<RunKey>> runs_by_rank);

// The assignment for `num_ranks` ranks that all need exactly `runs` (data-parallel replicas:
// Load groups ranks by the signature of their run lists): each distinct run to the least-loaded
// rank, larger runs first. O(runs log runs + num_ranks), whatever the number of ranks; `holders`
// and `unique_of` are left empty (every rank needs every run).
ReadAssignment AssignIdenticalReads(std::span<const RunKey> runs, int num_ranks);

// One piece of a shared run sent by its reader to the other ranks that need it.
struct ExchangePiece {
  uint32_t unique_run = 0;
  uint64_t begin = 0;  // byte offset within the run's bytes in memory (destination_length)
  uint64_t length = 0;
};

// The exchange in rounds, the same on every rank: each round, every rank contributes at most
// `bytes_per_rank_per_round` bytes (the pieces it read), so an all-gather round holds at most
// ranks x that. A run larger than the cap is cut into pieces. Runs needed by one rank only are
// not exchanged.
std::vector<std::vector<ExchangePiece>> ScheduleExchange(const ReadAssignment& assignment,
                                                         int num_ranks,
                                                         uint64_t bytes_per_rank_per_round);

}  // namespace tessera

#endif  // TESSERA_PLAN_READ_SHARING_H_
