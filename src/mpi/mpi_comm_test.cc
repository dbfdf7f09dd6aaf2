// The Comm conformance suite (tessera/testing/comm_suite.h: the same cases as the single-rank
// Comm and LocalComm run in src/comm/comm_test.cc), over MPI, plus MPI-only tests (isolation from
// the caller's communicator, the chunking of large buffers, MPI errors).
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
#include "tessera/testing/comm_suite.h"
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

// After a test, the ranks agree on who failed: on rank 0, a failure naming the other ranks
// that failed (their messages are on their stderr), else "". Collective over MPI_COMM_WORLD.
std::string AgreeOnFailure(bool failed_here) {
  int failed = failed_here ? 1 : 0;
  std::vector<int> all(WorldSize());
  MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::string ranks;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (WorldRank() != 0 || ranks.empty()) return "";
  return "failed on rank(s) " + ranks + " (their messages are on stderr)";
}

// Every MPI-only test derives from this: after the test, the ranks agree on who failed.
class MpiTest : public ::testing::Test {
 protected:
  void TearDown() override {
    const std::string elsewhere = AgreeOnFailure(HasFailure());
    if (!elsewhere.empty()) ADD_FAILURE() << elsewhere;
  }
};

// ---- the Comm conformance suite (tessera/testing/comm_suite.h), for several kinds of
// communicator ---------------------------------------------------------------------------------

struct CommKind {
  std::string name;
  enum Group { kWorld, kSelf, kAllButLast } group;
  int64_t max_message_bytes;
  // 0: no deadline, under which ScatterInto moves bytes straight between callers' ranges.
  std::chrono::milliseconds collective_timeout = MpiCommOptions{}.collective_timeout;
};

// The size of the communicator a kind makes (the same on every rank, members or not). Known once
// MPI is initialised: main() registers the suite after MPI_Init.
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

// Runs a case on this process's rank of a fresh MpiComm of the kind (ranks outside it, the last
// one of kAllButLast, only wait for the verdict), then makes every process agree on it.
class MpiCommSuiteRunner : public testing::CommSuiteRunner {
 public:
  explicit MpiCommSuiteRunner(CommKind kind) : kind_(std::move(kind)) {}

  int size() const override { return SizeOf(kind_); }

  void Run(const std::function<void(Comm&)>& rank_body) override {
    MPI_Comm base = MPI_COMM_WORLD;
    MPI_Comm sub = MPI_COMM_NULL;
    if (kind_.group == CommKind::kSelf) base = MPI_COMM_SELF;
    if (kind_.group == CommKind::kAllButLast) {
      const bool in = WorldSize() == 1 || WorldRank() < WorldSize() - 1;
      MPI_Comm_split(MPI_COMM_WORLD, in ? 0 : MPI_UNDEFINED, WorldRank(), &sub);
      base = sub;
    }
    std::unique_ptr<Comm> comm;
    if (base != MPI_COMM_NULL) {
      Result<std::unique_ptr<Comm>> made =
          NewMpiComm(base, MpiCommOptions{.max_message_bytes = kind_.max_message_bytes,
                                          .collective_timeout = kind_.collective_timeout});
      if (made.ok()) comm = std::move(*made);
      if (!made.ok()) ADD_FAILURE() << made.status().ToString();
    }
    // The Comm holds its own duplicate: the caller may free its communicator at once.
    if (sub != MPI_COMM_NULL) MPI_Comm_free(&sub);
    if (comm) rank_body(*comm);
  }

  std::string Finish(bool failed_here) override { return AgreeOnFailure(failed_here); }

 private:
  const CommKind kind_;
};

// Registers the suite once per kind; every case needs every rank of MPI_COMM_WORLD.
void RegisterCommSuites() {
  const std::vector<CommKind> kinds = {
      {"World", CommKind::kWorld, int64_t{1} << 30},
      // Tiny chunks: every Broadcast, Gather, AllGather, Scatter and AllReduce of the suite
      // takes several rounds, with pieces that do not divide evenly.
      {"WorldSmallChunks", CommKind::kWorld, 1000},
      {"Self", CommKind::kSelf, int64_t{1} << 30},
      {"AllButLast", CommKind::kAllButLast, 999},
      // Without a deadline (ScatterInto's direct path; its windows are max_message_bytes).
      {"WorldNoDeadline", CommKind::kWorld, int64_t{1} << 30, std::chrono::milliseconds(0)},
      {"WorldNoDeadlineSmallChunks", CommKind::kWorld, 1000, std::chrono::milliseconds(0)},
  };
  // MPI agrees on every collective's arguments: an argument error is every rank's.
  const testing::CommSuiteTraits traits{.agreed_argument_errors = true};
  for (const CommKind& kind : kinds) {
    testing::RegisterCommSuite("Mpi" + kind.name, std::make_shared<MpiCommSuiteRunner>(kind),
                               traits, __FILE__, __LINE__);
  }
}

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
  tessera::RegisterCommSuites();
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
