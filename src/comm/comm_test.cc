// Tests for every Comm: the single-rank one and LocalComm at several rank counts run the same
// collective tests; LocalComm-only tests cover timeouts, aborts, leaving ranks and Split.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <latch>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm.h"
#include "tessera/local_comm.h"
#include "tessera/status.h"

namespace tessera {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// Long enough never to fire in a healthy test, so a hang shows up as a slow failure.
constexpr milliseconds kLongTimeout{5'000};
constexpr milliseconds kShortTimeout{200};

// Checks inside rank threads return a status instead of asserting, so a failing rank also
// exercises the abort path and the test sees which rank and what went wrong.
#define CHECK_OR_RETURN(cond, what)                                                         \
  do {                                                                                      \
    if (!(cond)) return Internal(std::string("rank check failed: ") + #cond + ": " + what); \
  } while (0)

// `n` bytes that depend on `seed`, so buffers from different ranks and rounds differ.
Bytes Pattern(int seed, size_t n) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed * 131 + i * 7 + 1);
  return out;
}

std::string Str(const Bytes& b) { return "[" + std::to_string(b.size()) + " bytes]"; }

struct CommKind {
  std::string name;
  int num_ranks;
  bool single;  // NewSingleRankComm instead of LocalComm
};

void PrintTo(const CommKind& kind, std::ostream* os) { *os << kind.name; }

// Runs fn on every rank of a communicator of the kind under test; returns each rank's status.
std::vector<Status> RunOn(const CommKind& kind, const std::function<Status(Comm&)>& fn) {
  if (kind.single) {
    std::unique_ptr<Comm> comm = NewSingleRankComm();
    return {fn(*comm)};
  }
  return RunLocalRanks(kind.num_ranks, fn, LocalCommOptions{.timeout = kLongTimeout});
}

void ExpectAllOk(const std::vector<Status>& statuses, int num_ranks) {
  ASSERT_EQ(statuses.size(), static_cast<size_t>(num_ranks));
  EXPECT_TRUE(FirstError(statuses).ok()) << FirstError(statuses).ToString();
}

class CollectiveTest : public ::testing::TestWithParam<CommKind> {
 protected:
  int n() const { return GetParam().num_ranks; }
  void Run(const std::function<Status(Comm&)>& fn) { ExpectAllOk(RunOn(GetParam(), fn), n()); }
};

TEST_P(CollectiveTest, RankAndSize) {
  std::vector<std::atomic<int>> seen(n());
  Run([&](Comm& comm) {
    CHECK_OR_RETURN(comm.size() == n(), std::to_string(comm.size()));
    CHECK_OR_RETURN(comm.rank() >= 0 && comm.rank() < n(), std::to_string(comm.rank()));
    seen[comm.rank()]++;
    return Status::Ok();
  });
  for (int r = 0; r < n(); ++r) EXPECT_EQ(seen[r], 1) << "rank " << r;
}

TEST_P(CollectiveTest, BarrierWaitsForEveryRank) {
  std::atomic<int> arrived{0};
  Run([&](Comm& comm) {
    for (int round = 1; round <= 5; ++round) {
      // Stagger the ranks so a barrier that does not wait would be caught.
      std::this_thread::sleep_for(milliseconds(comm.rank() == round % n() ? 5 : 0));
      arrived++;
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      const int seen = arrived.load();
      CHECK_OR_RETURN(seen == round * n(), "round " + std::to_string(round) + " saw " +
                                               std::to_string(seen) + " arrivals");
      TESSERA_RETURN_IF_ERROR(comm.Barrier());  // nobody starts the next round early
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, BroadcastFromEveryRootWithVariousSizes) {
  Run([&](Comm& comm) {
    for (size_t len : {size_t{0}, size_t{1}, size_t{1000}, size_t{1} << 20}) {
      for (int root = 0; root < n(); ++root) {
        const Bytes expected = Pattern(root + static_cast<int>(len), len);
        Bytes data = comm.rank() == root ? expected : Pattern(99, 7);
        TESSERA_RETURN_IF_ERROR(comm.Broadcast(&data, root));
        CHECK_OR_RETURN(data == expected, "root " + std::to_string(root) + " got " + Str(data));
      }
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, GatherToEveryRoot) {
  Run([&](Comm& comm) {
    for (int root = 0; root < n(); ++root) {
      // Rank r sends 3*r bytes: rank 0's buffer is empty.
      const Bytes send = Pattern(comm.rank() + root, 3 * comm.rank());
      const bool is_root = comm.rank() == root;
      std::vector<Bytes> received = {Pattern(5, 5)};
      TESSERA_RETURN_IF_ERROR(comm.Gather(send, &received, root));
      if (!is_root) {
        CHECK_OR_RETURN(received == std::vector<Bytes>{Pattern(5, 5)}, "non-root was touched");
      }
      // A null `received` is fine off the root.
      TESSERA_RETURN_IF_ERROR(comm.Gather(send, is_root ? &received : nullptr, root));
      if (is_root) {
        CHECK_OR_RETURN(received.size() == static_cast<size_t>(n()), "");
        for (int r = 0; r < n(); ++r) {
          CHECK_OR_RETURN(received[r] == Pattern(r + root, 3 * r), "entry " + std::to_string(r));
        }
      }
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, AllGatherVariableSizes) {
  Run([&](Comm& comm) {
    for (int round = 0; round < 3; ++round) {
      const int r = comm.rank();
      const Bytes send = Pattern(r * 10 + round, (r + round) % 3 == 0 ? 0 : 100 * r + round);
      std::vector<Bytes> received;
      TESSERA_RETURN_IF_ERROR(comm.AllGather(send, &received));
      CHECK_OR_RETURN(received.size() == static_cast<size_t>(n()), "");
      for (int p = 0; p < n(); ++p) {
        const Bytes want = Pattern(p * 10 + round, (p + round) % 3 == 0 ? 0 : 100 * p + round);
        CHECK_OR_RETURN(received[p] == want, "entry " + std::to_string(p));
      }
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, ScatterFromEveryRoot) {
  Run([&](Comm& comm) {
    for (int root = 0; root < n(); ++root) {
      std::vector<Bytes> send;
      if (comm.rank() == root) {
        for (int r = 0; r < n(); ++r) send.push_back(Pattern(r * 7 + root, r + root));
      }
      Bytes received = Pattern(1, 3);
      TESSERA_RETURN_IF_ERROR(comm.Scatter(send, &received, root));
      const Bytes want = Pattern(comm.rank() * 7 + root, comm.rank() + root);
      CHECK_OR_RETURN(received == want, "root " + std::to_string(root) + " got " + Str(received));
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, AllReduceOps) {
  Run([&](Comm& comm) {
    const int64_t r = comm.rank();
    // Empty spans are allowed.
    TESSERA_RETURN_IF_ERROR(comm.AllReduce({}, ReduceOp::kSum));

    std::vector<int64_t> v = {r, -r, 1, r * r, int64_t{1} << 40};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kSum));
    const int64_t nn = n();
    const std::vector<int64_t> sum = {nn * (nn - 1) / 2, -nn * (nn - 1) / 2, nn,
                                      (nn - 1) * nn * (2 * nn - 1) / 6, nn << 40};
    CHECK_OR_RETURN(v == sum, "sum");

    v = {r, -r, 5 - r};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kMin));
    CHECK_OR_RETURN((v == std::vector<int64_t>{0, -(nn - 1), 5 - (nn - 1)}), "min");

    v = {r, -r, 5 - r};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kMax));
    CHECK_OR_RETURN((v == std::vector<int64_t>{nn - 1, 0, 5}), "max");
    return Status::Ok();
  });
}

// Many collectives back to back with moving roots and no barriers between them: a rank that
// runs ahead sends messages of later collectives while its peers are still in earlier ones.
TEST_P(CollectiveTest, ManyCollectivesInARowStaySeparate) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    for (int i = 0; i < 300; ++i) {
      const int root = (i * 5 + 1) % n();
      if (me == (i % n()) && i % 37 == 0) std::this_thread::sleep_for(milliseconds(2));
      switch (i % 4) {
        case 0: {
          Bytes data = me == root ? Pattern(i, i % 17) : Bytes{};
          TESSERA_RETURN_IF_ERROR(comm.Broadcast(&data, root));
          CHECK_OR_RETURN(data == Pattern(i, i % 17), "broadcast " + std::to_string(i));
          break;
        }
        case 1: {
          std::vector<Bytes> send;
          if (me == root) {
            for (int r = 0; r < n(); ++r) send.push_back(Pattern(i + r, r % 3));
          }
          Bytes got;
          TESSERA_RETURN_IF_ERROR(comm.Scatter(send, &got, root));
          CHECK_OR_RETURN(got == Pattern(i + me, me % 3), "scatter " + std::to_string(i));
          break;
        }
        case 2: {
          std::vector<Bytes> got;
          TESSERA_RETURN_IF_ERROR(comm.Gather(Pattern(i * me, 2), &got, root));
          if (me == root) {
            for (int r = 0; r < n(); ++r) {
              CHECK_OR_RETURN(got[r] == Pattern(i * r, 2), "gather " + std::to_string(i));
            }
          }
          break;
        }
        case 3: {
          std::vector<int64_t> v = {i + me};
          TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kMax));
          CHECK_OR_RETURN(v[0] == i + n() - 1, "allreduce " + std::to_string(i));
          break;
        }
      }
    }
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, SplitByParityWithReversedKeys) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> child, comm.Split(me % 2, -me));
    // Same color: same parity. Keys reverse the order: the highest old rank is child rank 0.
    std::vector<int> members;
    for (int r = n() - 1; r >= 0; --r) {
      if (r % 2 == me % 2) members.push_back(r);
    }
    CHECK_OR_RETURN(child->size() == static_cast<int>(members.size()),
                    std::to_string(child->size()));
    const int want_rank =
        static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
    CHECK_OR_RETURN(child->rank() == want_rank, std::to_string(child->rank()));

    std::vector<Bytes> all;
    TESSERA_RETURN_IF_ERROR(child->AllGather(Bytes{static_cast<uint8_t>(me)}, &all));
    CHECK_OR_RETURN(all.size() == members.size(), "");
    for (size_t i = 0; i < all.size(); ++i) {
      CHECK_OR_RETURN(all[i] == Bytes{static_cast<uint8_t>(members[i])}, std::to_string(i));
    }
    // The parent still works after the split.
    std::vector<int64_t> v = {1};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kSum));
    CHECK_OR_RETURN(v[0] == n(), "");
    return Status::Ok();
  });
}

TEST_P(CollectiveTest, SplitTiesKeepOldOrderAndNestedSplit) {
  Run([&](Comm& comm) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> same, comm.Split(7, 0));
    CHECK_OR_RETURN(same->size() == n() && same->rank() == comm.rank(), "");
    // Split of a split: every rank alone.
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> alone, same->Split(same->rank(), 0));
    CHECK_OR_RETURN(alone->size() == 1 && alone->rank() == 0, "");
    Bytes data = {1, 2, 3};
    TESSERA_RETURN_IF_ERROR(alone->Broadcast(&data, 0));
    TESSERA_RETURN_IF_ERROR(same->Barrier());
    CHECK_OR_RETURN((data == Bytes{1, 2, 3}), "");
    return Status::Ok();
  });
}

