// LocalComm: N ranks as N threads with real message passing.
//
// A Group is the state the ranks of one communicator share: one mailbox per rank, the abort
// state, and which ranks have left (destroyed their Comm). A message is addressed by
// (collective sequence number, source rank, tag): every rank numbers its collectives on a
// communicator in the same order, so messages of successive collectives never mix even when
// a fast rank runs ahead, and the tag tells apart the messages one source sends one
// destination within a collective. Every collective is built from Send (never blocks) and
// Recv (blocks until the message is there, the group is aborted, the peer has left, or the
// timeout expires).
//
// Every rank also declares each collective it enters (which one, its root, its reduction) in
// the Group: not a message, a check. A rank whose call differs from a peer's fails with
// kInvalidArgument and aborts the group, as MPI's header agreement does, instead of the ranks
// exchanging the wrong messages or waiting for each other until the deadline.
//
// Split builds a new Group, so a child's traffic never mixes with its parent's and both may
// be used concurrently. The parent keeps weak references to its children: aborting the parent
// aborts them too, so a failed rank never leaves its peers hanging in a child communicator.
#include "tessera/local_comm.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

class Group;

// Which message: the collective's sequence number, the sender and a tag within the collective.
struct MessageKey {
  uint64_t seq;
  int src;
  int tag;
  friend bool operator<(const MessageKey& a, const MessageKey& b) {
    return std::tie(a.seq, a.src, a.tag) < std::tie(b.seq, b.src, b.tag);
  }
};

// What the root of a ScatterInto shares with its receivers: its ranges, which each receiver
// copies from in place (one copy, none on the root). The root waits for every receiver's
// acknowledgement before it returns; if it gives up first (the group aborted, a receiver left),
// it marks the ranges released and waits only for the copies already under way.
struct DirectScatter {
  explicit DirectScatter(std::span<const std::vector<ConstByteSpan>> ranges) : send(ranges) {}
  const std::span<const std::vector<ConstByteSpan>> send;  // the root's; read while !released
  std::mutex mu;
  std::condition_variable cv;
  int copying = 0;        // receivers copying now; guarded by mu
  bool released = false;  // the root has given up: no receiver may begin to copy; guarded by mu
};

// What one message carries; each collective uses one of the members.
struct Payload {
  static Payload Of(Bytes bytes) {
    Payload p;
    p.bytes = std::move(bytes);
    return p;
  }
  static Payload Of(std::shared_ptr<const Bytes> shared) {
    Payload p;
    p.shared = std::move(shared);
    return p;
  }
  static Payload Of(std::shared_ptr<Group> group) {
    Payload p;
    p.group = std::move(group);
    return p;
  }
  static Payload Of(std::shared_ptr<DirectScatter> direct) {
    Payload p;
    p.direct = std::move(direct);
    return p;
  }

  Bytes bytes;                            // moved into the mailbox and out to the receiver
  std::shared_ptr<const Bytes> shared;    // one buffer forwarded to many receivers (Broadcast)
  std::shared_ptr<Group> group;           // how Split hands a new group to its members
  std::shared_ptr<DirectScatter> direct;  // ScatterInto: the root's ranges
};

// The collectives, in the order of MpiComm's (src/mpi/mpi_comm.cc), so that a mismatch between
// two of them is named in the same words.
enum class Kind {
  kBarrier = 1,
  kBroadcast,
  kGather,
  kAllGather,
  kScatter,
  kAllReduce,
  kSplit,
  kScatterInto
};

const char* KindName(Kind kind) {
  switch (kind) {
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
    case Kind::kScatterInto:
      return "ScatterInto";
    case Kind::kAllReduce:
      return "AllReduce";
    case Kind::kSplit:
      return "Split";
  }
  return "collective";
}

const char* ReduceOpName(int op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::kSum:
      return "kSum";
    case ReduceOp::kMin:
      return "kMin";
    case ReduceOp::kMax:
      return "kMax";
  }
  return "an unknown ReduceOp";
}

// What a rank declares about a collective it enters; every rank must declare the same.
struct Call {
  Kind kind;
  int root = -1;  // -1 where the collective has none
  int op = -1;    // AllReduce's ReduceOp, else -1
};

