// The collective tests of src/comm/comm_test.cc, over MPI, plus MPI-only ones (isolation from
// the caller's communicator, large buffers, Abort semantics without a timeout).
//
// One program started by mpirun: every rank runs every test, in the same order. Inside a test,
// each rank runs the test body against its own Comm; checks use EXPECT_* (which never return
// early), so every rank keeps calling the same collectives even after a check failed. Rank 0
// prints gtest's usual output; other ranks print only their failures, prefixed with their rank.
// After each test the ranks agree on whether any of them failed, and rank 0 fails the test
// naming those ranks; the exit code is non-zero on every rank if any rank failed.
//
//   mpirun -np 4 tessera_mpi_comm_test [--thread-level=serialized] [gtest flags]
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mpi/mpi_internal.h"
#include "tessera/comm.h"
#include "tessera/mpi_comm.h"
#include "tessera/status.h"
#include "testing/test_util.h"

// ---- call accounting through the MPI profiling interface ------------------------------------
//
// These definitions take the place of libmpi's for every call in this program, tessera_mpi's
// included, and forward to the PMPI_ entry points. They record, per function, how many calls
// were made and the most bytes one call moved on this rank, so tests can check the chunking.
namespace mpi_calls {

struct Stats {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> max_bytes{0};
};
enum Fn { kIbcast, kIgatherv, kIallgatherv, kIscatterv, kIallreduce, kNumFns };
Stats g_stats[kNumFns];

void Reset() {
  for (Stats& s : g_stats) s.calls = 0, s.max_bytes = 0;
}

int64_t Bytes(int64_t count, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  return count * size;
}

int64_t Sum(const int counts[], MPI_Comm comm) {
  int n = 0;
  PMPI_Comm_size(comm, &n);
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += counts[i];
  return total;
}

bool IsRoot(int root, MPI_Comm comm) {
  int rank = -1;
  PMPI_Comm_rank(comm, &rank);
  return rank == root;
}

void Record(Fn fn, int64_t bytes) {
  Stats& s = g_stats[fn];
  ++s.calls;
  int64_t seen = s.max_bytes.load();
  while (bytes > seen && !s.max_bytes.compare_exchange_weak(seen, bytes)) {
  }
}

}  // namespace mpi_calls

extern "C" {

int MPI_Ibcast(void* buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm,
               MPI_Request* request) {
  mpi_calls::Record(mpi_calls::kIbcast, mpi_calls::Bytes(count, datatype));
  return PMPI_Ibcast(buffer, count, datatype, root, comm, request);
}

int MPI_Igatherv(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf,
                 const int recvcounts[], const int displs[], MPI_Datatype recvtype, int root,
                 MPI_Comm comm, MPI_Request* request) {
  mpi_calls::Record(mpi_calls::kIgatherv,
                    mpi_calls::IsRoot(root, comm)
                        ? mpi_calls::Bytes(mpi_calls::Sum(recvcounts, comm), recvtype)
                        : mpi_calls::Bytes(sendcount, sendtype));
  return PMPI_Igatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, root,
                       comm, request);
}

int MPI_Iallgatherv(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf,
                    const int recvcounts[], const int displs[], MPI_Datatype recvtype,
                    MPI_Comm comm, MPI_Request* request) {
  mpi_calls::Record(mpi_calls::kIallgatherv,
                    mpi_calls::Bytes(mpi_calls::Sum(recvcounts, comm), recvtype));
  return PMPI_Iallgatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm,
                          request);
}

int MPI_Iscatterv(const void* sendbuf, const int sendcounts[], const int displs[],
                  MPI_Datatype sendtype, void* recvbuf, int recvcount, MPI_Datatype recvtype,
                  int root, MPI_Comm comm, MPI_Request* request) {
  mpi_calls::Record(mpi_calls::kIscatterv,
                    mpi_calls::IsRoot(root, comm)
                        ? mpi_calls::Bytes(mpi_calls::Sum(sendcounts, comm), sendtype)
                        : mpi_calls::Bytes(recvcount, recvtype));
  return PMPI_Iscatterv(sendbuf, sendcounts, displs, sendtype, recvbuf, recvcount, recvtype, root,
                        comm, request);
}

int MPI_Iallreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype, MPI_Op op,
                   MPI_Comm comm, MPI_Request* request) {
  mpi_calls::Record(mpi_calls::kIallreduce, mpi_calls::Bytes(count, datatype));
  return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
}

}  // extern "C"

namespace tessera {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;
using ::testing::StartsWith;

int WorldRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int WorldSize() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// `n` bytes that depend on `seed`, so buffers from different ranks and rounds differ.
Bytes Pattern(int seed, size_t n) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed * 131 + i * 7 + 1);
  return out;
}

std::string Str(const Bytes& b) { return "[" + std::to_string(b.size()) + " bytes]"; }

