// The cases of the Comm conformance suite: what every Comm (include/tessera/comm.h) must do,
// written against Comm only and free of any test framework, so that one list can run under any
// harness: GoogleTest runs it on the single-rank Comm, on LocalComm and on MPI (comm_suite.h);
// a harness without GoogleTest calls RunCommCase on each rank, as the Python extension's test
// hook does (python/src/py_comm_cases.cc) for the torch.distributed Comm in 1, 2 and 3 gloo
// processes (python/tests/test_comm_suite.py).
//
// A case is a body that every rank of a communicator runs at the same time, each on its own
// Comm, reporting what it found wrong through its CommCaseRun. Checks do not stop the body (as
// gtest's EXPECT_*): a rank whose check failed goes on calling the collectives its peers are
// in, so a wrong result does not turn into a hang. Only a result the rest of the body cannot do
// without (a failed Split) ends it, through TESSERA_COMM_ASSERT*.
//
// A harness tells the cases one thing about the Comm under test (CommSuiteTraits): whether an
// argument error found by one rank is returned by every rank as the same kInvalidArgument (MPI
// agrees on every collective's arguments before moving data), or by the rank that found it,
// the others returning kAborted quoting it (LocalComm; what comm.h requires).
#ifndef TESSERA_TESTING_COMM_CASES_H_
#define TESSERA_TESTING_COMM_CASES_H_

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/bytes.h"
#include "tessera/comm.h"
#include "tessera/status.h"

namespace tessera::testing {

// What the harness declares about the Comm under test (see the top of this file).
struct CommSuiteTraits {
  // Every rank returns kInvalidArgument, with its own rank in the message, when one rank passed
  // a bad argument (MPI). Otherwise the rank that found it does and the others return kAborted.
  bool agreed_argument_errors = false;
};

// One rank's run of one case: the size of the communicator under test, the traits, and the
// failures found. Thread-safe: a case may check from several threads of a rank.
class CommCaseRun {
 public:
  CommCaseRun(int size, CommSuiteTraits traits) : size_(size), traits_(traits) {}

  // The size of the communicator under test (the same on every rank).
  int n() const { return size_; }
  const CommSuiteTraits& traits() const { return traits_; }

  void Fail(const char* file, int line, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.push_back(std::string(file) + ":" + std::to_string(line) + ": " + std::move(what));
  }
  std::vector<std::string> failures() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }

 private:
  const int size_;
  const CommSuiteTraits traits_;
  mutable std::mutex mu_;
  std::vector<std::string> failures_;
};

// How a value appears in a failure message.
template <typename T>
std::string CommCaseShow(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return "\"" + v + "\"";
  } else if constexpr (std::is_same_v<T, StatusCode>) {
    return Status(v, "").ToString();
  } else if constexpr (std::is_same_v<T, Bytes>) {
    return "[" + std::to_string(v.size()) + " bytes]";
  } else if constexpr (std::is_same_v<T, std::vector<Bytes>>) {
    std::string out = "{";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + CommCaseShow(v[i]);
    return out + "}";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    std::string out = "{";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "}";
  } else {
    return std::to_string(v);
  }
}

}  // namespace tessera::testing

