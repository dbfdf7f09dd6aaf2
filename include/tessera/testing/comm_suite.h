// The Comm conformance suite for GoogleTest: the cases of comm_cases.h registered as tests of
// a harness that runs a case on every rank of a fresh communicator. tessera runs it on the
// single-rank Comm and on LocalComm at 1, 2, 3 and 8 ranks (src/comm/comm_test.cc) and on MPI
// (src/mpi/mpi_comm_test.cc); a user's own Comm runs it the same way:
//
//   #include "tessera/testing/comm_suite.h"
//
//   // In-process ranks: a runner whose Run gives each rank's body its own Comm, one thread
//   // per rank (as LocalCommSuiteRunner does).
//   TESSERA_INSTANTIATE_COMM_SUITE(MyComm4, std::make_shared<MyRunner>(4),
//                                  tessera::testing::CommSuiteTraits{});
//
// Where the ranks are processes (MPI), each process registers the suite with the runner of its
// own rank (RegisterCommSuite, from main once the communicator exists), and the runner's Finish
// makes every process agree on each test's verdict.
//
// The tests are named <Name>/<Group>.<Case>, the group saying how many ranks the case needs:
// CollectiveTest, CollectiveOfTwoOrMoreTest, CollectiveOfThreeOrMoreTest. A case that needs
// more ranks than the runner has is not registered. Header-only: tessera's public headers and
// gtest.
#ifndef TESSERA_TESTING_COMM_SUITE_H_
#define TESSERA_TESTING_COMM_SUITE_H_

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm.h"
#include "tessera/local_comm.h"
#include "tessera/status.h"
#include "tessera/testing/comm_cases.h"

namespace tessera::testing {

// Runs one case on the ranks a process plays of a fresh communicator.
class CommSuiteRunner {
 public:
  virtual ~CommSuiteRunner() = default;

  // The size of the communicators Run makes: the same in every process, known at registration.
  virtual int size() const = 0;

  // Calls `rank_body` on every rank this process plays, each with its own Comm of one fresh
  // communicator of size() ranks, all at the same time; returns when all have returned.
  virtual void Run(const std::function<void(Comm&)>& rank_body) = 0;

  // After each test, with whether this process saw a failure: a runner whose ranks are
  // processes makes them agree here, and returns a failure to report (naming the ranks that
  // failed elsewhere), or "".
  virtual std::string Finish(bool failed_here) { return ""; }
};

// The single-rank Comm (NewSingleRankComm).
class SingleRankCommSuiteRunner : public CommSuiteRunner {
 public:
  int size() const override { return 1; }
  void Run(const std::function<void(Comm&)>& rank_body) override {
    std::unique_ptr<Comm> comm = NewSingleRankComm();
    rank_body(*comm);
  }
};

// LocalComm: `n` ranks as `n` threads (RunLocalRanks).
class LocalCommSuiteRunner : public CommSuiteRunner {
 public:
  // `timeout`: the collective deadline, so that a case that fails by hanging fails in time.
  explicit LocalCommSuiteRunner(int n, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : n_(n), timeout_(timeout) {}
  int size() const override { return n_; }
  void Run(const std::function<void(Comm&)>& rank_body) override {
    RunLocalRanks(
        n_,
        [&](Comm& comm) {
          rank_body(comm);
          return Status::Ok();
        },
        LocalCommOptions{.timeout = timeout_});
  }

 private:
  const int n_;
  const std::chrono::milliseconds timeout_;
};

// The fixture of every case: runs it through the runner and reports each rank's failures.
class CommSuiteTest : public ::testing::Test {
 public:
  CommSuiteTest(std::shared_ptr<CommSuiteRunner> runner, CommSuiteTraits traits, CommCase c)
      : runner_(std::move(runner)), traits_(traits), case_(c) {}

  void TestBody() override {
    std::mutex mu;
    std::vector<std::string> failures;
    runner_->Run([&](Comm& comm) {
      const std::vector<std::string> mine = RunCommCase(case_, comm, runner_->size(), traits_);
      std::lock_guard<std::mutex> lock(mu);
      for (const std::string& f : mine) {
        failures.push_back("rank " + std::to_string(comm.rank()) + ": " + f);
      }
    });
    for (const std::string& f : failures) ADD_FAILURE() << f;
  }

 protected:
  void TearDown() override {
    const std::string elsewhere = runner_->Finish(HasFailure());
    if (!elsewhere.empty()) ADD_FAILURE() << elsewhere;
  }

 private:
  std::shared_ptr<CommSuiteRunner> runner_;
  CommSuiteTraits traits_;
  CommCase case_;
};

// The test suite a case is registered in: how many ranks it needs, as a name.
inline const char* CommSuiteGroup(int min_ranks) {
  if (min_ranks >= 3) return "CollectiveOfThreeOrMoreTest";
  if (min_ranks == 2) return "CollectiveOfTwoOrMoreTest";
  return "CollectiveTest";
}

// Registers every case the runner's size allows, as <name>/<group>.<case>. Call before
// RUN_ALL_TESTS. Returns the number of cases registered.
inline int RegisterCommSuite(const std::string& name, std::shared_ptr<CommSuiteRunner> runner,
                             CommSuiteTraits traits, const char* file, int line) {
  int registered = 0;
  for (const CommCase& c : CommSuiteCasesFor(runner->size())) {
    const std::string suite = name + "/" + CommSuiteGroup(c.min_ranks);
    ::testing::RegisterTest(
        suite.c_str(), c.name, nullptr, nullptr, file, line,
        [runner, traits, c]() -> CommSuiteTest* { return new CommSuiteTest(runner, traits, c); });
    ++registered;
  }
  return registered;
}

}  // namespace tessera::testing

// Runs the suite on the communicators `runner` (a std::shared_ptr to a CommSuiteRunner) makes;
// `name` (an identifier) names the instantiation, `traits` (a CommSuiteTraits) describes the
// Comm. At namespace scope, once per name, for runners whose size is known before main.
#define TESSERA_INSTANTIATE_COMM_SUITE(name, runner, traits)    \
  [[maybe_unused]] static const int tessera_comm_suite_##name = \
      ::tessera::testing::RegisterCommSuite(#name, runner, traits, __FILE__, __LINE__)

#endif  // TESSERA_TESTING_COMM_SUITE_H_
