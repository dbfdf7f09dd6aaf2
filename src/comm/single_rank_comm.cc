// NewSingleRankComm: a communicator of one rank. Every collective is a local copy; the only
// state is whether the communicator, or one it was split from, was aborted. It fails as the
// others do (the Comm conformance suite checks it): an argument error names the collective and
// rank 0 and aborts the communicator, and aborting a communicator aborts those split from it.
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm.h"

namespace tessera {
namespace {

// Whether a communicator was aborted, or one it was split from. Thread-safe: a parent may be
// aborted while its child is used on another thread.
class AbortState {
 public:
  explicit AbortState(std::shared_ptr<const AbortState> parent) : parent_(std::move(parent)) {}

  // OK, or the status of the first abort of this communicator or of an ancestor.
  Status status() const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status_.ok()) return status_;
    }
    return parent_ ? parent_->status() : Status::Ok();
  }

  // The first abort wins.
  void Abort(const Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = status;
  }

 private:
  const std::shared_ptr<const AbortState> parent_;
  mutable std::mutex mu_;
  Status status_;
};

class SingleRankComm final : public Comm {
 public:
  explicit SingleRankComm(std::shared_ptr<const AbortState> parent)
      : state_(std::make_shared<AbortState>(std::move(parent))) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }

  Status Barrier() override { return state_->status(); }

  Status Broadcast(Bytes* data, int root) override {
    TESSERA_RETURN_IF_ERROR(state_->status());
    TESSERA_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    if (data == nullptr) return Fail(InvalidArgument("Broadcast on rank 0: data is null"));
    return Status::Ok();
  }

  Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) override {
    TESSERA_RETURN_IF_ERROR(state_->status());
    TESSERA_RETURN_IF_ERROR(CheckRoot("Gather", root));
    if (received == nullptr) {
      return Fail(InvalidArgument("Gather on rank 0: received is null on the root"));
    }
    received->assign(1, send);
    return Status::Ok();
  }

  Status AllGather(const Bytes& send, std::vector<Bytes>* received) override {
    TESSERA_RETURN_IF_ERROR(state_->status());
    if (received == nullptr) return Fail(InvalidArgument("AllGather on rank 0: received is null"));
    received->assign(1, send);
    return Status::Ok();
  }

  Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) override {
    TESSERA_RETURN_IF_ERROR(state_->status());
    TESSERA_RETURN_IF_ERROR(CheckRoot("Scatter", root));
    if (send.size() != 1) {
      return Fail(InvalidArgument("Scatter on rank 0: the root passed " +
                                  std::to_string(send.size()) + " buffers for 1 ranks"));
    }
    if (received == nullptr) return Fail(InvalidArgument("Scatter on rank 0: received is null"));
    *received = send[0];
    return Status::Ok();
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return state_->status();  // The reduction of one contribution is itself.
  }

  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    TESSERA_RETURN_IF_ERROR(state_->status());
    return std::unique_ptr<Comm>(std::make_unique<SingleRankComm>(state_));
  }

  void Abort(const Status& reason) override {
    state_->Abort(Aborted("rank 0 aborted: " + reason.ToString()));
  }

 private:
  // An argument error: aborts the communicator for later collectives, as every Comm does.
  Status Fail(Status error) {
    Abort(error);
    return error;
  }

  Status CheckRoot(const char* op, int root) {
    if (root == 0) return Status::Ok();
    return Fail(InvalidArgument(std::string(op) + " on rank 0: root " + std::to_string(root) +
                                " is not a rank of a communicator of size 1"));
  }

  const std::shared_ptr<AbortState> state_;
};

}  // namespace

std::unique_ptr<Comm> NewSingleRankComm() { return std::make_unique<SingleRankComm>(nullptr); }

}  // namespace tessera
