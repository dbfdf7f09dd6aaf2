// Issue 11, item 10, under mpirun: the collective deadline of MpiComm with ranks that stop
// calling collectives (they sleep instead, then come back late). Every process is one rank:
//
//   mpirun -np 3 tessera_mpi_deadline_test
//
// Cases, each on a fresh communicator (MpiCommOptions::collective_timeout = 1 s):
//   late_barrier       the last rank comes 3 s late to a Barrier: every other rank returns
//                      kDeadlineExceeded naming it within the deadline plus the grace period,
//                      all with the same message; the late rank returns it too when it comes.
//   late_save          the same inside Save (a real protocol): the ranks that called Save fail
//                      naming the late rank, nothing is committed, and the late rank's Save
//                      fails at once with the same status.
//   two_late           (4 ranks or more) ranks 2 and 3 come late: the message names both.
//   slow_but_in_time   a rank 0.3 s late with a 1 s deadline: the collective just completes.
// Prints "[ OK ] case" or "[FAILED] case: why" per rank and case; exits 1 on every rank when
// any check failed on any rank.
#include <mpi.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/mpi_comm.h"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kTimeout{1000};
constexpr std::chrono::milliseconds kLate{3000};

int g_failures = 0;

void Check(bool ok, const std::string& name, const std::string& why) {
  if (ok) return;
  ++g_failures;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::printf("[FAILED] rank %d, %s: %s\n", rank, name.c_str(), why.c_str());
  std::fflush(stdout);
}

std::unique_ptr<Comm> FreshComm() {
  Result<std::unique_ptr<Comm>> comm =
      NewMpiComm(MPI_COMM_WORLD, MpiCommOptions{.collective_timeout = kTimeout});
  if (!comm.ok()) {
    std::fprintf(stderr, "NewMpiComm: %s\n", comm.status().ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return std::move(*comm);
}

// Every rank's message, gathered (to compare them).
std::vector<std::string> AllMessages(const std::string& mine) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(size), displs(size);
  MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < size; ++r) displs[r] = total, total += lengths[r];
  std::string all(total, '\0');
  MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), displs.data(), MPI_CHAR,
                 MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(all.substr(displs[r], lengths[r]));
  return out;
}

// Runs `call` on every rank; the ranks in `late` first sleep kLate. Checks that every rank
// returns kDeadlineExceeded naming `named`, the same message everywhere, and that the ranks
// that were on time returned within the deadline plus the grace period and a margin.
void ExpectGiveUp(const std::string& name, const std::vector<int>& late, const std::string& named,
                  const std::function<Status(Comm&)>& call) {
  std::unique_ptr<Comm> comm = FreshComm();
  const bool is_late = std::find(late.begin(), late.end(), comm->rank()) != late.end();
  if (is_late) std::this_thread::sleep_for(kLate);
  const Clock::time_point start = Clock::now();
  const Status status = call(*comm);
  const auto waited = Clock::now() - start;
  Check(status.code() == StatusCode::kDeadlineExceeded, name, "status " + status.ToString());
  Check(status.message().find("gave up after waiting 1000 ms for " + named + " to enter it") !=
            std::string::npos,
        name, "message does not name " + named + ": " + status.message());
  if (is_late) {
    Check(waited < std::chrono::milliseconds(500), name, "the late rank was not told at once");
  } else {
    Check(waited >= kTimeout, name, "gave up before the deadline");
    Check(waited < kTimeout + std::chrono::milliseconds(2000), name, "gave up too late");
  }
  const std::vector<std::string> all = AllMessages(status.message());
  for (const std::string& m : all) {
    Check(m == all[0], name, "ranks disagree: '" + m + "' vs '" + all[0] + "'");
  }
  if (comm->rank() == 0 && status.code() == StatusCode::kDeadlineExceeded) {
    std::printf("[ OK ] %s: %s\n", name.c_str(), status.ToString().c_str());
    std::fflush(stdout);
  }
  // Later collectives on the abandoned communicator fail at once, without communicating.
  Check(comm->Barrier().code() == StatusCode::kDeadlineExceeded, name, "not aborted after");
  MPI_Barrier(MPI_COMM_WORLD);
}

std::string SharedTempDir() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string dir(256, '\0');
  if (rank == 0) {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/tessera-deadline-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) MPI_Abort(MPI_COMM_WORLD, 2);
    dir.replace(0, pattern.size(), pattern);
  }
  MPI_Bcast(dir.data(), static_cast<int>(dir.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  return dir.c_str();
}

int Main() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int last = size - 1;
  const std::string last_text = "rank " + std::to_string(last);

  ExpectGiveUp("late_barrier", {last}, last_text, [](Comm& comm) { return comm.Barrier(); });

  const std::string dir = SharedTempDir();
  ExpectGiveUp("late_save", {last}, last_text, [&](Comm& comm) {
    std::vector<float> values(1024, static_cast<float>(comm.rank()));
    StateDict state;
    Status added =
        state.Add(ShardedTensor::Shard("w", TensorView(values.data(), DType::kF32, {1024}),
                                       {1024 * comm.size()}, {1024 * comm.rank()}));
    if (!added.ok()) return added;
    return Save(state, dir + "/ck", comm).status();
  });
  Check(!ReadMetadata(dir + "/ck").ok(), "late_save", "a checkpoint was committed");

  if (size >= 4) {
    ExpectGiveUp("two_late", {2, 3}, "ranks 2, 3", [](Comm& comm) {
      std::vector<int64_t> v = {1};
      return comm.AllReduce(v, ReduceOp::kSum);
    });
  }

  {
    std::unique_ptr<Comm> comm = FreshComm();
    if (comm->rank() == last) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::vector<int64_t> v = {1};
    const Status status = comm->AllReduce(v, ReduceOp::kSum);
    Check(status.ok() && v[0] == size, "slow_but_in_time", status.ToString());
    Check(comm->Barrier().ok(), "slow_but_in_time", "the communicator is still usable");
  }

  int failures = g_failures;
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    std::printf("%s: %d failed checks over %d ranks\n",
                failures == 0 ? "deadline test passed" : "deadline test FAILED", failures, size);
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tessera

int main() { return tessera::Main(); }
