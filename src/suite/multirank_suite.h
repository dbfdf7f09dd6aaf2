// The multi-rank test suite: checkpoint scenarios written against Comm only, so the same cases
// run under the in-process LocalComm (src/checkpoint/multirank_test.cc, a gtest) and under MPI
// (src/mpi/mpi_suite_main.cc, started by mpirun).
//
// A case is COLLECTIVE: every rank calls run(comm, dir) with the same `dir`, a directory that
// exists, is empty, and is shared by all ranks. It returns OK when the case passed on this rank;
// errors name what failed. A case must not assume a particular rank count beyond min_ranks.
#ifndef TESSERA_SUITE_MULTIRANK_SUITE_H_
#define TESSERA_SUITE_MULTIRANK_SUITE_H_

#include <functional>
#include <string>
#include <vector>

#include "tessera/comm.h"
#include "tessera/status.h"

namespace tessera::suite {

struct MultiRankCase {
  std::string name;
  int min_ranks = 1;
  std::function<Status(Comm& comm, const std::string& dir)> run;
};

// Every case, in a fixed order.
const std::vector<MultiRankCase>& MultiRankCases();

}  // namespace tessera::suite

#endif  // TESSERA_SUITE_MULTIRANK_SUITE_H_
