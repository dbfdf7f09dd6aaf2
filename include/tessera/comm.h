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

#include <cstddef>
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

// Byte ranges of caller memory that a collective reads from or writes into.
using ConstByteSpan = std::span<const std::byte>;
using MutableByteSpan = std::span<std::byte>;

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
  // COLLECTIVE. A scatter whose bytes land in caller memory (a vectored receive). On `root`,
  // `send` holds size() lists: `send[r]` are the ranges that make up rank r's message, in
  // order (`send` is ignored elsewhere). Every rank, the root included, passes in `receive` the
  // ranges its message fills, in order, and gets in `*received` the length of the message the
  // root sent it. When that length equals the ranges' total they hold the message; otherwise
  // they are left untouched: a message of another length is not a failure of the collective,
  // the caller's protocol decides what it means (read-once loads: a reader that failed sends
  // nothing). Ranges must not overlap one another, and the root's sent ranges must stay
  // unchanged until the call returns.
  //
  // Where the transport allows it the bytes move once, from the root's ranges straight into
  // the receiver's: LocalComm (the receiver copies from the root's memory), MpiComm without a
  // collective deadline (indexed datatypes over both sides' ranges). Elsewhere this default
  // goes through Scatter: the root packs each message, and the receiver copies the message
  // into its ranges. MpiComm with a deadline takes the default on purpose: a transfer it gives
  // up on stays pending inside MPI, which must then only ever write memory the Comm owns.
  virtual Status ScatterInto(std::span<const std::vector<ConstByteSpan>> send,
                             std::span<const MutableByteSpan> receive, uint64_t* received,
                             int root);
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

// The total length of `ranges`.
uint64_t TotalBytes(std::span<const ConstByteSpan> ranges);
uint64_t TotalBytes(std::span<const MutableByteSpan> ranges);

// Copies the bytes of `from`, in order, into the ranges of `to`, in order. Their totals must
// be equal.
void CopyRanges(std::span<const ConstByteSpan> from, std::span<const MutableByteSpan> to);

// A communicator of one rank: every collective is a local copy.
std::unique_ptr<Comm> NewSingleRankComm();

// COLLECTIVE. Every rank contributes its local status; all ranks return OK when all are OK,
// otherwise the same error on every rank, naming the lowest failing rank and its message
// ("rank 3: ..."), plus how many ranks failed. With one rank, its own status unchanged.
Status AgreeOnStatus(Comm& comm, const Status& local);

}  // namespace tessera

#endif  // TESSERA_COMM_H_