// Every test derives from this: after the test, the ranks agree on who failed.
class MpiTest : public ::testing::Test {
 protected:
  void TearDown() override {
    int failed = HasFailure() ? 1 : 0;
    std::vector<int> all(WorldSize());
    MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::string ranks;
    for (size_t r = 1; r < all.size(); ++r) {
      if (all[r]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    if (WorldRank() == 0 && !ranks.empty()) {
      ADD_FAILURE() << "failed on rank(s) " << ranks << " (their messages are on stderr)";
    }
  }
};

// ---- the collective tests, for several kinds of communicator -----------------------------------

struct CommKind {
  std::string name;
  enum Group { kWorld, kSelf, kAllButLast } group;
  int64_t max_message_bytes;
};

void PrintTo(const CommKind& kind, std::ostream* os) { *os << kind.name; }

// The size of the communicator a kind makes (the same on every rank, members or not). Known once
// MPI is initialised: main() calls MPI_Init before InitGoogleTest evaluates the instantiations.
int SizeOf(const CommKind& kind) {
  switch (kind.group) {
    case CommKind::kWorld:
      return WorldSize();
    case CommKind::kSelf:
      return 1;
    case CommKind::kAllButLast:
      return std::max(1, WorldSize() - 1);
  }
  return 0;
}

class CollectiveTest : public MpiTest, public ::testing::WithParamInterface<CommKind> {
 protected:
  void SetUp() override {
    const CommKind& kind = GetParam();
    MPI_Comm base = MPI_COMM_WORLD;
    MPI_Comm sub = MPI_COMM_NULL;
    if (kind.group == CommKind::kSelf) base = MPI_COMM_SELF;
    if (kind.group == CommKind::kAllButLast) {
      const bool in = WorldSize() == 1 || WorldRank() < WorldSize() - 1;
      MPI_Comm_split(MPI_COMM_WORLD, in ? 0 : MPI_UNDEFINED, WorldRank(), &sub);
      base = sub;
    }
    if (base != MPI_COMM_NULL) {
      Result<std::unique_ptr<Comm>> comm =
          NewMpiComm(base, MpiCommOptions{.max_message_bytes = kind.max_message_bytes});
      ASSERT_TRUE(comm.ok()) << comm.status().ToString();
      comm_ = std::move(*comm);
    }
    // The Comm holds its own duplicate: the caller may free its communicator at once.
    if (sub != MPI_COMM_NULL) MPI_Comm_free(&sub);
  }

  // The size of the communicator under test (the same on every rank, members or not).
  int n() const { return SizeOf(GetParam()); }

  // Runs fn on every member of the communicator under test; other ranks wait in TearDown.
  void Run(const std::function<void(Comm&)>& fn) {
    if (comm_) fn(*comm_);
  }

  std::unique_ptr<Comm> comm_;
};

TEST_P(CollectiveTest, RankAndSize) {
  Run([&](Comm& comm) {
    EXPECT_EQ(comm.size(), n());
    EXPECT_GE(comm.rank(), 0);
    EXPECT_LT(comm.rank(), n());
    std::vector<Bytes> all;
    EXPECT_OK(comm.AllGather(Bytes{static_cast<uint8_t>(comm.rank())}, &all));
    ASSERT_EQ(all.size(), static_cast<size_t>(n()));
    for (int r = 0; r < n(); ++r) EXPECT_EQ(all[r], Bytes{static_cast<uint8_t>(r)});
  });
}

// Ranks are processes: instead of counting arrivals in shared memory, one rank arrives late
// and the others must wait for it.
TEST_P(CollectiveTest, BarrierWaitsForEveryRank) {
  Run([&](Comm& comm) {
    constexpr milliseconds kLate{60};
    for (int round = 0; round < 3; ++round) {
      EXPECT_OK(comm.Barrier());  // start together
      const bool late = comm.rank() == round % n();
      if (late) std::this_thread::sleep_for(kLate);
      const auto start = std::chrono::steady_clock::now();
      EXPECT_OK(comm.Barrier());
      const auto waited = std::chrono::steady_clock::now() - start;
      if (!late) {
        EXPECT_GE(waited, kLate / 2)
            << "round " << round << ": left before rank " << round % n() << " arrived";
      }
    }
  });
}

TEST_P(CollectiveTest, BroadcastFromEveryRootWithVariousSizes) {
  Run([&](Comm& comm) {
    for (size_t len : {size_t{0}, size_t{1}, size_t{1000}, size_t{1} << 20}) {
      for (int root = 0; root < n(); ++root) {
        const Bytes expected = Pattern(root + static_cast<int>(len), len);
        Bytes data = comm.rank() == root ? expected : Pattern(99, 7);
        EXPECT_OK(comm.Broadcast(&data, root));
        EXPECT_TRUE(data == expected) << "root " << root << " got " << Str(data);
      }
    }
  });
}

TEST_P(CollectiveTest, GatherToEveryRoot) {
  Run([&](Comm& comm) {
    for (int root = 0; root < n(); ++root) {
      // Rank r sends 3*r bytes (rank 0's buffer is empty), and rank 1 sends 3000 more.
      const size_t len = 3 * comm.rank() + (comm.rank() == 1 ? 3000 : 0);
      const Bytes send = Pattern(comm.rank() + root, len);
      const bool is_root = comm.rank() == root;
      std::vector<Bytes> received = {Pattern(5, 5)};
      EXPECT_OK(comm.Gather(send, &received, root));
      if (!is_root) {
        EXPECT_EQ(received, std::vector<Bytes>{Pattern(5, 5)}) << "non-root touched";
      }
      // A null `received` is fine off the root.
      EXPECT_OK(comm.Gather(send, is_root ? &received : nullptr, root));
      if (is_root) {
        ASSERT_EQ(received.size(), static_cast<size_t>(n()));
        for (int r = 0; r < n(); ++r) {
          EXPECT_TRUE(received[r] == Pattern(r + root, 3 * r + (r == 1 ? 3000 : 0)))
              << "entry " << r << " " << Str(received[r]);
        }
      }
    }
  });
}

TEST_P(CollectiveTest, AllGatherVariableSizes) {
  Run([&](Comm& comm) {
    for (int round = 0; round < 3; ++round) {
      auto len = [&](int r) -> size_t { return (r + round) % 3 == 0 ? 0 : 1000 * r + round; };
      const int r = comm.rank();
      std::vector<Bytes> received;
      EXPECT_OK(comm.AllGather(Pattern(r * 10 + round, len(r)), &received));
      ASSERT_EQ(received.size(), static_cast<size_t>(n()));
      for (int p = 0; p < n(); ++p) {
        EXPECT_TRUE(received[p] == Pattern(p * 10 + round, len(p)))
            << "entry " << p << " " << Str(received[p]);
      }
    }
  });
}

TEST_P(CollectiveTest, AllGatherAllEmpty) {
  Run([&](Comm& comm) {
    std::vector<Bytes> received = {Bytes{1}};
    EXPECT_OK(comm.AllGather(Bytes{}, &received));
    EXPECT_EQ(received, std::vector<Bytes>(n()));
  });
}

TEST_P(CollectiveTest, ScatterFromEveryRoot) {
  Run([&](Comm& comm) {
    for (int root = 0; root < n(); ++root) {
      auto len = [&](int r) -> size_t { return r + root + (r == n() - 1 ? 5000 : 0); };
      std::vector<Bytes> send;
      if (comm.rank() == root) {
        for (int r = 0; r < n(); ++r) send.push_back(Pattern(r * 7 + root, len(r)));
      }
      Bytes received = Pattern(1, 3);
      EXPECT_OK(comm.Scatter(send, &received, root));
      const Bytes want = Pattern(comm.rank() * 7 + root, len(comm.rank()));
      EXPECT_TRUE(received == want) << "root " << root << " got " << Str(received);
    }
  });
}

TEST_P(CollectiveTest, AllReduceOps) {
  Run([&](Comm& comm) {
    const int64_t r = comm.rank();
    EXPECT_OK(comm.AllReduce({}, ReduceOp::kSum));  // empty spans are allowed

    std::vector<int64_t> v = {r, -r, 1, r * r, int64_t{1} << 40};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
    const int64_t nn = n();
    const std::vector<int64_t> sum = {nn * (nn - 1) / 2, -nn * (nn - 1) / 2, nn,
                                      (nn - 1) * nn * (2 * nn - 1) / 6, nn << 40};
    EXPECT_EQ(v, sum);

    v = {r, -r, 5 - r};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kMin));
    EXPECT_EQ(v, (std::vector<int64_t>{0, -(nn - 1), 5 - (nn - 1)}));

    v = {r, -r, 5 - r};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kMax));
    EXPECT_EQ(v, (std::vector<int64_t>{nn - 1, 0, 5}));

