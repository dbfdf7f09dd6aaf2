// kill -9 at random moments of a managed training loop (save every step, keep 2): after every
// kill, LatestStep() names a checkpoint that restores bit for bit, the retention has left at
// least that newest whole checkpoint, and no committed progress is ever lost.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "manager/testing/crash_loop.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

// Starts the loop program on `root`; its output goes to `log`.
pid_t StartLoop(const std::string& root, int64_t last_step, const std::string& log) {
  const std::string last = std::to_string(last_step);
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec: other threads may hold locks
    const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) _exit(127);
    execl(TESSERA_CRASH_LOOP, TESSERA_CRASH_LOOP, root.c_str(), last.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

std::string ReadLog(const std::string& path) {
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

Result<AfterKill> Check(const std::string& root) {
  CheckpointManager manager(root, crash_loop::Options());
  AfterKill after;
  TESSERA_ASSIGN_OR_RETURN(after.latest, manager.LatestStep());
  TESSERA_ASSIGN_OR_RETURN(after.all, manager.AllSteps());
  if (!after.latest) return after;
  crash_loop::LoopState state;
  StateDict dict = state.Dict();
  TESSERA_ASSIGN_OR_RETURN(RestoreReport report,
                           manager.Restore(dict, RestoreOptions{.step = *after.latest}));
  state.From(dict);
  if (!state.Holds(report.step)) {
    return DataLoss("step " + std::to_string(report.step) + " restored other bytes");
  }
  return after;
}

TEST(CheckpointManagerKillTest, LatestLoadsAfterEveryKill) {
  const char* env_seed = std::getenv("TESSERA_KILL_SEED");
  const uint64_t seed = env_seed ? std::strtoull(env_seed, nullptr, 10) : 20240611;
  const char* env_trials = std::getenv("TESSERA_KILL_TRIALS");
  const int trials = env_trials ? std::atoi(env_trials) : 40;
  std::printf("kill test: seed %llu, %d trials (TESSERA_KILL_SEED, TESSERA_KILL_TRIALS)\n",
              static_cast<unsigned long long>(seed), trials);
  std::mt19937_64 random(seed);
  testing::TempDir dir;
  const std::string root = dir.Sub("run");
  const std::string log = dir.Sub("loop.log");
  std::optional<int64_t> previous;
  int killed_before_any_commit = 0;
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial));
    // Up to 400 ms: the process start, the restore, and a few saves, each killable anywhere.
    const auto delay = std::chrono::microseconds(random() % 400000);
    const pid_t pid = StartLoop(root, 1000000, log);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(delay);
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the loop ended by itself (status " << status << "): " << ReadLog(log);
    ASSERT_OK_AND_ASSIGN(AfterKill after, Check(root));
    if (previous) {
      // Committed progress is never lost, and the newest whole checkpoint is always there.
      ASSERT_TRUE(after.latest.has_value()) << "every checkpoint gone after step " << *previous;
      ASSERT_GE(*after.latest, *previous);
      ASSERT_FALSE(after.all.empty());
    } else if (!after.latest) {
      ++killed_before_any_commit;
    }
    // Keep 2: the newest two, plus at most one the retention had not deleted yet when killed
    // (it runs after each commit) and one whose deletion was under way.
    EXPECT_LE(after.all.size(), 4u);
    previous = after.latest;
  }
  // Once more, to the end: the loop resumes and finishes.
  ASSERT_TRUE(previous.has_value()) << "no save ever committed in " << trials << " trials";
  const int64_t last = *previous + 3;
  const pid_t pid = StartLoop(root, last, log);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadLog(log);
  ASSERT_OK_AND_ASSIGN(AfterKill done, Check(root));
  EXPECT_EQ(done.latest, last);
  EXPECT_THAT(done.all, ::testing::ElementsAre(last - 1, last));
  std::printf("kill test: latest step %lld after %d kills (%d before the first commit)\n",
              static_cast<long long>(last), trials, killed_before_any_commit);
}

}  // namespace
}  // namespace tessera