// What differs between two declarations of one collective ("" when they agree), worded as
// MpiComm words it: lower value first.
std::string CallMismatch(const Call& a, const Call& b) {
  auto ordered = [](int x, int y) { return std::make_pair(std::min(x, y), std::max(x, y)); };
  if (a.kind != b.kind) {
    auto [lo, hi] = ordered(static_cast<int>(a.kind), static_cast<int>(b.kind));
    return std::string("the ranks called different collectives at the same point: ") +
           KindName(static_cast<Kind>(lo)) + " and " + KindName(static_cast<Kind>(hi));
  }
  if (a.root != b.root) {
    auto [lo, hi] = ordered(a.root, b.root);
    return "the ranks passed different roots, " + std::to_string(lo) + " and " + std::to_string(hi);
  }
  if (a.op != b.op) {
    auto [lo, hi] = ordered(a.op, b.op);
    return std::string("the ranks passed different ops, ") + ReduceOpName(lo) + " and " +
           ReduceOpName(hi);
  }
  return "";
}

std::string Ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

// "rank 3", "ranks 1, 3".
std::string RanksText(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

class Group {
 public:
  Group(int size, std::chrono::milliseconds timeout)
      : size_(size),
        timeout_(timeout),
        mailboxes_(size),
        departed_(std::make_unique<std::atomic<bool>[]>(size)),
        entered_(std::make_unique<std::atomic<uint64_t>[]>(size)) {}

  // `rank` has entered collective number `seq` (counted from 0).
  void Enter(int rank, uint64_t seq) { entered_[rank].store(seq + 1, std::memory_order_release); }

  // The ranks that have not entered collective `seq` yet, ascending.
  std::vector<int> NotEntered(uint64_t seq) const {
    std::vector<int> out;
    for (int r = 0; r < size_; ++r) {
      if (entered_[r].load(std::memory_order_acquire) <= seq) out.push_back(r);
    }
    return out;
  }

  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // `rank` enters collective `seq` as `call`: returns what differs from the declaration of the
  // first rank that entered it, or "". Forgets a collective once every rank has entered it.
  std::string Declare(uint64_t seq, const Call& call) {
    std::lock_guard<std::mutex> lock(calls_mu_);
    auto [it, first] = calls_.try_emplace(seq, DeclaredCall{call, 0});
    std::string mismatch = first ? "" : CallMismatch(it->second.call, call);
    if (++it->second.entered == size_) calls_.erase(it);
    return mismatch;
  }

  // OK, or the status every collective returns once the group is aborted.
  Status abort_status() const {
    // abort_status_ is written once, before aborted_ is set, and never again.
    return aborted_.load(std::memory_order_acquire) ? abort_status_ : Status::Ok();
  }

  void Send(int dst, const MessageKey& key, Payload payload) {
    Mailbox& box = mailboxes_[dst];
    {
      std::lock_guard<std::mutex> lock(box.mu);
      const bool inserted = box.messages.emplace(key, std::move(payload)).second;
      assert(inserted && "two messages with the same (seq, src, tag)");
      (void)inserted;
    }
    box.cv.notify_all();
  }

  // Waits for the message `key` addressed to `me`. `op` names the collective in errors.
  Result<Payload> Recv(int me, const MessageKey& key, std::string_view op) {
    Mailbox& box = mailboxes_[me];
    const auto deadline = Clock::now() + timeout_;
    std::unique_lock<std::mutex> lock(box.mu);
    while (true) {
      if (aborted_.load(std::memory_order_acquire)) return abort_status_;
      // Read before looking for the message: a rank sends everything before it leaves.
      const bool departed = departed_[key.src].load(std::memory_order_acquire);
      auto it = box.messages.find(key);
      if (it != box.messages.end()) {
        Payload payload = std::move(it->second);
        box.messages.erase(it);
        return payload;
      }
      Status error;
      if (departed) {
        Status reason;
        {
          std::lock_guard<std::mutex> reason_lock(mu_);
          reason = departure_reasons_[key.src];
        }
        error = Aborted(std::string(op) + " on rank " + std::to_string(me) + ": rank " +
                        std::to_string(key.src) +
                        " left the communicator (destroyed its Comm) without taking part" +
                        (reason.ok() ? "" : " after failing: " + reason.ToString()));
      } else if (Clock::now() >= deadline) {
        // Name the ranks that never reached this collective: the one this rank waits for may
        // itself be waiting for them (a tree). Every waiting rank then returns this error.
        std::vector<int> missing = NotEntered(key.seq);
        if (missing.empty()) missing = {key.src};
        error = DeadlineExceeded(std::string(op) + " on rank " + std::to_string(me) +
                                 " gave up after waiting " + Ms(timeout_) + " for " +
                                 RanksText(missing) + " to enter it (collective #" +
                                 std::to_string(key.seq) + " of this communicator)");
        lock.unlock();
        Abort(error);
        // Several ranks may time out at once: all return the first one's status.
        return abort_status();
      }
      if (!error.ok()) {
        lock.unlock();
        Abort(AbortStatus(me, error));
        return error;
      }
      box.cv.wait_until(lock, deadline);
    }
  }

  static Status AbortStatus(int rank, const Status& reason) {
    return Aborted("rank " + std::to_string(rank) + " aborted: " + reason.ToString());
  }

  // Marks the group (and its children) failed with `status`; the first abort wins.
  void Abort(const Status& status) {
    std::vector<std::weak_ptr<Group>> children;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_.load(std::memory_order_relaxed)) return;
      abort_status_ = status;
      aborted_.store(true, std::memory_order_release);
      children.swap(children_);
    }
    WakeAll();
    for (const auto& weak : children) {
      if (auto child = weak.lock()) child->Abort(status);
    }
  }

  // `rank` destroyed its Comm: it will send nothing more. `reason`: why it left, when it
  // failed; quoted to the peers left waiting for it.
  void Depart(int rank, const Status& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      departure_reasons_[rank] = reason;
    }
    departed_[rank].store(true, std::memory_order_release);
    WakeAll();
  }

  void AddChild(const std::shared_ptr<Group>& child) {
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_.load(std::memory_order_relaxed)) {
        std::erase_if(children_, [](const std::weak_ptr<Group>& g) { return g.expired(); });
        children_.push_back(child);
        return;
      }
      status = abort_status_;
    }
    child->Abort(status);
  }

 private:
  struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    std::map<MessageKey, Payload> messages;
  };

  void WakeAll() {
    for (Mailbox& box : mailboxes_) {
      // Taking the lock orders this wake-up after any waiter's check of the flags.
      { std::lock_guard<std::mutex> lock(box.mu); }
      box.cv.notify_all();
    }
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::vector<Mailbox> mailboxes_;
  std::unique_ptr<std::atomic<bool>[]> departed_;
  std::unique_ptr<std::atomic<uint64_t>[]> entered_;  // per rank: collectives entered

  std::mutex mu_;  // guards writes of abort_status_, and children_
  std::atomic<bool> aborted_{false};
  Status abort_status_;
  std::vector<std::weak_ptr<Group>> children_;
  std::vector<Status> departure_reasons_ = std::vector<Status>(size_);  // guarded by mu_

  struct DeclaredCall {
    Call call;    // the first rank's
    int entered;  // how many ranks have entered
  };
  std::mutex calls_mu_;
  std::map<uint64_t, DeclaredCall> calls_;  // by sequence number; guarded by calls_mu_
};