    // A sum wraps around instead of being undefined.
    v = {INT64_MAX};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
    EXPECT_EQ(v[0], static_cast<int64_t>(static_cast<uint64_t>(INT64_MAX) * nn));
  });
}

// Long enough to take several MPI calls under the small-chunk kinds.
TEST_P(CollectiveTest, AllReduceLongSpan) {
  Run([&](Comm& comm) {
    std::vector<int64_t> v(10'007);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i) * (comm.rank() + 1);
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
    const int64_t factor = int64_t{n()} * (n() + 1) / 2;
    size_t bad = 0;
    for (size_t i = 0; i < v.size(); ++i) bad += v[i] != static_cast<int64_t>(i) * factor;
    EXPECT_EQ(bad, 0u);
  });
}

// Many collectives back to back with moving roots and no barriers between them.
TEST_P(CollectiveTest, ManyCollectivesInARowStaySeparate) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    for (int i = 0; i < 300; ++i) {
      const int root = (i * 5 + 1) % n();
      if (me == (i % n()) && i % 37 == 0) std::this_thread::sleep_for(milliseconds(2));
      switch (i % 4) {
        case 0: {
          Bytes data = me == root ? Pattern(i, i % 17) : Bytes{};
          EXPECT_OK(comm.Broadcast(&data, root));
          EXPECT_EQ(data, Pattern(i, i % 17)) << "broadcast " << i;
          break;
        }
        case 1: {
          std::vector<Bytes> send;
          if (me == root) {
            for (int r = 0; r < n(); ++r) send.push_back(Pattern(i + r, r % 3));
          }
          Bytes got;
          EXPECT_OK(comm.Scatter(send, &got, root));
          EXPECT_EQ(got, Pattern(i + me, me % 3)) << "scatter " << i;
          break;
        }
        case 2: {
          std::vector<Bytes> got;
          EXPECT_OK(comm.Gather(Pattern(i * me, 2), &got, root));
          if (me == root) {
            ASSERT_EQ(got.size(), static_cast<size_t>(n()));
            for (int r = 0; r < n(); ++r) EXPECT_EQ(got[r], Pattern(i * r, 2)) << "gather " << i;
          }
          break;
        }
        case 3: {
          std::vector<int64_t> v = {i + me};
          EXPECT_OK(comm.AllReduce(v, ReduceOp::kMax));
          EXPECT_EQ(v[0], i + n() - 1) << "allreduce " << i;
          break;
        }
      }
    }
  });
}

