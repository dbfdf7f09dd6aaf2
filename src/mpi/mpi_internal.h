// Pieces of MpiComm exposed for its tests only; not installed.
#ifndef TESSERA_MPI_MPI_INTERNAL_H_
#define TESSERA_MPI_MPI_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string_view>

#include "tessera/status.h"

namespace tessera::mpi_internal {

// The Status for MPI error code `error` returned by MPI function `call` during tessera
// collective `op` on `rank`: "<op> on rank <rank>: <call> failed: <MPI_Error_string>
// (<error class name>)". kInternal for errors that mean tessera passed MPI something wrong
// (a count, a type, a root, a buffer, a truncated message), kIOError for the others (the
// transport, resources, a peer).
Status MpiErrorStatus(int error, std::string_view call, std::string_view op, int rank);

// How a v-collective (Gather, AllGather, Scatter) splits per-rank byte counts into rounds that
// each move at most `limit` bytes in total. Every rank derives the same schedule from values
// all ranks agree on (the largest count, the sum of the counts, the rank count): in round k,
// rank r moves bytes [k * quota, (k + 1) * quota) of its count, clipped to its count.
struct Rounds {
  int64_t quota = 0;   // bytes per rank per round
  int64_t rounds = 0;  // 0 when there is nothing to move

  static Rounds For(int64_t max_count, int64_t total, int num_ranks, int64_t limit) {
    Rounds r;
    if (total <= 0) return r;
    // One round when everything fits, whatever the spread of counts.
    r.quota = total <= limit ? max_count : std::max<int64_t>(1, limit / num_ranks);
    r.rounds = (max_count + r.quota - 1) / r.quota;
    return r;
  }
  int64_t Begin(int64_t count, int64_t round) const { return std::min(count, round * quota); }
  int64_t Size(int64_t count, int64_t round) const {
    return std::min(count, (round + 1) * quota) - Begin(count, round);
  }
};

// Test seam: when set, MpiComm calls it on this process twice for each operation of a
// collective's data transfer (after the header): right before starting it (`started` false) and
// right after (true, before waiting for it), with the MPI call's name. tessera_mpi_deadline_test
// freezes a rank there (sleeping, calling no MPI), which stands for a process stopped (SIGSTOP,
// a debugger, swapping) in the middle of a collective. Not thread-safe: set it before the
// collectives it is meant for.
using DataPhaseHook = std::function<void(std::string_view call, bool started)>;
void SetDataPhaseHookForTesting(DataPhaseHook hook);

}  // namespace tessera::mpi_internal

#endif  // TESSERA_MPI_MPI_INTERNAL_H_
