// The kill -9 trials of CheckpointManagerKillTest (crash_loop_test.cc, on a local root, and
// s3_manager_test.cc, on S3): start the loop program (crash_loop_main.cc), kill it at a random
// moment, and check what the root holds. For the tests of tessera_manager_test only: it needs
// TESSERA_CRASH_LOOP, the program's path, which CMake defines for that target.
#ifndef TESSERA_MANAGER_TESTING_KILL_TRIALS_H_
#define TESSERA_MANAGER_TESTING_KILL_TRIALS_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "manager/testing/crash_loop.h"
#include "testing/test_util.h"

namespace tessera::kill_trials {

// Starts the loop program on `root` (state of `elements` weights); its output goes to `log`.
inline pid_t StartLoop(const std::string& root, int64_t last_step, const std::string& log,
                       size_t elements = crash_loop::kElements) {
  const std::string last = std::to_string(last_step);
  const std::string count = std::to_string(elements);
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec: other threads may hold locks
    const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) _exit(127);
    execl(TESSERA_CRASH_LOOP, TESSERA_CRASH_LOOP, root.c_str(), last.c_str(), count.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

inline std::string ReadLog(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// What the root holds after a kill: its latest step, restored and checked.
struct AfterKill {
  std::optional<int64_t> latest;
  std::vector<int64_t> all;
};

inline Result<AfterKill> Check(const std::string& root, size_t elements) {
  CheckpointManager manager(root, crash_loop::Options());
  AfterKill after;
  TESSERA_ASSIGN_OR_RETURN(after.latest, manager.LatestStep());
  TESSERA_ASSIGN_OR_RETURN(after.all, manager.AllSteps());
  if (!after.latest) return after;
  crash_loop::LoopState state(elements);
  StateDict dict = state.Dict();
  TESSERA_ASSIGN_OR_RETURN(RestoreReport report,
                           manager.Restore(dict, RestoreOptions{.step = *after.latest}));
  state.From(dict);
  if (!state.Holds(report.step)) {
    return DataLoss("step " + std::to_string(report.step) + " restored other bytes");
  }
  return after;
}

struct Trials {
  std::string root;  // a path or a URI
  std::string log;   // the loop's output
  size_t elements = crash_loop::kElements;
  int trials = 40;
  uint64_t seed = 20240611;
  std::chrono::microseconds max_delay{400000};  // before each kill
};

// Kills the loop `trials` times at random moments: after each kill, LatestStep names a step
// that restores bit for bit, committed progress is never lost, and the retention (keep 2)
// leaves at most 4 step directories; then the loop resumes and finishes. Fatal failures end the
// test (call it directly from the TEST body).
inline void Run(const Trials& t) {
  std::printf("kill test on %s: seed %llu, %d trials\n", t.root.c_str(),
              static_cast<unsigned long long>(t.seed), t.trials);
  std::mt19937_64 random(t.seed);
  std::optional<int64_t> previous;
  int killed_before_any_commit = 0;
  for (int trial = 0; trial < t.trials; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(t.seed) + ", trial " + std::to_string(trial));
    const auto delay = std::chrono::microseconds(random() % t.max_delay.count());
    const pid_t pid = StartLoop(t.root, 1000000, t.log, t.elements);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(delay);
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the loop ended by itself (status " << status << "): " << ReadLog(t.log);
    Result<AfterKill> after = Check(t.root, t.elements);
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    if (previous) {
      // Committed progress is never lost, and the newest whole checkpoint is always there.
      ASSERT_TRUE(after->latest.has_value()) << "every checkpoint gone after step " << *previous;
      ASSERT_GE(*after->latest, *previous);
      ASSERT_FALSE(after->all.empty());
    } else if (!after->latest) {
      ++killed_before_any_commit;
    }
    // Keep 2: the newest two, plus at most one the retention had not deleted yet when killed
    // (it runs after each commit) and one whose deletion was under way.
    EXPECT_LE(after->all.size(), 4u);
    previous = after->latest;
  }
  // Once more, to the end: the loop resumes and finishes.
  ASSERT_TRUE(previous.has_value()) << "no save ever committed in " << t.trials << " trials";
  const int64_t last = *previous + 3;
  const pid_t pid = StartLoop(t.root, last, t.log, t.elements);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadLog(t.log);
  Result<AfterKill> done = Check(t.root, t.elements);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->latest, last);
  EXPECT_EQ(done->all, (std::vector<int64_t>{last - 1, last}));
  std::printf("kill test: latest step %lld after %d kills (%d before the first commit)\n",
              static_cast<long long>(last), t.trials, killed_before_any_commit);
}

}  // namespace tessera::kill_trials

#endif  // TESSERA_MANAGER_TESTING_KILL_TRIALS_H_