TEST_P(CollectiveTest, SplitByParityWithReversedKeys) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    Result<std::unique_ptr<Comm>> child = comm.Split(me % 2, -me);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    // Same color: same parity. Keys reverse the order: the highest old rank is child rank 0.
    std::vector<int> members;
    for (int r = n() - 1; r >= 0; --r) {
      if (r % 2 == me % 2) members.push_back(r);
    }
    EXPECT_EQ((*child)->size(), static_cast<int>(members.size()));
    const int want_rank =
        static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
    EXPECT_EQ((*child)->rank(), want_rank);

    std::vector<Bytes> all;
    EXPECT_OK((*child)->AllGather(Bytes{static_cast<uint8_t>(me)}, &all));
    ASSERT_EQ(all.size(), members.size());
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_EQ(all[i], Bytes{static_cast<uint8_t>(members[i])}) << i;
    }
    // The parent still works after the split.
    std::vector<int64_t> v = {1};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
    EXPECT_EQ(v[0], n());
  });
}

TEST_P(CollectiveTest, SplitTiesKeepOldOrderAndNestedSplit) {
  Run([&](Comm& comm) {
    Result<std::unique_ptr<Comm>> same = comm.Split(7, 0);
    ASSERT_TRUE(same.ok()) << same.status().ToString();
    EXPECT_EQ((*same)->size(), n());
    EXPECT_EQ((*same)->rank(), comm.rank());
    // Split of a split: every rank alone.
    Result<std::unique_ptr<Comm>> alone = (*same)->Split((*same)->rank(), 0);
    ASSERT_TRUE(alone.ok()) << alone.status().ToString();
    EXPECT_EQ((*alone)->size(), 1);
    EXPECT_EQ((*alone)->rank(), 0);
    Bytes data = {1, 2, 3};
    EXPECT_OK((*alone)->Broadcast(&data, 0));
    EXPECT_OK((*same)->Barrier());
    EXPECT_EQ(data, (Bytes{1, 2, 3}));
  });
}

// MPI colors must be non-negative; the Comm contract allows any int.
TEST_P(CollectiveTest, SplitWithNegativeColors) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    const int color = me % 2 == 0 ? INT_MIN : -1;
    Result<std::unique_ptr<Comm>> child = comm.Split(color, me);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    EXPECT_EQ((*child)->size(), (n() + (me % 2 == 0 ? 1 : 0)) / 2);
    EXPECT_EQ((*child)->rank(), me / 2);
    std::vector<int64_t> v = {me};
    EXPECT_OK((*child)->AllReduce(v, ReduceOp::kMax));
    const int last = n() - 1;
    EXPECT_EQ(v[0], last % 2 == me % 2 ? last : last - 1);
  });
}

// Parent and child used at the same time from two threads of each rank.
TEST_P(CollectiveTest, ParentAndChildConcurrently) {
  Run([&](Comm& comm) {
    const int me = comm.rank();
    Result<std::unique_ptr<Comm>> split = comm.Split(me % 3, me);
    ASSERT_TRUE(split.ok()) << split.status().ToString();
    Comm& child = **split;
    const int child_size = child.size();
    std::thread other([&] {
      for (int i = 0; i < 100; ++i) {
        std::vector<int64_t> v = {1, i};
        EXPECT_OK(child.AllReduce(v, ReduceOp::kSum));
        EXPECT_TRUE(v[0] == child_size && v[1] == int64_t{i} * child_size) << "child " << i;
        Bytes data = child.rank() == i % child_size ? Pattern(i, 3) : Bytes{};
        EXPECT_OK(child.Broadcast(&data, i % child_size));
        EXPECT_EQ(data, Pattern(i, 3)) << "child broadcast " << i;
      }
    });
    for (int i = 0; i < 100; ++i) {
      std::vector<int64_t> v = {2, -i};
      EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
      EXPECT_TRUE(v[0] == 2 * n() && v[1] == -int64_t{i} * n()) << "parent " << i;
      Bytes data = me == i % n() ? Pattern(-i, 4) : Bytes{};
      EXPECT_OK(comm.Broadcast(&data, i % n()));
      EXPECT_EQ(data, Pattern(-i, 4)) << "parent broadcast " << i;
    }
    other.join();
  });
}

