// NewSingleRankComm: a communicator of one rank. Every collective is a local copy; the only
// state is whether Abort was called.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm.h"

namespace tessera {
namespace {

class SingleRankComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  Status Barrier() override { return abort_status_; }

  Status Broadcast(Bytes* data, int root) override {
    TESSERA_RETURN_IF_ERROR(abort_status_);
    TESSERA_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    if (data == nullptr) return InvalidArgument("Broadcast: data is null");
    return Status::Ok();
  }

  Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) override {
    TESSERA_RETURN_IF_ERROR(abort_status_);
    TESSERA_RETURN_IF_ERROR(CheckRoot("Gather", root));
    if (received == nullptr) return InvalidArgument("Gather: received is null on the root");
    received->assign(1, send);
    return Status::Ok();
  }

  Status AllGather(const Bytes& send, std::vector<Bytes>* received) override {
    TESSERA_RETURN_IF_ERROR(abort_status_);
    if (received == nullptr) return InvalidArgument("AllGather: received is null");
    received->assign(1, send);
    return Status::Ok();
  }

  Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) override {
    TESSERA_RETURN_IF_ERROR(abort_status_);
    TESSERA_RETURN_IF_ERROR(CheckRoot("Scatter", root));
    if (send.size() != 1) {
      return InvalidArgument("Scatter: the root passed " + std::to_string(send.size()) +
                             " buffers for 1 rank");
    }
    if (received == nullptr) return InvalidArgument("Scatter: received is null");
    *received = send[0];
    return Status::Ok();
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return abort_status_;  // The reduction of one contribution is itself.
  }

  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    TESSERA_RETURN_IF_ERROR(abort_status_);
    return NewSingleRankComm();
  }

  void Abort(const Status& reason) override {
    if (abort_status_.ok()) abort_status_ = Aborted("rank 0 aborted: " + reason.ToString());
  }

 private:
  static Status CheckRoot(const char* op, int root) {
    if (root == 0) return Status::Ok();
    return InvalidArgument(std::string(op) + ": root " + std::to_string(root) +
                           " is not a rank of a communicator of size 1");
  }

  Status abort_status_;  // OK until Abort is called.
};

}  // namespace

std::unique_ptr<Comm> NewSingleRankComm() { return std::make_unique<SingleRankComm>(); }

}  // namespace tessera