Bytes ToBytes(std::span<const int64_t> values) {
  Bytes out(values.size_bytes());
  if (!out.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  ~LocalComm() override { group_->Depart(rank_, departure_reason_); }

  // Why this rank is about to leave (destroy this Comm), for the peers it leaves waiting.
  void set_departure_reason(Status reason) { departure_reason_ = std::move(reason); }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  Status Barrier() override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kBarrier}, &seq));
    // Dissemination barrier: in round k, tell rank + 2^k and hear from rank - 2^k.
    const int n = size();
    int tag = 0;
    for (int dist = 1; dist < n; dist *= 2, ++tag) {
      Send((rank_ + dist) % n, seq, tag, Payload{});
      TESSERA_RETURN_IF_ERROR(Recv((rank_ - dist + n) % n, seq, tag, "Barrier"));
    }
    return Status::Ok();
  }

  Status Broadcast(Bytes* data, int root) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kBroadcast, root}, &seq));
    TESSERA_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    if (data == nullptr) return Fail(InvalidArgument(Where("Broadcast") + ": data is null"));
    if (size() == 1) return Status::Ok();
    std::shared_ptr<const Bytes> buffer;
    if (rank_ == root) buffer = std::make_shared<const Bytes>(*data);
    TESSERA_RETURN_IF_ERROR(TreeBroadcast(&buffer, root, seq, /*tag=*/0, "Broadcast"));
    if (rank_ != root) data->assign(buffer->begin(), buffer->end());
    return Status::Ok();
  }

  Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kGather, root}, &seq));
    TESSERA_RETURN_IF_ERROR(CheckRoot("Gather", root));
    if (rank_ != root) {
      Send(root, seq, 0, Payload::Of(Bytes(send)));
      return Status::Ok();
    }
    if (received == nullptr) {
      return Fail(InvalidArgument(Where("Gather") + ": received is null on the root"));
    }
    std::vector<Bytes> out(size());
    out[rank_] = send;
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(r, seq, 0, "Gather"));
      out[r] = std::move(payload.bytes);
    }
    *received = std::move(out);
    return Status::Ok();
  }

  Status AllGather(const Bytes& send, std::vector<Bytes>* received) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kAllGather}, &seq));
    if (received == nullptr)
      return Fail(InvalidArgument(Where("AllGather") + ": received is null"));
    TESSERA_ASSIGN_OR_RETURN(*received, AllGatherImpl(send, seq, "AllGather"));
    return Status::Ok();
  }

  Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kScatter, root}, &seq));
    TESSERA_RETURN_IF_ERROR(CheckRoot("Scatter", root));
    if (received == nullptr) return Fail(InvalidArgument(Where("Scatter") + ": received is null"));
    if (rank_ != root) {
      TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(root, seq, 0, "Scatter"));
      *received = std::move(payload.bytes);
      return Status::Ok();
    }
    if (static_cast<int>(send.size()) != size()) {
      return Fail(InvalidArgument(Where("Scatter") + ": the root passed " +
                                  std::to_string(send.size()) + " buffers for " +
                                  std::to_string(size()) + " ranks"));
    }
    for (int r = 0; r < size(); ++r) {
      if (r != rank_) Send(r, seq, 0, Payload::Of(Bytes(send[r])));
    }
    *received = send[rank_];
    return Status::Ok();
  }

  // Moves the bytes once: each receiver copies its message from the root's ranges.
  Status ScatterInto(std::span<const std::vector<ConstByteSpan>> send,
                     std::span<const MutableByteSpan> receive, uint64_t* received,
                     int root) override {
    constexpr std::string_view kOp = "ScatterInto";
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kScatterInto, root}, &seq));
    TESSERA_RETURN_IF_ERROR(CheckRoot("ScatterInto", root));
    if (rank_ != root) return ReceiveDirect(root, seq, receive, received);
    if (static_cast<int>(send.size()) != size()) {
      return Fail(InvalidArgument(Where(kOp) + ": the root passed " + std::to_string(send.size()) +
                                  " lists for " + std::to_string(size()) + " ranks"));
    }
    auto direct = std::make_shared<DirectScatter>(send);
    for (int r = 0; r < size(); ++r) {
      if (r != rank_) Send(r, seq, 0, Payload::Of(direct));
    }
    const uint64_t mine = TotalBytes(send[rank_]);
    if (received != nullptr) *received = mine;
    if (mine == TotalBytes(receive)) CopyRanges(send[rank_], receive);
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      Result<Payload> ack = Recv(r, seq, 1, kOp);
      if (ack.ok()) continue;
      // Given up: no receiver may start reading the ranges the caller will now free.
      std::unique_lock<std::mutex> lock(direct->mu);
      direct->released = true;
      direct->cv.wait(lock, [&] { return direct->copying == 0; });
      return ack.status();
    }
    return Status::Ok();
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kAllReduce, -1, static_cast<int>(op)}, &seq));
    if (size() == 1) return Status::Ok();
    // Reduce on rank 0, then broadcast the result.
    constexpr int kRoot = 0;
    std::shared_ptr<const Bytes> result;
    if (rank_ != kRoot) {
      Send(kRoot, seq, 0, Payload::Of(ToBytes(values)));
    } else {
      std::vector<int64_t> acc(values.begin(), values.end());
      for (int r = 0; r < size(); ++r) {
        if (r == kRoot) continue;
        TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(r, seq, 0, "AllReduce"));
        const Bytes& in = payload.bytes;
        if (in.size() != values.size_bytes()) {
          return Fail(InvalidArgument(Where("AllReduce") + ": rank " + std::to_string(r) +
                                      " passed " + std::to_string(in.size() / sizeof(int64_t)) +
                                      " values, rank " + std::to_string(kRoot) + " passed " +
                                      std::to_string(values.size())));
        }
        for (size_t i = 0; i < acc.size(); ++i) {
          int64_t v;
          std::memcpy(&v, in.data() + i * sizeof(int64_t), sizeof(v));
          acc[i] = Reduce(acc[i], v, op);
        }
      }
      result = std::make_shared<const Bytes>(ToBytes(acc));
    }
    TESSERA_RETURN_IF_ERROR(TreeBroadcast(&result, kRoot, seq, /*tag=*/1, "AllReduce"));
    if (rank_ != kRoot && result->size() != values.size_bytes()) {
      return Fail(InvalidArgument(Where("AllReduce") + ": rank " + std::to_string(rank_) +
                                  " passed " + std::to_string(values.size()) + " values, rank " +
                                  std::to_string(kRoot) + " passed " +
                                  std::to_string(result->size() / sizeof(int64_t))));
    }
    if (!values.empty()) std::memcpy(values.data(), result->data(), result->size());
    return Status::Ok();
  }

  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    uint64_t seq;
    TESSERA_RETURN_IF_ERROR(Begin({Kind::kSplit}, &seq));
    Bytes mine(2 * sizeof(int));
    std::memcpy(mine.data(), &color, sizeof(int));
    std::memcpy(mine.data() + sizeof(int), &key, sizeof(int));
    TESSERA_ASSIGN_OR_RETURN(std::vector<Bytes> all, AllGatherImpl(mine, seq, "Split"));

    // Members of my color, ordered by (key, old rank).
    std::vector<std::pair<int, int>> members;  // (key, old rank)
    for (int r = 0; r < size(); ++r) {
      int c, k;
      std::memcpy(&c, all[r].data(), sizeof(int));
      std::memcpy(&k, all[r].data() + sizeof(int), sizeof(int));
      if (c == color) members.emplace_back(k, r);
    }
    std::sort(members.begin(), members.end());
    const int new_size = static_cast<int>(members.size());
    int new_rank = 0;
    while (members[new_rank].second != rank_) ++new_rank;

    // The new rank 0 creates the group and sends it to the other members.
    const int leader = members[0].second;
    std::shared_ptr<Group> group;
    if (rank_ == leader) {
      group = std::make_shared<Group>(new_size, group_->timeout());
      group_->AddChild(group);
      for (int i = 1; i < new_size; ++i) {
        Send(members[i].second, seq, /*tag=*/1, Payload::Of(group));
      }
    } else {
      TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(leader, seq, /*tag=*/1, "Split"));
      group = std::move(payload.group);
    }
    return std::unique_ptr<Comm>(std::make_unique<LocalComm>(std::move(group), new_rank));
  }

  void Abort(const Status& reason) override { group_->Abort(Group::AbortStatus(rank_, reason)); }

 private:
  // Starts a collective: numbers it, fails if the group is aborted, and fails (aborting the
  // group) if a peer declared another collective, root or reduction at this point.
  Status Begin(const Call& call, uint64_t* seq) {
    *seq = next_seq_++;
    group_->Enter(rank_, *seq);
    TESSERA_RETURN_IF_ERROR(group_->abort_status());
    const std::string mismatch = group_->Declare(*seq, call);
    if (mismatch.empty()) return Status::Ok();
    return Fail(InvalidArgument(Where(KindName(call.kind)) + ": " + mismatch));
  }

  // "Broadcast on rank 3": how an error of this rank's collective begins (as MpiComm's).
  std::string Where(std::string_view op) const {
    return std::string(op) + " on rank " + std::to_string(rank_);
  }

  // A local argument error in a collective: aborts the group so the peers do not wait for a
  // rank that has given up, and returns the error.
  Status Fail(Status error) {
    Abort(error);
    return error;
  }

  Status CheckRoot(const char* op, int root) {
    if (root >= 0 && root < size()) return Status::Ok();
    return Fail(InvalidArgument(Where(op) + ": root " + std::to_string(root) +
                                " is not a rank of a communicator of size " +
                                std::to_string(size())));
  }

  // A ScatterInto's receiver: copies its message from the root's ranges, then acknowledges.
  Status ReceiveDirect(int root, uint64_t seq, std::span<const MutableByteSpan> receive,
                       uint64_t* received) {
    TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(root, seq, 0, "ScatterInto"));
    DirectScatter& direct = *payload.direct;
    {
      std::lock_guard<std::mutex> lock(direct.mu);
      if (direct.released) {
        const Status aborted = group_->abort_status();
        return aborted.ok() ? Aborted(Where("ScatterInto") + ": the root, rank " +
                                      std::to_string(root) + ", gave up before the copy")
                            : aborted;
      }
      ++direct.copying;
    }
    const std::vector<ConstByteSpan>& message = direct.send[rank_];
    const uint64_t length = TotalBytes(message);
    if (received != nullptr) *received = length;
    if (length == TotalBytes(receive)) CopyRanges(message, receive);
    {
      std::lock_guard<std::mutex> lock(direct.mu);
      --direct.copying;
    }
    direct.cv.notify_all();
    Send(root, seq, 1, Payload{});
    return Status::Ok();
  }

  void Send(int dst, uint64_t seq, int tag, Payload payload) {
    group_->Send(dst, MessageKey{seq, rank_, tag}, std::move(payload));
  }

  Result<Payload> Recv(int src, uint64_t seq, int tag, std::string_view op) {
    return group_->Recv(rank_, MessageKey{seq, src, tag}, op);
  }

  // Every rank ends up with a copy of `send` from every rank.
  Result<std::vector<Bytes>> AllGatherImpl(const Bytes& send, uint64_t seq, std::string_view op) {
    const int n = size();
    for (int i = 1; i < n; ++i) Send((rank_ + i) % n, seq, 0, Payload::Of(Bytes(send)));
    std::vector<Bytes> out(n);
    out[rank_] = send;
    for (int i = 1; i < n; ++i) {
      const int src = (rank_ - i + n) % n;
      TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv(src, seq, 0, op));
      out[src] = std::move(payload.bytes);
    }
    return out;
  }

  // Binomial-tree broadcast of one shared buffer from `root`: each rank receives the pointer
  // from its parent and forwards it to its children, so no rank copies for another.
  Status TreeBroadcast(std::shared_ptr<const Bytes>* buffer, int root, uint64_t seq, int tag,
                       std::string_view op) {
    const int n = size();
    const int vrank = (rank_ - root + n) % n;  // rank relative to the root
    int mask = 1;
    for (; mask < n; mask <<= 1) {
      if (vrank & mask) {
        TESSERA_ASSIGN_OR_RETURN(Payload payload, Recv((vrank - mask + root) % n, seq, tag, op));
        *buffer = std::move(payload.shared);
        break;
      }
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {
      if (vrank + mask < n) Send((vrank + mask + root) % n, seq, tag, Payload::Of(*buffer));
    }
    return Status::Ok();
  }

  static int64_t Reduce(int64_t a, int64_t b, ReduceOp op) {
    switch (op) {
      case ReduceOp::kSum:  // wraps around on overflow instead of undefined behaviour
        return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
      case ReduceOp::kMin:
        return std::min(a, b);
      case ReduceOp::kMax:
        return std::max(a, b);
    }
    return a;
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
  Status departure_reason_;
  uint64_t next_seq_ = 0;  // sequence number of the next collective
};

}  // namespace

