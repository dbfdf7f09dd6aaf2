// MpiComm: a Comm over an MPI communicator. See include/tessera/mpi_comm.h for the contract.
//
// Every collective is: Begin (one MPI_Iallreduce of a fixed-size header, the same result on
// every rank), then the collective's own MPI calls. The header makes failures and argument
// mismatches collective decisions: a rank that failed (bad argument, aborted) still takes part
// in the header, flagged, and every rank then agrees on the status of the lowest flagged rank,
// broadcast from it. Once agreed, the status is sticky: later collectives return it at once,
// on every rank, without touching MPI.
//
// All MPI operations are nonblocking ones followed by a wait, so that without
// MPI_THREAD_MULTIPLE the wait can poll MPI_Test under a process-wide lock that it releases
// between polls (see Wait).
#include "tessera/mpi_comm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "comm/abort_state.h"
#include "mpi/mpi_internal.h"

namespace tessera {
namespace {

using mpi_internal::Rounds;

// ---- process-wide state ------------------------------------------------------------------

mpi_internal::DataPhaseHook& TestHook() {
  static mpi_internal::DataPhaseHook hook;
  return hook;
}

std::atomic<int> g_provided_thread_level{-1};  // recorded when tessera initialised MPI
std::atomic<bool> g_initialized_by_tessera{false};

// Serialises tessera's MPI calls when MPI does not provide MPI_THREAD_MULTIPLE.
std::mutex& SerialMpiMutex() {
  static std::mutex mu;
  return mu;
}

// Holds SerialMpiMutex when `serialized`, else nothing.
class MaybeLock {
 public:
  explicit MaybeLock(bool serialized) {
    if (serialized) lock_ = std::unique_lock<std::mutex>(SerialMpiMutex());
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool MpiIsUsable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// ---- the header ----------------------------------------------------------------------------

enum class Kind : int64_t {
  kBarrier = 1,
  kBroadcast,
  kGather,
  kAllGather,
  kScatter,
  kAllReduce,
  kSplit,
  kScatterInto,
};

std::string KindName(int64_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kBarrier:
      return "Barrier";
    case Kind::kBroadcast:
      return "Broadcast";
    case Kind::kGather:
      return "Gather";
    case Kind::kAllGather:
      return "AllGather";
    case Kind::kScatter:
      return "Scatter";
    case Kind::kAllReduce:
      return "AllReduce";
    case Kind::kSplit:
      return "Split";
    case Kind::kScatterInto:
      return "ScatterInto";
  }
  return "collective " + std::to_string(kind);
}

std::string ReduceOpName(int64_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::kSum:
      return "kSum";
    case ReduceOp::kMin:
      return "kMin";
    case ReduceOp::kMax:
      return "kMax";
  }
  return "ReduceOp " + std::to_string(op);
}

// ---- collective deadline (MpiCommOptions::collective_timeout) ------------------------------
//
// A rank that has waited `timeout` for its peers to enter a collective (its header all-reduce)
// asks who is there: point-to-point control messages on the same communicator, under a tag of
// their own (MPI keeps them apart from the collectives). The lowest-ranked rank that gives up
// decides for everyone:
//   NOTICE(seq)   "my deadline in collective #seq passed": sent to every other rank. A rank
//                 that has entered #seq answers PRESENT; a rank waiting in #seq stops waiting
//                 on its own and follows the lowest-ranked sender of a NOTICE (the leader).
//   PRESENT(seq)  the answer.
//   VERDICT(seq)  after a grace period, from the leader to every other rank: "proceed" if its
//                 header completed meanwhile (every rank came), else "give up" with the ranks
//                 that neither answered nor sent a NOTICE: every rank that hears it (the late
//                 ones too, when they arrive) returns the same kDeadlineExceeded naming them.
// A header request given up on stays pending inside MPI (a nonblocking collective cannot be
// cancelled), so its buffers are kept alive until exit; the communicator is then aborted for
// this rank (every later collective returns the same status without communicating). A rank
// never starts a collective's data phase after a NOTICE for it without the leader's "proceed",
// so no data transfer is ever left half done.
// Data transfers (issue 22): once every rank has entered a collective (its header completed),
// each of its data operations (MPI_Ibcast, MPI_Igatherv, ...) is waited for under the same
// deadline, measured from the start of that operation. A rank whose operation has not completed
// by then gives up on it: the operation stays pending inside MPI with every buffer it uses
// (heap memory of tessera's, never the caller's) kept until exit, the rank sends
//   ABANDON(seq)  "I gave up on collective #seq in the middle of its data transfer"
// to every other rank and returns kDeadlineExceeded; a rank that hears it returns the same
// status from whatever wait of this communicator it is in (that transfer, a later header), or
// at its next collective. No rank can tell which peer stalled a transfer (MPI does not say), so
// the message names the collective, not a rank, and reads the same on every rank.
enum Control : int64_t { kNotice = 1, kPresent = 2, kVerdict = 3, kAbandon = 4 };
constexpr int kControlTag = 0x7e55;  // < 32767, the smallest MPI_TAG_UB MPI allows
constexpr int kDirectTag = 0x5ca7;   // ScatterInto's point-to-point messages

using Clock = std::chrono::steady_clock;

// How long a leader collects answers, and (times 4) how long a follower waits for the verdict.
std::chrono::milliseconds Grace(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 10, std::chrono::milliseconds(50),
                                               std::chrono::milliseconds(5000));
}

// "rank 3", "ranks 1, 3".
std::string RanksText(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// Buffers MPI may still write into (an abandoned header, a control message whose send was
// released): kept until exit.
void KeepUntilExit(std::shared_ptr<void> buffer) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(buffer));
}

// Header fields. Every field is reduced with MAX except kTotal (SUM); a field and its negation
// side by side give the maximum and the minimum over the ranks.
enum Field : int {
  kFailed,         // 1 when this rank failed or was aborted
  kNegFailedRank,  // -rank when failed, else INT64_MIN: the maximum names the lowest failed rank
  kKind,           // Kind
  kNegKind,
  kRoot,  // root, or -1 for collectives without one
  kNegRoot,
  kValue,  // AllReduce: the number of values; Split: the color
  kNegValue,
  kReduceOp,  // AllReduce: the ReduceOp
  kNegReduceOp,
  kMaxCount,  // Broadcast: the root's size (-1 elsewhere); Gather, AllGather: own size;
              // Scatter: the root's largest buffer (0 elsewhere)
  kTotal,     // Gather, AllGather: own size; Scatter: the root's total (0 elsewhere)
  kNumFields,
};

using Header = std::array<int64_t, kNumFields>;

void SetPair(Header& h, Field field, int64_t value) {
  h[field] = value;
  h[field + 1] = -value;
}

Header NewHeader(Kind kind) {
  Header h{};
  SetPair(h, kKind, static_cast<int64_t>(kind));
  SetPair(h, kRoot, -1);
  h[kNegFailedRank] = INT64_MIN;
  return h;
}

