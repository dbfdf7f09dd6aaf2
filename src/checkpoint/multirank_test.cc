// Runs the multi-rank suite (src/suite) under the in-process LocalComm at several rank counts.
// The same cases run under MPI from src/mpi.
#include <gtest/gtest.h>

#include "suite/multirank_suite.h"
#include "tessera/local_comm.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

struct Param {
  suite::MultiRankCase test_case;
  int ranks;
  friend void PrintTo(const Param& p, std::ostream* os) {
    *os << p.test_case.name << " on " << p.ranks << " ranks";
  }
};

class MultiRankSuiteTest : public ::testing::TestWithParam<Param> {};

TEST_P(MultiRankSuiteTest, Passes) {
  const Param& p = GetParam();
  testing::TempDir dir;
  std::vector<Status> statuses = RunLocalRanks(
      p.ranks, [&](Comm& comm) { return p.test_case.run(comm, dir.path()); },
      LocalCommOptions{.timeout = std::chrono::seconds(60)});
  for (int r = 0; r < p.ranks; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

std::vector<Param> AllParams() {
  std::vector<Param> out;
  for (const suite::MultiRankCase& c : suite::MultiRankCases()) {
    for (int ranks : {1, 2, 3, 4, 8}) {
      if (ranks >= c.min_ranks) out.push_back({c, ranks});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Local, MultiRankSuiteTest, ::testing::ValuesIn(AllParams()),
                         [](const auto& info) {
                           return info.param.test_case.name + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

}  // namespace
}  // namespace tessera