std::vector<std::unique_ptr<Comm>> NewLocalComms(int num_ranks, LocalCommOptions options) {
  std::vector<std::unique_ptr<Comm>> comms;
  if (num_ranks <= 0) return comms;
  auto group = std::make_shared<Group>(num_ranks, options.timeout);
  comms.reserve(num_ranks);
  for (int r = 0; r < num_ranks; ++r) comms.push_back(std::make_unique<LocalComm>(group, r));
  return comms;
}

std::vector<Status> RunLocalRanks(int num_ranks, const std::function<Status(Comm&)>& fn,
                                  LocalCommOptions options) {
  std::vector<std::unique_ptr<Comm>> comms = NewLocalComms(num_ranks, options);
  std::vector<Status> statuses(comms.size());
  std::vector<std::thread> threads;
  threads.reserve(comms.size());
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] {
      Status status = fn(*comms[r]);
      // Leaving: peers still waiting for a message this rank never sent fail at once instead
      // of timing out; what it did send is still delivered. (Aborting the group here would
      // also fail peers whose messages had already arrived, e.g. after a collective that
      // reported the same error everywhere.)
      static_cast<LocalComm*>(comms[r].get())->set_departure_reason(status);
      comms[r].reset();
      statuses[r] = std::move(status);
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

Status FirstError(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) return statuses[r].WithContext("rank " + std::to_string(r));
  }
  return Status::Ok();
}

}  // namespace tessera