// The MPI reduction of headers: a header is one element of a contiguous datatype, so MPI never
// splits one across calls.
void ReduceHeaders(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const int64_t*>(in);
  auto* b = static_cast<int64_t*>(inout);
  for (int h = 0; h < *len; ++h, a += kNumFields, b += kNumFields) {
    for (int f = 0; f < kNumFields; ++f) {
      b[f] = f == kTotal
                 ? static_cast<int64_t>(static_cast<uint64_t>(a[f]) + static_cast<uint64_t>(b[f]))
                 : std::max(a[f], b[f]);
    }
  }
}

struct HeaderMpi {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  int error = MPI_SUCCESS;
};

// Created once per process, after MPI_Init, and kept until exit.
const HeaderMpi& GetHeaderMpi() {
  static HeaderMpi header;
  static std::once_flag once;
  std::call_once(once, [] {
    std::lock_guard<std::mutex> lock(SerialMpiMutex());
    header.error = MPI_Type_contiguous(kNumFields, MPI_INT64_T, &header.type);
    if (header.error == MPI_SUCCESS) header.error = MPI_Type_commit(&header.type);
    if (header.error == MPI_SUCCESS) {
      header.error = MPI_Op_create(&ReduceHeaders, /*commute=*/1, &header.op);
    }
  });
  return header;
}

// Statuses on the wire and the abort state: comm/abort_state.h (shared with PythonComm).

// ---- the communicator ---------------------------------------------------------------------------

struct Settings {
  MpiCommOptions options;
  bool serialized = false;  // MPI_THREAD_MULTIPLE not provided: lock and poll
  HeaderMpi header;
};