// Parent and child used at the same time from two threads of each rank.
TEST_P(CollectiveTest, ParentAndChildConcurrently) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> child, comm.Split(me % 3, me));
    const int child_size = child->size();
    Status child_status;
    std::thread other([&] {
      child_status = [&]() -> Status {
        for (int i = 0; i < 100; ++i) {
          std::vector<int64_t> v = {1, i};
          TESSERA_RETURN_IF_ERROR(child->AllReduce(v, ReduceOp::kSum));
          CHECK_OR_RETURN(v[0] == child_size && v[1] == int64_t{i} * child_size, "child");
          Bytes data = child->rank() == i % child_size ? Pattern(i, 3) : Bytes{};
          TESSERA_RETURN_IF_ERROR(child->Broadcast(&data, i % child_size));
          CHECK_OR_RETURN(data == Pattern(i, 3), "child broadcast");
        }
        return Status::Ok();
      }();
      if (!child_status.ok()) child->Abort(child_status);  // so peers cannot hang
    });
    Status parent_status = [&]() -> Status {
      for (int i = 0; i < 100; ++i) {
        std::vector<int64_t> v = {2, -i};
        TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kSum));
        CHECK_OR_RETURN(v[0] == 2 * n() && v[1] == -int64_t{i} * n(), "parent");
        Bytes data = me == i % n() ? Pattern(-i, 4) : Bytes{};
        TESSERA_RETURN_IF_ERROR(comm.Broadcast(&data, i % n()));
        CHECK_OR_RETURN(data == Pattern(-i, 4), "parent broadcast");
      }
      return Status::Ok();
    }();
    if (!parent_status.ok()) child->Abort(parent_status);  // so `other` cannot hang
    other.join();
    TESSERA_RETURN_IF_ERROR(parent_status);
    return child_status;
  });
}

