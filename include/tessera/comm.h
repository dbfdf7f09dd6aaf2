// Comm: how ranks move bytes between them. tessera's save and load are written against this
// interface only; implementations: a single-rank one (NewSingleRankComm), an in-process one
// that runs N ranks as N threads with real message passing (local_comm.h), and MPI
// (mpi_comm.h, its own target tessera::mpi).
//
// COLLECTIVE calls must be made by every rank of the communicator, in the same order. A
// collective that cannot complete (a peer failed or called Abort) returns an error on every
// rank that reaches it. tessera's own protocols never rely on that alone: a rank that fails
// still takes part in every collective and reports its failure through them, so every rank
// returns the same error.
//
// Collective deadline: a rank that stops calling collectives (it hangs, or its caller went
// elsewhere) must not leave its peers waiting forever. Every implementation that waits for
// peers bounds the wait for them to ENTER a collective by a deadline, an option of the
// implementation: LocalCommOptions::timeout, MpiCommOptions::collective_timeout (10 minutes
// by default each; the same on every rank). When it passes, every waiting rank returns
// kDeadlineExceeded "<collective> on rank R gave up after waiting T ms for ranks A, B to enter
// it (collective #N of this communicator)", naming the ranks that never came, the same text on
// every rank; the communicator is aborted, so a late rank gets the same status when it comes,
// and so does every later collective. Save, Load and AsyncSave return that status. The data
// transfers of a collective that every rank has entered are not bounded (they are bounded by
// the transport). A single-rank Comm never waits. A Comm written in Python over
// torch.distributed has that library's timeout (tessera.torch_dist_comm(timeout=...)).
//
// Thread safety: a Comm is used by one thread at a time. Different Comms (e.g. one from Split)
// may be used concurrently from different threads.
#ifndef TESSERA_COMM_H_
#define TESSERA_COMM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

enum class ReduceOp { kSum, kMin, kMax };

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // COLLECTIVE. Returns when every rank has entered.
  virtual Status Barrier() = 0;
  // COLLECTIVE. On `root`, `data` is sent; elsewhere it is replaced by root's bytes.
  virtual Status Broadcast(Bytes* data, int root) = 0;
  // COLLECTIVE. On `root`, `*received` becomes size() buffers, entry r from rank r (sizes may
  // differ). Elsewhere `received` is untouched and may be null.
  virtual Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) = 0;
  // COLLECTIVE. Every rank gets every rank's buffer.
  virtual Status AllGather(const Bytes& send, std::vector<Bytes>* received) = 0;
  // COLLECTIVE. On `root`, `send` holds size() buffers; rank r receives send[r]. `send` is
  // ignored elsewhere.
  virtual Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) = 0;
  // COLLECTIVE. Element-wise reduction of `values` (same length on every rank), in place.
  virtual Status AllReduce(std::span<int64_t> values, ReduceOp op) = 0;
  // COLLECTIVE. Ranks with the same `color` form a new communicator, ordered by (`key`, old
  // rank). The new Comm is independent: its traffic never mixes with this one's.
  virtual Result<std::unique_ptr<Comm>> Split(int color, int key) = 0;

  // Not collective. Marks this communicator failed for every rank: their current and future
  // collectives return kAborted naming this rank and `reason`. Used when a rank hits an error
  // it cannot report through the normal protocol.
  virtual void Abort(const Status& reason) = 0;

  // State tessera keeps per communicator across calls (the save plan cache, the asynchronous
  // saver), created by `make` on first use and destroyed with the Comm. Thread-safe.
  template <typename T, typename Make>
  std::shared_ptr<T> GetOrCreateAttachment(const std::string& name, Make&& make) {
    std::lock_guard<std::mutex> lock(attachments_mu_);
    std::shared_ptr<void>& slot = attachments_[name];
    if (!slot) slot = std::shared_ptr<T>(make());
    return std::static_pointer_cast<T>(slot);
  }

 private:
  std::mutex attachments_mu_;
  std::map<std::string, std::shared_ptr<void>> attachments_;
};

// A communicator of one rank: every collective is a local copy.
std::unique_ptr<Comm> NewSingleRankComm();

// COLLECTIVE. Every rank contributes its local status; all ranks return OK when all are OK,
// otherwise the same error on every rank, naming the lowest failing rank and its message
// ("rank 3: ..."), plus how many ranks failed. With one rank, its own status unchanged.
Status AgreeOnStatus(Comm& comm, const Status& local);

}  // namespace tessera

#endif  // TESSERA_COMM_H_
