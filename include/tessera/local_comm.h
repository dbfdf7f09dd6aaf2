// LocalComm: N ranks as N threads of one process, with real message passing: each rank sees
// only what was sent to it. The embedded default for multi-rank runs and tests.
#ifndef TESSERA_LOCAL_COMM_H_
#define TESSERA_LOCAL_COMM_H_

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "tessera/comm.h"

namespace tessera {

struct LocalCommOptions {
  // The collective deadline (comm.h): how long a rank waits in a collective for its peers.
  // Then it returns kDeadlineExceeded naming the ranks that had not entered the collective,
  // and aborts the group with that status, so every waiting rank returns it too, and so does
  // every later collective of any rank. Default 10 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// Creates `num_ranks` connected communicators; hand entry r to the thread that plays rank r.
std::vector<std::unique_ptr<Comm>> NewLocalComms(int num_ranks, LocalCommOptions options = {});

// Runs fn(comm) on `num_ranks` threads, one per rank, and waits for all. When fn returns, the
// rank leaves: a peer waiting for a message the rank never sent fails at once (kAborted)
// instead of hanging; messages it did send are still delivered. Returns each rank's status,
// indexed by rank.
std::vector<Status> RunLocalRanks(int num_ranks, const std::function<Status(Comm&)>& fn,
                                  LocalCommOptions options = {});

// The first error of RunLocalRanks' results (lowest rank), prefixed "rank R: ", or OK.
Status FirstError(const std::vector<Status>& statuses);

}  // namespace tessera

#endif  // TESSERA_LOCAL_COMM_H_