TEST_P(CollectiveTest, AgreeOnStatusAllOk) {
  Run([&](Comm& comm) { return AgreeOnStatus(comm, Status::Ok()); });
}

TEST_P(CollectiveTest, AgreeOnStatusOneFailure) {
  const int failing = n() - 1;
  std::vector<Status> agreed(n());
  Run([&](Comm& comm) {
    Status local = comm.rank() == failing ? NotFound("no such key: w") : Status::Ok();
    agreed[comm.rank()] = AgreeOnStatus(comm, local);
    return Status::Ok();
  });
  const std::string want = n() == 1
                               ? "no such key: w"
                               : "rank " + std::to_string(failing) + ": no such key: w (1 of " +
                                     std::to_string(n()) + " ranks failed)";
  for (int r = 0; r < n(); ++r) {
    EXPECT_EQ(agreed[r].code(), StatusCode::kNotFound) << "rank " << r;
    EXPECT_EQ(agreed[r].message(), want) << "rank " << r;
  }
}

// Two failures need three ranks or more (instantiated below for those kinds only).
class CollectiveOfThreeOrMoreTest : public CollectiveTest {};

TEST_P(CollectiveOfThreeOrMoreTest, AgreeOnStatusTwoFailuresNameTheLowest) {
  std::vector<Status> agreed(n());
  Run([&](Comm& comm) {
    Status local;
    if (comm.rank() == n() - 1) local = IOError("disk full");
    if (comm.rank() == 1) local = DataLoss("bad checksum");
    agreed[comm.rank()] = AgreeOnStatus(comm, local);
    return Status::Ok();
  });
  const std::string want = "rank 1: bad checksum (2 of " + std::to_string(n()) + " ranks failed)";
  for (int r = 0; r < n(); ++r) {
    EXPECT_EQ(agreed[r].code(), StatusCode::kDataLoss) << "rank " << r;
    EXPECT_EQ(agreed[r].message(), want) << "rank " << r;
  }
}