// Checks for case bodies; `t` is the CommCaseRun. The ASSERT forms return from the body.
#define TESSERA_COMM_EXPECT(t, cond, detail)                                                 \
  do {                                                                                       \
    if (!(cond)) (t).Fail(__FILE__, __LINE__, std::string(#cond) + " is false " + (detail)); \
  } while (0)
#define TESSERA_COMM_ASSERT(t, cond, detail)                                      \
  do {                                                                            \
    if (!(cond)) {                                                                \
      (t).Fail(__FILE__, __LINE__, std::string(#cond) + " is false " + (detail)); \
      return;                                                                     \
    }                                                                             \
  } while (0)
#define TESSERA_COMM_EXPECT_EQ(t, got, want)                                                 \
  do {                                                                                       \
    const auto& _tessera_got = (got);                                                        \
    const auto& _tessera_want = (want);                                                      \
    if (!(_tessera_got == _tessera_want)) {                                                  \
      (t).Fail(__FILE__, __LINE__,                                                           \
               std::string(#got) + " is " + ::tessera::testing::CommCaseShow(_tessera_got) + \
                   ", want " + ::tessera::testing::CommCaseShow(_tessera_want));             \
    }                                                                                        \
  } while (0)
#define TESSERA_COMM_EXPECT_OK(t, expr)                                                     \
  do {                                                                                      \
    const ::tessera::Status _tessera_s = ::tessera::internal::GetStatus(expr);              \
    if (!_tessera_s.ok()) (t).Fail(__FILE__, __LINE__, #expr ": " + _tessera_s.ToString()); \
  } while (0)
#define TESSERA_COMM_ASSERT_OK(t, expr)                                        \
  do {                                                                         \
    const ::tessera::Status _tessera_s = ::tessera::internal::GetStatus(expr); \
    if (!_tessera_s.ok()) {                                                    \
      (t).Fail(__FILE__, __LINE__, #expr ": " + _tessera_s.ToString());        \
      return;                                                                  \
    }                                                                          \
  } while (0)

namespace tessera::testing {
namespace comm_cases {

using std::chrono::milliseconds;

// `n` bytes that depend on `seed`, so buffers from different ranks and rounds differ.
inline Bytes Pattern(int seed, size_t n) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed * 131 + i * 7 + 1);
  return out;
}

inline bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

inline std::string Quote(const Status& s) { return "(" + s.ToString() + ")"; }

// A collective that failed because of a bad argument: kInvalidArgument naming this rank where
// the Comm agrees on argument errors or this rank found it; otherwise kAborted quoting it.
// Either way the message contains `detail`.
inline void ExpectArgumentError(CommCaseRun& t, const Status& s, const std::string& detail) {
  const bool invalid = s.code() == StatusCode::kInvalidArgument;
  if (t.traits().agreed_argument_errors) {
    TESSERA_COMM_EXPECT(t, invalid, Quote(s));
  } else {
    TESSERA_COMM_EXPECT(t, invalid || s.code() == StatusCode::kAborted, Quote(s));
  }
  TESSERA_COMM_EXPECT(t, Contains(s.message(), detail),
                      "looking for \"" + detail + "\" in " + Quote(s));
}

// ---- results ----------------------------------------------------------------------------

inline void RankAndSize(Comm& comm, CommCaseRun& t) {
  TESSERA_COMM_EXPECT_EQ(t, comm.size(), t.n());
  TESSERA_COMM_EXPECT(t, comm.rank() >= 0 && comm.rank() < t.n(), std::to_string(comm.rank()));
  // Every rank has a rank of its own.
  std::vector<Bytes> all;
  TESSERA_COMM_EXPECT_OK(t, comm.AllGather(Bytes{static_cast<uint8_t>(comm.rank())}, &all));
  TESSERA_COMM_ASSERT(t, all.size() == static_cast<size_t>(t.n()), CommCaseShow(all));
  for (int r = 0; r < t.n(); ++r) TESSERA_COMM_EXPECT_EQ(t, all[r], Bytes{static_cast<uint8_t>(r)});
}

// Ranks may be processes: instead of counting arrivals in shared memory, one rank arrives late
// and the others must wait for it.
inline void BarrierWaitsForEveryRank(Comm& comm, CommCaseRun& t) {
  constexpr milliseconds kLate{60};
  for (int round = 0; round < 3; ++round) {
    TESSERA_COMM_EXPECT_OK(t, comm.Barrier());  // start together
    const bool late = comm.rank() == round % t.n();
    if (late) std::this_thread::sleep_for(kLate);
    const auto start = std::chrono::steady_clock::now();
    TESSERA_COMM_EXPECT_OK(t, comm.Barrier());
    const auto waited = std::chrono::steady_clock::now() - start;
    if (!late) {
      TESSERA_COMM_EXPECT(t, waited >= kLate / 2,
                          "round " + std::to_string(round) + ": left before rank " +
                              std::to_string(round % t.n()) + " arrived");
    }
  }
}

inline void BroadcastFromEveryRootWithVariousSizes(Comm& comm, CommCaseRun& t) {
  for (size_t len : {size_t{0}, size_t{1}, size_t{1000}, size_t{1} << 20}) {
    for (int root = 0; root < t.n(); ++root) {
      const Bytes expected = Pattern(root + static_cast<int>(len), len);
      Bytes data = comm.rank() == root ? expected : Pattern(99, 7);
      TESSERA_COMM_EXPECT_OK(t, comm.Broadcast(&data, root));
      TESSERA_COMM_EXPECT(t, data == expected,
                          "root " + std::to_string(root) + " got " + CommCaseShow(data));
    }
  }
}

inline void GatherToEveryRoot(Comm& comm, CommCaseRun& t) {
  // Rank r sends 3*r bytes (rank 0's buffer is empty), and rank 1 sends 3000 more.
  auto len = [](int r) -> size_t { return 3 * r + (r == 1 ? 3000 : 0); };
  for (int root = 0; root < t.n(); ++root) {
    const Bytes send = Pattern(comm.rank() + root, len(comm.rank()));
    const bool is_root = comm.rank() == root;
    std::vector<Bytes> received = {Pattern(5, 5)};
    TESSERA_COMM_EXPECT_OK(t, comm.Gather(send, &received, root));
    if (!is_root) TESSERA_COMM_EXPECT_EQ(t, received, std::vector<Bytes>{Pattern(5, 5)});
    // A null `received` is fine off the root.
    TESSERA_COMM_EXPECT_OK(t, comm.Gather(send, is_root ? &received : nullptr, root));
    if (!is_root) continue;
    TESSERA_COMM_ASSERT(t, received.size() == static_cast<size_t>(t.n()), CommCaseShow(received));
    for (int r = 0; r < t.n(); ++r) {
      TESSERA_COMM_EXPECT(t, received[r] == Pattern(r + root, len(r)),
                          "entry " + std::to_string(r) + " " + CommCaseShow(received[r]));
    }
  }
}

inline void AllGatherVariableSizes(Comm& comm, CommCaseRun& t) {
  for (int round = 0; round < 3; ++round) {
    auto len = [&](int r) -> size_t { return (r + round) % 3 == 0 ? 0 : 1000 * r + round; };
    const int r = comm.rank();
    std::vector<Bytes> received;
    TESSERA_COMM_EXPECT_OK(t, comm.AllGather(Pattern(r * 10 + round, len(r)), &received));
    TESSERA_COMM_ASSERT(t, received.size() == static_cast<size_t>(t.n()), CommCaseShow(received));
    for (int p = 0; p < t.n(); ++p) {
      TESSERA_COMM_EXPECT(t, received[p] == Pattern(p * 10 + round, len(p)),
                          "entry " + std::to_string(p) + " " + CommCaseShow(received[p]));
    }
  }
}

inline void AllGatherAllEmpty(Comm& comm, CommCaseRun& t) {
  std::vector<Bytes> received = {Bytes{1}};
  TESSERA_COMM_EXPECT_OK(t, comm.AllGather(Bytes{}, &received));
  TESSERA_COMM_EXPECT_EQ(t, received, std::vector<Bytes>(t.n()));
}

inline void ScatterFromEveryRoot(Comm& comm, CommCaseRun& t) {
  for (int root = 0; root < t.n(); ++root) {
    auto len = [&](int r) -> size_t { return r + root + (r == t.n() - 1 ? 5000 : 0); };
    std::vector<Bytes> send;
    if (comm.rank() == root) {
      for (int r = 0; r < t.n(); ++r) send.push_back(Pattern(r * 7 + root, len(r)));
    }
    Bytes received = Pattern(1, 3);
    TESSERA_COMM_EXPECT_OK(t, comm.Scatter(send, &received, root));
    const Bytes want = Pattern(comm.rank() * 7 + root, len(comm.rank()));
    TESSERA_COMM_EXPECT(t, received == want,
                        "root " + std::to_string(root) + " got " + CommCaseShow(received));
  }
}

// Rank r's message from `root` in ScatterIntoFromEveryRoot: long enough on the last rank to
// take several messages where a Comm splits large ones.
inline Bytes ScatterIntoMessage(int root, int r, int n) {
  return Pattern(r * 11 + root, 3 * r + root + (r == n - 1 ? 5000 : 0));
}

// The root sends each message from three ranges of two buffers (one range empty); each rank
// receives into ranges of a buffer with gaps between them, which must stay as they were.
inline void ScatterIntoFromEveryRoot(Comm& comm, CommCaseRun& t) {
  const int me = comm.rank();
  for (int root = 0; root < t.n(); ++root) {
    const std::string what = " (root " + std::to_string(root) + ")";
    std::vector<Bytes> messages;
    std::vector<std::vector<ConstByteSpan>> send;
    if (me == root) {
      for (int r = 0; r < t.n(); ++r) messages.push_back(ScatterIntoMessage(root, r, t.n()));
      for (const Bytes& m : messages) {
        const auto* p = reinterpret_cast<const std::byte*>(m.data());
        const size_t half = m.size() / 2;
        send.push_back({ConstByteSpan(p, half), ConstByteSpan(p, 0),
                        ConstByteSpan(p + half, m.size() - half)});
      }
    }
    const Bytes want = ScatterIntoMessage(root, me, t.n());
    // Received at [0, a) and [a + 5, size + 5) of `into`, whose bytes [a, a + 5) are a gap.
    const size_t a = want.size() / 3;
    Bytes into = Pattern(77, want.size() + 5);
    const Bytes before = into;
    auto* q = reinterpret_cast<std::byte*>(into.data());
    const std::vector<MutableByteSpan> receive = {MutableByteSpan(q, a),
                                                  MutableByteSpan(q + a + 5, want.size() - a)};
    uint64_t received = 0;
    TESSERA_COMM_EXPECT_OK(t, comm.ScatterInto(send, receive, &received, root));
    TESSERA_COMM_EXPECT_EQ(t, received, uint64_t{want.size()});
    Bytes got(into.begin(), into.begin() + a);
    got.insert(got.end(), into.begin() + a + 5, into.end());
    TESSERA_COMM_EXPECT(t, got == want, "got " + CommCaseShow(got) + what);
    TESSERA_COMM_EXPECT(t, std::equal(into.begin() + a, into.begin() + a + 5, before.begin() + a),
                        "the gap between the ranges was written" + what);
  }
}

// A message of another length than the ranges hold is not a failure of the collective: the
// ranges stay untouched, `received` says the length, and the communicator goes on.
inline void ScatterIntoOtherLengthLeavesRangesUntouched(Comm& comm, CommCaseRun& t) {
  const int root = t.n() - 1;
  // Rank r is sent r bytes and expects 2.
  std::vector<Bytes> messages;
  std::vector<std::vector<ConstByteSpan>> send;
  if (comm.rank() == root) {
    for (int r = 0; r < t.n(); ++r) messages.push_back(Pattern(r, r));
    for (const Bytes& m : messages) {
      send.push_back({ConstByteSpan(reinterpret_cast<const std::byte*>(m.data()), m.size())});
    }
  }
  Bytes into = Pattern(5, 2);
  const std::vector<MutableByteSpan> receive = {
      MutableByteSpan(reinterpret_cast<std::byte*>(into.data()), into.size())};
  uint64_t received = 99;
  TESSERA_COMM_EXPECT_OK(t, comm.ScatterInto(send, receive, &received, root));
  TESSERA_COMM_EXPECT_EQ(t, received, uint64_t(comm.rank()));
  TESSERA_COMM_EXPECT(t, into == (comm.rank() == 2 ? Pattern(2, 2) : Pattern(5, 2)),
                      "got " + CommCaseShow(into));
  Bytes data = comm.rank() == 0 ? Pattern(3, 4) : Bytes{};
  TESSERA_COMM_EXPECT_OK(t, comm.Broadcast(&data, 0));
  TESSERA_COMM_EXPECT(t, data == Pattern(3, 4), "the Broadcast after got " + CommCaseShow(data));
}

inline void AllReduceOps(Comm& comm, CommCaseRun& t) {
  const int64_t r = comm.rank();
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce({}, ReduceOp::kSum));  // empty spans are allowed

  std::vector<int64_t> v = {r, -r, 1, r * r, int64_t{1} << 40};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
  const int64_t nn = t.n();
  TESSERA_COMM_EXPECT_EQ(t, v,
                         (std::vector<int64_t>{nn * (nn - 1) / 2, -nn * (nn - 1) / 2, nn,
                                               (nn - 1) * nn * (2 * nn - 1) / 6, nn << 40}));
  v = {r, -r, 5 - r};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kMin));
  TESSERA_COMM_EXPECT_EQ(t, v, (std::vector<int64_t>{0, -(nn - 1), 5 - (nn - 1)}));
  v = {r, -r, 5 - r};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kMax));
  TESSERA_COMM_EXPECT_EQ(t, v, (std::vector<int64_t>{nn - 1, 0, 5}));
  // A sum wraps around instead of being undefined.
  v = {INT64_MAX};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
  TESSERA_COMM_EXPECT_EQ(t, v[0], static_cast<int64_t>(static_cast<uint64_t>(INT64_MAX) * nn));
}

// Long enough to take several messages where a Comm splits large ones.
inline void AllReduceLongSpan(Comm& comm, CommCaseRun& t) {
  std::vector<int64_t> v(10'007);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i) * (comm.rank() + 1);
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
  const int64_t factor = int64_t{t.n()} * (t.n() + 1) / 2;
  size_t bad = 0;
  for (size_t i = 0; i < v.size(); ++i) bad += v[i] != static_cast<int64_t>(i) * factor;
  TESSERA_COMM_EXPECT_EQ(t, bad, size_t{0});
}

// One step of ManyCollectivesInARowStaySeparate: collective `i % 4` from a moving root.
inline void OneOfMany(Comm& comm, CommCaseRun& t, int i) {
  const int me = comm.rank();
  const int n = t.n();
  const int root = (i * 5 + 1) % n;
  const std::string what = " (step " + std::to_string(i) + ")";
  if (i % 4 == 0) {
    Bytes data = me == root ? Pattern(i, i % 17) : Bytes{};
    TESSERA_COMM_EXPECT_OK(t, comm.Broadcast(&data, root));
    TESSERA_COMM_EXPECT(t, data == Pattern(i, i % 17), what);
  } else if (i % 4 == 1) {
    std::vector<Bytes> send;
    for (int r = 0; me == root && r < n; ++r) send.push_back(Pattern(i + r, r % 3));
    Bytes got;
    TESSERA_COMM_EXPECT_OK(t, comm.Scatter(send, &got, root));
    TESSERA_COMM_EXPECT(t, got == Pattern(i + me, me % 3), what);
  } else if (i % 4 == 2) {
    std::vector<Bytes> got;
    TESSERA_COMM_EXPECT_OK(t, comm.Gather(Pattern(i * me, 2), &got, root));
    if (me != root) return;
    TESSERA_COMM_ASSERT(t, got.size() == static_cast<size_t>(n), what);
    for (int r = 0; r < n; ++r) TESSERA_COMM_EXPECT(t, got[r] == Pattern(i * r, 2), what);
  } else {
    std::vector<int64_t> v = {i + me};
    TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kMax));
    TESSERA_COMM_EXPECT(t, v[0] == i + n - 1, what);
  }
}

// Many collectives back to back with moving roots and no barriers between them: a rank that
// runs ahead sends messages of later collectives while its peers are still in earlier ones.
inline void ManyCollectivesInARowStaySeparate(Comm& comm, CommCaseRun& t) {
  for (int i = 0; i < 300; ++i) {
    if (comm.rank() == (i % t.n()) && i % 37 == 0) std::this_thread::sleep_for(milliseconds(2));
    OneOfMany(comm, t, i);
  }
}

// ---- Split ------------------------------------------------------------------------------

inline void SplitByParityWithReversedKeys(Comm& comm, CommCaseRun& t) {
  const int me = comm.rank();
  Result<std::unique_ptr<Comm>> child = comm.Split(me % 2, -me);
  TESSERA_COMM_ASSERT_OK(t, child);
  // Same color: same parity. Keys reverse the order: the highest old rank is child rank 0.
  std::vector<int> members;
  for (int r = t.n() - 1; r >= 0; --r) {
    if (r % 2 == me % 2) members.push_back(r);
  }
  TESSERA_COMM_EXPECT_EQ(t, (*child)->size(), static_cast<int>(members.size()));
  const auto want_rank = std::find(members.begin(), members.end(), me) - members.begin();
  TESSERA_COMM_EXPECT_EQ(t, (*child)->rank(), static_cast<int>(want_rank));
  std::vector<Bytes> all;
  TESSERA_COMM_EXPECT_OK(t, (*child)->AllGather(Bytes{static_cast<uint8_t>(me)}, &all));
  TESSERA_COMM_ASSERT(t, all.size() == members.size(), CommCaseShow(all));
  for (size_t i = 0; i < all.size(); ++i) {
    TESSERA_COMM_EXPECT_EQ(t, all[i], Bytes{static_cast<uint8_t>(members[i])});
  }
  // The parent still works after the split.
  std::vector<int64_t> v = {1};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
  TESSERA_COMM_EXPECT_EQ(t, v[0], int64_t{t.n()});
}

inline void SplitTiesKeepOldOrderAndNestedSplit(Comm& comm, CommCaseRun& t) {
  Result<std::unique_ptr<Comm>> same = comm.Split(7, 0);
  TESSERA_COMM_ASSERT_OK(t, same);
  TESSERA_COMM_EXPECT_EQ(t, (*same)->size(), t.n());
  TESSERA_COMM_EXPECT_EQ(t, (*same)->rank(), comm.rank());
  // Split of a split: every rank alone.
  Result<std::unique_ptr<Comm>> alone = (*same)->Split((*same)->rank(), 0);
  TESSERA_COMM_ASSERT_OK(t, alone);
  TESSERA_COMM_EXPECT_EQ(t, (*alone)->size(), 1);
  TESSERA_COMM_EXPECT_EQ(t, (*alone)->rank(), 0);
  Bytes data = {1, 2, 3};
  TESSERA_COMM_EXPECT_OK(t, (*alone)->Broadcast(&data, 0));
  TESSERA_COMM_EXPECT_OK(t, (*same)->Barrier());
  TESSERA_COMM_EXPECT_EQ(t, data, (Bytes{1, 2, 3}));
}

// MPI colors must be non-negative; the Comm contract allows any int.
inline void SplitWithNegativeColors(Comm& comm, CommCaseRun& t) {
  const int me = comm.rank();
  Result<std::unique_ptr<Comm>> child = comm.Split(me % 2 == 0 ? INT_MIN : -1, me);
  TESSERA_COMM_ASSERT_OK(t, child);
  TESSERA_COMM_EXPECT_EQ(t, (*child)->size(), (t.n() + (me % 2 == 0 ? 1 : 0)) / 2);
  TESSERA_COMM_EXPECT_EQ(t, (*child)->rank(), me / 2);
  std::vector<int64_t> v = {me};
  TESSERA_COMM_EXPECT_OK(t, (*child)->AllReduce(v, ReduceOp::kMax));
  const int last = t.n() - 1;
  TESSERA_COMM_EXPECT_EQ(t, v[0], int64_t{last % 2 == me % 2 ? last : last - 1});
}

// Parent and child used at the same time from two threads of each rank.
inline void ParentAndChildConcurrently(Comm& comm, CommCaseRun& t) {
  const int me = comm.rank();
  Result<std::unique_ptr<Comm>> split = comm.Split(me % 3, me);
  TESSERA_COMM_ASSERT_OK(t, split);
  Comm& child = **split;
  const int child_size = child.size();
  std::thread other([&] {
    for (int i = 0; i < 100; ++i) {
      std::vector<int64_t> v = {1, i};
      TESSERA_COMM_EXPECT_OK(t, child.AllReduce(v, ReduceOp::kSum));
      TESSERA_COMM_EXPECT(t, v[0] == child_size && v[1] == int64_t{i} * child_size,
                          "child " + std::to_string(i));
      Bytes data = child.rank() == i % child_size ? Pattern(i, 3) : Bytes{};
      TESSERA_COMM_EXPECT_OK(t, child.Broadcast(&data, i % child_size));
      TESSERA_COMM_EXPECT(t, data == Pattern(i, 3), "child broadcast " + std::to_string(i));
    }
  });
  for (int i = 0; i < 100; ++i) {
    std::vector<int64_t> v = {2, -i};
    TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
    TESSERA_COMM_EXPECT(t, v[0] == 2 * t.n() && v[1] == -int64_t{i} * t.n(),
                        "parent " + std::to_string(i));
    Bytes data = me == i % t.n() ? Pattern(-i, 4) : Bytes{};
    TESSERA_COMM_EXPECT_OK(t, comm.Broadcast(&data, i % t.n()));
    TESSERA_COMM_EXPECT(t, data == Pattern(-i, 4), "parent broadcast " + std::to_string(i));
  }
  other.join();
}

// ---- AgreeOnStatus ----------------------------------------------------------------------

inline void AgreeOnStatusAllOk(Comm& comm, CommCaseRun& t) {
  TESSERA_COMM_EXPECT_OK(t, AgreeOnStatus(comm, Status::Ok()));
}

inline void AgreeOnStatusOneFailure(Comm& comm, CommCaseRun& t) {
  const int failing = t.n() - 1;
  Status local = comm.rank() == failing ? NotFound("no such key: w") : Status::Ok();
  Status agreed = AgreeOnStatus(comm, local);
  TESSERA_COMM_EXPECT_EQ(t, agreed.code(), StatusCode::kNotFound);
  TESSERA_COMM_EXPECT_EQ(t, agreed.message(),
                         t.n() == 1
                             ? std::string("no such key: w")
                             : "rank " + std::to_string(failing) + ": no such key: w (1 of " +
                                   std::to_string(t.n()) + " ranks failed)");
}

// Needs three ranks or more.
inline void AgreeOnStatusTwoFailuresNameTheLowest(Comm& comm, CommCaseRun& t) {
  Status local;
  if (comm.rank() == t.n() - 1) local = IOError("disk full");
  if (comm.rank() == 1) local = DataLoss("bad checksum");
  Status agreed = AgreeOnStatus(comm, local);
  TESSERA_COMM_EXPECT_EQ(t, agreed.code(), StatusCode::kDataLoss);
  TESSERA_COMM_EXPECT_EQ(t, agreed.message(),
                         "rank 1: bad checksum (2 of " + std::to_string(t.n()) + " ranks failed)");
}

// ---- Abort ------------------------------------------------------------------------------

// A peer may learn of the abort in a collective it is already in (LocalComm) or only in its
// next one (MPI cannot interrupt a collective); from then on every collective fails at once.
inline void AbortFailsLaterCollectives(Comm& comm, CommCaseRun& t) {
  const std::string want = "rank 0 aborted: Internal: disk on fire";
  const Status first = comm.Barrier();
  if (comm.rank() == 0) {
    TESSERA_COMM_EXPECT_OK(t, first);
    comm.Abort(Internal("disk on fire"));
    comm.Abort(Internal("a second abort is ignored"));
  } else if (!first.ok()) {
    TESSERA_COMM_EXPECT_EQ(t, first.message(), want);
  }
  Status after = comm.Barrier();
  TESSERA_COMM_EXPECT_EQ(t, after.code(), StatusCode::kAborted);
  TESSERA_COMM_EXPECT_EQ(t, after.message(), want);
  Bytes data;
  Status broadcast = comm.Broadcast(&data, 0);
  TESSERA_COMM_EXPECT_EQ(t, broadcast.code(), StatusCode::kAborted);
  TESSERA_COMM_EXPECT_EQ(t, broadcast.message(), want);
  // AgreeOnStatus reports the failed AllGather.
  Status agreed = AgreeOnStatus(comm, Status::Ok());
  TESSERA_COMM_EXPECT_EQ(t, agreed.code(), StatusCode::kAborted);
  auto split = comm.Split(0, 0);
  TESSERA_COMM_EXPECT_EQ(t, split.status().code(), StatusCode::kAborted);
}

inline void AbortingChildLeavesParentUsable(Comm& comm, CommCaseRun& t) {
  Result<std::unique_ptr<Comm>> child = comm.Split(0, 0);
  TESSERA_COMM_ASSERT_OK(t, child);
  if (comm.rank() == 0) (*child)->Abort(Internal("child only"));
  TESSERA_COMM_EXPECT_OK(t, comm.Barrier());
  Status s = (*child)->Barrier();
  TESSERA_COMM_EXPECT_EQ(t, s.code(), StatusCode::kAborted);
  std::vector<int64_t> v = {1};
  TESSERA_COMM_EXPECT_OK(t, comm.AllReduce(v, ReduceOp::kSum));
  TESSERA_COMM_EXPECT_EQ(t, v[0], int64_t{t.n()});
}

// A child split before its parent was aborted is aborted with it.
inline void AgreedParentAbortReachesExistingChild(Comm& comm, CommCaseRun& t) {
  const int aborting = t.n() - 1;
  const std::string want =
      "rank " + std::to_string(aborting) + " aborted: IOError: lost the storage";
  Result<std::unique_ptr<Comm>> child = comm.Split(0, 0);
  if (comm.rank() != aborting && !child.ok()) {
    // The abort may reach a Split still in progress on this rank (LocalComm): no child then.
    TESSERA_COMM_EXPECT_EQ(t, child.status().message(), want);
    return;
  }
  TESSERA_COMM_ASSERT_OK(t, child);
  if (comm.rank() == aborting) comm.Abort(IOError("lost the storage"));
  TESSERA_COMM_EXPECT_EQ(t, comm.Barrier().message(), want);
  Status s = (*child)->Barrier();
  TESSERA_COMM_EXPECT_EQ(t, s.code(), StatusCode::kAborted);
  TESSERA_COMM_EXPECT_EQ(t, s.message(), want);
}

// An abort of a parent reaches ranks blocked in its child (needs two ranks or more).
inline void ParentAbortReachesChild(Comm& comm, CommCaseRun& t) {
  const std::string want = "rank 0 aborted: Internal: parent gave up";
  Result<std::unique_ptr<Comm>> child = comm.Split(0, comm.rank());
  if (comm.rank() != 0 && !child.ok()) {
    // The abort may reach a Split still in progress on this rank (LocalComm): no child then.
    TESSERA_COMM_EXPECT_EQ(t, child.status().message(), want);
    return;
  }
  TESSERA_COMM_ASSERT_OK(t, child);
  if (comm.rank() == 0) {
    std::this_thread::sleep_for(milliseconds(30));  // let the others block in the child
    comm.Abort(Internal("parent gave up"));
  }
  Status s = (*child)->Barrier();
  TESSERA_COMM_EXPECT_EQ(t, s.code(), StatusCode::kAborted);
  TESSERA_COMM_EXPECT_EQ(t, s.message(), want);
}

// ---- bad arguments: every rank fails, and later collectives too --------------------------

inline void InvalidRootFails(Comm& comm, CommCaseRun& t) {
  Bytes data;
  const std::string detail = ": root " + std::to_string(t.n()) +
                             " is not a rank of a communicator of size " + std::to_string(t.n());
  Status s = comm.Broadcast(&data, t.n());
  ExpectArgumentError(t, s, detail);
  if (s.code() == StatusCode::kInvalidArgument) {
    TESSERA_COMM_EXPECT_EQ(t, s.message(),
                           "Broadcast on rank " + std::to_string(comm.rank()) + detail);
  }
  // The communicator is aborted for later collectives.
  Status later = comm.Barrier();
  TESSERA_COMM_EXPECT_EQ(t, later.code(), StatusCode::kAborted);
  const std::string prefix = t.traits().agreed_argument_errors
                                 ? "rank 0 aborted: InvalidArgument: Broadcast on rank 0"
                                 : " aborted: InvalidArgument: Broadcast on rank ";
  TESSERA_COMM_EXPECT(t, Contains(later.message(), prefix), Quote(later));
}

inline void ScatterWithWrongCountFailsEverywhere(Comm& comm, CommCaseRun& t) {
  std::vector<Bytes> send(t.n() + 1);
  Bytes got;
  Status s = comm.Scatter(send, &got, 0);
  const std::string detail = "Scatter on rank 0: the root passed " + std::to_string(t.n() + 1) +
                             " buffers for " + std::to_string(t.n()) + " ranks";
  if (comm.rank() == 0) {
    TESSERA_COMM_EXPECT_EQ(t, s.code(), StatusCode::kInvalidArgument);
    TESSERA_COMM_EXPECT_EQ(t, s.message(), detail);
  } else {
    TESSERA_COMM_EXPECT_EQ(t, s.code(), StatusCode::kAborted);
    TESSERA_COMM_EXPECT_EQ(t, s.message(), "rank 0 aborted: InvalidArgument: " + detail);
  }
}

inline void NullOutputOnOneRankFailsEverywhere(Comm& comm, CommCaseRun& t) {
  const int bad = t.n() - 1;
  std::vector<Bytes> all;
  Status s = comm.AllGather(Bytes{1}, comm.rank() == bad ? nullptr : &all);
  TESSERA_COMM_EXPECT_EQ(t, s.code(),
                         comm.rank() == bad ? StatusCode::kInvalidArgument : StatusCode::kAborted);
  TESSERA_COMM_EXPECT(
      t, Contains(s.message(), "AllGather on rank " + std::to_string(bad) + ": received is null"),
      Quote(s));
}

// The argument mismatches below need two ranks or more.

inline void AllReduceLengthMismatchFailsEverywhere(Comm& comm, CommCaseRun& t) {
  std::vector<int64_t> v(comm.rank() == 1 ? 3 : 2, 1);
  Status s = comm.AllReduce(v, ReduceOp::kSum);
  const std::string detail = ": rank 1 passed 3 values, rank 0 passed 2";
  ExpectArgumentError(t, s, detail);
  if (s.code() == StatusCode::kInvalidArgument) {
    TESSERA_COMM_EXPECT_EQ(t, s.message(),
                           "AllReduce on rank " + std::to_string(comm.rank()) + detail);
  }
  TESSERA_COMM_EXPECT_EQ(t, comm.Barrier().code(), StatusCode::kAborted);
}

inline void AllReduceOpMismatchFailsEverywhere(Comm& comm, CommCaseRun& t) {
  std::vector<int64_t> v = {1};
  Status s = comm.AllReduce(v, comm.rank() == 1 ? ReduceOp::kMax : ReduceOp::kSum);
  ExpectArgumentError(t, s, "the ranks passed different ops, kSum and kMax");
}

// Collectives that do not match (a hang or undefined behaviour in MPI) fail on every rank.
inline void DifferentCollectivesFailEverywhere(Comm& comm, CommCaseRun& t) {
  Status s;
  if (comm.rank() == 1) {
    s = comm.Barrier();
  } else {
    std::vector<Bytes> all;
    s = comm.AllGather(Bytes{1, 2}, &all);
  }
  ExpectArgumentError(t, s,
                      "the ranks called different collectives at the same point: Barrier and "
                      "AllGather");
}

inline void DifferentRootsFailEverywhere(Comm& comm, CommCaseRun& t) {
  Bytes data = {1};
  Status s = comm.Broadcast(&data, comm.rank() == 0 ? 1 : 0);
  ExpectArgumentError(t, s, "the ranks passed different roots, 0 and 1");
}

}  // namespace comm_cases

