// AgreeOnStatus: every rank contributes its status through one AllGather and every rank
// derives the same verdict from the same gathered bytes.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status_wire.h"
#include "tessera/comm.h"

namespace tessera {
namespace {

// A rank's status as it sent it (core/status_wire.h); an error for bytes that are not one.
Status StatusSentBy(const Bytes& in, int rank) {
  Status status;
  if (Status read = DecodeStatus(in, &status); !read.ok()) {
    return Internal("malformed status from rank " + std::to_string(rank) + ": " + read.message());
  }
  return status;
}

}  // namespace

Status AgreeOnStatus(Comm& comm, const Status& local) {
  std::vector<Bytes> all;
  TESSERA_RETURN_IF_ERROR(comm.AllGather(EncodeStatus(local), &all));
  int first_failed = -1;
  int num_failed = 0;
  Status first;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    Status status = StatusSentBy(all[r], r);
    if (status.ok()) continue;
    if (num_failed++ == 0) {
      first_failed = r;
      first = std::move(status);
    }
  }
  if (num_failed == 0) return Status::Ok();
  // Alone, the rank's own error says everything: no "rank 0: ... (1 of 1 ranks failed)".
  if (all.size() == 1) return first;
  Status agreed(first.code(), "rank " + std::to_string(first_failed) + ": " + first.message() +
                                  " (" + std::to_string(num_failed) + " of " +
                                  std::to_string(all.size()) + " ranks failed)");
  return first.detail() ? agreed.WithDetail(*first.detail()) : agreed;
}

}  // namespace tessera