TEST_P(CollectiveTest, AgreeOnStatusAllOk) {
  Run([&](Comm& comm) { EXPECT_OK(AgreeOnStatus(comm, Status::Ok())); });
}

TEST_P(CollectiveTest, AgreeOnStatusOneFailure) {
  Run([&](Comm& comm) {
    const int failing = n() - 1;
    Status local = comm.rank() == failing ? NotFound("no such key: w") : Status::Ok();
    Status agreed = AgreeOnStatus(comm, local);
    EXPECT_EQ(agreed.code(), StatusCode::kNotFound);
    EXPECT_EQ(agreed.message(), n() == 1 ? "no such key: w"
                                         : "rank " + std::to_string(failing) +
                                               ": no such key: w (1 of " + std::to_string(n()) +
                                               " ranks failed)");
  });
}

// Tests that need two ranks or more, or three (instantiated below for those kinds only).
class CollectiveOfTwoOrMoreTest : public CollectiveTest {};
class CollectiveOfThreeOrMoreTest : public CollectiveTest {};

TEST_P(CollectiveOfThreeOrMoreTest, AgreeOnStatusTwoFailuresNameTheLowest) {
  Run([&](Comm& comm) {
    Status local;
    if (comm.rank() == n() - 1) local = IOError("disk full");
    if (comm.rank() == 1) local = DataLoss("bad checksum");
    Status agreed = AgreeOnStatus(comm, local);
    EXPECT_EQ(agreed.code(), StatusCode::kDataLoss);
    EXPECT_EQ(agreed.message(),
              "rank 1: bad checksum (2 of " + std::to_string(n()) + " ranks failed)");
  });
}

// MPI cannot interrupt a peer's collective: the aborting rank tells its peers in its next
// collective, and from then on every collective fails at once on every rank.
TEST_P(CollectiveTest, AbortFailsLaterCollectives) {
  Run([&](Comm& comm) {
    EXPECT_OK(comm.Barrier());
    if (comm.rank() == 0) comm.Abort(Internal("disk on fire"));
    if (comm.rank() == 0) comm.Abort(Internal("a second abort is ignored"));
    const std::string want = "rank 0 aborted: Internal: disk on fire";
    Status after = comm.Barrier();
    EXPECT_EQ(after.code(), StatusCode::kAborted) << after.ToString();
    EXPECT_EQ(after.message(), want);
    Bytes data;
    Status broadcast = comm.Broadcast(&data, 0);
    EXPECT_EQ(broadcast.code(), StatusCode::kAborted) << broadcast.ToString();
    EXPECT_EQ(broadcast.message(), want);
    // AgreeOnStatus reports the failed AllGather.
    Status agreed = AgreeOnStatus(comm, Status::Ok());
    EXPECT_EQ(agreed.code(), StatusCode::kAborted) << agreed.ToString();
    auto split = comm.Split(0, 0);
    EXPECT_EQ(split.status().code(), StatusCode::kAborted) << split.status().ToString();
  });
}

TEST_P(CollectiveTest, InvalidRootFails) {
  Run([&](Comm& comm) {
    Bytes data;
    Status s = comm.Broadcast(&data, n());
    // Every rank checks the root itself.
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_EQ(s.message(), "Broadcast on rank " + std::to_string(comm.rank()) + ": root " +
                               std::to_string(n()) + " is not a rank of a communicator of size " +
                               std::to_string(n()));
    // The communicator is aborted for later collectives, as with LocalComm.
    Status later = comm.Barrier();
    EXPECT_EQ(later.code(), StatusCode::kAborted) << later.ToString();
    EXPECT_THAT(later.message(),
                StartsWith("rank 0 aborted: InvalidArgument: Broadcast on rank 0"));
  });
}

TEST_P(CollectiveTest, ScatterWithWrongCountFailsEverywhere) {
  Run([&](Comm& comm) {
    std::vector<Bytes> send(n() + 1);
    Bytes got;
    Status s = comm.Scatter(send, &got, 0);
    const std::string detail = "Scatter on rank 0: the root passed " + std::to_string(n() + 1) +
                               " buffers for " + std::to_string(n()) + " ranks";
    if (comm.rank() == 0) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_EQ(s.message(), detail);
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
      EXPECT_EQ(s.message(), "rank 0 aborted: InvalidArgument: " + detail);
    }
  });
}

TEST_P(CollectiveTest, NullOutputOnOneRankFailsEverywhere) {
  Run([&](Comm& comm) {
    const int bad = n() - 1;
    std::vector<Bytes> all;
    Status s = comm.AllGather(Bytes{1}, comm.rank() == bad ? nullptr : &all);
    EXPECT_EQ(s.code(), comm.rank() == bad ? StatusCode::kInvalidArgument : StatusCode::kAborted)
        << s.ToString();
    EXPECT_THAT(s.message(),
                HasSubstr("AllGather on rank " + std::to_string(bad) + ": received is null"));
  });
}