class MpiComm final : public Comm {
 public:
  // Takes ownership of `comm`.
  MpiComm(MPI_Comm comm, int rank, int size, std::shared_ptr<const Settings> settings)
      : comm_(comm), rank_(rank), size_(size), settings_(std::move(settings)) {}

  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MaybeLock lock(serialized());
    for (auto& [request, buffer] : sends_) {
      MPI_Request_free(&request);  // allowed for a send; MPI may still read the buffer
      KeepUntilExit(std::move(buffer));
    }
    MPI_Comm_free(&comm_);
  }

  // Wraps an MPI communicator this Comm will own: sets MPI_ERRORS_RETURN and reads rank and
  // size. Frees `comm` on failure. `op` names the caller in errors.
  static Result<std::unique_ptr<MpiComm>> Adopt(MPI_Comm comm,
                                                std::shared_ptr<const Settings> settings,
                                                std::string_view op, int parent_rank) {
    int rank = 0, size = 0;
    int rc;
    const char* call = "MPI_Comm_set_errhandler";
    {
      MaybeLock lock(settings->serialized);
      rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
      if (rc == MPI_SUCCESS) {
        call = "MPI_Comm_rank";
        rc = MPI_Comm_rank(comm, &rank);
      }
      if (rc == MPI_SUCCESS) {
        call = "MPI_Comm_size";
        rc = MPI_Comm_size(comm, &size);
      }
      if (rc != MPI_SUCCESS) MPI_Comm_free(&comm);
    }
    if (rc != MPI_SUCCESS) return mpi_internal::MpiErrorStatus(rc, call, op, parent_rank);
    return std::make_unique<MpiComm>(comm, rank, size, std::move(settings));
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status Barrier() override {
    Header h = NewHeader(Kind::kBarrier);
    return Begin(Kind::kBarrier, h, Status::Ok()).status();
  }

  Status Broadcast(Bytes* data, int root) override {
    constexpr std::string_view kOp = "Broadcast";
    Status local = CheckRoot(kOp, root);
    if (local.ok() && data == nullptr) local = InvalidArgument(Where(kOp) + ": data is null");
    Header h = NewHeader(Kind::kBroadcast);
    SetPair(h, kRoot, root);
    h[kMaxCount] = local.ok() && rank_ == root ? static_cast<int64_t>(data->size()) : -1;
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kBroadcast, h, local));
    return BcastBytes(data, agreed.max_count, root, kOp);
  }

  // The root's layout of round `k` of a Gather or Scatter: piece[r] bytes of rank r at
  // displs[r], none of its own (it copies those itself). Returns the round's total bytes.
  int64_t RootRound(const Rounds& rounds, const std::vector<int64_t>& counts, int64_t k,
                    std::vector<int>& piece, std::vector<int>& displs) const {
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      piece[r] = r == rank_ ? 0 : static_cast<int>(rounds.Size(counts[r], k));
      displs[r] = static_cast<int>(total);
      total += piece[r];
    }
    return total;
  }

  Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) override {
    constexpr std::string_view kOp = "Gather";
    Status local = CheckRoot(kOp, root);
    if (local.ok() && rank_ == root && received == nullptr) {
      local = InvalidArgument(Where(kOp) + ": received is null on the root");
    }
    const auto mine = static_cast<int64_t>(send.size());
    Header h = NewHeader(Kind::kGather);
    SetPair(h, kRoot, root);
    h[kMaxCount] = h[kTotal] = mine;
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kGather, h, local));
    const bool is_root = rank_ == root;
    std::vector<Bytes> out(is_root ? size_ : 0);
    const Rounds rounds = Schedule(agreed);
    if (rounds.rounds > 0) {
      // Every buffer MPI touches is the Comm's own (see kAbandon).
      auto mine_out = std::make_shared<int64_t>(mine);
      auto counts = std::make_shared<std::vector<int64_t>>(is_root ? size_ : 0);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Igather", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Igather(mine_out.get(), 1, MPI_INT64_T,
                                                       counts->data(), 1, MPI_INT64_T, root, comm_,
                                                       request);
                                  },
                                  {mine_out, counts}));
      for (int r = 0; is_root && r < size_; ++r) {
        if (r != rank_) out[r].resize((*counts)[r]);
      }
      for (int64_t k = 0; k < rounds.rounds; ++k) {
        auto piece = std::make_shared<std::vector<int>>(is_root ? size_ : 0);
        auto displs = std::make_shared<std::vector<int>>(is_root ? size_ : 0);
        auto staging = std::make_shared<Bytes>();
        if (is_root) {
          // The root's own bytes stay put (MPI_IN_PLACE, count 0); it copies them below.
          staging->resize(RootRound(rounds, *counts, k, *piece, *displs));
        } else {
          const uint8_t* from = send.data() + rounds.Begin(mine, k);
          staging->assign(from, from + rounds.Size(mine, k));
        }
        TESSERA_RETURN_IF_ERROR(Run(
            "MPI_Igatherv", kOp,
            [&](MPI_Request* request) {
              return is_root
                         ? MPI_Igatherv(MPI_IN_PLACE, 0, MPI_BYTE, staging->data(), piece->data(),
                                        displs->data(), MPI_BYTE, root, comm_, request)
                         : MPI_Igatherv(staging->data(), static_cast<int>(staging->size()),
                                        MPI_BYTE, nullptr, nullptr, nullptr, MPI_BYTE, root, comm_,
                                        request);
            },
            {staging, piece, displs}));
        for (int r = 0; is_root && r < size_; ++r) {
          if ((*piece)[r] > 0) {
            std::memcpy(out[r].data() + rounds.Begin((*counts)[r], k),
                        staging->data() + (*displs)[r], (*piece)[r]);
          }
        }
      }
    }
    if (is_root) {
      out[rank_] = send;
      *received = std::move(out);
    }
    return Status::Ok();
  }

  Status AllGather(const Bytes& send, std::vector<Bytes>* received) override {
    constexpr std::string_view kOp = "AllGather";
    Status local;
    if (received == nullptr) local = InvalidArgument(Where(kOp) + ": received is null");
    const auto mine = static_cast<int64_t>(send.size());
    Header h = NewHeader(Kind::kAllGather);
    h[kMaxCount] = h[kTotal] = mine;
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kAllGather, h, local));
    std::vector<Bytes> out(size_);
    const Rounds rounds = Schedule(agreed);
    if (rounds.rounds > 0) {
      auto mine_out = std::make_shared<int64_t>(mine);
      auto counts = std::make_shared<std::vector<int64_t>>(size_);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iallgather", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Iallgather(mine_out.get(), 1, MPI_INT64_T,
                                                          counts->data(), 1, MPI_INT64_T, comm_,
                                                          request);
                                  },
                                  {mine_out, counts}));
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) out[r].resize((*counts)[r]);
      }
      for (int64_t k = 0; k < rounds.rounds; ++k) {
        auto piece = std::make_shared<std::vector<int>>(size_);
        auto displs = std::make_shared<std::vector<int>>(size_);
        int64_t total = 0;
        for (int r = 0; r < size_; ++r) {
          (*piece)[r] = static_cast<int>(rounds.Size((*counts)[r], k));
          (*displs)[r] = static_cast<int>(total);
          total += (*piece)[r];
        }
        // This rank's piece goes in place: MPI reads it from the staging buffer.
        auto staging = std::make_shared<Bytes>(total);
        std::memcpy(staging->data() + (*displs)[rank_], send.data() + rounds.Begin(mine, k),
                    (*piece)[rank_]);
        TESSERA_RETURN_IF_ERROR(Run("MPI_Iallgatherv", kOp,
                                    [&](MPI_Request* request) {
                                      return MPI_Iallgatherv(
                                          MPI_IN_PLACE, 0, MPI_BYTE, staging->data(), piece->data(),
                                          displs->data(), MPI_BYTE, comm_, request);
                                    },
                                    {staging, piece, displs}));
        for (int r = 0; r < size_; ++r) {
          if (r != rank_ && (*piece)[r] > 0) {
            std::memcpy(out[r].data() + rounds.Begin((*counts)[r], k),
                        staging->data() + (*displs)[r], (*piece)[r]);
          }
        }
      }
    }
    out[rank_] = send;
    *received = std::move(out);
    return Status::Ok();
  }

  Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) override {
    constexpr std::string_view kOp = "Scatter";
    const bool is_root = rank_ == root;
    Status local = CheckRoot(kOp, root);
    if (local.ok() && received == nullptr) {
      local = InvalidArgument(Where(kOp) + ": received is null");
    }
    if (local.ok() && is_root && static_cast<int64_t>(send.size()) != size_) {
      local = InvalidArgument(Where(kOp) + ": the root passed " + std::to_string(send.size()) +
                              " buffers for " + std::to_string(size_) + " ranks");
    }
    Header h = NewHeader(Kind::kScatter);
    SetPair(h, kRoot, root);
    if (local.ok() && is_root) {
      for (const Bytes& b : send) {
        h[kMaxCount] = std::max<int64_t>(h[kMaxCount], static_cast<int64_t>(b.size()));
        h[kTotal] += static_cast<int64_t>(b.size());
      }
    }
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kScatter, h, local));
    auto out = std::make_shared<Bytes>();
    const Rounds rounds = Schedule(agreed);
    if (rounds.rounds > 0) {
      auto counts = std::make_shared<std::vector<int64_t>>(is_root ? size_ : 0);
      for (int r = 0; is_root && r < size_; ++r)
        (*counts)[r] = static_cast<int64_t>(send[r].size());
      auto mine = std::make_shared<int64_t>(0);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iscatter", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Iscatter(counts->data(), 1, MPI_INT64_T, mine.get(),
                                                        1, MPI_INT64_T, root, comm_, request);
                                  },
                                  {counts, mine}));
      if (!is_root) out->resize(*mine);
      for (int64_t k = 0; k < rounds.rounds; ++k) {
        auto piece = std::make_shared<std::vector<int>>(is_root ? size_ : 0);
        auto displs = std::make_shared<std::vector<int>>(is_root ? size_ : 0);
        auto staging = std::make_shared<Bytes>();
        if (is_root) {
          // The root keeps its own buffer (MPI_IN_PLACE, count 0) and copies it below.
          staging->resize(RootRound(rounds, *counts, k, *piece, *displs));
          for (int r = 0; r < size_; ++r) {
            if ((*piece)[r] > 0) {
              std::memcpy(staging->data() + (*displs)[r],
                          send[r].data() + rounds.Begin((*counts)[r], k), (*piece)[r]);
            }
          }
        }
        const int64_t at = is_root ? 0 : rounds.Begin(*mine, k);
        const int recvcount = is_root ? 0 : static_cast<int>(rounds.Size(*mine, k));
        TESSERA_RETURN_IF_ERROR(Run("MPI_Iscatterv", kOp,
                                    [&](MPI_Request* request) {
                                      return MPI_Iscatterv(
                                          staging->data(), piece->data(), displs->data(), MPI_BYTE,
                                          is_root ? MPI_IN_PLACE : out->data() + at, recvcount,
                                          MPI_BYTE, root, comm_, request);
                                    },
                                    {staging, piece, displs, out}));
      }
    }
    if (is_root) *out = send[rank_];
    *received = std::move(*out);
    return Status::Ok();
  }

  // Without a collective deadline the bytes move once: the root sends each message from its
  // ranges and the receiver receives into its ranges, through indexed datatypes (MPI_BOTTOM
  // and absolute addresses). With a deadline, the default (comm.h says why).
  Status ScatterInto(std::span<const std::vector<ConstByteSpan>> send,
                     std::span<const MutableByteSpan> receive, uint64_t* received,
                     int root) override {
    if (settings_->options.collective_timeout.count() > 0) {
      return Comm::ScatterInto(send, receive, received, root);
    }
    constexpr std::string_view kOp = "ScatterInto";
    const bool is_root = rank_ == root;
    Status local = CheckRoot(kOp, root);
    if (local.ok() && is_root && static_cast<int64_t>(send.size()) != size_) {
      local = InvalidArgument(Where(kOp) + ": the root passed " + std::to_string(send.size()) +
                              " lists for " + std::to_string(size_) + " ranks");
    }
    Header h = NewHeader(Kind::kScatterInto);
    SetPair(h, kRoot, root);
    if (local.ok() && is_root) {
      for (const std::vector<ConstByteSpan>& ranges : send) {
        const auto bytes = static_cast<int64_t>(TotalBytes(ranges));
        h[kMaxCount] = std::max(h[kMaxCount], bytes);
        h[kTotal] += bytes;
      }
    }
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kScatterInto, h, local));
    uint64_t mine = 0;
    if (agreed.total > 0) {
      std::vector<int64_t> counts(is_root ? size_ : 0);
      for (int r = 0; is_root && r < size_; ++r) counts[r] = TotalBytes(send[r]);
      int64_t count = 0;
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iscatter", kOp, [&](MPI_Request* request) {
        return MPI_Iscatter(counts.data(), 1, MPI_INT64_T, &count, 1, MPI_INT64_T, root, comm_,
                            request);
      }));
      mine = static_cast<uint64_t>(count);
      for (int r = 0; is_root && r < size_; ++r) {
        if (r != rank_ && counts[r] > 0) TESSERA_RETURN_IF_ERROR(SendRanges(send[r], r, kOp));
      }
      if (!is_root && mine > 0) TESSERA_RETURN_IF_ERROR(ReceiveRanges(receive, mine, root, kOp));
    }
    if (is_root) {
      mine = TotalBytes(send[rank_]);
      if (mine == TotalBytes(receive)) CopyRanges(send[rank_], receive);
    }
    if (received != nullptr) *received = mine;
    return Status::Ok();
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    constexpr std::string_view kOp = "AllReduce";
    Status local;
    if (op != ReduceOp::kSum && op != ReduceOp::kMin && op != ReduceOp::kMax) {
      local = InvalidArgument(Where(kOp) + ": unknown " + ReduceOpName(static_cast<int>(op)));
    }
    const auto count = static_cast<int64_t>(values.size());
    Header h = NewHeader(Kind::kAllReduce);
    SetPair(h, kValue, count);
    SetPair(h, kReduceOp, static_cast<int64_t>(op));
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kAllReduce, h, local));
    if (agreed.value_min != agreed.value_max) {
      // Every rank is here: find who differs from rank 0, for the message.
      auto mine = std::make_shared<int64_t>(count);
      auto counts = std::make_shared<std::vector<int64_t>>(size_);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iallgather", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Iallgather(mine.get(), 1, MPI_INT64_T,
                                                          counts->data(), 1, MPI_INT64_T, comm_,
                                                          request);
                                  },
                                  {mine, counts}));
      int other = 1;
      while (other < size_ - 1 && (*counts)[other] == (*counts)[0]) ++other;
      return FailEverywhere(InvalidArgument(Where(kOp) + ": rank " + std::to_string(other) +
                                            " passed " + std::to_string((*counts)[other]) +
                                            " values, rank 0 passed " +
                                            std::to_string((*counts)[0])));
    }
    if (agreed.op_min != agreed.op_max) {
      return FailEverywhere(InvalidArgument(Where(kOp) + ": the ranks passed different ops, " +
                                            ReduceOpName(agreed.op_min) + " and " +
                                            ReduceOpName(agreed.op_max)));
    }
    // A sum on uint64 wraps around on overflow, like LocalComm, instead of undefined behaviour.
    const MPI_Datatype type = op == ReduceOp::kSum ? MPI_UINT64_T : MPI_INT64_T;
    const MPI_Op mpi_op = op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMin ? MPI_MIN : MPI_MAX;
    const int64_t chunk = settings_->options.max_message_bytes / int64_t{sizeof(int64_t)};
    for (int64_t begin = 0; begin < count; begin += chunk) {
      const int n = static_cast<int>(std::min(chunk, count - begin));
      // The Comm's own copy (see kAbandon): the caller's span may be gone if this is given up.
      auto part = std::make_shared<std::vector<int64_t>>(values.begin() + begin,
                                                         values.begin() + begin + n);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iallreduce", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Iallreduce(MPI_IN_PLACE, part->data(), n, type,
                                                          mpi_op, comm_, request);
                                  },
                                  {part}));
      std::copy(part->begin(), part->end(), values.begin() + begin);
    }
    return Status::Ok();
  }

  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    constexpr std::string_view kOp = "Split";
    Header h = NewHeader(Kind::kSplit);
    SetPair(h, kValue, color);
    TESSERA_ASSIGN_OR_RETURN(Agreed agreed, Begin(Kind::kSplit, h, Status::Ok()));
    int mpi_color = color;
    if (agreed.value_min < 0) {
      // MPI colors must be non-negative: number the distinct colors 0, 1, ...
      auto colors = std::make_shared<std::vector<int64_t>>(size_);
      auto mine = std::make_shared<int64_t>(color);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iallgather", kOp,
                                  [&](MPI_Request* request) {
                                    return MPI_Iallgather(mine.get(), 1, MPI_INT64_T,
                                                          colors->data(), 1, MPI_INT64_T, comm_,
                                                          request);
                                  },
                                  {mine, colors}));
      std::sort(colors->begin(), colors->end());
      colors->erase(std::unique(colors->begin(), colors->end()), colors->end());
      mpi_color = static_cast<int>(std::lower_bound(colors->begin(), colors->end(), *mine) -
                                   colors->begin());
    }
    // MPI has no nonblocking split. Under a deadline, a barrier the deadline covers first: every
    // rank is then at the split, and only a rank that stops between the two can hold the others
    // in MPI_Comm_split.
    if (settings_->options.collective_timeout.count() > 0) {
      TESSERA_RETURN_IF_ERROR(Run(
          "MPI_Ibarrier", kOp, [&](MPI_Request* request) { return MPI_Ibarrier(comm_, request); }));
    }
    MPI_Comm child = MPI_COMM_NULL;
    int rc;
    {
      MaybeLock lock(serialized());
      rc = MPI_Comm_split(comm_, mpi_color, key, &child);
    }
    if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Comm_split", kOp);
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<MpiComm> comm, Adopt(child, settings_, kOp, rank_));
    state_->AddChild(comm->state_);
    return std::unique_ptr<Comm>(std::move(comm));
  }

  void Abort(const Status& reason) override {
    state_->Abort(Aborted("rank " + std::to_string(rank_) + " aborted: " + reason.ToString()));
  }

 private:
  // What every rank learns from the header.
  struct Agreed {
    int64_t max_count = 0;
    int64_t total = 0;
    int64_t value_min = 0, value_max = 0;
    int64_t op_min = 0, op_max = 0;
  };

  bool serialized() const { return settings_->serialized; }

  // An MPI datatype over `ranges` at their absolute addresses (for MPI_BOTTOM), freed with it.
  // `serialized`: MPI calls hold SerialMpiMutex.
  class RangesType {
   public:
    template <typename Span>
    RangesType(std::span<const Span> ranges, bool serialized) : serialized_(serialized) {
      MaybeLock lock(serialized_);
      std::vector<int> lengths;
      std::vector<MPI_Aint> addresses;
      for (const Span& r : ranges) {  // each within one window: its length fits an int
        MPI_Aint address;
        MPI_Get_address(r.data(), &address);
        lengths.push_back(static_cast<int>(r.size()));
        addresses.push_back(address);
      }
      error_ = MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                        addresses.data(), MPI_BYTE, &type_);
      if (error_ == MPI_SUCCESS) error_ = MPI_Type_commit(&type_);
    }
    ~RangesType() {
      MaybeLock lock(serialized_);
      if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
    }
    RangesType(const RangesType&) = delete;
    RangesType& operator=(const RangesType&) = delete;
    int error() const { return error_; }
    MPI_Datatype type() const { return type_; }

   private:
    const bool serialized_;
    MPI_Datatype type_ = MPI_DATATYPE_NULL;
    int error_ = MPI_SUCCESS;
  };

  // ScatterInto sends a message in windows of at most max_message_bytes, one MPI message each,
  // so that no datatype's size overflows MPI's int (MPI keeps the messages of one source and
  // tag in order).
  uint64_t window_bytes() const {
    return static_cast<uint64_t>(settings_->options.max_message_bytes);
  }

  // The ranges of window `w` of a message: its bytes [w * window_bytes(), (w + 1) * ...).
  template <typename Span>
  std::vector<Span> Window(std::span<const Span> ranges, uint64_t w) const {
    const uint64_t begin = w * window_bytes(), end = begin + window_bytes();
    std::vector<Span> out;
    uint64_t at = 0;
    for (const Span& r : ranges) {
      const uint64_t lo = std::max(at, begin), hi = std::min(at + r.size(), end);
      if (lo < hi) out.push_back(r.subspan(lo - at, hi - lo));
      at += r.size();
    }
    return out;
  }

  // ScatterInto's root: rank `to`'s message, from `ranges`, window by window.
  Status SendRanges(std::span<const ConstByteSpan> ranges, int to, std::string_view op) {
    const uint64_t total = TotalBytes(ranges);
    for (uint64_t w = 0; w * window_bytes() < total; ++w) {
      const std::vector<ConstByteSpan> window = Window(ranges, w);
      const RangesType type(std::span<const ConstByteSpan>(window), serialized());
      if (type.error() != MPI_SUCCESS) return Failed(type.error(), "MPI_Type_create_hindexed", op);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Isend", op, [&](MPI_Request* request) {
        return MPI_Isend(MPI_BOTTOM, 1, type.type(), to, kDirectTag, comm_, request);
      }));
    }
    return Status::Ok();
  }

  // ScatterInto's receiver: a message of `length` bytes from `root`, into `ranges` when they
  // hold exactly that much, else into a buffer that is dropped (comm.h: ranges untouched).
  Status ReceiveRanges(std::span<const MutableByteSpan> ranges, uint64_t length, int root,
                       std::string_view op) {
    Bytes discard;
    std::vector<MutableByteSpan> into(ranges.begin(), ranges.end());
    if (TotalBytes(ranges) != length) {
      discard.resize(std::min(length, window_bytes()));
      into.clear();
      for (uint64_t at = 0; at < length; at += discard.size()) {
        into.emplace_back(reinterpret_cast<std::byte*>(discard.data()),
                          std::min<uint64_t>(discard.size(), length - at));
      }
    }
    for (uint64_t w = 0; w * window_bytes() < length; ++w) {
      const std::vector<MutableByteSpan> window = Window(std::span<const MutableByteSpan>(into), w);
      const RangesType type(std::span<const MutableByteSpan>(window), serialized());
      if (type.error() != MPI_SUCCESS) return Failed(type.error(), "MPI_Type_create_hindexed", op);
      TESSERA_RETURN_IF_ERROR(Run("MPI_Irecv", op, [&](MPI_Request* request) {
        return MPI_Irecv(MPI_BOTTOM, 1, type.type(), root, kDirectTag, comm_, request);
      }));
    }
    return Status::Ok();
  }

  std::string Where(std::string_view op) const {
    return std::string(op) + " on rank " + std::to_string(rank_);
  }

  Status CheckRoot(std::string_view op, int root) const {
    if (root >= 0 && root < size_) return Status::Ok();
    return InvalidArgument(Where(op) + ": root " + std::to_string(root) +
                           " is not a rank of a communicator of size " + std::to_string(size_));
  }

  Rounds Schedule(const Agreed& agreed) const {
    return Rounds::For(agreed.max_count, agreed.total, size_, settings_->options.max_message_bytes);
  }

  // Starts a collective: returns the agreed abort status at once if there is one; otherwise
  // exchanges headers. `local`: this rank's own error (a bad argument), or OK. When any rank
  // failed or was aborted, every rank adopts the lowest such rank's abort status and returns
  // it (a rank returns its own `local` error instead). When the ranks disagree on the
  // collective or its root, every rank fails with InvalidArgument.
  Result<Agreed> Begin(Kind kind, Header& h, const Status& local) {
    const std::string op = KindName(static_cast<int64_t>(kind));
    auto [agreed_abort, pending] = state_->Get();
    if (!agreed_abort.ok()) return agreed_abort;
    const bool failed = !pending.ok() || !local.ok();
    h[kFailed] = failed ? 1 : 0;
    h[kNegFailedRank] = failed ? -static_cast<int64_t>(rank_) : INT64_MIN;
    Header result{};
    const uint64_t seq = entered_++;
    current_ = kind;
    if (settings_->options.collective_timeout.count() > 0) {
      TESSERA_RETURN_IF_ERROR(ExchangeHeaderWithDeadline(kind, seq, h, result));
    } else {
      TESSERA_RETURN_IF_ERROR(Run("MPI_Iallreduce", op, [&](MPI_Request* request) {
        return MPI_Iallreduce(h.data(), result.data(), 1, settings_->header.type,
                              settings_->header.op, comm_, request);
      }));
    }
    if (result[kFailed] != 0) {
      const int who = static_cast<int>(-result[kNegFailedRank]);
      Bytes encoded;
      if (who == rank_) {
        encoded = EncodeStatus(pending.ok() ? Aborted("rank " + std::to_string(rank_) +
                                                      " aborted: " + local.ToString())
                                            : pending);
      }
      TESSERA_RETURN_IF_ERROR(BcastSized(&encoded, who, op));
      Status announced = AnnouncedStatus(encoded, who);
      state_->Agree(announced);
      if (pending.ok() && !local.ok()) return local;
      return announced;
    }
    if (result[kKind] != -result[kNegKind]) {
      return FailEverywhere(InvalidArgument(
          Where(op) + ": the ranks called different collectives at the same point: " +
          KindName(-result[kNegKind]) + " and " + KindName(result[kKind])));
    }
    if (result[kRoot] != -result[kNegRoot]) {
      return FailEverywhere(InvalidArgument(Where(op) + ": the ranks passed different roots, " +
                                            std::to_string(-result[kNegRoot]) + " and " +
                                            std::to_string(result[kRoot])));
    }
    Agreed agreed;
    agreed.max_count = result[kMaxCount];
    agreed.total = result[kTotal];
    agreed.value_max = result[kValue];
    agreed.value_min = -result[kNegValue];
    agreed.op_max = result[kReduceOp];
    agreed.op_min = -result[kNegReduceOp];
    return agreed;
  }

  // An error every rank detected in the same collective: aborts the communicator for later
  // collectives (every rank does the same) and returns `error`.
  Status FailEverywhere(Status error) {
    state_->Agree(Aborted("an earlier collective failed on every rank: " + error.ToString()));
    return error;
  }

  // An MPI call failed: the communicator's state is unknown. Aborts it (the next collective
  // tells the peers, if MPI still can) and returns the error.
  Status Failed(int rc, std::string_view call, std::string_view op) {
    Status error = mpi_internal::MpiErrorStatus(rc, call, op, rank_);
    state_->Abort(Aborted("rank " + std::to_string(rank_) + " aborted: " + error.ToString()));
    return error;
  }

  // Runs one nonblocking MPI operation of a collective (the header without a deadline, or a data
  // transfer) to completion. `start(&request)` starts it; `buffers` are every buffer it reads or
  // writes (the Comm's own: see kAbandon), kept until exit if it is given up on.
  template <typename Start>
  Status Run(std::string_view call, std::string_view op, Start&& start,
             std::initializer_list<std::shared_ptr<void>> buffers = {}) {
    MPI_Request request = MPI_REQUEST_NULL;
    int rc;
    if (TestHook()) TestHook()(call, false);
    {
      MaybeLock lock(serialized());
      rc = start(&request);
    }
    if (rc != MPI_SUCCESS) return Failed(rc, call, op);
    if (TestHook()) TestHook()(call, true);
    if (settings_->options.collective_timeout.count() > 0) {
      return AwaitTransfer(request, call, op, buffers);
    }
    if (!serialized()) {
      rc = MPI_Wait(&request, MPI_STATUS_IGNORE);
    } else {
      // Poll, releasing the lock between polls so that another thread's operation (on a
      // parent or child communicator) can progress too.
      for (int polls = 0;; ++polls) {
        int done = 0;
        {
          std::lock_guard<std::mutex> lock(SerialMpiMutex());
          rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
        }
        if (rc != MPI_SUCCESS || done) break;
        Pause(polls);
      }
    }
    if (rc != MPI_SUCCESS) return Failed(rc, call, op);
    return Status::Ok();
  }

  static void Pause(int polls) {
    if (polls < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Waits for data operation `request` of the collective this rank is in (#entered_ - 1) under
  // the deadline (see kAbandon): returns OK when it completes; kDeadlineExceeded when
  // collective_timeout passes first, or when a peer gave up on a transfer of this communicator.
  // Then the operation stays pending inside MPI, `buffers` are kept until exit, the peers are
  // told, and the communicator is aborted for this rank.
  Status AwaitTransfer(MPI_Request& request, std::string_view call, std::string_view op,
                       std::initializer_list<std::shared_ptr<void>> buffers) {
    const std::chrono::milliseconds timeout = settings_->options.collective_timeout;
    const Clock::time_point start = Clock::now();
    const uint64_t seq = entered_ - 1;
    for (uint64_t polls = 0;; ++polls) {
      int completed = 0, rc;
      {
        MaybeLock lock(serialized());
        rc = MPI_Test(&request, &completed, MPI_STATUS_IGNORE);
      }
      if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Test", op);
      // MPI progresses a transfer only inside its calls: test it without pause, as MPI_Wait
      // would, and look at the control messages and the clock every 16th time only.
      if (!completed && polls % 16 != 0) {
        std::this_thread::yield();
        continue;
      }
      TESSERA_RETURN_IF_ERROR(DrainControl(op));
      if (completed) {
        // Done with this part, but a peer that gave up meanwhile has made the outcome one of
        // failure for every rank: say so now rather than at the next collective.
        if (!abandoned_.ok()) state_->Agree(abandoned_);
        return abandoned_;
      }
      Status give_up = abandoned_;
      if (give_up.ok() && Clock::now() - start >= timeout) {
        give_up = Abandoned(current_, timeout, seq);
        SendToAll(
            {kAbandon, static_cast<int64_t>(seq), static_cast<int64_t>(current_), timeout.count()});
      }
      if (!give_up.ok()) {
        for (const std::shared_ptr<void>& buffer : buffers) KeepUntilExit(buffer);
        state_->Agree(give_up);
        return give_up;
      }
      std::this_thread::yield();
    }
  }

  // The status of a transfer given up on, the same text on every rank.
  static Status Abandoned(Kind kind, std::chrono::milliseconds timeout, uint64_t seq) {
    return DeadlineExceeded(
        KindName(static_cast<int64_t>(kind)) + " gave up after waiting " +
        std::to_string(timeout.count()) + " ms for a data transfer of collective #" +
        std::to_string(seq) +
        " of this communicator: every rank had entered it, so a rank stopped or slowed down in "
        "the middle of its data transfer (MPI does not say which)");
  }

  // ---- the collective deadline (see the comment at Control) ----------------------------------

  struct Verdict {
    bool give_up = false;
    Status status;  // the leader's kDeadlineExceeded when give_up
  };

  // The header all-reduce of collective #seq under the deadline. On failure the communicator
  // is aborted for this rank with the returned status.
  Status ExchangeHeaderWithDeadline(Kind kind, uint64_t seq, const Header& h, Header& result) {
    const std::string op = KindName(static_cast<int64_t>(kind));
    // NOTICEs of this collective that arrived before this rank entered it: answer them now.
    for (int r : noticed_[seq]) Send(r, {kPresent, static_cast<int64_t>(seq)});
    Status status = DrainControl(op);
    if (status.ok()) status = abandoned_;  // a peer gave up on an earlier transfer
    if (status.ok() && verdicts_.count(seq) && verdicts_[seq].give_up) {
      status = verdicts_[seq].status;  // a late rank: its peers gave up on this collective
    }
    if (status.ok()) {
      // Heap buffers: if this rank gives up, MPI may still write the result until exit.
      auto buffers = std::make_shared<std::array<Header, 2>>();
      (*buffers)[0] = h;
      MPI_Request request = MPI_REQUEST_NULL;
      int rc;
      {
        MaybeLock lock(serialized());
        rc = MPI_Iallreduce((*buffers)[0].data(), (*buffers)[1].data(), 1, settings_->header.type,
                            settings_->header.op, comm_, &request);
      }
      if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Iallreduce", op);
      bool done = false;
      status = AwaitHeader(request, seq, kind, done);
      if (status.ok()) result = (*buffers)[1];
      if (!done) KeepUntilExit(std::move(buffers));
    }
    ForgetControlBefore(seq);
    if (!status.ok()) state_->Agree(status);
    return status;
  }

  // Waits for the header request of collective #seq (see the comment at Control). `done`:
  // whether the request completed (else it stays pending, given up on).
  Status AwaitHeader(MPI_Request& request, uint64_t seq, Kind kind, bool& done) {
    const std::string op = KindName(static_cast<int64_t>(kind));
    const std::chrono::milliseconds timeout = settings_->options.collective_timeout;
    const std::chrono::milliseconds grace = Grace(timeout);
    const Clock::time_point start = Clock::now();
    bool leading = false;  // this rank's deadline passed and it sent NOTICE
    bool extended = false;
    Clock::time_point grace_end{}, follow_end{};
    int followed = -1;
    for (int polls = 0;; ++polls) {
      if (!done) {
        int completed = 0, rc;
        {
          MaybeLock lock(serialized());
          rc = MPI_Test(&request, &completed, MPI_STATUS_IGNORE);
        }
        if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Test", op);
        done = completed != 0;
      }
      // After the test: a NOTICE sent before the completion is seen before acting on it.
      TESSERA_RETURN_IF_ERROR(DrainControl(op));
      if (!abandoned_.ok()) return abandoned_;  // a peer gave up on an earlier transfer
      const Clock::time_point now = Clock::now();
      int leader = leading ? rank_ : -1;
      if (auto it = noticed_.find(seq); it != noticed_.end() && !it->second.empty()) {
        leader = leader < 0 ? *it->second.begin() : std::min(leader, *it->second.begin());
      }
      if (leader < 0) {  // nobody has given up
        if (done) return Status::Ok();
        if (now - start >= timeout) {
          leading = true;
          grace_end = now + grace;
          SendToAll({kNotice, static_cast<int64_t>(seq)});
        }
      } else if (leader == rank_) {  // this rank decides
        if (done) {
          SendToAll({kVerdict, static_cast<int64_t>(seq), 0});
          return Status::Ok();
        }
        if (now >= grace_end) {
          std::vector<int> missing = Missing(seq);
          if (missing.empty() && !extended) {  // everyone answered: give MPI a moment more
            extended = true;
            grace_end = now + grace;
          } else {
            Status verdict = GaveUp(kind, rank_, timeout, seq, missing);
            std::vector<int64_t> message = {kVerdict, static_cast<int64_t>(seq), 1,
                                            static_cast<int64_t>(kind), timeout.count()};
            message.insert(message.end(), missing.begin(), missing.end());
            SendToAll(message);
            return verdict;
          }
        }
      } else {  // follow the leader's verdict
        if (followed != leader) follow_end = now + 4 * grace;
        followed = leader;
        auto it = verdicts_.find(seq);
        if (it != verdicts_.end() && it->second.give_up) return it->second.status;
        if (it != verdicts_.end()) {
          if (done) return Status::Ok();  // "proceed": every rank came; the header completes
        } else if (now >= follow_end) {
          return DeadlineExceeded(Where(op) + ": rank " + std::to_string(leader) +
                                  " gave up waiting for its peers to enter collective #" +
                                  std::to_string(seq) + " of this communicator, and its " +
                                  "verdict did not arrive within " +
                                  std::to_string((4 * grace).count()) + " ms");
        }
      }
      if (polls < 100) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // The status of a give-up by `leader`, the same text on every rank that learns of it.
  Status GaveUp(Kind kind, int leader, std::chrono::milliseconds timeout, uint64_t seq,
                const std::vector<int>& missing) const {
    return DeadlineExceeded(KindName(static_cast<int64_t>(kind)) + " on rank " +
                            std::to_string(leader) + " gave up after waiting " +
                            std::to_string(timeout.count()) + " ms for " + RanksText(missing) +
                            " to enter it (collective #" + std::to_string(seq) +
                            " of this communicator)");
  }

  // The ranks other than this one that neither answered its NOTICE(seq) nor sent one.
  std::vector<int> Missing(uint64_t seq) {
    std::vector<int> missing;
    const std::set<int>& present = present_[seq];
    const std::set<int>& noticed = noticed_[seq];
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && !present.count(r) && !noticed.count(r)) missing.push_back(r);
    }
    return missing;
  }

  // Receives every control message waiting for this rank and answers the NOTICEs of
  // collectives it has entered; releases completed sends.
  Status DrainControl(std::string_view op) {
    while (true) {
      int flag = 0, rc;
      MPI_Status st;
      {
        MaybeLock lock(serialized());
        rc = MPI_Iprobe(MPI_ANY_SOURCE, kControlTag, comm_, &flag, &st);
      }
      if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Iprobe", op);
      if (!flag) break;
      int count = 0;
      MPI_Get_count(&st, MPI_INT64_T, &count);
      std::vector<int64_t> message(std::max(count, 0));
      {
        MaybeLock lock(serialized());
        rc = MPI_Recv(message.data(), count, MPI_INT64_T, st.MPI_SOURCE, kControlTag, comm_,
                      MPI_STATUS_IGNORE);
      }
      if (rc != MPI_SUCCESS) return Failed(rc, "MPI_Recv", op);
      HandleControl(st.MPI_SOURCE, message);
    }
    for (auto it = sends_.begin(); it != sends_.end();) {
      int completed = 0;
      {
        MaybeLock lock(serialized());
        MPI_Test(&it->first, &completed, MPI_STATUS_IGNORE);
      }
      it = completed ? sends_.erase(it) : std::next(it);
    }
    return Status::Ok();
  }

  void HandleControl(int from, const std::vector<int64_t>& message) {
    if (message.size() < 2 || from < 0 || from >= size_) return;
    const auto seq = static_cast<uint64_t>(message[1]);
    switch (message[0]) {
      case kNotice:
        noticed_[seq].insert(from);
        if (seq < entered_) Send(from, {kPresent, message[1]});
        break;
      case kPresent:
        present_[seq].insert(from);
        break;
      case kAbandon:
        if (abandoned_.ok() && message.size() >= 4) {
          abandoned_ =
              Abandoned(static_cast<Kind>(message[2]), std::chrono::milliseconds(message[3]), seq);
        }
        break;
      case kVerdict: {
        Verdict verdict;
        verdict.give_up = message.size() >= 5 && message[2] != 0;
        if (verdict.give_up) {
          std::vector<int> missing(message.begin() + 5, message.end());
          verdict.status = GaveUp(static_cast<Kind>(message[3]), from,
                                  std::chrono::milliseconds(message[4]), seq, missing);
        }
        // The lowest-ranked leader's verdict counts (the others defer to it).
        auto [it, inserted] = verdicts_.try_emplace(seq, verdict);
        if (!inserted && from < verdict_from_[seq]) it->second = verdict;
        if (inserted || from < verdict_from_[seq]) verdict_from_[seq] = from;
        break;
      }
      default:
        break;
    }
  }

  // Drops what is known of collectives before #seq: none of it matters any more.
  void ForgetControlBefore(uint64_t seq) {
    for (auto* m : {&noticed_, &present_}) m->erase(m->begin(), m->lower_bound(seq));
    verdicts_.erase(verdicts_.begin(), verdicts_.lower_bound(seq));
    verdict_from_.erase(verdict_from_.begin(), verdict_from_.lower_bound(seq));
  }

  void SendToAll(const std::vector<int64_t>& message) {
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) Send(r, message);
    }
  }

  // Best effort: a control message that cannot be sent only makes the verdict less precise.
  void Send(int to, std::vector<int64_t> message) {
    auto buffer = std::make_shared<std::vector<int64_t>>(std::move(message));
    MPI_Request request = MPI_REQUEST_NULL;
    int rc;
    {
      MaybeLock lock(serialized());
      rc = MPI_Isend(buffer->data(), static_cast<int>(buffer->size()), MPI_INT64_T, to, kControlTag,
                     comm_, &request);
    }
    if (rc == MPI_SUCCESS) sends_.emplace_back(request, std::move(buffer));
  }

  // Broadcasts `*data` (`size` bytes) from `root`, in calls of at most max_message_bytes. The
  // bytes move into a buffer of the Comm's own (see kAbandon) and back, never copied; a
  // transfer given up on keeps that buffer and leaves `*data` empty.
  Status BcastBytes(Bytes* data, int64_t size, int root, std::string_view op) {
    auto owned = std::make_shared<Bytes>(std::move(*data));
    if (rank_ != root) owned->resize(size);
    const int64_t chunk = settings_->options.max_message_bytes;
    for (int64_t begin = 0; begin < size; begin += chunk) {
      const int n = static_cast<int>(std::min(chunk, size - begin));
      Status status =
          Run("MPI_Ibcast", op,
              [&](MPI_Request* request) {
                return MPI_Ibcast(owned->data() + begin, n, MPI_BYTE, root, comm_, request);
              },
              {owned});
      if (!status.ok()) {
        if (owned.use_count() == 1) *data = std::move(*owned);  // not kept: MPI is done with it
        return status;
      }
    }
    *data = std::move(*owned);
    return Status::Ok();
  }

  // Broadcasts `*bytes` from `root`: its size, then its data.
  Status BcastSized(Bytes* bytes, int root, std::string_view op) {
    auto size = std::make_shared<int64_t>(static_cast<int64_t>(bytes->size()));
    TESSERA_RETURN_IF_ERROR(Run("MPI_Ibcast", op,
                                [&](MPI_Request* request) {
                                  return MPI_Ibcast(size.get(), 1, MPI_INT64_T, root, comm_,
                                                    request);
                                },
                                {size}));
    return BcastBytes(bytes, *size, root, op);
  }

  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const std::shared_ptr<const Settings> settings_;
  const std::shared_ptr<AbortState> state_ = std::make_shared<AbortState>();
  // The collective deadline's state (used by the one thread that uses this Comm).
  uint64_t entered_ = 0;           // collectives this rank has entered: #0 .. #entered_-1
  Kind current_ = Kind::kBarrier;  // the kind of #entered_-1
  Status abandoned_;               // a transfer some rank gave up on (kAbandon), once heard of
  std::map<uint64_t, std::set<int>> noticed_;  // collective -> ranks whose deadline passed in it
  std::map<uint64_t, std::set<int>> present_;  // collective -> ranks that answered this rank
  std::map<uint64_t, Verdict> verdicts_;       // collective -> the leader's verdict
  std::map<uint64_t, int> verdict_from_;       // collective -> that leader
  std::vector<std::pair<MPI_Request, std::shared_ptr<std::vector<int64_t>>>> sends_;
};

}  // namespace

