// Runs every case of the multi-rank suite (src/suite/multirank_suite.h) under MPI, one rank
// per process:
//
//   mpirun -np 4 tessera_mpi_suite [substring]    # only the cases whose name contains it
//   mpirun -np 3 tessera_mpi_suite --no-deadline  # MpiCommOptions::collective_timeout 0: the
//                                                 # Comm's ScatterInto moves bytes in place
//
// Rank 0 creates a fresh directory under $TMPDIR (or /tmp) and broadcasts its path; each case
// runs on every rank, in its own subdirectory and on its own communicator (split from the
// world, so an aborted communicator or a cached plan never leaks into the next case); the
// ranks agree on each case's outcome with AgreeOnStatus. Rank 0 prints "[ OK ] name" or
// "[FAILED] name: message" per case and "N passed, M failed" at the end, and removes the
// directory. The exit code is 1 on every rank when any case failed on any rank.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <stdlib.h>

#include "suite/multirank_suite.h"
#include "tessera/comm.h"
#include "tessera/mpi_comm.h"
#include "tessera/status.h"

namespace tessera {
namespace {

// A new directory under $TMPDIR (or /tmp).
Result<std::string> MakeTempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/tessera-mpi-suite-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return IOErrorFromErrno("mkdtemp " + pattern, errno);
  return std::string(buf.data());
}

std::string CaseDirName(size_t index, const std::string& name) {
  std::string number = std::to_string(index);
  if (number.size() < 2) number.insert(0, 2 - number.size(), '0');
  return number + "_" + name;
}

int Main(int argc, char** argv) {
  std::string filter;
  MpiCommOptions options;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--no-deadline") {
      options.collective_timeout = std::chrono::milliseconds(0);
    } else {
      filter = argv[i];
    }
  }
  Result<std::unique_ptr<Comm>> made_world = NewMpiWorldComm(options);
  if (!made_world.ok()) {
    std::fprintf(stderr, "tessera_mpi_suite: %s\n", made_world.status().ToString().c_str());
    return 2;
  }
  Comm& world = **made_world;
  const int rank = world.rank();
  const bool printer = rank == 0;

  // The shared directory: rank 0 makes it, everyone learns its path (one machine here; on
  // several machines $TMPDIR must be on a shared file system).
  Bytes root_bytes;
  Status made;
  if (rank == 0) {
    Result<std::string> dir = MakeTempDir();
    made = dir.status();
    if (dir.ok()) root_bytes.assign(dir->begin(), dir->end());
  }
  Status status = AgreeOnStatus(world, made);
  if (status.ok()) status = world.Broadcast(&root_bytes, 0);
  if (!status.ok()) {
    if (printer) std::fprintf(stderr, "tessera_mpi_suite: %s\n", status.ToString().c_str());
    return 1;
  }
  const std::string root(root_bytes.begin(), root_bytes.end());
  if (printer) {
    std::printf("tessera multi-rank suite over MPI: %d ranks, MPI thread level %d, %s, in %s\n",
                world.size(), MpiProvidedThreadLevel(),
                options.collective_timeout.count() > 0 ? "collective deadline" : "no deadline",
                root.c_str());
    std::fflush(stdout);
  }

  int passed = 0, failed = 0, skipped = 0;
  const std::vector<suite::MultiRankCase>& cases = suite::MultiRankCases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const suite::MultiRankCase& c = cases[i];
    if (c.name.find(filter) == std::string::npos) continue;
    if (c.min_ranks > world.size()) {
      ++skipped;
      if (printer) std::printf("[ SKIP ] %s: needs %d ranks\n", c.name.c_str(), c.min_ranks);
      continue;
    }
    const std::string dir = root + "/" + CaseDirName(i, c.name);
    const auto start = std::chrono::steady_clock::now();
    Status local;
    if (rank == 0) {
      std::error_code ec;
      std::filesystem::create_directory(dir, ec);
      if (ec) local = IOError("creating " + dir + ": " + ec.message());
    }
    Status agreed = AgreeOnStatus(world, local);  // also: nobody starts before the directory
    if (agreed.ok()) {
      Result<std::unique_ptr<Comm>> comm = world.Split(0, rank);
      local = comm.ok() ? c.run(**comm, dir) : comm.status();
      if (comm.ok()) {
        // Leave the case's communicator so that no peer can be left waiting in it: a case that
        // went wrong may have returned on this rank while a peer is still in a collective.
        // The abort is announced by one more collective, which releases such a peer (with
        // kAborted, so its case fails) and returns kAborted everywhere once all have left.
        (*comm)->Abort(Aborted("rank " + std::to_string(rank) + " finished case " + c.name +
                               (local.ok() ? "" : " with " + local.ToString())));
        (*comm)->Barrier().IgnoreError();
      }
      agreed = AgreeOnStatus(world, local);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    if (agreed.ok()) {
      ++passed;
      if (printer) std::printf("[ OK ] %s (%lld ms)\n", c.name.c_str(), static_cast<long long>(ms));
    } else {
      ++failed;
      if (printer) {
        std::printf("[FAILED] %s: %s (%lld ms)\n", c.name.c_str(), agreed.ToString().c_str(),
                    static_cast<long long>(ms));
      }
    }
    if (printer) std::fflush(stdout);
  }

  // Everyone is done with the directory before rank 0 removes it.
  Status done = world.Barrier();
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
    if (ec)
      std::fprintf(stderr, "tessera_mpi_suite: removing %s: %s\n", root.c_str(),
                   ec.message().c_str());
  }
  if (!done.ok()) {
    if (printer) std::printf("final barrier: %s\n", done.ToString().c_str());
    ++failed;
  }
  if (printer) {
    std::printf("%d passed, %d failed", passed, failed);
    if (skipped > 0) std::printf(", %d skipped", skipped);
    std::printf("\n");
  }
  return failed > 0 ? 1 : 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) { return tessera::Main(argc, argv); }