TEST_P(CollectiveOfTwoOrMoreTest, AllReduceLengthMismatchFailsEverywhere) {
  Run([&](Comm& comm) {
    std::vector<int64_t> v(comm.rank() == 1 ? 3 : 2, 1);
    Status s = comm.AllReduce(v, ReduceOp::kSum);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_EQ(s.message(), "AllReduce on rank " + std::to_string(comm.rank()) +
                               ": rank 1 passed 3 values, rank 0 passed 2");
    EXPECT_EQ(comm.Barrier().code(), StatusCode::kAborted);
  });
}

TEST_P(CollectiveOfTwoOrMoreTest, AllReduceOpMismatchFailsEverywhere) {
  Run([&](Comm& comm) {
    std::vector<int64_t> v = {1};
    Status s = comm.AllReduce(v, comm.rank() == 1 ? ReduceOp::kMax : ReduceOp::kSum);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("the ranks passed different ops, kSum and kMax"));
  });
}

// Collectives MPI would mismatch (a hang or undefined behaviour) fail on every rank instead.
TEST_P(CollectiveOfTwoOrMoreTest, DifferentCollectivesFailEverywhere) {
  Run([&](Comm& comm) {
    Status s;
    if (comm.rank() == 1) {
      s = comm.Barrier();
    } else {
      std::vector<Bytes> all;
      s = comm.AllGather(Bytes{1, 2}, &all);
    }
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_THAT(s.message(),
                HasSubstr("the ranks called different collectives at the same point: Barrier and "
                          "AllGather"));
  });
}

TEST_P(CollectiveOfTwoOrMoreTest, DifferentRootsFailEverywhere) {
  Run([&](Comm& comm) {
    Bytes data = {1};
    Status s = comm.Broadcast(&data, comm.rank() == 0 ? 1 : 0);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("the ranks passed different roots, 0 and 1"));
  });
}

// An abort of a parent reaches its children: a rank blocked in the child is released when the
// aborting rank enters its next collective on the child.
TEST_P(CollectiveOfTwoOrMoreTest, ParentAbortReachesChild) {
  Run([&](Comm& comm) {
    Result<std::unique_ptr<Comm>> child = comm.Split(0, comm.rank());
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    if (comm.rank() == 0) {
      std::this_thread::sleep_for(milliseconds(30));  // let the others block in the child
      comm.Abort(Internal("parent gave up"));
    }
    Status s = (*child)->Barrier();
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_EQ(s.message(), "rank 0 aborted: Internal: parent gave up");
  });
}

TEST_P(CollectiveTest, AbortingChildLeavesParentUsable) {
  Run([&](Comm& comm) {
    Result<std::unique_ptr<Comm>> child = comm.Split(0, 0);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    if (comm.rank() == 0) (*child)->Abort(Internal("child only"));
    EXPECT_OK(comm.Barrier());
    Status s = (*child)->Barrier();
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    std::vector<int64_t> v = {1};
    EXPECT_OK(comm.AllReduce(v, ReduceOp::kSum));
    EXPECT_EQ(v[0], n());
  });
}

// A child split after its parent agreed on an abort cannot exist; one split before is aborted
// with the parent.
TEST_P(CollectiveTest, AgreedParentAbortReachesExistingChild) {
  Run([&](Comm& comm) {
    Result<std::unique_ptr<Comm>> child = comm.Split(0, 0);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    if (comm.rank() == n() - 1) comm.Abort(IOError("lost the storage"));
    const std::string want =
        "rank " + std::to_string(n() - 1) + " aborted: IOError: lost the storage";
    EXPECT_EQ(comm.Barrier().message(), want);
    Status s = (*child)->Barrier();
    EXPECT_EQ(s.code(), StatusCode::kAborted);
    EXPECT_EQ(s.message(), want);
  });
}

std::vector<CommKind> AllKinds() {
  return {
      {"World", CommKind::kWorld, int64_t{1} << 30},
      // Tiny chunks: every Broadcast, Gather, AllGather, Scatter and AllReduce above takes
      // several rounds, with pieces that do not divide evenly.
      {"WorldSmallChunks", CommKind::kWorld, 1000},
      {"Self", CommKind::kSelf, int64_t{1} << 30},
      {"AllButLast", CommKind::kAllButLast, 999},
  };
}

std::vector<CommKind> KindsOfAtLeast(int ranks) {
  std::vector<CommKind> kinds;
  for (const CommKind& kind : AllKinds()) {
    if (SizeOf(kind) >= ranks) kinds.push_back(kind);
  }
  return kinds;
}