namespace mpi_internal {

void SetDataPhaseHookForTesting(DataPhaseHook hook) { TestHook() = std::move(hook); }

namespace {

const char* ErrorClassName(int error_class) {
  switch (error_class) {
    case MPI_ERR_BUFFER:
      return "MPI_ERR_BUFFER";
    case MPI_ERR_COUNT:
      return "MPI_ERR_COUNT";
    case MPI_ERR_TYPE:
      return "MPI_ERR_TYPE";
    case MPI_ERR_TAG:
      return "MPI_ERR_TAG";
    case MPI_ERR_COMM:
      return "MPI_ERR_COMM";
    case MPI_ERR_RANK:
      return "MPI_ERR_RANK";
    case MPI_ERR_ROOT:
      return "MPI_ERR_ROOT";
    case MPI_ERR_GROUP:
      return "MPI_ERR_GROUP";
    case MPI_ERR_OP:
      return "MPI_ERR_OP";
    case MPI_ERR_ARG:
      return "MPI_ERR_ARG";
    case MPI_ERR_TRUNCATE:
      return "MPI_ERR_TRUNCATE";
    case MPI_ERR_REQUEST:
      return "MPI_ERR_REQUEST";
    case MPI_ERR_NO_MEM:
      return "MPI_ERR_NO_MEM";
    case MPI_ERR_INTERN:
      return "MPI_ERR_INTERN";
    case MPI_ERR_OTHER:
      return "MPI_ERR_OTHER";
    default:
      return nullptr;
  }
}

}  // namespace

Status MpiErrorStatus(int error, std::string_view call, std::string_view op, int rank) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  std::string message;
  if (MPI_Error_string(error, text, &length) == MPI_SUCCESS && length > 0) {
    message.assign(text, length);
  } else {
    message = "unknown MPI error";
  }
  int error_class = error;
  if (MPI_Error_class(error, &error_class) != MPI_SUCCESS) error_class = MPI_ERR_UNKNOWN;
  const char* class_name = ErrorClassName(error_class);
  // Open MPI's text starts with the class name already; say it once.
  if (class_name != nullptr && message.rfind(class_name, 0) != 0) {
    message = std::string(class_name) + ": " + message;
  }
  message = std::string(op) + " on rank " + std::to_string(rank) + ": " + std::string(call) +
            " failed: " + message + " (MPI error " + std::to_string(error) + ")";
  switch (error_class) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_TAG:
    case MPI_ERR_COMM:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_GROUP:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:
    case MPI_ERR_REQUEST:
      return Internal(std::move(message));
    default:
      return IOError(std::move(message));
  }
}

}  // namespace mpi_internal