TEST_P(CollectiveTest, AbortFailsLaterCollectives) {
  std::vector<Status> after(n());
  std::vector<Status> statuses = RunOn(GetParam(), [&](Comm& comm) {
    // Rank 0 may leave this barrier and abort while a peer is still in it: then the peer's
    // first barrier fails already.
    Status first = comm.Barrier();
    if (comm.rank() == 0) {
      CHECK_OR_RETURN(first.ok(), first.ToString());
      comm.Abort(Internal("disk on fire"));
    }
    after[comm.rank()] = first.ok() ? comm.Barrier() : first;
    Bytes data;
    Status broadcast = comm.Broadcast(&data, 0);
    CHECK_OR_RETURN(broadcast.code() == StatusCode::kAborted, broadcast.ToString());
    // AgreeOnStatus reports the failed AllGather.
    Status agreed = AgreeOnStatus(comm, Status::Ok());
    CHECK_OR_RETURN(agreed.code() == StatusCode::kAborted, agreed.ToString());
    auto split = comm.Split(0, 0);
    CHECK_OR_RETURN(split.status().code() == StatusCode::kAborted, split.status().ToString());
    return Status::Ok();
  });
  ExpectAllOk(statuses, n());
  // Every rank's barrier fails: none can complete without rank 0, which aborted instead.
  for (int r = 0; r < n(); ++r) {
    EXPECT_EQ(after[r].code(), StatusCode::kAborted) << "rank " << r << ": " << after[r].ToString();
    EXPECT_EQ(after[r].message(), "rank 0 aborted: Internal: disk on fire");
  }
}

