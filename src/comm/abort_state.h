// What MpiComm and the Python binding's PythonComm share (LocalComm's ranks are threads of one
// process and keep one abort status for the whole group instead): the abort state of one rank's
// communicator, and the status a failed rank announces to the others.
#ifndef TESSERA_COMM_ABORT_STATE_H_
#define TESSERA_COMM_ABORT_STATE_H_

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/status_wire.h"
#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

// Whether a communicator is aborted, on this rank. `pending`: this rank was aborted (Abort, its
// parent's abort, a failed call underneath) and says so in its next collective's header.
// `agreed`: every rank knows; collectives return it without communicating. Children (from
// Split) inherit an abort as pending. Thread-safe: Abort may come from any thread.
class AbortState {
 public:
  // First abort wins; later ones, and aborts of an agreed communicator, are ignored. Returns
  // whether this one was taken.
  bool Abort(const Status& status) {
    std::vector<std::weak_ptr<AbortState>> children;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pending_.ok() || !agreed_.ok()) return false;
      pending_ = status;
      children = children_;
    }
    for (const auto& weak : children) {
      if (auto child = weak.lock()) child->Abort(status);
    }
    return true;
  }

  // Every rank adopted `status`: later collectives return it at once.
  void Agree(const Status& status) {
    std::vector<std::weak_ptr<AbortState>> children;
    {
      std::lock_guard<std::mutex> lock(mu_);
      agreed_ = status;
      children.swap(children_);
    }
    for (const auto& weak : children) {
      if (auto child = weak.lock()) child->Abort(status);
    }
  }

  // (agreed, pending)
  std::pair<Status, Status> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return {agreed_, pending_};
  }

  // A communicator split from this one: aborted now if this one is, else when this one is.
  void AddChild(const std::shared_ptr<AbortState>& child) {
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status = agreed_.ok() ? pending_ : agreed_;
      if (status.ok()) {
        std::erase_if(children_, [](const auto& weak) { return weak.expired(); });
        children_.push_back(child);
        return;
      }
    }
    child->Abort(status);
  }

 private:
  std::mutex mu_;
  Status pending_;
  Status agreed_;
  std::vector<std::weak_ptr<AbortState>> children_;
};

// The status rank `from` announced as the reason its collective failed (EncodeStatus, detail
// included): kAborted naming the rank when the bytes are not one status, or say OK.
inline Status AnnouncedStatus(const Bytes& bytes, int from) {
  Status status;
  if (!DecodeStatus(bytes, &status).ok() || status.ok()) {
    return Aborted("rank " + std::to_string(from) + " aborted with a malformed status of " +
                   std::to_string(bytes.size()) + " bytes");
  }
  return status;
}

}  // namespace tessera

#endif  // TESSERA_COMM_ABORT_STATE_H_