Result<std::unique_ptr<Comm>> NewMpiComm(MPI_Comm user_comm, const MpiCommOptions& options) {
  if (options.max_message_bytes < 8 || options.max_message_bytes > INT_MAX) {
    return InvalidArgument("NewMpiComm: MpiCommOptions::max_message_bytes must be in [8, " +
                           std::to_string(INT_MAX) + "], got " +
                           std::to_string(options.max_message_bytes));
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized) {
    return FailedPrecondition(
        "NewMpiComm: MPI is not initialised (call MPI_Init_thread first, or use "
        "NewMpiWorldComm)");
  }
  if (finalized) return FailedPrecondition("NewMpiComm: MPI has been finalised");
  if (user_comm == MPI_COMM_NULL) return InvalidArgument("NewMpiComm: the communicator is null");

  auto settings = std::make_shared<Settings>();
  settings->options = options;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  settings->serialized = provided < MPI_THREAD_MULTIPLE;
  settings->header = GetHeaderMpi();
  if (settings->header.error != MPI_SUCCESS) {
    return mpi_internal::MpiErrorStatus(settings->header.error, "MPI_Type_contiguous/MPI_Op_create",
                                        "NewMpiComm", -1);
  }

  int rank = -1;
  int rc;
  MPI_Comm dup = MPI_COMM_NULL;
  {
    MaybeLock lock(settings->serialized);
    int is_inter = 0;
    rc = MPI_Comm_test_inter(user_comm, &is_inter);
    if (rc == MPI_SUCCESS && is_inter) {
      return InvalidArgument("NewMpiComm: intercommunicators are not supported");
    }
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(user_comm, &rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(user_comm, &dup);
  }
  if (rc != MPI_SUCCESS)
    return mpi_internal::MpiErrorStatus(rc, "MPI_Comm_dup", "NewMpiComm", rank);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<MpiComm> comm,
                           MpiComm::Adopt(dup, std::move(settings), "NewMpiComm", rank));
  return std::unique_ptr<Comm>(std::move(comm));
}

Result<std::unique_ptr<Comm>> NewMpiWorldComm(const MpiCommOptions& options) {
  {
    static std::mutex init_mu;
    std::lock_guard<std::mutex> lock(init_mu);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) return FailedPrecondition("NewMpiWorldComm: MPI has been finalised");
    if (!initialized) {
      int provided = MPI_THREAD_SINGLE;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) {
        return mpi_internal::MpiErrorStatus(rc, "MPI_Init_thread", "NewMpiWorldComm", -1);
      }
      g_provided_thread_level.store(provided);
      g_initialized_by_tessera.store(true);
      std::atexit(&FinalizeAtExit);
    }
  }
  return NewMpiComm(MPI_COMM_WORLD, options);
}

int MpiProvidedThreadLevel() {
  if (!MpiIsUsable()) return g_provided_thread_level.load();
  int provided = -1;
  if (MPI_Query_thread(&provided) != MPI_SUCCESS) return -1;
  return provided;
}

bool MpiInitializedByTessera() { return g_initialized_by_tessera.load(); }

}  // namespace tessera