TEST_P(CollectiveTest, InvalidRootFails) {
  std::vector<Status> statuses = RunOn(GetParam(), [&](Comm& comm) {
    Bytes data;
    return comm.Broadcast(&data, n());
  });
  // Every rank fails: on its own check, or through the abort of the first rank that failed.
  int invalid = 0;
  for (const Status& s : statuses) {
    EXPECT_TRUE(s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kAborted)
        << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("Broadcast: root " + std::to_string(n()) +
                                       " is not a rank of a communicator of size"));
    invalid += s.code() == StatusCode::kInvalidArgument;
  }
  EXPECT_GE(invalid, 1);
}

TEST_P(CollectiveTest, ScatterWithWrongCountFailsEverywhere) {
  std::vector<Status> statuses = RunOn(GetParam(), [&](Comm& comm) {
    std::vector<Bytes> send(n() + 1);
    Bytes got;
    return comm.Scatter(send, &got, 0);
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << statuses[0].ToString();
  for (int r = 1; r < n(); ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_THAT(statuses[r].message(), HasSubstr("Scatter: the root passed"));
  }
}

std::vector<CommKind> AllKinds() {
  return {{"Single", 1, true},
          {"Local1", 1, false},
          {"Local2", 2, false},
          {"Local3", 3, false},
          {"Local8", 8, false}};
}

std::vector<CommKind> KindsOfAtLeast(int ranks) {
  std::vector<CommKind> kinds;
  for (const CommKind& kind : AllKinds()) {
    if (kind.num_ranks >= ranks) kinds.push_back(kind);
  }
  return kinds;
}

INSTANTIATE_TEST_SUITE_P(Comms, CollectiveTest, ::testing::ValuesIn(AllKinds()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Comms, CollectiveOfThreeOrMoreTest, ::testing::ValuesIn(KindsOfAtLeast(3)),
                         [](const auto& info) { return info.param.name; });

// ---- LocalComm only --------------------------------------------------------------------

class LocalCommTest : public ::testing::TestWithParam<int> {
 protected:
  int n() const { return GetParam(); }
};

// Tests of how ranks affect their peers: two ranks or more (instantiated below).
class LocalCommPeersTest : public LocalCommTest {};

TEST_P(LocalCommPeersTest, AllReduceLengthMismatchFailsEverywhere) {
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) {
    std::vector<int64_t> v(comm.rank() == 1 ? 3 : 2, 1);
    return comm.AllReduce(v, ReduceOp::kSum);
  });
  for (int r = 0; r < n(); ++r) {
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
    EXPECT_THAT(statuses[r].message(), HasSubstr("rank 1 passed 3 values")) << "rank " << r;
  }
}

// A rank returns without calling the collective its peers are in: they fail fast.
TEST_P(LocalCommPeersTest, RankReturningEarlyFailsPeersQuickly) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = RunLocalRanks(
      n(),
      [&](Comm& comm) -> Status {
        if (comm.rank() == 1) return Status::Ok();
        TESSERA_RETURN_IF_ERROR(comm.Barrier());
        std::vector<int64_t> v = {1};
        return comm.AllReduce(v, ReduceOp::kSum);
      },
      LocalCommOptions{.timeout = kShortTimeout});
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
  EXPECT_TRUE(statuses[1].ok());
  for (int r = 0; r < n(); ++r) {
    if (r == 1) continue;
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
  }
  EXPECT_FALSE(FirstError(statuses).ok());
}