// One case: its name, the fewest ranks it needs, its body.
struct CommCase {
  const char* name;
  int min_ranks;
  void (*body)(Comm& comm, CommCaseRun& t);
};

// Every case, in order.
inline const std::vector<CommCase>& CommSuiteCases() {
#define TESSERA_COMM_CASE(name, min_ranks) \
  CommCase { #name, min_ranks, &comm_cases::name }
  static const std::vector<CommCase> cases = {
      TESSERA_COMM_CASE(RankAndSize, 1),
      TESSERA_COMM_CASE(BarrierWaitsForEveryRank, 1),
      TESSERA_COMM_CASE(BroadcastFromEveryRootWithVariousSizes, 1),
      TESSERA_COMM_CASE(GatherToEveryRoot, 1),
      TESSERA_COMM_CASE(AllGatherVariableSizes, 1),
      TESSERA_COMM_CASE(AllGatherAllEmpty, 1),
      TESSERA_COMM_CASE(ScatterFromEveryRoot, 1),
      TESSERA_COMM_CASE(ScatterIntoFromEveryRoot, 1),
      TESSERA_COMM_CASE(ScatterIntoOtherLengthLeavesRangesUntouched, 1),
      TESSERA_COMM_CASE(AllReduceOps, 1),
      TESSERA_COMM_CASE(AllReduceLongSpan, 1),
      TESSERA_COMM_CASE(ManyCollectivesInARowStaySeparate, 1),
      TESSERA_COMM_CASE(SplitByParityWithReversedKeys, 1),
      TESSERA_COMM_CASE(SplitTiesKeepOldOrderAndNestedSplit, 1),
      TESSERA_COMM_CASE(SplitWithNegativeColors, 1),
      TESSERA_COMM_CASE(ParentAndChildConcurrently, 1),
      TESSERA_COMM_CASE(AgreeOnStatusAllOk, 1),
      TESSERA_COMM_CASE(AgreeOnStatusOneFailure, 1),
      TESSERA_COMM_CASE(AgreeOnStatusTwoFailuresNameTheLowest, 3),
      TESSERA_COMM_CASE(AbortFailsLaterCollectives, 1),
      TESSERA_COMM_CASE(AbortingChildLeavesParentUsable, 1),
      TESSERA_COMM_CASE(AgreedParentAbortReachesExistingChild, 1),
      TESSERA_COMM_CASE(ParentAbortReachesChild, 2),
      TESSERA_COMM_CASE(InvalidRootFails, 1),
      TESSERA_COMM_CASE(ScatterWithWrongCountFailsEverywhere, 1),
      TESSERA_COMM_CASE(NullOutputOnOneRankFailsEverywhere, 1),
      TESSERA_COMM_CASE(AllReduceLengthMismatchFailsEverywhere, 2),
      TESSERA_COMM_CASE(AllReduceOpMismatchFailsEverywhere, 2),
      TESSERA_COMM_CASE(DifferentCollectivesFailEverywhere, 2),
      TESSERA_COMM_CASE(DifferentRootsFailEverywhere, 2),
  };
#undef TESSERA_COMM_CASE
  return cases;
}

// The cases a communicator of `size` ranks runs, in order.
inline std::vector<CommCase> CommSuiteCasesFor(int size) {
  std::vector<CommCase> out;
  for (const CommCase& c : CommSuiteCases()) {
    if (size >= c.min_ranks) out.push_back(c);
  }
  return out;
}

// Runs case `c` on this rank's `comm` (every rank of the communicator must run it at the same
// time); returns the failures this rank found, empty when it passed.
inline std::vector<std::string> RunCommCase(const CommCase& c, Comm& comm, int size,
                                            CommSuiteTraits traits) {
  CommCaseRun run(size, traits);
  c.body(comm, run);
  return run.failures();
}

}  // namespace tessera::testing

#endif  // TESSERA_TESTING_COMM_CASES_H_