INSTANTIATE_TEST_SUITE_P(Mpi, CollectiveTest, ::testing::ValuesIn(AllKinds()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Mpi, CollectiveOfTwoOrMoreTest, ::testing::ValuesIn(KindsOfAtLeast(2)),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Mpi, CollectiveOfThreeOrMoreTest, ::testing::ValuesIn(KindsOfAtLeast(3)),
                         [](const auto& info) { return info.param.name; });

// ---- MPI only ------------------------------------------------------------------------------

class MpiCommTest : public MpiTest {};

// The caller's messages on its communicator are not disturbed by tessera's, even with
// overlapping tags and collectives in between.
TEST_F(MpiCommTest, TrafficIsIsolatedFromTheCallersCommunicator) {
  const int n = WorldSize();
  const int me = WorldRank();
  ASSERT_GE(n, 2) << "run under mpiexec with 2 ranks or more (ctest does)";
  Result<std::unique_ptr<Comm>> comm = NewMpiComm(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  // Every rank sends its right neighbour a message on MPI_COMM_WORLD before tessera's
  // collectives run, and receives it only after them.
  int out = 1000 + me, in = -1;
  MPI_Request send_request;
  MPI_Isend(&out, 1, MPI_INT, (me + 1) % n, /*tag=*/0, MPI_COMM_WORLD, &send_request);
  for (int root = 0; root < n; ++root) {
    Bytes data = me == root ? Pattern(root, 64) : Bytes{};
    EXPECT_OK((*comm)->Broadcast(&data, root));
    EXPECT_EQ(data, Pattern(root, 64));
    std::vector<Bytes> got;
    EXPECT_OK((*comm)->Gather(Bytes{static_cast<uint8_t>(me)}, &got, root));
  }
  MPI_Recv(&in, 1, MPI_INT, (me + n - 1) % n, /*tag=*/0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  MPI_Wait(&send_request, MPI_STATUS_IGNORE);
  EXPECT_EQ(in, 1000 + (me + n - 1) % n);
}

TEST_F(MpiCommTest, RejectsNullCommAndBadOptions) {
  Result<std::unique_ptr<Comm>> null = NewMpiComm(MPI_COMM_NULL);
  EXPECT_EQ(null.status().code(), StatusCode::kInvalidArgument) << null.status().ToString();
  Result<std::unique_ptr<Comm>> tiny = NewMpiComm(MPI_COMM_SELF, {.max_message_bytes = 7});
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument) << tiny.status().ToString();
  Result<std::unique_ptr<Comm>> huge =
      NewMpiComm(MPI_COMM_SELF, {.max_message_bytes = int64_t{INT_MAX} + 1});
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument) << huge.status().ToString();
}

// MPI is already initialised (by main): NewMpiWorldComm uses it and will not finalise it.
TEST_F(MpiCommTest, WorldCommUsesTheCallersMpi) {
  Result<std::unique_ptr<Comm>> comm = NewMpiWorldComm();
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ((*comm)->size(), WorldSize());
  EXPECT_EQ((*comm)->rank(), WorldRank());
  EXPECT_OK((*comm)->Barrier());
  EXPECT_FALSE(MpiInitializedByTessera());
  int provided = -1;
  MPI_Query_thread(&provided);
  EXPECT_EQ(MpiProvidedThreadLevel(), provided);
}

TEST_F(MpiCommTest, MpiErrorsBecomeStatuses) {
  Status s = mpi_internal::MpiErrorStatus(MPI_ERR_TRUNCATE, "MPI_Ibcast", "Broadcast", 3);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_THAT(s.message(), StartsWith("Broadcast on rank 3: MPI_Ibcast failed: MPI_ERR_TRUNCATE"));
  EXPECT_THAT(s.message(), HasSubstr("truncated"));
  s = mpi_internal::MpiErrorStatus(MPI_ERR_OTHER, "MPI_Igatherv", "Gather", 0);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_THAT(s.message(), StartsWith("Gather on rank 0: MPI_Igatherv failed: MPI_ERR_OTHER"));
}

TEST(RoundsTest, OneRoundWhenEverythingFits) {
  auto r = mpi_internal::Rounds::For(/*max_count=*/600, /*total=*/1000, 4, /*limit=*/1000);
  EXPECT_EQ(r.rounds, 1);
  EXPECT_EQ(r.Size(600, 0), 600);
  EXPECT_EQ(mpi_internal::Rounds::For(0, 0, 4, 1000).rounds, 0);
}

TEST(RoundsTest, EveryRoundStaysUnderTheLimit) {
  // Counts over INT_MAX in total and per rank, as in a gather of 3 GiB from each of 4 ranks.
  const std::vector<int64_t> counts = {int64_t{3} << 30, 0, 17, (int64_t{3} << 30) + 5};
  int64_t max = 0, total = 0;
  for (int64_t c : counts) max = std::max(max, c), total += c;
  const int64_t limit = INT_MAX;
  auto r = mpi_internal::Rounds::For(max, total, 4, limit);
  std::vector<int64_t> moved(counts.size());
  for (int64_t k = 0; k < r.rounds; ++k) {
    int64_t round_total = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      EXPECT_EQ(r.Begin(counts[i], k), moved[i]);
      moved[i] += r.Size(counts[i], k);
      round_total += r.Size(counts[i], k);
    }
    EXPECT_LE(round_total, limit) << "round " << k;
  }
  EXPECT_EQ(moved, counts);
}