// A rank that stays alive but never calls the collective: its peers time out.
TEST_P(LocalCommPeersTest, SilentRankTimesOutPeers) {
  auto comms = NewLocalComms(n(), LocalCommOptions{.timeout = kShortTimeout});
  std::vector<Status> statuses(n());
  std::latch others_done(n() - 1);
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < n(); ++r) {
    threads.emplace_back([&, r] {
      if (r == 1) {
        others_done.wait();
        statuses[r] = comms[r]->Barrier();  // the group is aborted by now: fails at once
        return;
      }
      statuses[r] = comms[r]->Barrier();
      others_done.count_down();
    });
  }
  for (auto& t : threads) t.join();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, kShortTimeout);
  EXPECT_LT(elapsed, milliseconds(2000));
  // Issue 11, item 10: every waiting rank returns the same kDeadlineExceeded, naming the rank
  // that never came; so does that rank when it finally calls a collective.
  for (int r = 0; r < n(); ++r) {
    const Status& s = statuses[r];
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << "rank " << r << ": " << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("gave up after waiting 200 ms for rank 1 to enter it "
                                       "(collective #0 of this communicator)"));
    EXPECT_EQ(s.message(), statuses[0].message());
  }
}

TEST(LocalCommTimeoutTest, TimeoutNamesRankCollectiveAndPeer) {
  auto comms = NewLocalComms(2, LocalCommOptions{.timeout = kShortTimeout});
  std::vector<Bytes> got;
  Status s = comms[0]->Gather(Bytes{1}, &got, 0);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_EQ(s.message(),
            "Gather on rank 0 gave up after waiting 200 ms for rank 1 to enter it (collective "
            "#0 of this communicator)");
  // The timeout aborted the group: rank 1 learns of it at once.
  Status other = comms[1]->Barrier();
  EXPECT_EQ(other.code(), s.code());
  EXPECT_EQ(other.message(), s.message());
}

// Issue 11, item 10: the ranks named are those that never entered the collective, not the
// peer a rank happened to wait for (in a tree, a rank waits for its parent, which waits for
// the missing ones).
TEST(LocalCommTimeoutTest, TimeoutNamesEveryRankThatNeverCame) {
  auto comms = NewLocalComms(5, LocalCommOptions{.timeout = kShortTimeout});
  std::vector<Status> statuses(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      std::vector<int64_t> v = {r};
      EXPECT_TRUE(comms[r]->Barrier().ok());
      statuses[r] = comms[r]->AllReduce(v, ReduceOp::kSum);
    });
  }
  // Ranks 3 and 4 pass the first barrier with the others, then stop calling collectives.
  std::thread late([&] {
    std::thread t3([&] { EXPECT_TRUE(comms[3]->Barrier().ok()); });
    EXPECT_TRUE(comms[4]->Barrier().ok());
    t3.join();
  });
  late.join();
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kDeadlineExceeded) << statuses[r].ToString();
    EXPECT_THAT(statuses[r].message(),
                HasSubstr("for ranks 3, 4 to enter it (collective #1 of this communicator)"));
  }
}

TEST(LocalCommLeaveTest, DestroyedPeerFailsWaitersWithoutTimeout) {
  auto comms = NewLocalComms(2, LocalCommOptions{.timeout = kLongTimeout});
  const auto start = std::chrono::steady_clock::now();
  comms[1].reset();
  Bytes data;
  Status s = comms[0]->Broadcast(&data, 1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("Broadcast on rank 0: rank 1 left the communicator"));
}

TEST(LocalCommLeaveTest, MessagesSentBeforeLeavingStillArrive) {
  auto comms = NewLocalComms(2, LocalCommOptions{.timeout = kLongTimeout});
  Bytes mine;
  ASSERT_TRUE(comms[1]->Scatter({Bytes{1}, Bytes{2, 3}}, &mine, 1).ok());
  comms[1].reset();  // a root that sent everything may leave
  Bytes got;
  Status s = comms[0]->Scatter({}, &got, 1);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(got, Bytes{1});
  EXPECT_EQ(mine, (Bytes{2, 3}));
}

// Abort reaches ranks already blocked in a collective, promptly, with the default timeout.
TEST_P(LocalCommPeersTest, AbortWakesBlockedPeers) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) -> Status {
    if (comm.rank() == n() - 1) {
      std::this_thread::sleep_for(milliseconds(50));  // let the others block first
      comm.Abort(IOError("lost the storage"));
      return Status::Ok();
    }
    return comm.Barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
  const std::string want =
      "rank " + std::to_string(n() - 1) + " aborted: IOError: lost the storage";
  for (int r = 0; r < n() - 1; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_EQ(statuses[r].message(), want);
  }
}

