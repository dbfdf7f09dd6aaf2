// The Comm conformance suite (tessera/testing/comm_suite.h) on the single-rank Comm and on
// LocalComm at several rank counts; then LocalComm's own: timeouts, aborts of ranks blocked in a
// collective, ranks that leave, RunLocalRanks.
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
#include "tessera/testing/comm_suite.h"

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

void ExpectAllOk(const std::vector<Status>& statuses, int num_ranks) {
  ASSERT_EQ(statuses.size(), static_cast<size_t>(num_ranks));
  EXPECT_TRUE(FirstError(statuses).ok()) << FirstError(statuses).ToString();
}

// ---- the conformance suite (tessera/testing/comm_suite.h) -----------------------------------

using testing::CommSuiteTraits;
using testing::LocalCommSuiteRunner;
using testing::SingleRankCommSuiteRunner;

TESSERA_INSTANTIATE_COMM_SUITE(Single, std::make_shared<SingleRankCommSuiteRunner>(),
                               CommSuiteTraits{});
TESSERA_INSTANTIATE_COMM_SUITE(Local1, std::make_shared<LocalCommSuiteRunner>(1, kLongTimeout),
                               CommSuiteTraits{});
TESSERA_INSTANTIATE_COMM_SUITE(Local2, std::make_shared<LocalCommSuiteRunner>(2, kLongTimeout),
                               CommSuiteTraits{});
TESSERA_INSTANTIATE_COMM_SUITE(Local3, std::make_shared<LocalCommSuiteRunner>(3, kLongTimeout),
                               CommSuiteTraits{});
TESSERA_INSTANTIATE_COMM_SUITE(Local8, std::make_shared<LocalCommSuiteRunner>(8, kLongTimeout),
                               CommSuiteTraits{});

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
  auto child = comm->Split(3, 4);
  ASSERT_TRUE(child.ok());
  EXPECT_EQ((*child)->size(), 1);
  comm->Abort(Internal("why"));
  comm->Abort(Internal("second abort is ignored"));
  Status s = comm->Barrier();
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(), "rank 0 aborted: Internal: why");
  // A child is aborted with its parent, as with every Comm.
  EXPECT_EQ((*child)->Barrier().message(), "rank 0 aborted: Internal: why");
}

// An argument error aborts the communicator and those split from it, as with every Comm; the
// communicator it was split from goes on.
TEST(SingleRankCommTest, ArgumentErrorsAbortTheCommunicator) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  auto child = comm->Split(0, 0);
  ASSERT_TRUE(child.ok());
  auto grandchild = (*child)->Split(0, 0);
  ASSERT_TRUE(grandchild.ok());
  Bytes data = {1, 2};
  const Status bad = (*child)->Broadcast(&data, 1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "Broadcast on rank 0: root 1 is not a rank of a communicator of size 1");
  EXPECT_EQ((*child)->Scatter({}, &data, 0).message(),
            "rank 0 aborted: InvalidArgument: " + bad.message());
  EXPECT_EQ((*grandchild)->Barrier().code(), StatusCode::kAborted);
  EXPECT_TRUE(comm->Barrier().ok());  // the parent of an aborted communicator goes on
}

TEST(AgreeOnStatusTest, EveryRankGetsTheFailingRanksDetail) {
  const StatusDetail sent{.kind = StatusDetail::Kind::kCorruption,
                          .keys = {"w", "b"},
                          .options = {"LoadOptions::verify_checksums"},
                          .advice = "look",
                          .file = "/c/tsr-0.safetensors",
                          .offset = 4096};
  std::vector<Status> agreed(3);
  std::vector<Status> returned = RunLocalRanks(3, [&](Comm& comm) {
    const Status local =
        comm.rank() == 1 ? DataLoss("checksum mismatch").WithDetail(sent) : Status::Ok();
    agreed[comm.rank()] = AgreeOnStatus(comm, local);
    return Status::Ok();
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(returned[r].ok()) << returned[r].ToString();
    EXPECT_EQ(agreed[r].code(), StatusCode::kDataLoss);
    EXPECT_EQ(agreed[r].message(), "rank 1: checksum mismatch (1 of 3 ranks failed)");
    const StatusDetail* got = agreed[r].detail();
    ASSERT_NE(got, nullptr) << "rank " << r;
    EXPECT_EQ(got->kind, sent.kind);
    EXPECT_EQ(got->keys, sent.keys);
    EXPECT_EQ(got->options, sent.options);
    EXPECT_EQ(got->advice, sent.advice);
    EXPECT_EQ(got->file, sent.file);
    EXPECT_EQ(got->offset, sent.offset);
  }
}

}  // namespace
}  // namespace tessera