// Every MPI call moves at most max_message_bytes, and larger buffers do take several calls.
TEST_F(MpiCommTest, NoMpiCallMovesMoreThanTheLimit) {
  constexpr int64_t kLimit = 1000;
  Result<std::unique_ptr<Comm>> made = NewMpiComm(MPI_COMM_WORLD, {.max_message_bytes = kLimit});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Comm& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  const int root = n - 1;
  mpi_calls::Reset();

  Bytes data = me == root ? Pattern(1, 10'000) : Bytes{};
  EXPECT_OK(comm.Broadcast(&data, root));
  EXPECT_EQ(data, Pattern(1, 10'000));

  std::vector<Bytes> gathered;
  EXPECT_OK(comm.Gather(Pattern(me, 3000), &gathered, root));
  std::vector<Bytes> all;
  EXPECT_OK(comm.AllGather(Pattern(me, 2500 + me), &all));
  ASSERT_EQ(all.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[r], Pattern(r, 2500 + r));
  std::vector<Bytes> send;
  if (me == root) {
    for (int r = 0; r < n; ++r) send.push_back(Pattern(r + 7, 2000));
  }
  Bytes mine;
  EXPECT_OK(comm.Scatter(send, &mine, root));
  EXPECT_EQ(mine, Pattern(me + 7, 2000));
  std::vector<int64_t> values(1000, 1);
  EXPECT_OK(comm.AllReduce(values, ReduceOp::kSum));
  EXPECT_EQ(values, std::vector<int64_t>(1000, n));

  const char* names[] = {"MPI_Ibcast", "MPI_Igatherv", "MPI_Iallgatherv", "MPI_Iscatterv",
                         "MPI_Iallreduce"};
  for (int fn = 0; fn < mpi_calls::kNumFns; ++fn) {
    EXPECT_LE(mpi_calls::g_stats[fn].max_bytes.load(), kLimit) << names[fn];
  }
  // 10 000 bytes in chunks of 1000 (and nothing else: sizes travel in the header).
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIbcast].calls.load(), 10);
  // 1000 values of 8 bytes in chunks of 125 values, plus one header per collective.
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIallreduce].calls.load(), 8 + 5);
  // The v-collectives move at most kLimit / n bytes per rank per round.
  auto rounds = [&](int64_t max_count) { return (max_count + kLimit / n - 1) / (kLimit / n); };
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIgatherv].calls.load(), rounds(3000));
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIallgatherv].calls.load(), rounds(2500 + n - 1));
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIscatterv].calls.load(), rounds(2000));
}

// The harness itself: a failure on one rank only fails the test (and the program). ctest runs it
// alone with TESSERA_MPI_FAIL_ON_RANK set and expects a failure; the other runs filter it out.
TEST_F(MpiCommTest, HarnessReportsAFailureOnOneRank) {
  const char* fail_on = std::getenv("TESSERA_MPI_FAIL_ON_RANK");
  ASSERT_NE(fail_on, nullptr) << "set TESSERA_MPI_FAIL_ON_RANK to the rank that should fail";
  EXPECT_NE(WorldRank(), std::atoi(fail_on)) << "failing on purpose";
}

// A real broadcast over 2 GiB between two ranks (MPI counts are int): three MPI calls.
TEST_F(MpiCommTest, BroadcastOver2GiB) {
  ASSERT_GE(WorldSize(), 2) << "run under mpiexec with 2 ranks or more (ctest does)";
  Result<std::unique_ptr<Comm>> world = NewMpiComm(MPI_COMM_WORLD);
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  // Ranks 0 and 1 only: two buffers of 2.1 GiB in memory.
  Result<std::unique_ptr<Comm>> pair = (*world)->Split(WorldRank() < 2 ? 0 : 1, 0);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  if (WorldRank() >= 2) return;
  const size_t size = (size_t{2} << 30) + (size_t{100} << 20) + 3;
  const auto start = std::chrono::steady_clock::now();
  Bytes data;
  if (WorldRank() == 0) {
    data.resize(size);
    for (size_t i = 0; i < size; i += 4096) data[i] = static_cast<uint8_t>(i >> 12);
    data[size - 1] = 0x5A;
  }
  mpi_calls::Reset();
  EXPECT_OK((*pair)->Broadcast(&data, 0));
  // Three calls: MPI counts are int, and the default limit is 1 GiB.
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIbcast].calls.load(), 3);
  EXPECT_EQ(mpi_calls::g_stats[mpi_calls::kIbcast].max_bytes.load(), int64_t{1} << 30);
  ASSERT_EQ(data.size(), size);
  size_t bad = 0;
  for (size_t i = 0; i < size; i += 4096) bad += data[i] != static_cast<uint8_t>(i >> 12);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(data[size - 1], 0x5A);
  if (WorldRank() == 1) {
    std::cerr << "[rank 1] 2.1 GiB broadcast: "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
              << " s\n";
  }
}

// Prints the failures of ranks other than 0, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // (UnitTest::current_test_info() would deadlock inside OnTestPartResult: remember the test.)
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  int wanted = MPI_THREAD_MULTIPLE;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--thread-level=serialized") == 0) wanted = MPI_THREAD_SERIALIZED;
  }
  int provided = -1;
  MPI_Init_thread(&argc, &argv, wanted, &provided);
  const int rank = tessera::WorldRank();
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new tessera::RankFailurePrinter(rank));
  } else {
    std::printf("MPI: %d ranks, thread level %d requested, %d provided\n", tessera::WorldSize(),
                wanted, provided);
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