// When a rank's fn fails, RunLocalRanks makes it leave, so peers blocked in a collective
// waiting for it return its error instead of waiting for the timeout.
TEST_P(LocalCommPeersTest, FailingRankAbortsPeers) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) -> Status {
    if (comm.rank() == 0) {
      std::this_thread::sleep_for(milliseconds(30));  // let the others block first
      return InvalidArgument("bad shape for key w");
    }
    return comm.Barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
  EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument);
  for (int r = 1; r < n(); ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_THAT(statuses[r].message(),
                HasSubstr("rank 0 left the communicator (destroyed its Comm) without taking part "
                          "after failing: InvalidArgument: bad shape for key w"));
  }
  Status first = FirstError(statuses);
  EXPECT_EQ(first.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(first.message(), "rank 0: bad shape for key w");
}

// Aborting a communicator reaches ranks blocked in communicators split from it.
TEST_P(LocalCommPeersTest, ParentAbortReachesChild) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) -> Status {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> child, comm.Split(0, comm.rank()));
    if (comm.rank() == 0) {
      std::this_thread::sleep_for(milliseconds(30));  // let the others block in the child
      comm.Abort(Internal("parent gave up"));
      Status s = child->Barrier();
      CHECK_OR_RETURN(s.code() == StatusCode::kAborted, s.ToString());
      return Status::Ok();
    }
    return child->Barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].ToString();
  for (int r = 1; r < n(); ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_EQ(statuses[r].message(), "rank 0 aborted: Internal: parent gave up");
  }
}

TEST_P(LocalCommTest, AbortingChildLeavesParentUsable) {
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) -> Status {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> child, comm.Split(0, 0));
    if (comm.rank() == 0) child->Abort(Internal("child only"));
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    Status s = child->Barrier();
    CHECK_OR_RETURN(s.code() == StatusCode::kAborted, s.ToString());
    std::vector<int64_t> v = {1};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kSum));
    CHECK_OR_RETURN(v[0] == n(), "");
    return Status::Ok();
  });
  ExpectAllOk(statuses, n());
}

TEST_P(LocalCommTest, RunLocalRanksRunsEveryRankOnItsOwnThread) {
  std::vector<std::thread::id> ids(n());
  std::vector<Status> statuses = RunLocalRanks(n(), [&](Comm& comm) {
    ids[comm.rank()] = std::this_thread::get_id();
    return comm.Barrier();
  });
  ExpectAllOk(statuses, n());
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(std::unique(ids.begin(), ids.end()), ids.end());
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCommTest, ::testing::Values(1, 2, 3, 8));
INSTANTIATE_TEST_SUITE_P(Ranks, LocalCommPeersTest, ::testing::Values(2, 3, 8));

TEST(LocalCommMiscTest, ZeroRanks) {
  EXPECT_TRUE(NewLocalComms(0).empty());
  EXPECT_TRUE(RunLocalRanks(0, [](Comm&) { return Status::Ok(); }).empty());
}

TEST(FirstErrorTest, ReturnsLowestFailingRankWithPrefix) {
  EXPECT_TRUE(FirstError({}).ok());
  EXPECT_TRUE(FirstError({Status::Ok(), Status::Ok()}).ok());
  Status s = FirstError({Status::Ok(), NotFound("x"), Internal("y")});
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "rank 1: x");
}

TEST(SingleRankCommTest, Basics) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  Bytes data = {1, 2};
  EXPECT_EQ(comm->Broadcast(&data, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm->Scatter({}, &data, 0).code(), StatusCode::kInvalidArgument);
  auto child = comm->Split(3, 4);
  ASSERT_TRUE(child.ok());
  EXPECT_EQ((*child)->size(), 1);
  comm->Abort(Internal("why"));
  comm->Abort(Internal("second abort is ignored"));
  Status s = comm->Barrier();
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(), "rank 0 aborted: Internal: why");
  // The child is independent.
  EXPECT_TRUE((*child)->Barrier().ok());
}

}  // namespace
}  // namespace tessera
