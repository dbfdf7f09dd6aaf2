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
//   frozen_mid_bcast   (issue 22) root 0 of a 64 MiB Broadcast freezes 3 s right before sending
//   frozen_mid_allgather  (rank 1 right after starting its part of a 16 MiB-per-rank AllGather),
//                      every rank having entered the collective: the ranks
//                      still waiting for the transfer at the deadline return kDeadlineExceeded
//                      then; a rank whose part completed earlier returns OK and learns it at
//                      its next collective; the frozen rank when it wakes; one message
//                      everywhere. Before: they waited in MPI_Wait until the frozen rank woke
//                      (25 s and more with a 3 s deadline).
// Prints "[ OK ] case" or "[FAILED] case: why" per rank and case; exits 1 on every rank when
// any check failed on any rank.
#include <mpi.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "mpi/mpi_internal.h"
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

// Runs `call` on every rank; rank `frozen` freezes kLate (sleeping, calling no MPI) right before
// (or, `after_start`, right after) it starts the first operation of the collective's data
// transfer named `mpi_call`, every rank having entered the collective. A rank still
// waiting for the transfer when the deadline passes returns kDeadlineExceeded then (within a
// margin), saying the transfer was given up mid-way; a rank whose part completed before returns
// OK, and its next collective returns that status at once; the frozen rank returns it when it
// wakes. The message is the same everywhere, and the communicator is aborted after.
void ExpectGiveUpMidTransfer(const std::string& name, int frozen, const std::string& mpi_call,
                             bool after_start, const std::function<Status(Comm&)>& call) {
  std::unique_ptr<Comm> comm = FreshComm();
  const bool is_frozen = comm->rank() == frozen;
  if (is_frozen) {
    mpi_internal::SetDataPhaseHookForTesting(
        [mpi_call, after_start](std::string_view what, bool started) {
          if (what != mpi_call || started != after_start) return;
          mpi_internal::SetDataPhaseHookForTesting(nullptr);
          std::this_thread::sleep_for(kLate);
        });
  }
  const Clock::time_point start = Clock::now();
  const Status status = call(*comm);
  const auto waited = Clock::now() - start;
  if (is_frozen) mpi_internal::SetDataPhaseHookForTesting(nullptr);
  const Clock::time_point next_start = Clock::now();
  const Status after = comm->Barrier();
  const auto waited_after = Clock::now() - next_start;
  const std::string ms = std::to_string(waited / std::chrono::milliseconds(1)) + " ms";
  if (status.ok()) {
    Check(!is_frozen && waited < kTimeout, name, "returned OK after the deadline: " + ms);
    Check(waited_after < kTimeout + std::chrono::milliseconds(1500), name,
          "the next collective was not told at once");
  } else {
    Check(status.code() == StatusCode::kDeadlineExceeded, name, "status " + status.ToString());
    if (is_frozen) {
      Check(waited >= kLate && waited < kLate + std::chrono::milliseconds(2000), name,
            "the frozen rank returned after " + ms);
    } else {
      Check(waited >= kTimeout && waited < kTimeout + std::chrono::milliseconds(1500), name,
            "gave up after " + ms + ", not at the deadline");
    }
    Check(waited_after < std::chrono::milliseconds(200), name, "not aborted after");
  }
  const Status& told = status.ok() ? after : status;
  Check(told.code() == StatusCode::kDeadlineExceeded, name, "told " + told.ToString());
  Check(told.message().find("in the middle of its data transfer") != std::string::npos, name,
        "message does not say where it gave up: " + told.message());
  Check(after.code() == StatusCode::kDeadlineExceeded && after.message() == told.message(), name,
        "not aborted after: " + after.ToString());
  const std::vector<std::string> all = AllMessages(told.message());
  for (const std::string& m : all) {
    Check(m == all[0], name, "ranks disagree: '" + m + "' vs '" + all[0] + "'");
  }
  // The deadline held: some rank that was not frozen gave up at it.
  int gave_up = !is_frozen && !status.ok() ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &gave_up, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  Check(gave_up > 0, name, "no rank waited for the frozen one: the case tests nothing");
  if (comm->rank() == 0 && told.code() == StatusCode::kDeadlineExceeded) {
    std::printf("[ OK ] %s: %s\n", name.c_str(), told.ToString().c_str());
    std::fflush(stdout);
  }
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

  // The root stops before it sends (after the header: every rank is in the Broadcast); rank 1
  // stops right after starting its part of an AllGather, whose every rank needs every other's.
  // (Which ranks a stalled broadcast holds up depends on Open MPI's algorithm: a stalled
  // forwarder may be bypassed.)
  ExpectGiveUpMidTransfer("frozen_mid_bcast", 0, "MPI_Ibcast", false, [](Comm& comm) {
    Bytes data(comm.rank() == 0 ? size_t{64} << 20 : 0, 0x5A);
    return comm.Broadcast(&data, 0);
  });
  ExpectGiveUpMidTransfer("frozen_mid_allgather", 1, "MPI_Iallgatherv", true, [](Comm& comm) {
    std::vector<Bytes> received;
    return comm.AllGather(Bytes(size_t{16} << 20, static_cast<uint8_t>(comm.rank())), &received);
  });

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
